"""Every rank starts from rank 0: its parameters and buffers, its random states, its plan.

Scripts may seed their ranks apart; SMP trains one model, rank 0's. A model with tensor
parallelism takes rank 0's values when it is wrapped, before its modules are split (each rank
cuts its shards from them); any other at its first step, or as it is sharded. A model created
without memory is made on every rank from rank 0's random states (:mod:`..deferred`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtrain.modelparallel import deferred
from dtrain.modelparallel.state import MPState
from dtrain.sealed import broadcast_object


def broadcast_objects(payload: list[Any], st: MPState) -> list[Any]:
    """Rank 0's ``payload``, on every rank."""
    return broadcast_object(payload, 0, st.object_groups["world"], st.seals)


def sync_random_states(tensors: Iterable[torch.Tensor], st: MPState) -> None:
    """The tensors among ``tensors`` created without memory will be made from rank 0's random
    states, on every rank."""
    recordings = deferred.recordings_of(list(tensors))
    if recordings and st.size > 1:

        def rank0_states(states: list[torch.Tensor]) -> list[torch.Tensor]:
            theirs = broadcast_objects([state.numpy().tobytes() for state in states], st)
            return [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in theirs]

        deferred.sync_random_states(recordings, rank0_states)


def broadcast_values(root: nn.Module, st: MPState) -> None:
    """Rank 0's parameters and buffers of ``root`` on every rank. A tensor created without
    memory is made from rank 0's random states instead, and a DTensor then is an ``smp.nn``
    module's, created alike on every rank (``tensor_parallel_seed``)."""
    if st.size == 1:
        return
    with torch.no_grad():
        for tensor in [*root.parameters(), *root.buffers()]:
            if tensor.is_meta or is_traceable_wrapper_subclass(tensor):
                continue
            data = tensor.data.to(st.device)
            dist.broadcast(data, src=0, group=st.world_process_group)
            if data is not tensor.data:
                tensor.data.copy_(data)
