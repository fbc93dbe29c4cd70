"""How an attempt ends, from reports alone: root cause, collateral errors, stops, lost hosts."""

from __future__ import annotations

from dtrain.launch.outcome import (
    COMPLETED,
    FAILED,
    STOPPED,
    Attempt,
    Failure,
    failed_rank,
    rank_failure,
)

HOSTS = ("algo-1", "algo-2")
GLOO = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4"


def test_every_rank_done_is_completed() -> None:
    attempt = Attempt(1, HOSTS)
    assert not attempt.rank_exited(None, stopped=False)
    attempt.host_done("algo-1")
    assert not attempt.ended
    attempt.host_done("algo-2")
    assert attempt.ended and attempt.outcome().status == COMPLETED


def test_first_failure_stops_all_once_and_the_earliest_is_the_cause() -> None:
    attempt = Attempt(1, HOSTS)
    late = rank_failure("algo-1", 0, 1, 10.5, "Traceback...\nValueError: late")
    early = rank_failure("algo-2", 3, 1, 10.0, "Traceback...\nValueError: boom from rank 3")
    assert attempt.rank_exited(late, stopped=False) is True  # stop every host now
    assert attempt.rank_exited(early, stopped=False) is False  # already stopping
    outcome = attempt.outcome()
    assert outcome.status == FAILED and outcome.failure == early
    assert outcome.message == "rank 3 (algo-2) exited with code 1: ValueError: boom from rank 3"
    assert not outcome.retryable  # an exception in the script is not retried


def test_a_peers_collateral_error_ranks_after_the_root_cause_even_if_earlier() -> None:
    attempt = Attempt(1, HOSTS)
    attempt.rank_exited(rank_failure("algo-1", 0, 1, 5.0, f"Traceback...\n{GLOO}"), False)
    attempt.rank_exited(rank_failure("algo-2", 3, 1, 5.1, "Traceback...\nKeyError: 'x'"), False)
    assert attempt.outcome().failure.rank == 3  # type: ignore[union-attr]


def test_a_model_parallel_error_belongs_to_the_rank_that_raised_it() -> None:
    """Both ranks print ``KeyError ... (raised on rank 1 ...)``: it is rank 1's own error."""
    remote = "RemoteError: KeyError: 'boom' (raised on rank 1; remote traceback below)"
    own = "StepFailedError: KeyError: 'boom' (raised on rank 1; remote traceback below)"
    attempt = Attempt(1, HOSTS)
    attempt.rank_exited(rank_failure("algo-1", 0, 1, 5.0, f"Traceback...\n{remote}"), False)
    attempt.rank_exited(rank_failure("algo-1", 1, 1, 5.2, f"Traceback...\n{own}"), False)
    assert attempt.outcome().failure.rank == 1  # type: ignore[union-attr]


def test_ranks_that_were_being_stopped_do_not_count() -> None:
    attempt = Attempt(1, HOSTS)
    assert attempt.request_stop("Stopped", "Stopped by request (dtrain stop)")
    killed = rank_failure("algo-1", 0, -15, 3.0, "")
    assert not attempt.rank_exited(killed, stopped=True)
    assert attempt.outcome().status == STOPPED
    assert attempt.outcome().message == "Stopped by request (dtrain stop)"


def test_a_failure_before_a_stop_request_keeps_the_job_failed() -> None:
    attempt = Attempt(1, HOSTS)
    attempt.rank_exited(rank_failure("algo-1", 1, -9, 2.0, ""), stopped=False)
    assert not attempt.request_stop("MaxRuntimeExceeded", "too long")
    outcome = attempt.outcome()
    assert outcome.status == FAILED and outcome.message == "rank 1 (algo-1) was killed by SIGKILL"
    assert outcome.retryable  # a killed rank is an infrastructure failure


def test_a_lost_host_ends_its_share_and_is_retryable() -> None:
    attempt = Attempt(1, HOSTS)
    lost = Failure("algo-2", None, 4.0, "(10.0.0.2) was lost: no heartbeat for 15 s", lost=True)
    assert attempt.host_lost(lost)
    attempt.rank_exited(rank_failure("algo-1", 0, 1, 4.5, f"Traceback...\n{GLOO}"), False)
    attempt.host_done("algo-1")
    outcome = attempt.outcome()
    assert attempt.ended and outcome.failure == lost and outcome.retryable
    assert outcome.message == "host algo-2 (10.0.0.2) was lost: no heartbeat for 15 s"


def test_a_host_that_reports_an_error_fails_the_job_without_a_retry() -> None:
    attempt = Attempt(1, HOSTS)
    assert attempt.host_lost(Failure("algo-1", None, 1.0, "failed: cannot start rank 0"))
    attempt.host_done("algo-2")
    outcome = attempt.outcome()
    assert outcome.message == "host algo-1 failed: cannot start rank 0" and not outcome.retryable


def test_the_failed_rank_is_read_back_from_the_reason() -> None:
    """The web view opens the log of the rank a job's FailureReason names."""
    for rank, tail in ((3, "ValueError: rank 1 (algo-1) said no"), (0, ""), (12, "x\n")):
        failure = Failure("algo-2", rank, 1.0, "exited with code 1", tail)
        assert failed_rank(failure.reason) == rank
    assert failed_rank(Failure("algo-2", None, 1.0, "was lost: no heartbeat").reason) is None
    assert failed_rank("the dtrain supervisor (pid 7) exited without finishing") is None
