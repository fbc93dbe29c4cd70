"""What each host's ranks are told, from the facts its agent reported."""

from __future__ import annotations

import inspect
import json
import re

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from dtrain.config.distribution import resolve_distribution
from dtrain.jobs.spec import JobSpec
from dtrain.launch.env import Host, LaunchPlan, device_slices


def host(name: str, machine: str, gpus: int = 0, address: str = "10.0.0.1") -> Host:
    devices = [str(d) for d in range(gpus)]
    return Host(name, address, "eth1", machine, "node", 8, devices, "/home/u/.dtrain", 1)


def test_hosts_on_one_machine_share_its_gpus_and_others_get_their_own() -> None:
    local = [host("algo-1", "m", gpus=8), host("algo-2", "m", gpus=8)]
    assert device_slices("local", local) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert device_slices("local_cpu", local) == [[], []]
    apart = [host("algo-1", "a", gpus=4), host("algo-2", "b", gpus=2)]
    assert device_slices("local", apart) == [["0", "1"], ["0", "1"]]  # homogeneous: the least


def test_rank_environment_follows_each_hosts_address_interface_and_cores() -> None:
    spec = JobSpec("train.py", "job", instance_count=2, instance_type="local_cpu")
    distribution = resolve_distribution(
        None, instance_count=2, processes_per_host=2, default_processes_per_host=1
    )
    hosts = (host("algo-1", "a", address="10.0.0.1"), host("algo-2", "b", address="10.0.0.2"))
    plan = LaunchPlan(spec, distribution, hosts)
    env = plan.rank_env(3, master_port=29400, attempt=2)
    assert (env["RANK"], env["LOCAL_RANK"], env["SM_CURRENT_HOST"]) == ("3", "1", "algo-2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29400")
    assert (env["DTRAIN_ATTEMPT"], env["TORCHELASTIC_RESTART_COUNT"]) == ("2", "1")
    assert env["SM_NETWORK_INTERFACE_NAME"] == "eth1"
    assert env["SM_MODEL_DIR"] == "/home/u/.dtrain/jobs/job/hosts/algo-2/model"
    assert (
        json.loads(plan.host_config(1)["resourceconfig.json"])["network_interface_name"] == "eth1"
    )
    assert plan.defaults(1) == {
        "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1", "OMP_NUM_THREADS": "4",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip
    shared = LaunchPlan(spec, distribution, (host("algo-1", "m"), host("algo-2", "m")))
    assert shared.defaults(0)["OMP_NUM_THREADS"] == "2"  # 8 cores, 4 ranks on the machine


def torchrun_worker_variables() -> set[str]:
    """The variables torchrun's agent gives every worker, read from torch's own source
    (``LocalElasticAgent._start_workers``'s table, and ``LOCAL_RANK``), so that one torch adds
    shows here."""
    source = inspect.getsource(LocalElasticAgent._start_workers)
    return set(re.findall(r'"([A-Z][A-Z_]+)": ', source)) | {"LOCAL_RANK"}


def test_torch_distributed_ranks_get_the_values_torchrun_gives() -> None:
    """SageMaker starts a ``torch_distributed`` job as ``torchrun --nnodes 2 --nproc-per-node 2
    --node-rank H`` on host H; each rank gets what torchrun's agent would give it there."""
    spec = JobSpec("train.py", "v2-job", instance_count=2, instance_type="local_cpu")
    distribution = resolve_distribution(
        {"torch_distributed": {"enabled": True}},
        instance_count=2,
        processes_per_host=2,
        default_processes_per_host=1,
    )
    hosts = (host("algo-1", "a", address="10.0.0.1"), host("algo-2", "b", address="10.0.0.2"))
    plan = LaunchPlan(spec, distribution, hosts)
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**plan.defaults(node), **plan.rank_env(rank, master_port=29400, attempt=1)}
        expected = {
            "RANK": rank, "LOCAL_RANK": local, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2,
            "GROUP_RANK": node, "GROUP_WORLD_SIZE": 2,
            "ROLE_NAME": "default", "ROLE_RANK": rank, "ROLE_WORLD_SIZE": 4,
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": 29400,  # algo-1's, on every host
            "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
            "TORCHELASTIC_RUN_ID": "v2-job", "TORCHELASTIC_USE_AGENT_STORE": True,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
        }  # fmt: skip
        assert set(expected) == torchrun_worker_variables()
        assert {name: env.get(name) for name in expected} == {
            name: str(value) for name, value in expected.items()
        }, rank
