"""What every way of finding machines provides (:class:`Cluster`), and what it is given."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dtrain.errors import ConfigError
from dtrain.jobs.folder import JobFolder


@dataclass(frozen=True)
class AgentJob:
    """What every agent of the job is started with, and where the cluster reports to."""

    controller: tuple[str, int]
    """The address and port agents join."""
    secret: bytes
    folder: JobFolder
    say: Callable[[str], None]


class Cluster(Protocol):
    """The machines of one job, and how their agents start."""

    kind: str
    join_timeout: float

    def open(self, instance_count: int) -> socket.socket:
        """Check the cluster can hold the job; the controller's socket, bound to the address
        the agents reach it at. A ConfigError here comes before anything is launched."""
        ...

    def secret(self) -> bytes: ...

    def start_agents(self, hosts: Sequence[str], job: AgentJob) -> None:
        """Start (or ask for) one agent for each of ``hosts``."""
        ...

    def lost(self) -> list[tuple[str, str]]:
        """Hosts whose agents the engine saw end, each once, with what it said."""
        ...

    def close(self) -> None:
        """End what ``start_agents`` started (the agents were dismissed before)."""
        ...


def listener(address: str, port: int, key: str, value: str) -> socket.socket:
    """A listening socket on ``address:port``, or a ConfigError that names the flag's value."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a finished job used
    try:
        sock.bind((address, port))
        sock.listen(256)
    except OSError as error:
        sock.close()
        raise ConfigError(
            key, value, f"an address and port free to listen on ({error.strerror})"
        ) from None
    return sock
