"""The web view's application through Flask's test client, over a job store made by hand."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import ClassVar

import pytest
import waitress.server
from flask import Flask
from flask.testing import FlaskClient

from dtrain.cli import main
from dtrain.jobs.folder import JobFolder
from dtrain.jobs.metrics import MetricSample
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.jobs.store import JobStore
from dtrain.ui import jobview
from dtrain.ui.app import TOKEN_COOKIE, create_app

TOKEN = "t" * 32
TRACE = {
    "traceEvents": [
        # as the pipeline writes it: a process per rank, a row (thread) per kind of work
        {"name": "F0", "cat": "F", "ph": "X", "pid": 1, "tid": 0, "ts": 600.0, "dur": 400.0},
        {"name": "send", "cat": "SEND", "ph": "X", "pid": 0, "tid": 1, "ts": 500.0, "dur": 9.0},
        {"name": "F0", "cat": "F", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 500.0},
        *(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}}
            for rank, name in ((0, "rank 0"), (1, "rank 1"))
        ),
        {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},
        {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
        *(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
            for rank in (0, 1)
            for tid, name in ((0, "compute"), (1, "send"))
        ),
        {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": 1, "args": {"sort_index": 101}},
    ],
    "displayTimeUnit": "ms",
}
PLAN_TABLE = [
    "module  type       placement  part  params  compute ms  memory  cost",
    "(root)  Net        auto          0       0       0.100     4 B  0.010",
    "",
    "partition  modules  compute ms  comm ms  time ms  memory  cost",
    "        0        1       0.100    0.000    0.100     4 B  0.010",
    "slowest partition: 0 (0.100 ms predicted for the profiled batch)",
    "traffic 0 -> 1: 1.0 KiB per forward pass",
]


def _make_job(store: JobStore, home: Path, name: str, status: str | None) -> JobFolder:
    """A job as ``dtrain run`` leaves it: record, transitions, hosts, metrics and files."""
    folder = JobFolder(home / "jobs" / name)
    spec = JobSpec(
        entry_point="train.py",
        job_name=name,
        instance_count=2,
        processes_per_host=1,
        channels=(ChannelSpec("training", "/data"),),
        environment={"AWS_SECRET_ACCESS_KEY": "hunter2"},
    )
    store.create(name, spec.to_json(), folder.root)
    store.update(name, secondary_status="Training", message="Training", start_time=time.time())
    store.set_hosts(
        name,
        [
            {"name": f"algo-{i}", "address": "127.0.0.1", "interface": "lo", "hostname": "vm"}
            | {"pid": i}
            for i in (1, 2)
        ],
    )
    store.add_metrics(
        name,
        [MetricSample("loss", 1.0 / (step + 1), 1000.0 + step * 0.5, step) for step in range(5)],
    )
    folder.attempt_logs_dir(1).mkdir(parents=True)
    folder.log_file(0, 1).write_text("step=0 loss=1\n" + "\n".join(PLAN_TABLE) + "\npartial")
    folder.log_file(1, 1).write_text("")
    folder.controller_log_file.write_text("Training: attempt 1\n")
    folder.spec_file.write_text(spec.to_json())
    host = folder.host(0)
    host.output_data_dir.mkdir(parents=True)
    (host.output_data_dir / "timeline.json").write_text(json.dumps(TRACE))
    (host.output_data_dir / "plan.json").write_text(
        json.dumps({"partitions": 1, "owners": {"": 0}, "stages": [{"cost": 0.01}]})
    )
    host.model_dir.mkdir(parents=True)
    host.code_dir.mkdir(parents=True)
    (host.code_dir / "train.py").write_text("print('training')\n")
    (host.model_dir / "model.pt").write_bytes(b"weights")
    host.channel_dir("training").mkdir(parents=True)
    (host.channel_dir("training") / "data.csv").write_text("1,2\n")
    if status is not None:
        store.update(name, status=status, secondary_status=status, end_time=time.time())
    return folder


@pytest.fixture
def store(dtrain_home: Path) -> JobStore:
    store = JobStore()
    _make_job(store, dtrain_home, "done", "Completed")
    _make_job(store, dtrain_home, "running", None)
    return store


@pytest.fixture
def client(store: JobStore) -> FlaskClient:
    return create_app(store).test_client()


def test_jobs_table_shows_status_layout_metrics_and_step_rate(client: FlaskClient) -> None:
    jobs = {job["name"]: job for job in client.get("/api/jobs").get_json()}
    done = jobs["done"]
    assert (done["status"], done["layout"]) == ("Completed", "2 × 1")
    assert done["last_metrics"] == {"loss": pytest.approx(0.2)}
    assert done["step_rate"] == {"metric": "loss", "per_second": pytest.approx(2.0)}
    assert jobs["running"]["status"] == "InProgress"
    page = client.get("/")
    assert page.status_code == 200 and b'data-page="jobs"' in page.data


def test_job_page_and_detail(client: FlaskClient) -> None:
    assert b"done" in client.get("/jobs/done").data
    missing = client.get("/jobs/dnoe")
    assert missing.status_code == 404 and b"did you mean &#39;done&#39;" in missing.data
    detail = client.get("/api/jobs/done").get_json()
    description = detail["description"]
    assert [t["Status"] for t in description["SecondaryStatusTransitions"]] == [
        "Starting",
        "Training",
        "Completed",
    ]
    assert [h["Name"] for h in description["Hosts"]] == ["algo-1", "algo-2"]
    assert detail["host_ranks"] == {"algo-1": [0], "algo-2": [1]}
    assert [(r["rank"], r["host"]) for r in detail["logs"]] == [(0, "algo-1"), (1, "algo-2")]
    # Environment names only: their values are often credentials.
    assert description["Environment"] == ["AWS_SECRET_ACCESS_KEY"]
    assert "hunter2" not in json.dumps(detail)
    files = [f["path"] for f in detail["files"]]
    assert "hosts/algo-1/model/model.pt" in files and "logs/attempt-1/rank0.log" in files
    assert files[-1] == "hosts/algo-1/code/train.py"  # what the job made comes first
    assert "spec.json" not in files
    assert not any("/input/data/" in path for path in files)


def test_logs_as_the_ranks_wrote_them_on_the_hosts_ranks_json_names(
    store: JobStore, dtrain_home: Path
) -> None:
    """Lines are stored after their times (``dtrain.jobs.logs``); the page shows them as the
    rank wrote them (a plan table they printed is found too), and each rank on the host the
    attempt's ``ranks.json`` names."""
    folder = _make_job(store, dtrain_home, "stamped", "Completed")
    attempt = folder.attempt_logs_dir(1)
    (attempt / "ranks.json").write_text(json.dumps({"0": "algo-2", "1": "algo-1"}))
    folder.log_file(1, 1).write_text(
        "2026-11-25T19:09:32.123456Z epoch 1\n2026-11-25T19:09:33.000001Z 2026 was a year\n"
    )
    folder.log_file(0, 1).write_text(
        "".join(f"2026-11-25T19:09:31.{i:06d}Z {line}\n" for i, line in enumerate(PLAN_TABLE))
    )
    client = create_app(store).test_client()
    log = client.get("/api/jobs/stamped/logs?rank=1&attempt=1").get_json()
    assert log["text"] == "epoch 1\n2026 was a year\n"
    detail = client.get("/api/jobs/stamped").get_json()
    assert detail["host_ranks"] == {"algo-2": [0], "algo-1": [1]}
    assert [(r["rank"], r["host"]) for r in detail["logs"]] == [(0, "algo-2"), (1, "algo-1")]
    views = client.get("/api/jobs/stamped/views").get_json()
    assert [v["text"] for v in views if v["kind"] == "plan-text"] == ["\n".join(PLAN_TABLE)]


