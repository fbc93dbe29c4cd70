"""``tsm.transform`` as scripts call it: over the tp group ``tsm.init`` made."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.smpv2 import transform as library
from dtrain.smpv2.runtime import state


def transform(
    model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: str = "p2p",
) -> nn.Module:
    """SMP v2's ``torch.sagemaker.transform``: ``model`` split in place over ``tsm.state``'s
    tensor-parallel group (nothing split at degree 1), with the job's context parallel degree
    checked against what is built. Needs ``tsm.init()`` first, as SMP does."""
    return library.transform(
        model,
        state.mesh("tp"),
        device=device,
        dtype=dtype,
        config=config,
        load_state_dict_from_rank0=load_state_dict_from_rank0,
        cp_comm_type=cp_comm_type,
        context_parallel_degree=state.context_parallel_degree,
    )
