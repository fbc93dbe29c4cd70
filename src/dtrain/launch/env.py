"""The contract every worker process gets.

torch.distributed variables, SageMaker's ``SM_*``, MPI's rank.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.compat import shim_pythonpath_entry
from dtrain.config.distribution import DistributionPlan
from dtrain.jobs.folder import HostFolder, JobFolder
from dtrain.jobs.hyperparameters import (
    env_value,
    framework_parameters,
    to_cmd_args,
    to_env,
    to_json_file_content,
    user_hyperparameters,
)
from dtrain.jobs.spec import JobSpec
from dtrain.topology import host_name

LOOPBACK = "127.0.0.1"
INSTANCE_GROUP = "homogeneousCluster"


def count_gpus() -> int:
    """GPUs on this machine.

    Counted like SageMaker's toolkit: lines of ``nvidia-smi --list-gpus``.
    """
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def entry_command(entry_point: str) -> list[str]:
    """How SageMaker's toolkit starts an entry point.

    Python files with Python, others as programs.
    """
    if entry_point.endswith(".py"):
        return [sys.executable, "-u", entry_point]
    if entry_point.endswith(".sh"):
        return ["/bin/sh", entry_point]
    return [f"./{entry_point}"]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start a validated job's processes: layout, folders, rendezvous port."""

    spec: JobSpec
    distribution: DistributionPlan
    folder: JobFolder
    gpus_per_host: int
    master_port: int
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    @property
    def hosts(self) -> list[str]:
        return [host_name(i) for i in range(self.spec.instance_count)]

    @property
    def processes_per_host(self) -> int:
        return self.distribution.processes_per_host

    @property
    def world_size(self) -> int:
        return self.distribution.world_size

    def host_index(self, rank: int) -> int:
        return rank // self.processes_per_host

    def host_folder(self, rank: int) -> HostFolder:
        return self.folder.host(self.host_index(rank))

    @property
    def entry_point_name(self) -> str:
        return Path(self.spec.entry_point).name

    def command(self) -> list[str]:
        return [*entry_command(self.entry_point_name), *to_cmd_args(self.hyperparameters)]

    def resource_config(self, host: str) -> dict[str, Any]:
        return {
            "current_host": host,
            "current_instance_type": self.spec.instance_type,
            "current_group_name": INSTANCE_GROUP,
            "hosts": self.hosts,
            "instance_groups": [
                {
                    "instance_group_name": INSTANCE_GROUP,
                    "instance_type": self.spec.instance_type,
                    "hosts": self.hosts,
                }
            ],
            "network_interface_name": "lo",
        }

    def input_data_config(self) -> dict[str, Any]:
        from dtrain.jobs.channels import input_data_config

        return input_data_config(self.spec.channels)

    def write_host_config(self, host_index: int) -> None:
        """``input/config/*.json`` of one host, as SageMaker writes them before training."""
        config_dir = self.folder.host(host_index).input_config_dir
        files = {
            "hyperparameters.json": to_json_file_content(self.hyperparameters),
            "resourceconfig.json": self.resource_config(host_name(host_index)),
            "inputdataconfig.json": self.input_data_config(),
        }
        for file_name, content in files.items():
            (config_dir / file_name).write_text(json.dumps(content, indent=2, sort_keys=True))

    def training_env(self, rank: int) -> dict[str, Any]:
        """``SM_TRAINING_ENV``: the toolkit's whole view of the job, as one JSON document."""
        host_index = self.host_index(rank)
        host = host_name(host_index)
        folder = self.folder.host(host_index)
        channels = sorted(c.name for c in self.spec.channels)
        return {
            "additional_framework_parameters": framework_parameters(self.hyperparameters),
            "channel_input_dirs": {c: str(folder.channel_dir(c)) for c in channels},
            "current_host": host,
            "current_instance_group": INSTANCE_GROUP,
            "current_instance_group_hosts": self.hosts,
            "current_instance_type": self.spec.instance_type,
            "distribution_hosts": self.hosts,
            "distribution_instance_groups": [INSTANCE_GROUP],
            "framework_module": "dtrain.launch",
            "hosts": self.hosts,
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
            "master_hostname": self.hosts[0],
            "model_dir": str(folder.model_dir),
            "module_dir": str(self.folder.code_dir),
            "module_name": Path(self.entry_point_name).stem,
            "network_interface_name": "lo",
            "num_cpus": multiprocessing.cpu_count(),
            "num_gpus": self.gpus_per_host,
            "num_neurons": 0,
            "output_data_dir": str(folder.output_data_dir),
            "output_dir": str(folder.output_dir),
            "output_intermediate_dir": str(folder.output_intermediate_dir),
            "resource_config": self.resource_config(host),
            "user_entry_point": self.entry_point_name,
        }

    def checkpoint_dir(self, rank: int) -> Path:
        if self.spec.checkpoint_local_path:
            return Path(self.spec.checkpoint_local_path)
        return self.host_folder(rank).checkpoints_dir

    def rank_env(self, rank: int, inherited: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of global ``rank``.

        Inherited, then the user's ``environment``, then ours.
        """
        env = dict(os.environ if inherited is None else inherited)
        env.update(self.spec.environment)
        host_index = self.host_index(rank)
        local_rank = rank % self.processes_per_host
        folder = self.folder.host(host_index)
        training_env = self.training_env(rank)
        world = str(self.world_size)
        contract: dict[str, str] = {
            "RANK": str(rank),
            "WORLD_SIZE": world,
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.processes_per_host),
            "GROUP_RANK": str(host_index),
            "NODE_RANK": str(host_index),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(self.master_port),
            # The launcher hosts the rendezvous store (bound to loopback); ranks are its clients.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
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
            "TRAINING_JOB_NAME": self.spec.job_name,
            "SAGEMAKER_JOB_NAME": self.spec.job_name,
            "DTRAIN_JOB_NAME": self.spec.job_name,
            "DTRAIN_JOB_DIR": str(self.folder.root),
            "DTRAIN_CHECKPOINT_DIR": str(self.checkpoint_dir(rank)),
            "SM_USER_ARGS": env_value(to_cmd_args(self.hyperparameters)),
            "SM_TRAINING_ENV": env_value(training_env),
            "SM_FRAMEWORK_PARAMS": env_value(framework_parameters(self.hyperparameters)),
            "SM_CHANNELS": env_value(sorted(training_env["channel_input_dirs"])),
            "PYTHONUNBUFFERED": "1",
        }
        contract.update(self._sm_variables_from(training_env))
        for channel, path in training_env["channel_input_dirs"].items():
            contract[f"SM_CHANNEL_{channel.upper()}"] = path
        contract.update(to_env(self.hyperparameters))
        if self.distribution.mp_parameters is not None:
            contract["SM_HP_MP_PARAMETERS"] = env_value(self.hyperparameters["mp_parameters"])
        contract.update(self._device_env(host_index))
        env.update(contract)
        self._set_defaults(env)
        return env

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
        """Each simulated host sees its own slice of the machine's GPUs, or none on a CPU job."""
        if self.gpus_per_host == 0:
            return {"CUDA_VISIBLE_DEVICES": ""} if self.spec.instance_type == "local_cpu" else {}
        first = host_index * self.gpus_per_host
        devices = range(first, first + self.gpus_per_host)
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}

    def _set_defaults(self, env: dict[str, str]) -> None:
        """Keep traffic on loopback and threads within the cores.

        Variables the user already set are left alone.
        """
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        threads = max(1, multiprocessing.cpu_count() // self.world_size)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        entries = [str(self.folder.code_dir), env.get("PYTHONPATH"), shim_pythonpath_entry()]
        env["PYTHONPATH"] = os.pathsep.join(entry for entry in entries if entry)
