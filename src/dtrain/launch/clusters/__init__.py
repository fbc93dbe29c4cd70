"""Where a job's hosts come from: one agent per host, found three ways, one job spec.

* ``local`` (default): the controller starts N agents on this machine (the simulated hosts).
* ``join://ADDR:PORT``: the controller listens at ADDR:PORT and waits for N agents started by hand,
  under Slurm's ``srun`` or as Kubernetes pods, each proving the secret in ``--secret-file``.
* ``ray://ADDR:PORT``: one agent per node of an existing Ray cluster.

Each is checked before anything launches (the address is this machine's and free, the cluster
has enough nodes, ...). After that the agents are the same whatever found them: they join the
controller, which drives them all alike.
"""

from __future__ import annotations

from dtrain.errors import ConfigError, did_you_mean
from dtrain.jobs.spec import JobSpec
from dtrain.launch.clusters.base import AgentJob, Cluster
from dtrain.launch.clusters.join import JoinCluster
from dtrain.launch.clusters.local import LocalCluster
from dtrain.launch.netif import interface_of, parse_endpoint

SCHEMES = ("local", "join://ADDR:PORT", "ray://ADDR:PORT")

__all__ = ["AgentJob", "Cluster", "parse_cluster"]


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
        from dtrain.launch.clusters.ray import RayCluster  # Ray is an optional extra

        if secret_file is not None:
            raise ConfigError("secret_file", secret_file, "only with a join:// cluster")
        # Ray puts a runtime_env's variables on a command line (its worker set-up's): those given
        # by name or in a file travel only in the job's encrypted start message.
        shown = {k: v for k, v in spec.environment.items() if k not in spec.hidden_environment}
        return RayCluster(*parse_endpoint("cluster", rest), shown)
    candidates = ["local", "join", "ray"]
    raise ConfigError("cluster", text, ", ".join(SCHEMES), did_you_mean(scheme or text, candidates))