def test_logs_tail_offsets_and_partial_lines(client: FlaskClient, dtrain_home: Path) -> None:
    running = client.get("/api/jobs/running/logs?rank=0&attempt=1").get_json()
    assert running["text"].startswith("step=0 loss=1\n") and "partial" not in running["text"]
    again = client.get(f"/api/jobs/running/logs?rank=0&attempt=1&offset={running['offset']}")
    assert again.get_json()["text"] == ""  # half a line waits for its end while the job runs
    with (dtrain_home / "jobs" / "running" / "logs" / "attempt-1" / "rank0.log").open("a") as log:
        log.write(" line\nstep=1 loss=0.5\n")
    grown = client.get(f"/api/jobs/running/logs?rank=0&attempt=1&offset={running['offset']}")
    assert grown.get_json()["text"] == "partial line\nstep=1 loss=0.5\n"
    done = client.get("/api/jobs/done/logs?rank=0&attempt=1").get_json()
    assert done["text"].endswith("partial") and done["offset"] == done["size"]
    assert client.get("/api/jobs/done/logs").get_json()["text"] == "Training: attempt 1\n"
    assert client.get("/api/jobs/done/logs?rank=x").status_code == 400


def test_log_tail_starts_at_a_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobview, "LOG_CHUNK_BYTES", 10)
    path = tmp_path / "rank0.log"
    path.write_text("first line\nsecond\nthird\n")
    chunk = jobview.read_log(path, None, whole_lines=True)
    assert (chunk.text, chunk.offset) == ("third\n", path.stat().st_size)


