"""The rendezvous store: its port is there at once, a rank that comes before the server waits
for it, and closing frees the port whether or not the server started."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from dtrain.launch.rendezvous import RendezvousStore


@pytest.fixture
def torch_loaded(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Servers start only once this is set, as if torch took that long to load."""
    loaded = threading.Event()
    start = RendezvousStore._start
    monkeypatch.setattr(RendezvousStore, "_start", lambda self: (loaded.wait(), start(self)))
    return loaded


def test_a_rank_that_connects_before_the_server_runs_waits_for_it(
    torch_loaded: threading.Event,
) -> None:
    store = RendezvousStore("127.0.0.1")
    got: list[bytes] = []

    def rank() -> None:
        client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30))
        client.set("ready", "yes")
        got.append(client.get("ready"))

    early = threading.Thread(target=rank)
    early.start()
    early.join(timeout=0.5)
    assert early.is_alive() and not got, "it waits while the server is not up"
    torch_loaded.set()
    early.join(timeout=30)
    assert got == [b"yes"]
    store.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", store.port), timeout=5)


def test_a_store_closed_before_its_server_started_frees_its_port(
    torch_loaded: threading.Event,
) -> None:
    store = RendezvousStore("127.0.0.1")
    store.close()
    torch_loaded.set()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", store.port), timeout=5)
    store.check()
