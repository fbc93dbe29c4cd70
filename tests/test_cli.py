"""``dtrain run`` flags map onto a JobSpec; malformed flags are clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtrain.cli import _build_parser, main, spec_from_args
from dtrain.errors import ConfigError


def parse(*argv: str):
    return spec_from_args(_build_parser().parse_args(["run", *argv]))


def test_flags_map_to_spec(tmp_path: Path) -> None:
    distribution = tmp_path / "dist.json"
    distribution.write_text(json.dumps({"smdistributed": {"dataparallel": {"enabled": True}}}))
    spec = parse(
        "train.py", "--instance-count", "3", "--processes-per-host", "2",
        "--distribution", str(distribution), "--hyperparameters", '{"lr": 0.1}',
        "--channel", f"training={tmp_path}",
        "--channel", f"test={tmp_path},distribution=ShardedByS3Key",
        "--job-name", "j1", "--max-run", "60", "--output-path", "s3://bucket/out",
        "--checkpoint-local-path", "/ckpt", "--environment", "A=1", "--environment", "B=x=y",
        "--metric-definitions", '[{"Name": "l", "Regex": "l=(\\\\d+)"}]',
    )  # fmt: skip
    assert spec.instance_count == 3 and spec.processes_per_host == 2
    assert spec.distribution == {"smdistributed": {"dataparallel": {"enabled": True}}}
    assert spec.hyperparameters == {"lr": 0.1}
    assert [(c.name, c.distribution) for c in spec.channels] == [
        ("training", "FullyReplicated"),
        ("test", "ShardedByS3Key"),
    ]
    assert spec.job_name == "j1" and spec.max_run == 60
    assert spec.environment == {"A": "1", "B": "x=y"}
    assert spec.metric_definitions == ({"Name": "l", "Regex": "l=(\\d+)"},)


def test_generated_job_name() -> None:
    spec = parse("my_train.py", "--base-job-name", "exp_1")
    assert spec.job_name.startswith("exp-1-")
    assert parse("my_train.py").job_name.startswith("my-train-")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--hyperparameters", "{lr: 1}"], "--hyperparameters: got '{lr: 1}'; allowed: JSON"),
        (["--hyperparameters", "[1]"], "a JSON object"),
        (["--metric-definitions", '{"Name": "x"}'], "a JSON array"),
        (["--environment", "NOVALUE"], "--environment: got 'NOVALUE'; allowed: a variable set"),
        (["--distribution", '{"mpi": {"enabled": tru}}'], "distribution"),
    ],
)
def test_malformed_flags(argv: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse("train.py", *argv)
    assert expected in str(error.value)


def test_main_prints_one_line_errors(capsys: pytest.CaptureFixture[str], dtrain_home: Path) -> None:
    assert main(["describe", "nothing-here"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtrain: error: no job named 'nothing-here'")
    assert "Traceback" not in err


def test_the_command_line_is_tidy(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import JOB_SCRIPTS, dtrain

    home = tmp_path / "home"
    assert "SUPPRESS" not in dtrain("--help", home=home).stdout
    missing = dtrain("metrics", "nope", home=home)
    assert missing.returncode == 2 and "no job named 'nope'" in missing.stderr
    more = str((os.cpu_count() or 1) + 1)  # than the machine has cores
    run = dtrain("run", "sleeps.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "tidy",
                 "--instance-type", "local_cpu", "--processes-per-host", more, "--max-run", "1",
                 home=home)  # fmt: skip
    assert "dtrain: job tidy Stopped; model: file://" in run.stdout
    assert f"{more} processes on the" in run.stdout and "oversubscribed" in run.stdout
    piped = subprocess.run(
        f"{sys.executable} -m dtrain.cli describe tidy | head -1",
        shell=True, capture_output=True, text=True, env={**os.environ, "DTRAIN_HOME": str(home)},
        check=True,
    )  # fmt: skip
    assert piped.stdout == "{\n" and "Traceback" not in piped.stderr
    listed = dtrain("jobs", "--status", "Stopped", "--name-contains", "ti", home=home).stdout
    assert "tidy" in listed
    assert "tidy" not in dtrain("jobs", "--status", "Completed", home=home).stdout
    wrong = dtrain("jobs", "--status", "Complete", home=home)
    assert wrong.returncode == 2 and "did you mean 'Completed'" in wrong.stderr


def test_channel_help_names_the_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "distribution=ShardedByS3Key|FullyReplicated" in help_text


def test_readme_run_example_shards_like_make_demo() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme[readme.index("dtrain run train.py") :].split("\n\n", 1)[0]
    assert "--channel training=out/demo-data,distribution=ShardedByS3Key" in example


def test_a_misspelled_entry_point_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str], dtrain_home: Path, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text("")
    assert main(["run", "trian.py", "--source-dir", str(tmp_path)]) == 2
    assert "(did you mean 'train.py'?)" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "nowhere" / "trian.py")]) == 2
    assert "entry_point" in capsys.readouterr().err


def test_dtrain_agent_ends_without_the_interpreters_teardown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's exit status leaves through ``entry.end`` (``os._exit``): tearing down the
    torch its rendezvous store loaded made every job's end wait 1 to 3 s for ``algo-1``."""
    import dtrain.launch.agent
    import dtrain.launch.entry

    class Ended(Exception):
        pass

    def end(status: int) -> None:
        raise Ended(status)

    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    secret.chmod(0o600)
    monkeypatch.setattr(dtrain.launch.agent, "run_agent", lambda *args: 3)
    monkeypatch.setattr(dtrain.launch.entry, "end", end)
    with pytest.raises(Ended) as ended:
        main(["agent", "--join", "127.0.0.1:29400", "--secret-file", str(secret)])
    assert ended.value.args == (3,)
