"""Odd paths and numbers in requests to the web view: each is answered 4xx, never 500.

A 500 means a traceback in the server's log and, to whoever probes the view, a sign of which
input reaches the file system unchecked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flask.testing import FlaskClient

from dtrain.jobs.store import JobStore
from dtrain.ui.app import create_app
from tests.ui.test_app import _make_job

LONG_NAME = "a" * 5000
DEEP_PATH = "a/" * 3000 + "b"


@pytest.fixture
def client(dtrain_home: Path) -> FlaskClient:
    store = JobStore()
    folder = _make_job(store, dtrain_home, "done", "Completed")
    (folder.root / "loop").symlink_to(folder.root / "loop")
    (folder.root / "ping").symlink_to(folder.root / "pong")
    (folder.root / "pong").symlink_to(folder.root / "ping")
    return create_app(store).test_client()


@pytest.mark.parametrize(
    "path",
    [
        "spec.json%00",
        "hosts/algo-1/model/model.pt%00",
        "x%00y",
        LONG_NAME,
        DEEP_PATH,
        "loop",
        "ping",
        "loop/x",
        "..%2f..%2fjobs.db",
        "%2e%2e/%2e%2e/jobs.db",
        "hosts%2f..%2f..%2fjobs.db",
        "%ff%fe",
        "a%0ab",
        ".",
    ],
)
def test_a_file_path_that_names_no_file_of_the_job_is_not_found(
    client: FlaskClient, path: str
) -> None:
    assert client.get(f"/jobs/done/files/{path}").status_code == 404
    assert client.get(f"/api/jobs/done/view?path={path}").status_code == 404


def test_a_view_path_with_a_nul_byte_is_not_found(client: FlaskClient) -> None:
    plan = "hosts/algo-1/output/data/plan.json"
    assert client.get(f"/api/jobs/done/view?path={plan}").status_code == 200
    assert client.get(f"/api/jobs/done/view?path={plan}%00").status_code == 404
    assert client.get("/api/jobs/done/view?path=x%00").status_code == 404
    assert client.get(f"/api/jobs/done/view?path={'../' * 3000}").status_code == 404


@pytest.mark.parametrize("name", ["done%00", LONG_NAME, "%ff", "..", "done%2f..%2fdone"])
def test_an_odd_job_name_is_not_found(client: FlaskClient, name: str) -> None:
    for route in ("/jobs/{}", "/api/jobs/{}", "/api/jobs/{}/logs", "/jobs/{}/files/spec.json"):
        assert client.get(route.format(name)).status_code == 404, route


@pytest.mark.parametrize(
    "query",
    [
        "rank=0%00",
        "rank=" + "9" * 300,
        "rank=" + "9" * 5000,
        "rank=0&attempt=" + "9" * 300,
        "rank=-1",
        "rank=0&attempt=0",
        "offset=-5",
        "offset=" + "9" * 30,
        "rank=x",
    ],
)
def test_a_log_request_out_of_range_is_a_bad_request(client: FlaskClient, query: str) -> None:
    response = client.get(f"/api/jobs/done/logs?{query}")
    assert response.status_code == 400
    assert b"must be" in response.data


def test_log_requests_in_range_are_answered(client: FlaskClient) -> None:
    for query in ("", "rank=0", "rank=0&attempt=1&offset=0", "rank=2147483647", "offset=0"):
        assert client.get(f"/api/jobs/done/logs?{query}").status_code == 200, query
