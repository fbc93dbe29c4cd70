"""torchrun's habits: --version, script arguments after --, -m module entry points, --detach,
rerun, rm and prune."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from dtrain.cli import _parse, main, spec_from_args
from dtrain.errors import ConfigError
from dtrain.jobs.cleanup import parse_duration
from dtrain.jobs.describe import describe
from dtrain.jobs.modules import module_file
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.jobs.store import JobRecord, JobStore
from dtrain.launch.job import default_job_name, generated_base
from dtrain.launch.submit import rerun_spec
from dtrain.procfs import running
from tests.conftest import JOB_SCRIPTS, dtrain, processes_of_job

pytestmark = pytest.mark.timeout(240)

PRINT_ARGS = """\
import json, os, sys
print("args", json.dumps({"argv": sys.argv[1:], "name": __name__, "file": __file__,
      "user_args": json.loads(os.environ["SM_USER_ARGS"])}), flush=True)
"""
SCRIPT_ARGS = ["--epochs", "1", "--name", "two words", "--"]
EXPECTED_ARGV = ["--epochs", "5", *SCRIPT_ARGS]  # the hyperparameters' first


def _wait(condition: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def store_of(home: Path) -> Iterator[JobStore]:
    """The job store under ``home``, and on leaving, no job's controller or ranks running: a
    failed test stops the jobs it left running (SIGTERM: their controllers stop their ranks)."""
    previous = os.environ.get("DTRAIN_HOME")
    os.environ["DTRAIN_HOME"] = str(home)
    store = JobStore()
    try:
        yield store
    finally:
        records = store.list()
        running = [r.supervisor_pid for r in records if not r.is_terminal and r.supervisor_pid]
        for pid in running:  # a finished job's process id may be another's by now
            os.kill(pid, signal.SIGTERM)
        for pid in running:
            _wait(lambda pid=pid: not running(pid), f"controller {pid} to exit")
        for record in records:
            _wait(lambda r=record: not processes_of_job(r.name), f"{record.name}'s ranks")
        if previous is None:
            del os.environ["DTRAIN_HOME"]
        else:
            os.environ["DTRAIN_HOME"] = previous


# --- without jobs -----------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dtrain {version('dtrain')} (torch {version('torch')}, Python 3.")


def test_arguments_after_double_dash_are_the_scripts() -> None:
    args = _parse(["run", "train.py", "--job-name", "j", "--", "--epochs", "1", "--", "-m", "x"])
    spec = spec_from_args(args)
    assert spec.script_args == ("--epochs", "1", "--", "-m", "x")
    assert spec.entry_point == "train.py" and not spec.module
    assert JobSpec.from_json(spec.to_json()) == spec
    module = spec_from_args(_parse(["run", "-m", "pkg.train_net", "--source-dir", "."]))
    assert module.module and module.entry_point == "pkg.train_net"
    assert module.job_name.startswith("train-net-") and module.script_args == ()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "train.py", "--epochs", "1"], "arguments for the script go after --"),
        (["jobs", "--", "x"], "dtrain jobs takes no arguments after --"),
    ],
)
def test_misplaced_arguments(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["run"], ["run", "train.py", "-m", "pkg.train"]])
def test_a_script_or_a_module(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"^SCRIPT or -m MODULE: got .*; allowed: one of them"):
        spec_from_args(_parse(argv))


def test_module_files(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "train.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__main__.py").write_text("")  # a namespace package's __main__
    (tmp_path / "pkg" / "data").mkdir()
    (tmp_path / "tool.py").write_text("")
    assert module_file(tmp_path, "pkg.train") == tmp_path / "pkg" / "train.py"
    assert module_file(tmp_path, "pkg.sub") == tmp_path / "pkg" / "sub" / "__main__.py"
    assert module_file(tmp_path, "tool") == tmp_path / "tool.py"
    for module, message in [
        ("pkg.trian", "package pkg holds: data, sub, train) (did you mean 'pkg.train'?)"),
        ("pgk.train", "holds: pkg, tool) (did you mean 'pkg.train'?)"),
        ("pkg.data", "a package with a __main__.py (pkg.data holds: no modules)"),
        ("tool.main", "holds: pkg, tool)"),  # a module is no package
        ("pkg/train.py", "a dotted module name"),
    ]:
        with pytest.raises(ConfigError, match=r"^-m: ") as error:
            module_file(tmp_path, module)
        assert message in str(error.value)


def test_a_missing_module_is_refused_before_launch(
    dtrain_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(JOB_SCRIPTS)
    assert main(["run", "-m", "colective", "--source-dir", source, "--job-name", "m"]) == 2
    assert "did you mean 'collective'?" in capsys.readouterr().err
    assert main(["run", "-m", "collective", "--job-name", "m"]) == 2
    assert "the folder holding the -m module" in capsys.readouterr().err
    assert JobStore().list() == [] and not (dtrain_home / "jobs" / "m").exists()


def test_paths_are_recorded_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = JobSpec(
        entry_point="train.py",
        job_name="j",
        source_dir="code",
        output_path="out",
        checkpoint_local_path="ckpt",
        channels=(ChannelSpec("a", "data"), ChannelSpec("b", "s3://bucket/b")),
    ).with_absolute_paths()
    assert spec.entry_point == "train.py"  # relative to source_dir, as given
    assert (spec.source_dir, spec.output_path, spec.checkpoint_local_path) == (
        str(tmp_path / "code"), str(tmp_path / "out"), str(tmp_path / "ckpt"),
    )  # fmt: skip
    assert [c.uri for c in spec.channels] == [str(tmp_path / "data"), "s3://bucket/b"]
    alone = JobSpec(entry_point="dir/train.py", job_name="j").with_absolute_paths()
    assert alone.entry_point == str(tmp_path / "dir" / "train.py")
    hosts = JobSpec(
        entry_point="t.py", job_name="j", cluster="join://10.0.0.1:7000",
        checkpoint_local_path="ckpt", channels=(ChannelSpec("a", "data"),),
    ).with_absolute_paths()  # fmt: skip
    assert hosts.checkpoint_local_path == "ckpt" and hosts.channels[0].uri == "data"  # on hosts


def test_rerun_names() -> None:
    spec = JobSpec("t.py", "x", script_args=("--a",), key_salt="f" * 32)
    for old, base in [("demo-2026-11-25-10-00-00-000", "demo-"), ("habits", "habits-")]:
        record = JobRecord(
            old, "Completed", "Completed", None, 0, 0, 0, 0, spec.to_json(), "", 1, None
        )
        again = rerun_spec(record, None)
        assert again.job_name.startswith(base) and again.job_name != old
        assert re.fullmatch(r"\d{4}(-\d\d){5}-\d{3}", again.job_name.removeprefix(base))
        assert again == dataclasses.replace(spec, job_name=again.job_name, key_salt="")
        assert rerun_spec(record, "named").job_name == "named"


def test_a_generated_name_gives_back_its_base() -> None:
    for base, cleaned in [("demo", "demo"), ("my script.py", "my-script-py"), ("--", "job")]:
        name = default_job_name(base)
        assert re.fullmatch(rf"{cleaned}-\d{{4}}(-\d\d){{5}}-\d{{3}}", name)
        assert generated_base(name) == cleaned
    for name, base in [
        ("demo-2026-11-25-10-00-00-000", "demo"),
        ("a-b-2026-01-02-03-04-05-999", "a-b"),
        ("habits", "habits"),
        ("2026-11-25-10-00-00-000", "2026-11-25-10-00-00-000"),  # no base
        ("demo-2026-13-25-10-00-00-000", "demo-2026-13-25-10-00-00-000"),  # no 13th month
        ("demo-2026-1-25-10-00-00-0000", "demo-2026-1-25-10-00-00-0000"),  # not as written
        ("demo-2026-11-25-10-00-00-00", "demo-2026-11-25-10-00-00-00"),
    ]:
        assert generated_base(name) == base, name


def test_durations() -> None:
    assert parse_duration("--older-than", "7d") == 7 * 86400
    assert parse_duration("--older-than", "1d12h") == 36 * 3600
    assert parse_duration("--older-than", "1.5h") == 5400
    assert parse_duration("--older-than", "0s") == 0
    for bad in ("7", "d", "7 days", "-1d", "7y"):
        with pytest.raises(ConfigError, match="a duration such as 7d, 12h"):
            parse_duration("--older-than", bad)


def test_prune_takes_only_jobs_that_ended_long_ago(
    dtrain_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = JobStore()
    week = 7 * 24 * 60 * 60
    now = time.time()
    for name, status, ended in [
        ("old", "Completed", now - week - 60),
        ("recent", "Failed", now - week + 60),
        ("running", "InProgress", None),
    ]:
        folder = dtrain_home / "jobs" / name
        (folder / "logs").mkdir(parents=True)
        (folder / "logs" / "controller.log").write_bytes(b"x" * 2**20)
        store.create(name, JobSpec("t.py", name).to_json(), folder)
        store.update(name, status=status, end_time=ended, supervisor_pid=os.getpid())
    assert main(["prune", "--older-than", "7d", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("would remove old (Completed ") and out[0].endswith(", 1.0 MiB)")
    assert out[1:] == ["1 job(s) ended more than 7d ago; would free 1.0 MiB"]
    assert (dtrain_home / "jobs" / "old").exists()
    assert main(["prune", "--older-than", "7d"]) == 0
    assert capsys.readouterr().out.startswith("removed old (Completed ")
    assert not (dtrain_home / "jobs" / "old").exists()
    assert [r.name for r in store.list()] == ["running", "recent"]
    assert main(["prune", "--older-than", "0s"]) == 0  # never a running job
    assert [r.name for r in store.list()] == ["running"]
    assert (dtrain_home / "jobs" / "running").exists()


def test_rm_refuses_unknown_names_and_foreign_folders(
    dtrain_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = JobStore()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store.create("kept", JobSpec("t.py", "kept").to_json(), elsewhere)
    store.update("kept", status="Completed", end_time=time.time())
    assert main(["rm", "kept", "kepd"]) == 2  # nothing goes when one name is wrong
    assert "no job named 'kepd'; did you mean 'kept'?" in capsys.readouterr().err
    assert main(["rm", "kept"]) == 2
    assert "remove it by hand" in capsys.readouterr().err
    assert elsewhere.exists() and [r.name for r in store.list()] == ["kept"]


def test_rm_force_gives_up_on_a_job_that_does_not_stop(
    dtrain_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = JobStore()
    store.create("stuck", JobSpec("t.py", "stuck").to_json(), dtrain_home / "jobs" / "stuck")
    monkeypatch.setattr("dtrain.jobs.cleanup.STOP_WAIT", 0.05)
    assert main(["rm", "--force", "stuck"]) == 2  # no controller ever marks it Stopped
    assert capsys.readouterr().err.endswith(
        "job stuck is still Stopping after 0.05 s; run dtrain rm again once it has stopped\n"
    )
    assert store.get("stuck").status == "Stopping"


# --- with jobs --------------------------------------------------------------------------------


def _args_lines(logs: str) -> list[dict]:
    return [json.loads(line.split("args ", 1)[1]) for line in logs.splitlines() if "args {" in line]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One detached two-rank job of a module, with script arguments, followed to its end."""
    home = tmp_path_factory.mktemp("home")
    source = tmp_path_factory.mktemp("source")
    (source / "pkg").mkdir()
    (source / "pkg" / "show_args.py").write_text(PRINT_ARGS)
    with store_of(home):
        submitted = dtrain(
            "run", "-m", "pkg.show_args", "--source-dir", str(source), "--job-name", "habits",
            "--instance-type", "local_cpu", "--processes-per-host", "2",
            "--hyperparameters", '{"epochs": 5}', "--detach", "--", *SCRIPT_ARGS, home=home,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout == "habits\n" and "dtrain logs -f habits" in submitted.stderr
        followed = dtrain("logs", "-f", "habits", home=home)
        assert followed.returncode == 0, followed.stderr
    return home, followed.stdout


def test_a_detached_module_job_gets_its_script_arguments(finished: tuple[Path, str]) -> None:
    home, logs = finished
    ranks = _args_lines(logs)
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["argv"] == EXPECTED_ARGV == rank["user_args"]
        assert rank["name"] == "__main__"
        assert rank["file"].endswith("/jobs/habits/hosts/algo-1/code/pkg/show_args.py")
    with store_of(home) as store:
        record = store.get("habits")
        assert record.status == "Completed"
        _wait(lambda: not running(record.supervisor_pid), "the controller to exit")
        assert processes_of_job("habits") == []
        spec = JobSpec.from_json(record.spec)
        assert spec.module and spec.entry_point == "pkg.show_args"
        assert spec.script_args == tuple(SCRIPT_ARGS)
        algorithm = describe(store, "habits")["AlgorithmSpecification"]
        assert algorithm["EntryPoint"] == "-m pkg.show_args"
        assert algorithm["ContainerArguments"] == SCRIPT_ARGS
        log = (home / "jobs" / "habits" / "logs" / "controller.log").read_text()
        assert "Completed: Training job completed" in log
        assert "dtrain: job habits Completed; model: file://" in log  # the controller's output


def test_rerun_rm_and_prune(finished: tuple[Path, str]) -> None:
    home, _ = finished
    again = dtrain("rerun", "habits", "--job-name", "again", "--quiet", home=home)
    assert again.returncode == 0, again.stderr
    logs = dtrain("logs", "again", home=home).stdout
    assert [rank["argv"] for rank in _args_lines(logs)] == [EXPECTED_ARGV] * 2
    taken = dtrain("rerun", "habits", "--job-name", "habits", home=home)
    assert taken.returncode == 2 and "already" in taken.stderr
    with store_of(home) as store:
        old, new = (JobSpec.from_json(store.get(n).spec) for n in ("habits", "again"))
        assert dataclasses.replace(new, job_name="habits", key_salt=old.key_salt) == old
        assert [r.name for r in store.list()] == ["again", "habits"]
    removed = dtrain("rm", "again", home=home)
    assert removed.returncode == 0 and removed.stdout.startswith("removed again (Completed, ")
    assert not (home / "jobs" / "again").exists()
    assert dtrain("describe", "again", home=home).returncode == 2
    listed = dtrain("prune", "--older-than", "0s", "--dry-run", home=home)
    assert listed.stdout.startswith("would remove habits (Completed ")
    assert (home / "jobs" / "habits").exists()
    pruned = dtrain("prune", "--older-than", "0s", home=home)
    assert pruned.stdout.startswith("removed habits (Completed ")
    assert not (home / "jobs" / "habits").exists()
    assert "habits" not in dtrain("jobs", home=home).stdout


def test_stop_and_remove_detached_jobs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with store_of(home) as store:

        def training(name: str) -> Callable[[], bool]:
            log = home / "jobs" / name / "logs" / "attempt-1" / "rank0.log"
            return lambda: log.exists() and "started" in log.read_text()

        first = dtrain(  # returns while the job runs (for minutes, unless stopped)
            "run", "sleeps.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "first",
            "--instance-type", "local_cpu", "--detach", home=home,
        )  # fmt: skip
        assert first.returncode == 0, first.stderr
        _wait(training("first"), "first to train")
        assert store.get("first").status == "InProgress"
        refused = dtrain("rm", "first", home=home)
        assert refused.returncode == 2
        assert "not finished: first (InProgress); stop it first" in refused.stderr
        assert dtrain("stop", "first", home=home).returncode == 0
        assert dtrain("logs", "-f", "first", home=home).returncode == 0  # ends with the job
        assert store.get("first").status == "Stopped"

        second = dtrain("rerun", "first", "--job-name", "second", "--detach", home=home)
        assert second.returncode == 0 and second.stdout == "second\n"
        _wait(training("second"), "second to train")
        controllers = [store.get(name).supervisor_pid for name in ("first", "second")]
        forced = dtrain("rm", "--force", "second", "first", home=home)
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.startswith("removed second (Stopped, ")
        assert store.list() == [] and list((home / "jobs").iterdir()) == []
        for pid in controllers:
            _wait(lambda pid=pid: not running(pid), f"controller {pid} to exit")
        assert processes_of_job("first") == processes_of_job("second") == []


def test_a_detached_job_that_cannot_start_says_why(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "jobs" / "taken").mkdir(parents=True)  # a folder no record knows
    home.chmod(0o700)  # a home dtrain did not make is used only if private
    with store_of(home):
        result = dtrain(
            "run", "sleeps.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "taken",
            "--instance-type", "local_cpu", "--detach", home=home,
        )  # fmt: skip
        assert result.returncode == 2 and result.stdout == ""
        assert "job folder" in result.stderr and "already exists" in result.stderr
        bad = dtrain("run", "nope.py", "--detach", home=home)
        assert bad.returncode == 2 and "entry_point" in bad.stderr
