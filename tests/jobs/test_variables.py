"""A job's variables by name (``--environment NAME``) or from a file (``--environment-file``):
never in any process's arguments, never shown by ``dtrain describe``."""

from __future__ import annotations

import hashlib
import json
import secrets
import stat
from pathlib import Path

import pytest

from dtrain.cli import _parse, spec_from_args
from dtrain.errors import ConfigError
from dtrain.jobs.describe import HIDDEN_VALUE, describe
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.store import JobStore
from dtrain.jobs.variables import job_variables, read_environment_file
from dtrain.launch.clusters import parse_cluster
from dtrain.launch.clusters.ray import RayCluster
from dtrain.launch.submit import rerun_spec
from tests.conftest import JOB_SCRIPTS, dtrain


def _file(tmp_path: Path, data: bytes | str, name: str = "job.env") -> str:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


# --- the env file, as docker reads it -----------------------------------------------------------


def test_an_env_file_is_read_as_docker_reads_it(tmp_path: Path) -> None:
    text = (
        "\ufeffFIRST=1\r\n"  # a byte-order mark, a Windows line end
        "# a comment\n"
        "\n"
        "   \t\n"
        "  INDENTED=value  \n"  # leading space of the line goes, trailing space stays
        'QUOTED="kept as written"\n'
        "EXPANDED=$HOME\n"
        "EQUALS=a=b#c\n"
        "EMPTY=\n"
        "FROM_CALLER\n"
        "   # an indented comment"
    )
    entries = read_environment_file(_file(tmp_path, text))
    assert [(name, value) for _, name, value in entries] == [
        ("FIRST", "1"),
        ("INDENTED", "value  "),
        ("QUOTED", '"kept as written"'),
        ("EXPANDED", "$HOME"),
        ("EQUALS", "a=b#c"),
        ("EMPTY", ""),
        ("FROM_CALLER", None),
    ]
    assert entries[0][0] == "line 1" and entries[-1][0] == "line 10"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"OK=1\n=hunter2\n", "line 2'; allowed: NAME=VALUE or NAME"),
        (b"OK=1\nBAD NAME=hunter2\n", "line 2: got 'BAD NAME'; allowed: a variable name without"),
        (b"OK=1\nTOKEN=hun\xfftere2\n", "line 2'; allowed: UTF-8 text"),
        (b"TOKEN=hunter2\0x\n", "line 1'; allowed: a value without NUL"),
    ],
)
def test_a_bad_line_is_named_by_its_number_never_its_value(
    data: bytes, expected: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as refused:
        read_environment_file(_file(tmp_path, data))
    assert expected in str(refused.value)
    assert "hunter" not in str(refused.value) and "tere" not in str(refused.value)


def test_a_missing_env_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--environment-file: got .*a readable file"):
        read_environment_file(str(tmp_path / "missing.env"))


# --- flags and files together -------------------------------------------------------------------


def test_names_take_the_callers_values_and_are_hidden_unless_a_command_line_gave_them(
    tmp_path: Path,
) -> None:
    first = _file(tmp_path, "A=from-file\nB=from-file\nC\nD=from-file\n", "first.env")
    second = _file(tmp_path, "D=second-file\n", "second.env")
    caller = {"C": "caller-c", "E": "caller-e", "B": "caller-b"}
    variables = job_variables(["B", "A=flag", "E", "F=", "G=x=y"], [first, second], caller)
    assert variables.values == {
        "A": "flag",  # a flag wins over a file
        "B": "caller-b",
        "C": "caller-c",
        "D": "second-file",  # the later file wins
        "E": "caller-e",
        "F": "",
        "G": "x=y",
    }
    assert set(variables.hidden) == {"B", "C", "D", "E"}


def test_a_name_the_caller_does_not_set_is_refused_not_dropped(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--environment: got 'UNSET'; allowed: a variable set"):
        job_variables(["UNSET"], [], {})
    with pytest.raises(ConfigError, match=r"job\.env line 2: got 'UNSET'; allowed: a variable set"):
        job_variables([], [_file(tmp_path, "A=1\nUNSET\n")], {})
    with pytest.raises(ConfigError, match="--environment: got '=x'"):
        job_variables(["=x"], [], {})


def test_the_run_flags_build_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTRAIN_TEST_TOKEN", "caller's")
    env_file = _file(tmp_path, "FILED=from-file\n")
    args = _parse(
        ["run", "train.py", "--environment", "DTRAIN_TEST_TOKEN", "--environment", "OPEN=1",
         "--environment-file", env_file]
    )  # fmt: skip
    spec = spec_from_args(args)
    assert spec.environment == {"FILED": "from-file", "DTRAIN_TEST_TOKEN": "caller's", "OPEN": "1"}
    assert spec.hidden_environment == ("FILED", "DTRAIN_TEST_TOKEN")


# --- what is stored and shown -------------------------------------------------------------------


def _record(store: JobStore, spec: JobSpec, folder: Path) -> None:
    store.create(spec.job_name, spec.to_json(), folder)


def test_describe_hides_what_no_command_line_showed_and_rerun_keeps_it(dtrain_home: Path) -> None:
    store = JobStore()
    spec = JobSpec(
        entry_point="train.py",
        job_name="hidden",
        environment={"OPEN": "1", "TOKEN": "hunter2"},
        hidden_environment=("TOKEN",),
    )
    _record(store, spec, dtrain_home / "jobs" / "hidden")
    shown = describe(store, "hidden")["Environment"]
    assert shown == {"OPEN": "1", "TOKEN": HIDDEN_VALUE}
    again = rerun_spec(store.get("hidden"), "again")
    assert again.environment == spec.environment and again.hidden_environment == ("TOKEN",)
    # A record made before hidden_environment existed, or by the Estimator, shows every value,
    # as SageMaker's DescribeTrainingJob does.
    old = json.loads(JobSpec(entry_point="t.py", job_name="old", environment={"A": "1"}).to_json())
    del old["hidden_environment"]
    store.create("old", json.dumps(old), dtrain_home / "jobs" / "old")
    assert describe(store, "old")["Environment"] == {"A": "1"}


# --- a real job ---------------------------------------------------------------------------------


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _scanned(output: str, name: str) -> str:
    """What argv_scan.py said of ``name``: its digest and the processes holding its value."""
    line = next(line for line in output.splitlines() if f" {name} sha256=" in line)
    return line.split(f" {name} ", 1)[1]


@pytest.mark.timeout(240)
def test_values_by_name_or_file_reach_the_ranks_and_no_processs_arguments(
    dtrain_home: Path, tmp_path: Path
) -> None:
    given, by_name, in_file = (secrets.token_hex(16) for _ in range(3))
    env_file = tmp_path / "job.env"
    env_file.write_text(f"# credentials\nFILED={in_file}\n")
    result = dtrain(
        "run", "argv_scan.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "scan",
        "--instance-type", "local_cpu", "--instance-count", "2",
        "--environment", "SCANNED=GIVEN,BY_NAME,FILED", "--environment", f"GIVEN={given}",
        "--environment", "BY_NAME", "--environment-file", str(env_file),
        home=dtrain_home, env={"BY_NAME": by_name},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # The control: a value given on the command line is found, in dtrain run's arguments.
    assert f"sha256={_digest(given)} in argv of: [" in _scanned(result.stdout, "GIVEN")
    assert "-m dtrain.cli run']" in _scanned(result.stdout, "GIVEN")  # and nowhere else
    for name, value in (("BY_NAME", by_name), ("FILED", in_file)):
        assert result.stdout.count(f"{name} sha256={_digest(value)} in argv of: []") == 2
    shown = json.loads(dtrain("describe", "scan", home=dtrain_home).stdout)["Environment"]
    assert shown["GIVEN"] == given
    assert shown["BY_NAME"] == shown["FILED"] == HIDDEN_VALUE
    # Stored for rerun, in files only their owner reads.
    spec_file = dtrain_home / "jobs" / "scan" / "spec.json"
    assert json.loads(spec_file.read_text())["environment"]["BY_NAME"] == by_name
    for private in (spec_file, dtrain_home / "jobs.db"):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600


@pytest.mark.timeout(240)
def test_a_detached_controller_gets_the_spec_in_a_private_file_not_its_arguments(
    dtrain_home: Path,
) -> None:
    by_name = secrets.token_hex(16)
    result = dtrain(
        "run", "argv_scan.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "detached",
        "--instance-type", "local_cpu", "--environment", "SCANNED=BY_NAME",
        "--environment", "BY_NAME", "--detach", home=dtrain_home, env={"BY_NAME": by_name},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = JobStore().wait("detached", timeout=120)
    assert record.status == "Completed", record.failure_reason
    logs = dtrain("logs", "detached", home=dtrain_home).stdout
    assert f"BY_NAME sha256={_digest(by_name)} in argv of: []" in logs
    assert not list(dtrain_home.glob("spec-*"))  # the private copy is gone once read


def test_on_ray_only_variables_a_command_line_showed_go_in_the_runtime_env() -> None:
    """Ray puts a runtime_env's variables on its worker set-up's command line; the others reach
    the agent in the job's encrypted start message."""
    spec = JobSpec(
        entry_point="train.py",
        job_name="on-ray",
        cluster="ray://127.0.0.1:6379",
        environment={"PYTHONPATH": "/code", "TOKEN": "hunter2"},
        hidden_environment=("TOKEN",),
    )
    cluster = parse_cluster(spec)
    assert isinstance(cluster, RayCluster) and cluster.environment == {"PYTHONPATH": "/code"}