def test_metrics_series(client: FlaskClient) -> None:
    series = client.get("/api/jobs/done/metrics").get_json()
    assert series["loss"]["step"] == [0, 1, 2, 3, 4]
    assert series["loss"]["value"][0] == 1.0


def test_plans_and_timelines_found_and_read(client: FlaskClient) -> None:
    views = client.get("/api/jobs/done/views").get_json()
    kinds = {view["kind"]: view for view in views}
    assert kinds["trace"]["path"] == "hosts/algo-1/output/data/timeline.json"
    assert kinds["plan"]["path"] == "hosts/algo-1/output/data/plan.json"
    assert kinds["plan-text"]["text"] == "\n".join(PLAN_TABLE)
    trace = client.get(f"/api/jobs/done/view?path={kinds['trace']['path']}").get_json()
    assert [(e["row"], e["name"], e["dur"]) for e in trace["events"]] == [
        ("rank 0 compute", "F0", 500.0),
        ("rank 0 send", "send", 9.0),
        ("rank 1 compute", "F0", 400.0),
    ]
    plan = client.get(f"/api/jobs/done/view?path={kinds['plan']['path']}").get_json()
    assert plan["plan"]["partitions"] == 1
    assert client.get("/api/jobs/done/view?path=logs/controller.log").status_code == 404


def test_downloads_stay_inside_the_job_folder(
    client: FlaskClient, dtrain_home: Path, tmp_path: Path
) -> None:
    root = dtrain_home / "jobs" / "done"
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    (root / "escape").symlink_to(outside)
    (root / "hosts" / "algo-1" / "up").symlink_to(dtrain_home)
    (root / "inside").symlink_to(root / "hosts" / "algo-1" / "model" / "model.pt")
    good = client.get("/jobs/done/files/hosts/algo-1/model/model.pt")
    assert good.status_code == 200 and good.data == b"weights"
    assert good.headers["Content-Type"] == "application/octet-stream"
    assert good.headers["Content-Disposition"].startswith("attachment")
    assert client.get("/jobs/done/files/inside").data == b"weights"
    for path in (
        "../running/spec.json",
        "..%2F..%2Fjobs.db",
        "hosts/../../../jobs.db",
        "%2Fetc%2Fpasswd",
        "/etc/passwd",
        str(outside),
        "escape",
        "hosts/algo-1/up/jobs.db",
        "spec.json",
        "./spec.json",
        "hosts/algo-1/input/data/training/data.csv",
        "hosts/algo-1/model",
        "no-such-file",
    ):
        response = client.get(f"/jobs/done/files/{path}", follow_redirects=True)
        assert response.status_code == 404, path
        assert b"not yours" not in response.data and b"SQLite" not in response.data
    assert jobview.file_in_job(JobStore().get("done"), "") is None


