"""``DistributedDataParallel``: SMDDP's wrapper, on our bucketed, overlapped, hierarchical reducer.

Every rank holds a full replica. Wrapping copies rank 0's parameters and buffers to all ranks;
each forward (with ``broadcast_buffers``) copies rank 0's buffers again, so BatchNorm running
statistics follow rank 0; each backward leaves the across-rank average of the gradients in
``param.grad``, so ``optimizer.step()`` needs no change.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.dataparallel.buckets import BucketPlan
from dtrain.dataparallel.compression import Codec
from dtrain.dataparallel.hierarchical import HierarchicalAllReduce, wants_hierarchical
from dtrain.dataparallel.process_group import get_local_size
from dtrain.dataparallel.reducer import Reducer
from dtrain.dataparallel.shm import (
    SHM_ENV,
    SharedMemoryAllReduce,
    SharedMemoryUnavailable,
    wants_shared_memory,
)
from dtrain.dataparallel.strategies import FlatAllReduce, StagedAllReduce
from dtrain.topology import Topology

DEFAULT_BUCKET_CAP_MB = 25
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024
"""Largest flat buffer used to copy rank 0's state at wrap time (bounds the extra memory)."""


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper with SMDDP's constructor arguments (positional order as SMDDP's).

    ``device_ids``: at most one device; inputs are moved to it before the forward. ``output_device``
    is accepted for compatibility; outputs stay where the module puts them.
    ``compression``: ``None``, ``"fp16"`` or ``"bf16"`` for the wire format of gradients (see
    ``dtrain.dataparallel.compression`` for the error this adds). ``hierarchical``: ``None`` (auto:
    several hosts with several processes each, or the ``DTRAIN_HIERARCHICAL_ALLREDUCE`` env var),
    ``True`` or ``False``. ``shared_memory``: reduce CPU gradients inside a host through
    ``/dev/shm`` instead of the process group (``dtrain.dataparallel.shm``); ``None`` reads
    ``DTRAIN_SHM_ALLREDUCE`` and falls back with a warning where it cannot apply, ``True`` raises
    there. Compression then applies to the bytes that cross hosts only.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
        *,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        compression: str | None = None,
        hierarchical: bool | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("call dtrain.dataparallel.init_process_group() before wrapping")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameter that requires a gradient")
        codec = Codec.named(compression)
        self.module = module
        self.device = _single_device(device_ids)
        self.broadcast_buffers = broadcast_buffers
        world = dist.distributed_c10d._get_default_group()
        self.process_group = process_group if process_group is not None else world
        self._require_sync = True
        _broadcast_from_root([*module.parameters(), *module.buffers()], self.process_group)
        strategy = self._transport(hierarchical, shared_memory, codec, [p for _, p in named])
        self.shared_memory = isinstance(strategy, SharedMemoryAllReduce)
        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.reducer = Reducer(
            named,
            strategy,
            Codec() if self.shared_memory else codec,  # it compresses the cross-host shards
            self.process_group,
            int(cap_mb * 1024 * 1024),
            find_unused_parameters,
            gradient_as_bucket_view,
        )

    @property
    def bucket_plan(self) -> BucketPlan:
        """Which parameters (indices among those requiring grad) share each bucket."""
        return self.reducer.plan

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                _broadcast_from_root(buffers, self.process_group)
        if torch.is_grad_enabled():
            self.reducer.prepare_forward(sync=self._require_sync)
        if self.device is not None:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run in here accumulate locally; the next synced one reduces."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def _transport(
        self,
        hierarchical: bool | None,
        shared_memory: bool | None,
        codec: Codec,
        params: list[nn.Parameter],
    ) -> StagedAllReduce:
        """Pick how buckets are summed; sets ``self.hierarchical`` (two levels: host, network)."""
        world = dist.get_world_size(self.process_group)
        ranks = dist.get_process_group_ranks(self.process_group)
        spans_world = ranks == list(range(dist.get_world_size()))
        local_size = get_local_size()
        self.hierarchical = wants_hierarchical(hierarchical, world, local_size, spans_world)
        if wants_shared_memory(shared_memory):
            host_size = local_size if self.hierarchical else world
            obstacle = _shared_memory_obstacle(spans_world, host_size, local_size, params)
            try:
                if obstacle:
                    raise SharedMemoryUnavailable(obstacle)
                topology = Topology(world, host_size)
                return SharedMemoryAllReduce.create(
                    dist.get_rank(),
                    topology.all_groups("host"),
                    topology.all_groups("cross_host"),
                    codec,
                )
            except SharedMemoryUnavailable as error:
                if shared_memory:
                    raise
                warnings.warn(
                    f"{SHM_ENV} is set but {error}; reducing through the process group",
                    stacklevel=3,
                )
        if self.hierarchical:
            return HierarchicalAllReduce.create(dist.get_rank(), world, local_size)
        return FlatAllReduce(self.process_group)


def _shared_memory_obstacle(
    spans_world: bool, host_size: int, local_size: int, params: list[nn.Parameter]
) -> str | None:
    """Why the ranks cannot reduce through shared memory, known without asking the others."""
    if not spans_world:
        return "shared memory reduction needs a process group spanning all ranks in order"
    if host_size > local_size:
        return "hierarchical=False with several hosts: a flat reduction must cross the network"
    devices = {param.device.type for param in params}
    if devices != {"cpu"}:
        return f"shared memory reduction serves CPU gradients, not {sorted(devices - {'cpu'})}"
    return None


def _broadcast_from_root(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with group rank 0's: one broadcast per dtype, device and chunk."""
    root = dist.get_global_rank(group, 0)
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}
    for tensor in tensors:
        kind, nbytes = (tensor.dtype, tensor.device), tensor.numel() * tensor.element_size()
        chunks = by_kind.setdefault(kind, [[]])
        if chunks[-1] and filled[kind] + nbytes > BROADCAST_CHUNK_BYTES:
            chunks.append([])
            filled[kind] = 0
        chunks[-1].append(tensor)
        filled[kind] = filled.get(kind, 0) + nbytes
    with torch.no_grad():
        for chunks in by_kind.values():
            for chunk in chunks:
                flat = torch.cat([t.reshape(-1) for t in chunk])
                dist.broadcast(flat, src=root, group=group)
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


def _single_device(device_ids: Sequence[int | torch.device] | None) -> torch.device | None:
    if device_ids is None:
        return None
    if len(device_ids) != 1:
        raise ValueError(f"one device per process: device_ids must hold one, got {device_ids}")
    device = device_ids[0]
    return device if isinstance(device, torch.device) else torch.device("cuda", device)


def _to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in nested tuples, lists and dicts to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    if isinstance(value, tuple):
        items = [_to_device(item, device) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value
