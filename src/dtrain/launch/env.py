"""The contract every worker process gets.

torch.distributed variables, SageMaker's ``SM_*``, MPI's rank: computed by the controller from what
each host's agent reported of its machine, and sent to that agent with the ranks to start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.config.distribution import DistributionPlan
from dtrain.jobs.folder import HostFolder, host_folder
from dtrain.jobs.hyperparameters import (
    env_value,
    framework_parameters,
    to_cmd_args,
    to_env,
    to_json_file_content,
    user_hyperparameters,
)
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.tensorboard import host_tensorboard_dir

INSTANCE_GROUP = "homogeneousCluster"


@dataclass(frozen=True)
class Host:
    """A host of a job (``algo-1``...) and the machine its agent runs on, as the agent reported."""

    name: str
    address: str
    """The address the job uses on this machine; every listener of the job binds to it."""
    interface: str
    machine: str
    """Hosts with the same value share one machine (its CPUs and GPUs)."""
    hostname: str
    cpus: int
    gpus: list[str]
    """The GPUs its machine lets processes use (``CUDA_VISIBLE_DEVICES`` names)."""
    home: str
    """The agent's ``DTRAIN_HOME``, under which it lays out its host's folder."""
    pid: int
    """The agent's process id on its machine."""

    def folder(self, job_name: str) -> HostFolder:
        return host_folder(Path(self.home), job_name, self.name)


