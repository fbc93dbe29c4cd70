"""Shared fixtures: every test gets its own DTRAIN_HOME so jobs never touch the user's."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.launch.processes import marked_processes

JOB_SCRIPTS = Path(__file__).parent / "job_scripts"


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_configure(config: pytest.Config) -> None:
    """The test process computes on one torch thread, as every rank it starts does.

    The suite runs two workers on two cores beside the ranks they start: a second OpenMP thread
    only waits for a core at the end of each parallel operation. A reference run of one
    process took 6.4 s on two threads beside two busy cores, 0.2 s on one.

    xdist's controller runs no test: it leaves torch alone (importing it there, and its teardown
    at exit, took 2 to 5 s under load before the workers started and after they ended).
    """
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(1)


LONGEST_FIRST = (
    "launch/test_clusters.py", "test_jobs_integration.py", "modelparallel/api/test_sharded.py",
    "modelparallel/test_delayed.py", "modelparallel/test_job.py",
    "modelparallel/api/test_half_precision.py", "launch/test_join.py", "launch/test_entry.py",
    "compat/test_scripts.py", "smpv2/test_jobs.py", "modelparallel/test_hf_models.py",
    "modelparallel/modules/test_activation_checkpointing.py",
    "modelparallel/pipeline/test_stall.py", "modelparallel/test_equivalence.py",
    "modelparallel/tensor/test_mixed.py", "modelparallel/api/test_sharded_tensor.py",
    "modelparallel/tensor/test_hf.py", "modelparallel/tensor/test_pipeline.py",
    "modelparallel/tensor/test_translated.py",
)  # fmt: skip
"""The files that take longest (20 to 140 s each on this 2-core machine), longest first; they
start first and the rest follow in collection order. ``make test`` hands whole files to two
workers in the order given (``--no-loadscope-reorder``): xdist's own order, most tests first,
started the slow files of few tests (jobs, clusters) last, and one worker ran on alone."""


def _start_rank(item: pytest.Item) -> int:
    tests = Path(__file__).parent
    name = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (stable: a file's tests stay together, in order); ``gpu`` tests
    run only where CUDA GPUs are."""
    missing = [name for name in LONGEST_FIRST if not Path(__file__).parent.joinpath(name).is_file()]
    if missing:
        raise pytest.UsageError(f"LONGEST_FIRST in tests/conftest.py names no file: {missing}")
    items.sort(key=_start_rank)
    if any(item.get_closest_marker("gpu") for item in items) and _cuda_devices() == 0:
        skip = pytest.mark.skip(reason="needs CUDA GPUs; this machine has none")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def cpu_only_unless_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other test is a CPU test: on a GPU machine its processes must not see the GPUs, or
    libraries would choose NCCL and hand it CPU tensors."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def dtrain_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "dtrain-home"
    monkeypatch.setenv("DTRAIN_HOME", str(home))
    yield home


def dtrain(
    *args: str, home: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``dtrain`` CLI in a fresh process, as a user would."""
    full_env = {**os.environ, "DTRAIN_HOME": str(home), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        check=False,
    )


def processes_of_job(job_name: str) -> list[int]:
    """Pids of every live process started for ``job_name``, found by the environment we gave
    them."""
    return marked_processes(f"DTRAIN_JOB_NAME={job_name}".encode())


S3_KEYS = ["train/part-0.csv", "train/part-1.csv", "train/sub/part-2.csv", "train/part-3.csv"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A ``moto_server`` on a free loopback port, with the AWS environment pointed at it."""
    for module in ("moto.server", "s3fs", "boto3"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = (tmp_path / "moto.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except (urllib.error.URLError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start: {(tmp_path / 'moto.log').read_text()}")
                time.sleep(0.1)
        for key, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        }.items():
            monkeypatch.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(key, raising=False)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="dtrain-test")
    for key in [*S3_KEYS, "train/sub/", "other/ignored.csv"]:  # "train/sub/": a folder marker
        client.put_object(Bucket="dtrain-test", Key=key, Body=f"object {key}\n".encode())
    return "dtrain-test"
