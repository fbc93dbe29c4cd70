"""Hosts on an existing Ray cluster: one agent per Ray node, started and watched through Ray.

``ray://ADDR:PORT`` is the cluster's GCS address (what ``ray start --head`` prints for adding
nodes), and the controller connects to it as a Ray driver, so it runs on a machine of the cluster,
typically the head. A ``STRICT_SPREAD`` placement group of one bundle per host (1 CPU each) puts
each agent on its own node; a cluster with fewer live nodes than hosts is refused before launch.
Each agent runs as a subprocess of a Ray actor, with the job's ``environment`` carried in the
actor's ``runtime_env`` (but for variables given by name or in a file: Ray puts a runtime_env's
variables on its worker set-up's command line, which every user of the node can read; the agent
gets every variable in the job's encrypted start message anyway) and a parent-death signal, so an
actor Ray kills takes its agent along.
Ray's node health checks report a dead node or actor (:meth:`RayCluster.lost`); the agents'
own heartbeats find a cut link sooner (15 s against Ray's default of about a minute).

Ray itself is an optional extra (``ray``: ``pip install ray`` beside dtrain).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

from dtrain.errors import ConfigError, DtrainError
from dtrain.launch.agent import spawn_agent
from dtrain.launch.clusters.base import AgentJob, listener
from dtrain.launch.netif import format_endpoint, route_source
from dtrain.launch.processes import die_with_parent
from dtrain.launch.wire import new_secret

PLACEMENT_TIMEOUT = 120.0
"""How long the cluster may take to reserve a CPU on each of N nodes."""
BUNDLE = {"CPU": 1}


class AgentActor:
    """Runs an agent on its node until the agent exits (Ray's remote class, unwrapped)."""

    def run(
        self, controller: tuple[str, int], secret: bytes, host: str, connect_timeout: float
    ) -> int:
        parent_death = functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
        return spawn_agent(
            controller, secret, host, connect_timeout, preexec_fn=parent_death
        ).wait()


class RayCluster:
    """The nodes of the Ray cluster whose GCS listens at ``address:port``."""

    kind = "ray"
    join_timeout = PLACEMENT_TIMEOUT

    def __init__(self, address: str, port: int, environment: dict[str, str]) -> None:
        self.address = address
        self.port = port
        self.environment = environment
        self.uri = f"ray://{format_endpoint(address, port)}"
        self._groups: list[Any] = []
        self._actors: dict[str, Any] = {}
        self._runs: dict[str, Any] = {}
        self._last_look = 0.0

    def open(self, instance_count: int) -> socket.socket:
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "cluster",
                self.uri,
                "a Ray cluster, with Ray installed (pip install ray: dtrain's ray extra)",
            ) from None
        try:
            ray.init(
                address=format_endpoint(self.address, self.port),
                logging_level=logging.ERROR,
                log_to_driver=False,
                configure_logging=False,
            )
        except Exception as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ConfigError(
                "cluster", self.uri, f"a reachable Ray cluster ({type(error).__name__}: {first})"
            ) from None
        alive = sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
        if len(alive) < instance_count:
            ray.shutdown()
            raise ConfigError(
                "cluster",
                self.uri,
                f"a Ray cluster with a live node per host: {instance_count} host(s) asked for, "
                f"{len(alive)} node(s) alive ({', '.join(alive)})",
            )
        return listener(route_source(self.address), 0, "cluster", self.uri)

    def secret(self) -> bytes:
        return new_secret()

    def start_agents(self, hosts: Sequence[str], job: AgentJob) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([BUNDLE] * len(hosts), strategy="STRICT_SPREAD")
        self._groups.append(group)  # replacements of lost hosts get a group of their own
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise DtrainError(
                f"the Ray cluster could not reserve {BUNDLE} on each of {len(hosts)} nodes "
                f"within {PLACEMENT_TIMEOUT:g} s"
            ) from None
        remote = ray.remote(AgentActor)
        options: dict[str, Any] = {"num_cpus": BUNDLE["CPU"], "max_restarts": 0}
        if self.environment:
            options["runtime_env"] = {"env_vars": dict(self.environment)}
        for index, host in zip(self._bundle_order(group), hosts, strict=True):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            actor = remote.options(scheduling_strategy=strategy, **options).remote()
            self._actors[host] = actor
            self._runs[host] = actor.run.remote(job.controller, job.secret, host, PLACEMENT_TIMEOUT)
        job.say(f"started agents for {', '.join(hosts)} on the Ray cluster at {self.uri}")

    @staticmethod
    def _bundle_order(group: Any) -> list[int]:
        """Bundles in host order: the one on the controller's node first (``algo-1``, which
        hosts the rendezvous), then by node address, so the same cluster names hosts alike."""
        import ray
        from ray.util.placement_group import placement_group_table

        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        own = ray.get_runtime_context().get_node_id()
        placed = placement_group_table(group)["bundles_to_node_id"]
        return sorted(
            placed, key=lambda bundle: (placed[bundle] != own, addresses.get(placed[bundle], ""))
        )

    def lost(self) -> list[tuple[str, str]]:
        """Agents whose actor call ended: Ray saw their node or process die (or they exited)."""
        import ray

        now = time.monotonic()
        if not self._runs or now - self._last_look < 0.5:
            return []
        self._last_look = now
        ended, _ = ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=0)
        found = []
        for host, run in list(self._runs.items()):
            if run not in ended:
                continue
            del self._runs[host]
            try:
                found.append((host, f"its agent exited with code {ray.get(run)}"))
            except ray.exceptions.RayError as error:
                detail = " ".join(str(error).split())[:300]
                found.append((host, f"Ray reports its agent's actor dead: {detail}"))
        return found

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self._runs:  # dismissed agents exit at once; give them a moment before the kill
            ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=10)
        for actor in self._actors.values():
            ray.kill(actor)
        for group in self._groups:
            remove_placement_group(group)
        ray.shutdown()