def device_slices(instance_type: str, hosts: Sequence[Host]) -> list[list[str]]:
    """The GPUs each host's ranks see: hosts on one machine share out its visible GPUs; all get
    as many.

    ``local_cpu`` hides every GPU. SageMaker's clusters are homogeneous, so every host gets the
    smallest share any host can have, which may be none.
    """
    if instance_type == "local_cpu" or not hosts:
        return [[] for _ in hosts]
    sharing = {host.machine: 0 for host in hosts}
    for host in hosts:
        sharing[host.machine] += 1
    each = min(len(host.gpus) // sharing[host.machine] for host in hosts)
    seen = dict.fromkeys(sharing, 0)
    slices = []
    for host in hosts:
        first = seen[host.machine] * each
        seen[host.machine] += 1
        slices.append(host.gpus[first : first + each])
    return slices


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start a validated job's processes on the hosts that joined it."""

    spec: JobSpec
    distribution: DistributionPlan
    hosts: tuple[Host, ...]
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    @property
    def host_names(self) -> list[str]:
        return [host.name for host in self.hosts]

    @property
    def processes_per_host(self) -> int:
        return self.distribution.processes_per_host

    @property
    def world_size(self) -> int:
        return self.distribution.world_size

    @property
    def gpus_per_host(self) -> int:
        return len(device_slices(self.spec.instance_type, self.hosts)[0])

    def host_index(self, rank: int) -> int:
        return rank // self.processes_per_host

    def ranks_of(self, host_index: int) -> range:
        first = host_index * self.processes_per_host
        return range(first, first + self.processes_per_host)

    def host_folder(self, host_index: int) -> HostFolder:
        return self.hosts[host_index].folder(self.spec.job_name)

    @property
    def entry_point_name(self) -> str:
        return Path(self.spec.entry_point).name

    @property
    def module_name(self) -> str:
        """The toolkit's ``module_name``: the script's name without ``.py``, or the module."""
        return self.spec.entry_point if self.spec.module else Path(self.entry_point_name).stem

    @property
    def arguments(self) -> list[str]:
        """The script's arguments: the hyperparameters' (as SageMaker's toolkit passes them),
        then ``script_args`` (as torchrun passes what follows the script), which argparse lets
        win over a hyperparameter of the same name."""
        return [*to_cmd_args(self.hyperparameters), *self.spec.script_args]

    def resource_config(self, host_index: int) -> dict[str, Any]:
        return {
            "current_host": self.hosts[host_index].name,
            "current_instance_type": self.spec.instance_type,
            "current_group_name": INSTANCE_GROUP,
            "hosts": self.host_names,
            "instance_groups": [
                {
                    "instance_group_name": INSTANCE_GROUP,
                    "instance_type": self.spec.instance_type,
                    "hosts": self.host_names,
                }
            ],
            "network_interface_name": self.hosts[host_index].interface,
        }

    def input_data_config(self) -> dict[str, Any]:
        from dtrain.jobs.channels import input_data_config

        return input_data_config(self.spec.channels)

    def host_config(self, host_index: int) -> dict[str, str]:
        """``input/config/*.json`` of one host, as SageMaker writes them before training."""
        files = {
            "hyperparameters.json": to_json_file_content(self.hyperparameters),
            "resourceconfig.json": self.resource_config(host_index),
            "inputdataconfig.json": self.input_data_config(),
        }
        return {
            name: json.dumps(content, indent=2, sort_keys=True) for name, content in files.items()
        }

    def training_env(self, host_index: int) -> dict[str, Any]:
        """``SM_TRAINING_ENV``: the toolkit's whole view of the job, as one JSON document."""
        host = self.hosts[host_index]
        folder = self.host_folder(host_index)
        channels = sorted(c.name for c in self.spec.channels)
        return {
            "additional_framework_parameters": framework_parameters(self.hyperparameters),
            "channel_input_dirs": {c: str(folder.channel_dir(c)) for c in channels},
            "current_host": host.name,
            "current_instance_group": INSTANCE_GROUP,
            "current_instance_group_hosts": self.host_names,
            "current_instance_type": self.spec.instance_type,
            "distribution_hosts": self.host_names,
            "distribution_instance_groups": [INSTANCE_GROUP],
            "framework_module": "dtrain.launch",
            "hosts": self.host_names,
            "hyperparameters": user_hyperparameters(self.hyperparameters),
            "input_config_dir": str(folder.input_config_dir),
            "input_data_config": self.input_data_config(),
            "input_dir": str(folder.input_dir),
            "instance_groups": [INSTANCE_GROUP],
            "is_hetero": False,
            "is_master": host_index == 0,
            "is_modelparallel_enabled": self.distribution.mp_parameters is not None,
            "job_name": self.spec.job_name,
            "log_level": 20,
            "master_hostname": self.host_names[0],
            "model_dir": str(folder.model_dir),
            "module_dir": str(folder.code_dir),
            "module_name": self.module_name,
            "network_interface_name": host.interface,
            "num_cpus": host.cpus,
            "num_gpus": self.gpus_per_host,
            "num_neurons": 0,
            "output_data_dir": str(folder.output_data_dir),
            "output_dir": str(folder.output_dir),
            "output_intermediate_dir": str(folder.output_intermediate_dir),
            "resource_config": self.resource_config(host_index),
            "user_entry_point": self.entry_point_name,
        }

    def checkpoint_dir(self, host_index: int) -> Path:
        if self.spec.checkpoint_local_path:
            return Path(self.spec.checkpoint_local_path)
        return self.host_folder(host_index).checkpoints_dir

    def tensorboard_dir(self, host_index: int) -> Path:
        """The host's ``TensorBoardOutputConfig.LocalPath``, collected when the job ends."""
        return host_tensorboard_dir(
            self.host_folder(host_index), self.spec.tensorboard_output_config
        )

    def rank_env(self, rank: int, master_port: int, attempt: int) -> dict[str, str]:
        """What global ``rank`` is told, over its agent's environment: the job's, then ours."""
        host_index = self.host_index(rank)
        local_rank = rank % self.processes_per_host
        folder = self.host_folder(host_index)
        training_env = self.training_env(host_index)
        world = str(self.world_size)
        contract: dict[str, str] = dict(self.spec.environment)
        contract.update({
            "RANK": str(rank),
            "WORLD_SIZE": world,
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.processes_per_host),
            "GROUP_RANK": str(host_index),
            "GROUP_WORLD_SIZE": str(len(self.hosts)),
            "NODE_RANK": str(host_index),
            # torchrun's one role, "default", holds every rank
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": world,
            "MASTER_ADDR": self.hosts[0].address,
            "MASTER_PORT": str(master_port),
            # algo-1's agent hosts the rendezvous store (on its job address); ranks are clients.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt - 1),
            "TORCHELASTIC_MAX_RESTARTS": str(self.spec.max_retry_attempts),
            "TORCHELASTIC_RUN_ID": self.spec.job_name,
            "DTRAIN_ATTEMPT": str(attempt),
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": world,
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(self.processes_per_host),
            "OMPI_COMM_WORLD_NODE_RANK": str(host_index),
            "SM_CURRENT_HOST": training_env["current_host"],
            "CURRENT_HOST": training_env["current_host"],
            "SM_NUM_GPUS": str(self.gpus_per_host),
            "SM_MODEL_DIR": str(folder.model_dir),
            "SM_OUTPUT_DIR": str(folder.output_dir),
            "SM_OUTPUT_DATA_DIR": str(folder.output_data_dir),
            "SM_INPUT_DIR": str(folder.input_dir),
            # sagemaker_training (AWS's toolkit, imported by some of their scripts) reads its
            # /opt/ml tree from here.
            "SAGEMAKER_BASE_DIR": str(folder.root),
            "TRAINING_JOB_NAME": self.spec.job_name,
            "SAGEMAKER_JOB_NAME": self.spec.job_name,
            "DTRAIN_JOB_NAME": self.spec.job_name,
            "DTRAIN_JOB_DIR": str(folder.root.parent.parent),
            "DTRAIN_CHECKPOINT_DIR": str(self.checkpoint_dir(host_index)),
            "DTRAIN_TENSORBOARD_DIR": str(self.tensorboard_dir(host_index)),
            "SM_USER_ARGS": env_value(self.arguments),
            "SM_TRAINING_ENV": env_value(training_env),
            "SM_FRAMEWORK_PARAMS": env_value(framework_parameters(self.hyperparameters)),
            "SM_CHANNELS": env_value(sorted(training_env["channel_input_dirs"])),
            "PYTHONUNBUFFERED": "1",
        })  # fmt: skip
        contract.update(self._sm_variables_from(training_env))
        for channel, path in training_env["channel_input_dirs"].items():
            contract[f"SM_CHANNEL_{channel.upper()}"] = path
        contract.update(to_env(self.hyperparameters))
        if self.distribution.mp_parameters is not None:
            contract["SM_HP_MP_PARAMETERS"] = env_value(self.hyperparameters["mp_parameters"])
        contract.update(self._device_env(host_index))
        return contract

    @staticmethod
    def _sm_variables_from(training_env: dict[str, Any]) -> dict[str, str]:
        """``SM_<KEY>`` for the toolkit's keys, as its ``to_env_vars`` does."""
        keys = (
            "hosts", "num_cpus", "network_interface_name", "input_config_dir",
            "output_intermediate_dir", "module_name", "module_dir", "user_entry_point",
            "framework_module", "log_level",
            "current_instance_type", "current_instance_group", "current_instance_group_hosts",
            "instance_groups", "distribution_instance_groups", "is_hetero", "resource_config",
            "input_data_config", "num_neurons",
        )  # fmt: skip
        named = {
            "resource_config": "SM_RESOURCE_CONFIG",
            "input_data_config": "SM_INPUT_DATA_CONFIG",
        }
        return {named.get(k, f"SM_{k.upper()}"): env_value(training_env[k]) for k in keys}

    def _device_env(self, host_index: int) -> dict[str, str]:
        """Each host sees its own share of its machine's GPUs; a host that gets none (a CPU
        job, fewer GPUs than hosts) sees none, rather than ranks all picking GPU 0."""
        devices = device_slices(self.spec.instance_type, self.hosts)[host_index]
        if devices:
            return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}
        hide = self.spec.instance_type == "local_cpu" or self.hosts[host_index].gpus
        return {"CUDA_VISIBLE_DEVICES": ""} if hide else {}

    def defaults(self, host_index: int) -> dict[str, str]:
        """Variables a host's ranks get unless its agent's environment already sets them.

        Collective traffic stays on the interface of the job's address, the machine's cores are
        shared out between all the ranks it runs, and a failed NCCL collective ends its rank
        instead of hanging it (as under torchrun).
        """
        host = self.hosts[host_index]
        on_machine = sum(1 for other in self.hosts if other.machine == host.machine)
        threads = max(1, host.cpus // (on_machine * self.processes_per_host))
        return {
            "GLOO_SOCKET_IFNAME": host.interface,
            "NCCL_SOCKET_IFNAME": host.interface,
            "OMP_NUM_THREADS": str(threads),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # torchrun's default
        }
