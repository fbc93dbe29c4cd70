"""``join://ADDR:PORT``: the controller listens there for agents started elsewhere.

By hand, under Slurm's ``srun`` or as Kubernetes pods, each agent proves the secret in the job's
``--secret-file``.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from dtrain.launch.clusters.base import AgentJob, listener
from dtrain.launch.netif import format_endpoint
from dtrain.launch.wire import read_secret


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

    def start_agents(self, hosts: Sequence[str], job: AgentJob) -> None:
        job.say(
            f"waiting up to {self.join_timeout:g} s for {', '.join(hosts)}; on each machine, run: "
            f"dtrain agent --join {format_endpoint(*job.controller)} "
            f"--secret-file {self.secret_file}"
        )

    def lost(self) -> list[tuple[str, str]]:
        return []

    def close(self) -> None:
        return None
