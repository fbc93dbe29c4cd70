"""The order in which the transport hands streams to gloo: a stream whose GPU copies still run
waits on the poster's thread, and every stream sent after it waits behind it, whether or not it
has copies of its own; the sender never waits. Without processes or GPUs: completions are
events the test sets."""

from __future__ import annotations

import threading

import pytest

from dtrain.modelparallel.transport.posting import Poster

WAIT = 30.0
"""Seconds a test waits for what it released (reached at once unless the code is broken)."""


class Copies:
    """A stream's copies, done when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(WAIT), "the test never completed these copies"


class Network:
    """What was posted, in order, and on which thread."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []
        self.failures: list[BaseException] = []
        self.poster: Poster[str] = Poster(self.post, self.failures.append, "poster")
        self.also: dict[str, str] = {}
        """Posting the key submits the value too (as a failure sends its notice on)."""

    def post(self, item: str) -> None:
        if item == "broken":
            raise RuntimeError("gloo failed")
        self.posted.append((item, threading.current_thread().name))
        if item in self.also:
            self.poster.submit(self.also[item])


def test_streams_leave_in_sending_order_each_once_its_copies_are_done() -> None:
    network, main = Network(), threading.current_thread().name
    first, third = Copies(), Copies()
    network.poster.submit("cpu before", None)
    network.poster.submit("gpu 1", first)
    network.poster.submit("cpu behind gpu 1", None)  # the sender goes on: queued
    network.poster.submit("gpu 2", third)
    assert network.posted == [("cpu before", main)]
    third.done.set()  # done early: still waits for the streams before it
    assert network.posted == [("cpu before", main)]
    first.done.set()
    assert network.poster.drain(WAIT)
    assert network.posted == [
        ("cpu before", main),
        ("gpu 1", "poster"),
        ("cpu behind gpu 1", "poster"),
        ("gpu 2", "poster"),
    ]
    network.poster.submit("cpu after", None)  # nothing before it: on the sender's thread
    assert network.posted[-1] == ("cpu after", main)
    network.poster.close()


def test_drain_says_when_a_stream_is_still_waiting() -> None:
    network, copies = Network(), Copies()
    network.poster.submit("gpu", copies)
    assert not network.poster.drain(0.05)
    copies.done.set()
    assert network.poster.drain(WAIT) and network.posted == [("gpu", "poster")]
    network.poster.close()


@pytest.mark.parametrize("waiting", [False, True], ids=["on the sender", "on the poster"])
def test_a_post_may_send_on_from_inside_it(waiting: bool) -> None:
    """A post that fails the transport sends the failure to its peers from inside the post (the
    lock is re-entrant): on the sender's thread at once, on the poster's behind what waits."""
    network, copies = Network(), Copies()
    network.also["first"] = "notice"
    network.poster.submit("first", copies if waiting else None)
    network.poster.submit("last", None)
    copies.done.set()
    assert network.poster.drain(WAIT)
    expected = ["first", "last", "notice"] if waiting else ["first", "notice", "last"]
    assert [item for item, _ in network.posted] == expected
    network.poster.close()


def test_a_post_that_fails_on_the_posters_thread_is_reported_and_the_rest_leave() -> None:
    network, copies = Network(), Copies()
    network.poster.submit("broken", copies)
    network.poster.submit("last", None)
    copies.done.set()
    assert network.poster.drain(WAIT)
    assert [str(exc) for exc in network.failures] == ["gloo failed"]
    assert network.posted == [("last", "poster")]
    network.poster.close()
