"""What an agent tells the controller about its machine, so the controller can plan its ranks."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError
from dtrain.jobs.folder import dtrain_home
from dtrain.launch.netif import interface_of


def machine_id() -> str:
    """What tells two hosts apart as machines: the running kernel's boot id.

    Hosts that share it share CPUs and GPUs, as the simulated hosts of a local job do.
    """
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


NVIDIA_DRIVER = Path("/proc/driver/nvidia/gpus")
"""Where the NVIDIA kernel driver lists the machine's GPUs; there whenever it is loaded."""


def count_gpus() -> int:
    """GPUs on this machine, counted as SageMaker's toolkit does (``nvidia-smi --list-gpus``).

    Where the driver is loaded but ``nvidia-smi`` is missing (slim container images), torch
    counts them (through NVML where it can, as ``nvidia-smi`` does: no CUDA context); only
    then is torch imported for it. Its count leaves out the GPUs ``CUDA_VISIBLE_DEVICES``
    hides, which :func:`visible_gpus` then names.
    """
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except OSError:
        return _torch_count() if NVIDIA_DRIVER.is_dir() else 0
    except subprocess.SubprocessError:
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def _torch_count() -> int:
    import torch

    return torch.cuda.device_count()


def visible_gpus() -> list[str]:
    """The GPUs this machine lets its processes use: those ``CUDA_VISIBLE_DEVICES`` names, if
    set (an inherited ``2,3`` stays ``2,3``), else every GPU ``nvidia-smi`` lists."""
    count = count_gpus()
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return [str(index) for index in range(count)]
    return [device.strip() for device in inherited.split(",") if device.strip()][:count]


def host_facts(address: str, requested_host: str | None) -> dict[str, Any]:
    """This machine as a host of a job: its job address and interface, its size, its home."""
    interface = interface_of(address)
    if interface is None:
        raise DtrainError(f"{address} is not an address of this machine")
    return {
        "address": address,
        "interface": interface,
        "machine": machine_id(),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count() or 1,
        "gpus": visible_gpus(),
        "home": str(dtrain_home()),
        "pid": os.getpid(),
        "host": requested_host,
    }
