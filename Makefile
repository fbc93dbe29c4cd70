# Two entry points for a fresh machine: `make demo` and `make test` (CI runs `make test`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DATA ?= $(CURDIR)/out/demo-data

.PHONY: install demo test lint stress

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python examples/make_dataset.py $(DEMO_DATA)
	$(BIN)/dtrain run train.py --source-dir examples/sagemaker_style \
	    --instance-count 2 --processes-per-host 1 --instance-type local_cpu \
	    --channel training=$(DEMO_DATA),distribution=ShardedByS3Key \
	    --hyperparameters '{"epochs": 5, "batch-size": 32, "lr": 0.05}' \
	    --metric-definitions '[{"Name": "train:loss", "Regex": "train_loss=([0-9.]+)"}, {"Name": "train:accuracy", "Regex": "train_accuracy=([0-9.]+)"}]' \
	    --base-job-name demo

lint: install
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

# Two workers, each taking whole files (a file's tests share module fixtures, such as the
# network namespaces of test_clusters): the tests wait on processes and timers as much as they
# compute. The longest files go first, in the order tests/conftest.py gives (LONGEST_FIRST).
test: lint
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

stress: install
	$(BIN)/python -m pytest -m stress
