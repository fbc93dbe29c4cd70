"""Where a job's hosts come from: one agent per host, found three ways, one job spec.

* ``local`` (default): the controller starts N agents on this machine (the simulated hosts).
* ``join://ADDR:PORT``: the controller listens at ADDR:PORT and waits for N agents started by hand,
  under Slurm's ``srun`` or as Kubernetes pods, each proving the secret in ``--secret-file``.
* ``ray://ADDR:PORT``: one agent per node of an existing Ray cluster (:mod:`ray_cluster`).

Each is checked before anything launches (the address is this machine's and free, the cluster
has enough nodes, ...). After that the agents are the same whatever found them: they join the
controller, which drives them all alike.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dtrain.errors import ConfigError, did_you_mean
from dtrain.jobs.folder import JobFolder
from dtrain.jobs.spec import JobSpec
from dtrain.launch.agent import spawn_agent
from dtrain.launch.netif import format_endpoint, interface_of, parse_endpoint
from dtrain.launch.wire import new_secret, read_secret

SCHEMES = ("local", "join://ADDR:PORT", "ray://ADDR:PORT")
LOCAL_JOIN_TIMEOUT = 120.0
"""Agents started on this machine join in seconds; this only bounds a broken start."""


class Cluster(Protocol):
    """The machines of one job, and how their agents start."""

    kind: str
    join_timeout: float

    def open(self, instance_count: int) -> socket.socket:
        """Check the cluster can hold the job; the controller's socket, bound to the address
        the agents reach it at. A ConfigError here comes before anything is launched."""
        ...

    def secret(self) -> bytes: ...

    def start_agents(
        self,
        controller: tuple[str, int],
        secret: bytes,
        hosts: Sequence[str],
        folder: JobFolder,
        say: Callable[[str], None],
    ) -> None:
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


@dataclass
class LocalCluster:
    """N agents on this machine, started and watched by the controller."""

    kind: str = "local"
    join_timeout: float = LOCAL_JOIN_TIMEOUT

    def __post_init__(self) -> None:
        self._agents: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, Path] = {}
        self._reported: set[str] = set()

    def open(self, instance_count: int) -> socket.socket:
        return listener("127.0.0.1", 0, "cluster", self.kind)

    def secret(self) -> bytes:
        return new_secret()

    def start_agents(
        self,
        controller: tuple[str, int],
        secret: bytes,
        hosts: Sequence[str],
        folder: JobFolder,
        say: Callable[[str], None],
    ) -> None:
        for host in hosts:
            log = self._logs[host] = folder.agent_log_file(host)
            self._reported.discard(host)  # a replacement for a lost host
            with log.open("ab") as sink:  # Ctrl-C reaches the controller, which stops all
                self._agents[host] = spawn_agent(
                    controller, secret, host, self.join_timeout, stdout=sink, stderr=sink
                )

    def lost(self) -> list[tuple[str, str]]:
        found = []
        for host, agent in self._agents.items():
            code = agent.poll()
            if code is None or host in self._reported:
                continue
            self._reported.add(host)
            last = self._logs[host].read_text(errors="replace").strip().splitlines()[-1:]
            found.append(
                (host, f"its agent exited with code {code}: {''.join(last) or 'no output'}")
            )
        return found

    def close(self) -> None:
        for agent in self._agents.values():
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


@dataclass
class JoinCluster:
    """Agents started elsewhere join the controller listening at ``address:port``."""

    address: str
    port: int
    secret_file: str
    join_timeout: float
    kind: str = "join"

    def open(self, instance_count: int) -> socket.socket:
        where = f"join://{format_endpoint(self.address, self.port)}"
        return listener(self.address, self.port, "cluster", where)

    def secret(self) -> bytes:
        return read_secret(self.secret_file, create=True)

    def start_agents(
        self,
        controller: tuple[str, int],
        secret: bytes,
        hosts: Sequence[str],
        folder: JobFolder,
        say: Callable[[str], None],
    ) -> None:
        say(
            f"waiting up to {self.join_timeout:g} s for {len(hosts)} agent(s); on each machine, "
            "run: "
            f"dtrain agent --join {format_endpoint(*controller)} --secret-file {self.secret_file}"
        )

    def lost(self) -> list[tuple[str, str]]:
        return []

    def close(self) -> None:
        return None


def parse_cluster(spec: JobSpec) -> Cluster:
    """The job's ``cluster`` as a :class:`Cluster`; checks what needs no machine but this one."""
    text, secret_file = spec.cluster, spec.secret_file
    if not isinstance(text, str):
        raise ConfigError("cluster", text, ", ".join(SCHEMES))
    scheme, separator, rest = text.partition("://")
    if text == "local":
        if secret_file is not None:
            raise ConfigError("secret_file", secret_file, "only with a join:// cluster")
        return LocalCluster()
    if separator and scheme == "join":
        address, port = parse_endpoint("cluster", rest)
        if interface_of(address) is None and address not in ("0.0.0.0", "::"):
            raise ConfigError(
                "cluster", text, f"an address of this machine to listen on ({address} is not)"
            )
        if secret_file is None:
            raise ConfigError(
                "secret_file",
                None,
                "a file holding the job's secret (created, mode 0600, if missing)",
            )
        return JoinCluster(address, port, secret_file, spec.join_timeout)
    if separator and scheme == "ray":
        from dtrain.launch.ray_cluster import RayCluster

        if secret_file is not None:
            raise ConfigError("secret_file", secret_file, "only with a join:// cluster")
        return RayCluster(*parse_endpoint("cluster", rest), spec.environment)
    candidates = ["local", "join", "ray"]
    raise ConfigError("cluster", text, ", ".join(SCHEMES), did_you_mean(scheme or text, candidates))
