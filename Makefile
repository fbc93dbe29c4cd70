# Two entry points for a fresh machine: `make demo` and `make test` (CI runs `make test`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DATA ?= $(CURDIR)/out/demo-data

.PHONY: install demo test lint stress gpu-check gpu-wheels

PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

# Two stamps, so that either target may come first: .installed-dtrain is dtrain and what it needs
# to run (what the demo needs), .installed adds the test tools (pytest, ruff, mypy, and the
# packages the tests drive: ray, transformers, moto, boto3, s3fs).
$(BIN)/.installed-dtrain: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(BIN)/.installed: $(BIN)/.installed-dtrain
	$(PIP) -e '.[test]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed-dtrain
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

# The tests marked gpu, on this machine's GPU, and a table of what passed (tests/gpu_check.py;
# README: "On a GPU"). GPU_PYTHON must have torch with CUDA: .venv's is the CPU build pinned in
# constraints.txt, so a GPU machine names its own (a .venv absent, python3). Without a GPU the
# check says so and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-check:
	$(GPU_PYTHON) tests/gpu_check.py

# The wheels a GPU machine without network lacks for dtrain (for its Python 3.12, x86-64), into
# .whl/, which gpu-check installs from: run here, bring .whl/ along.
gpu-wheels: install
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps \
	    --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -c constraints.txt -d .whl google-re2 cryptography cffi pycparser
