"""``local``: N agents on this machine, started and watched by the controller (simulated hosts)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.launch.agent import spawn_agent
from dtrain.launch.clusters.base import AgentJob, listener
from dtrain.launch.wire import new_secret

LOCAL_JOIN_TIMEOUT = 120.0
"""Agents started on this machine join in seconds; this only bounds a broken start."""


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

    def start_agents(self, hosts: Sequence[str], job: AgentJob) -> None:
        for host in hosts:
            log = self._logs[host] = job.folder.agent_log_file(host)
            self._reported.discard(host)  # a replacement for a lost host
            with log.open("ab") as sink:  # Ctrl-C reaches the controller, which stops all
                self._agents[host] = spawn_agent(
                    job.controller, job.secret, host, self.join_timeout, stdout=sink, stderr=sink
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
