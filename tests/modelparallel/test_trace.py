"""The pipeline's Chrome trace: computations, sends, receives and waits, exported by a job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dtrain.modelparallel as smp
from dtrain.errors import ConfigError
from dtrain.modelparallel.options import TRACE_ENV, RuntimeOptions
from dtrain.modelparallel.timeline import COMMUNICATION_KINDS, TimelineEvent, chrome_trace
from tests.modelparallel.harness import run_ranks, train_steps
from tests.modelparallel.models import GroupedNet

STEPS = 2


def _traced_training() -> dict[str, Any]:
    """Two steps of a 2-rank pipeline, as a script would run them: the trace is the
    environment's doing (``DTRAIN_MP_TRACE``), not the script's."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    module = GroupedNet(seed=0)
    smp.set_partition(module.group2, 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    batches = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        images = torch.randn(4, 1, 12, 12, generator=generator)
        batches.append((images, torch.randint(0, 10, (4,), generator=generator)))
    train_steps(model, optimizer, batches, F.nll_loss)
    return {
        "compute": model.timeline(),
        "everything": model.timeline(communication=True),
        "global_rank": smp.rank(),
    }


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Any]:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    ranks = run_ranks(2, _traced_training, timeout=120, env={TRACE_ENV: str(path)})
    return ranks, json.loads(path.read_text())


def test_the_job_trace_has_communication_and_waiting_slices(
    traced: tuple[list[dict[str, Any]], Any],
) -> None:
    ranks, trace = traced
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_kind: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for event in slices:
        by_kind.setdefault((event["pid"], event["cat"]), []).append(event)
    for rank in (0, 1):
        assert by_kind.get((rank, "F")) and by_kind.get((rank, "SEND")), rank
        assert by_kind.get((rank, "RECV")), rank
    # The leader waits for the other partition's replies (its outputs, its backward).
    waits = by_kind[(0, "WAIT")]
    assert all(event["args"]["peer"] == ranks[1]["global_rank"] for event in waits)
    assert all("from rank 1" in event["name"] for event in waits)

    # Sane times: within the step, and every stream received was sent before it arrived.
    first = min(event["ts"] for event in slices)
    last = max(event["ts"] + event["dur"] for event in slices)
    assert 0 < last - first < 60e6
    for event in slices:
        assert event["dur"] >= 0 and first <= event["ts"] <= last
    for receive in by_kind[(1, "RECV")]:
        sends = [s for s in by_kind[(0, "SEND")] if s["ts"] <= receive["ts"] + receive["dur"]]
        assert sends, receive
        assert receive["args"]["bytes"] > 0 and "from rank 0" in receive["name"]
    for rank in (0, 1):  # waiting is not computing: the leader's waits hold no compute token
        computed = sum(event["dur"] for event in slices if event["pid"] == rank
                       and event["cat"] not in COMMUNICATION_KINDS)  # fmt: skip
        assert 0 < computed < last - first

    rows = {
        (e["pid"], e["args"]["name"])
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert {(0, "compute"), (0, "send"), (0, "receive"), (0, "wait")} <= rows
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1"}


def test_the_models_timeline_keeps_computations_apart(
    traced: tuple[list[dict[str, Any]], Any],
) -> None:
    """``model.timeline()`` is what ran on the rank (schedules are checked against it); the
    communication is there on request, and the trace holds the last step of every rank (as
    the ranks had recorded it when the step ended: a thread that sent a reply may record its
    send a moment after the step ended for the rank that got it)."""
    ranks, trace = traced
    for rank in ranks:
        assert rank["compute"] and not {e.kind for e in rank["compute"]} & {*COMMUNICATION_KINDS}
        kinds = {e.kind for e in rank["everything"]}
        assert {"SEND", "RECV"} <= kinds and set(rank["compute"]) <= set(rank["everything"])
    exported = [(e["pid"], e["cat"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    recorded = {(e.rank, e.kind, e.start * 1e6) for rank in ranks for e in rank["everything"]}
    assert exported and set(exported) <= recorded


def test_overlapping_slices_get_rows_of_their_own() -> None:
    events = [
        TimelineEvent(0, "F", 0, 1.0, 2.0),
        TimelineEvent(0, "WAIT", 0, 1.0, 3.0, "FORWARD a from rank 1", peer=1),
        TimelineEvent(0, "WAIT", 1, 2.0, 4.0, "FORWARD a from rank 1", peer=1),
        TimelineEvent(0, "WAIT", 2, 3.5, 5.0, "FETCH from rank 1", peer=1),
        TimelineEvent(1, "SEND_F", 0, 2.0, 2.0),
    ]
    trace = chrome_trace(events)["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    waits = [e for e in trace if e["ph"] == "X" and e["cat"] == "WAIT"]
    assert [rows[(0, e["tid"])] for e in waits] == ["wait", "wait 2", "wait"]
    assert waits[0]["args"] == {"microbatch": 0, "peer": 1}
    assert sorted(rows.values()) == ["compute", "send", "wait", "wait 2"]
    order = {e["args"]["sort_index"]: rows[(e["pid"], e["tid"])] for e in trace
             if e["name"] == "thread_sort_index" and e["pid"] == 0}  # fmt: skip
    assert [order[key] for key in sorted(order)] == ["compute", "wait", "wait 2"]


def test_the_trace_variable_names_a_file_in_the_jobs_output(tmp_path: Path) -> None:
    environ = {TRACE_ENV: "trace.json", "SM_OUTPUT_DATA_DIR": str(tmp_path)}
    assert RuntimeOptions.from_environment(environ).trace == str(tmp_path / "trace.json")
    absolute = str(tmp_path / "elsewhere.json")
    assert RuntimeOptions.from_environment({TRACE_ENV: absolute}).trace == absolute
    assert RuntimeOptions.from_environment({}).trace == ""
    with pytest.raises(ConfigError, match=f"{TRACE_ENV}: got 'missing/trace.json'"):
        RuntimeOptions.from_environment({**environ, TRACE_ENV: "missing/trace.json"})