def test_without_a_token_only_loopback_names_are_answered(client: FlaskClient) -> None:
    for host in ("localhost", "127.0.0.1:8470", "[::1]:8470", "127.0.0.2"):
        assert client.get("/api/jobs", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8470", "10.0.0.1", "localhost.evil.example"):
        assert client.get("/api/jobs", headers={"Host": host}).status_code == 403, host


def test_a_token_is_checked_on_every_request(store: JobStore) -> None:
    client = create_app(store, TOKEN).test_client()
    host = {"Host": "10.0.0.1:8470"}  # any name: the token is what counts
    for path in ("/", "/api/jobs", "/jobs/done", "/jobs/done/files/logs/controller.log"):
        assert client.get(path, headers=host).status_code == 403, path
        assert client.get(f"{path}?token=wrong", headers=host).status_code == 403, path
    bearer = {**host, "Authorization": f"Bearer {TOKEN}"}
    assert client.get("/api/jobs", headers=bearer).status_code == 200
    assert client.get(f"/api/jobs?token={TOKEN}", headers=host).status_code == 200
    # A page opened with the token moves it to a cookie and out of the address.
    opened = client.get(f"/jobs/done?token={TOKEN}", headers=host)
    assert opened.status_code == 303 and opened.headers["Location"] == "/jobs/done"
    cookie = opened.headers["Set-Cookie"]
    assert f"{TOKEN_COOKIE}={TOKEN}" in cookie and "HttpOnly" in cookie and "Strict" in cookie
    assert client.get("/jobs/done", headers=host).status_code == 200  # the cookie now
    assert client.get("/api/jobs/done/metrics", headers=host).status_code == 200


def test_security_headers(client: FlaskClient) -> None:
    headers = client.get("/").headers
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"


def test_the_chart_library_ships_with_the_package() -> None:
    static = Path(jobview.__file__).parent / "static" / "uplot"
    assert (static / "uPlot.iife.min.js").stat().st_size > 10_000
    assert "MIT" in (static / "LICENSE").read_text()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--port", "70000"], "--port: got 70000"),
        (["--token-file", "missing-file"], "--token-file: got 'missing-file'"),
        (["--token-file", "short"], "a file holding one token of 16+ characters"),
        (["--host", "192.0.2.1", "--port", "0"], "--host: got '192.0.2.1'"),
    ],
)
def test_bad_flags_are_refused_before_serving(
    flags: list[str],
    expected: str,
    dtrain_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short").write_text("abc\n")
    (tmp_path / "short").chmod(0o600)
    assert main(["ui", *flags]) == 2
    assert expected in capsys.readouterr().err


def test_a_port_in_use_is_refused(dtrain_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["ui", "--port", str(port)]) == 2
    assert f"--port: got {port}" in capsys.readouterr().err


class _Server:
    """Stands in for waitress's server: records the application, listens nowhere."""

    effective_port = 8470
    apps: ClassVar[list[Flask]] = []

    def __init__(self, app: Flask, **options: object) -> None:
        self.apps.append(app)

    def run(self) -> None:
        pass

    def close(self) -> None:
        pass


def _serve(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[str, FlaskClient]:
    """``dtrain ARGS`` with the server replaced: what it printed and a client of its app."""
    monkeypatch.setattr(waitress.server, "create_server", _Server)
    assert main(args) == 0
    return capsys.readouterr().out, _Server.apps[-1].test_client()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "::"])
def test_beyond_loopback_a_token_is_made_and_required(
    host: str,
    dtrain_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    printed, client = _serve(["ui", "--host", host], monkeypatch, capsys)
    token = re.search(r"/\?token=(\S+)", printed)
    assert token and len(token.group(1)) >= 32, printed
    assert client.get("/api/jobs").status_code == 403
    assert client.get(f"/api/jobs?token={token.group(1)}").status_code == 200


class _Sockets(waitress.server.MultiSocketServer):
    """What waitress serves a name of several addresses with: one socket on each, each with a
    port of its own when the port is 0, and no ``effective_port`` of its own."""

    def run(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_name_of_several_addresses_prints_each(
    dtrain_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def create_server(app: Flask, **options: object) -> _Sockets:
        return _Sockets(effective_listen=[("::1", 8470), ("127.0.0.1", 8471)])

    monkeypatch.setattr(waitress.server, "create_server", create_server)
    assert main(["ui", "--host", "localhost", "--port", "0"]) == 0
    printed = capsys.readouterr().out
    assert "http://[::1]:8470/\n" in printed and "http://127.0.0.1:8471/\n" in printed, printed


def test_a_given_token_is_required_on_loopback_too(
    dtrain_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "token").chmod(0o600)
    printed, client = _serve(["ui", "--token-file", str(tmp_path / "token")], monkeypatch, capsys)
    assert f"http://127.0.0.1:8470/?token={TOKEN}" in printed
    assert client.get("/api/jobs").status_code == 403
    assert client.get("/api/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
