"""Training runs for every rank of a pool, and the single-process references they must match.

Models are tiny and the bucket cap is ~600 bytes, so even these models use several buckets and
every code path (ordering, rebuild, padding for hierarchical shards) runs. Ranks start from
different random initialisations: the wrap-time broadcast must make them rank 0's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dtrain.dataparallel import (
    DistributedDataParallel,
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
    register_smddp_backend,
)

CPU = torch.device("cpu")
LR = 0.1
STEPS = 3
CAP_MB = 600 / 2**20
ROOT_SEED = 100


# --- models and data ---------------------------------------------------------------------------


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


class Branchy(nn.Module):
    """``extra`` is used only when asked; ``never`` is never used."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_extra:
            h = torch.tanh(self.extra(h))
        return self.head(h)


class Reordered(nn.Module):
    """Defined in the opposite order of use: backward readies ``late`` first, not ``early``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.late = nn.Linear(16, 3)
        self.early = nn.Linear(6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.tanh(self.early(x)))


def uses_extra(step: int, rank: int) -> bool:
    """Locally unused on some ranks at steps 0 and 2; unused by every rank at step 1."""
    return step != 1 and (rank + step) % 2 == 1


def bn_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * micro + 100 * step + rank)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)


def global_batch(step: int, world: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of every rank's batch: what one process would train on."""
    xs, ys = zip(*(batch(step, rank, micro) for rank in range(world)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def replace_buffers(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """New tensors, not in-place copies: autograd saved the old ones for the pending backward."""
    for name in dict(module.named_buffers(recurse=False)):
        setattr(module, name, values[name].clone())


# --- runs on every rank ------------------------------------------------------------------------


def _train(rank: int, factory: Callable[[int], nn.Module] = mlp, **options: Any) -> dict[str, Any]:
    model = DistributedDataParallel(factory(ROOT_SEED + rank), bucket_cap_mb=CAP_MB, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        x, y = batch(step, rank)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {
        "params": params_of(model.module),
        "buckets": len(model.bucket_plan.buckets),
        "order": model.bucket_plan.order,
        "hierarchical": model.hierarchical,
        "grads_are_views": all(p.grad._base is not None for p in model.parameters()),
        "shared_memory": model.shared_memory,
        "pid": os.getpid(),
    }


def plain(rank: int, world: int) -> dict[str, Any]:
    return _train(rank)


def bucket_view(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, gradient_as_bucket_view=True)


def reordered(rank: int, world: int) -> dict[str, Any]:
    """The first backward's ready order differs from the initial guess: buckets are rebuilt."""
    return _train(rank, Reordered, gradient_as_bucket_view=True)


def overlap(rank: int, world: int) -> dict[str, Any]:
    """How many gradients were ready when each bucket's all-reduce was launched."""
    net = mlp(ROOT_SEED + rank)
    ready: list[int] = []
    for index, param in enumerate(net.parameters()):
        # registered before DDP's own hooks, so it runs first for each parameter
        param.register_post_accumulate_grad_hook(lambda _, index=index: ready.append(index))
    model = DistributedDataParallel(net, bucket_cap_mb=CAP_MB)
    launches: list[list[int]] = []
    original = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):
            launches[-1].append(len(ready))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        for step in range(2):
            ready.clear()
            launches.append([])
            x, y = batch(step, rank)
            F.mse_loss(model(x), y).backward()
    finally:
        dist.all_reduce = original
    return {"launches": launches, "params": len(ready), "buckets": len(model.bucket_plan.buckets)}


def flat(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, hierarchical=False)


def no_sync(rank: int, world: int) -> dict[str, Any]:
    """Two micro-batches per step: the first backward inside ``no_sync``, the second reduces."""
    model = DistributedDataParallel(mlp(ROOT_SEED + rank), bucket_cap_mb=CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        with model.no_sync():
            x, y = batch(step, rank, micro=0)
            F.mse_loss(model(x), y).backward()
        x, y = batch(step, rank, micro=1)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {"params": params_of(model.module)}


def unused(rank: int, world: int) -> dict[str, Any]:
    model = DistributedDataParallel(
        Branchy(ROOT_SEED + rank), bucket_cap_mb=CAP_MB, find_unused_parameters=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    unused_grad_is_none = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(model(x, uses_extra(step, rank)), y).backward()
        module = model.module
        unused_grad_is_none.append(
            (module.extra.weight.grad is None, module.never.weight.grad is None)
        )
        optimizer.step()
    return {
        "params": params_of(model.module),
        "grad_is_none": unused_grad_is_none,
        "hierarchical": model.hierarchical,
    }


def missing_gradient(rank: int, world: int) -> dict[str, Any]:
    """Without find_unused_parameters an unused parameter is an error, raised by backward."""
    model = DistributedDataParallel(Branchy(ROOT_SEED + rank), bucket_cap_mb=CAP_MB)
    x, y = batch(0, rank)
    try:
        F.mse_loss(model(x, False), y).backward()
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def batchnorm(rank: int, world: int) -> dict[str, Any]:
    net = bn_net(ROOT_SEED + rank)
    with torch.no_grad():  # ranks disagree on buffers too until the wrap-time broadcast
        net[1].running_mean.fill_(rank)
        net[1].running_var.fill_(1 + rank)
    model = DistributedDataParallel(net, bucket_cap_mb=CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    after_train = buffers_of(net)
    model.eval()
    with torch.no_grad():
        model(batch(STEPS, rank)[0])  # broadcasts rank 0's buffers; eval BN does not update them
    return {"params": params_of(net), "after_train": after_train, "after_eval": buffers_of(net)}


def _compressed(
    rank: int, compression: str, device: torch.device = CPU, **options: Any
) -> dict[str, Any]:
    """Train as ``plain`` (on ``device``) and record, per step, this rank's exact gradient and
    the reduced one."""
    model = DistributedDataParallel(
        mlp(ROOT_SEED + rank).to(device), bucket_cap_mb=CAP_MB, compression=compression, **options
    )
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    local, reduced = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (t.to(device) for t in batch(step, rank))
        # autograd.grad does not accumulate into .grad, so DDP's hooks stay out of it
        local.append([g.cpu() for g in torch.autograd.grad(F.mse_loss(model.module(x), y), params)])
        F.mse_loss(model(x), y).backward()
        reduced.append([p.grad.cpu().clone() for p in params])
        optimizer.step()
    return {
        "params": params_of(model.module),
        "local": local,
        "reduced": reduced,
        "hierarchical": model.hierarchical,
    }


def fp16(rank: int, world: int) -> dict[str, Any]:
    return _compressed(rank, "fp16")


def bf16(rank: int, world: int) -> dict[str, Any]:
    return _compressed(rank, "bf16")


def gpu_bf16(rank: int, world: int) -> dict[str, Any]:
    """``bf16`` on this rank's GPU (an NCCL world), hierarchical; and where torch's DDP with
    its bf16 compression hook takes the same model and batches."""
    device = torch.device("cuda", torch.cuda.current_device())
    result = _compressed(rank, "bf16", device, hierarchical=True)
    model = nn.parallel.DistributedDataParallel(
        mlp(ROOT_SEED + rank).to(device), device_ids=[device], bucket_cap_mb=CAP_MB
    )
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (t.to(device) for t in batch(step, rank))
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {**result, "torch": params_of(model.module)}


def shm_plain(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, shared_memory=True)


def shm_bucket_view(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, shared_memory=True, gradient_as_bucket_view=True)


def shm_fp16(rank: int, world: int) -> dict[str, Any]:
    """Across hosts only the cross-host shards are compressed; inside a host, full precision."""
    return _compressed(rank, "fp16", shared_memory=True)


def collectives(rank: int, world: int) -> dict[str, Any]:
    init_process_group()  # a default group exists: must be a no-op
    out: dict[str, Any] = {}
    for op in ReduceOp:
        tensor = torch.tensor([rank + 1.0, -(rank + 1.0)])
        assert all_reduce(tensor, op) is None
        out[op.name] = tensor
    tensor = torch.tensor([rank + 1.0])
    work = all_reduce(tensor, ReduceOp.AVERAGE, async_op=True)
    assert work is not None
    work.wait()
    out["AVERAGE_async"] = tensor
    try:
        all_reduce(torch.tensor([rank]), ReduceOp.AVERAGE)
        out["int_average"] = "accepted"
    except TypeError:
        out["int_average"] = "rejected"
    tensor = torch.full((3,), float(rank))
    broadcast(tensor, src=world - 1)
    out["broadcast"] = tensor
    gathered = [torch.empty(2) for _ in range(world)]
    all_gather(gathered, torch.tensor([float(rank), 10.0 * rank]))
    out["all_gather"] = torch.stack(gathered)
    received = torch.empty(world)
    all_to_all_single(received, torch.arange(world, dtype=torch.float32) + 100 * rank)
    out["all_to_all"] = received
    barrier()
    out["layout"] = (get_rank(), get_world_size(), get_local_rank(), get_local_size())
    out["available"] = (is_available(), is_initialized())
    return out


def smddp_backend(rank: int, world: int) -> dict[str, Any]:
    """Our DDP and torch's DDP over a group of the registered ``smddp`` backend."""
    register_smddp_backend()
    group = dist.new_group(backend="smddp")
    tensor = torch.tensor([rank + 1.0])
    dist.all_reduce(tensor, group=group)
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    ours = _train(rank, process_group=group)["params"]
    model = nn.parallel.DistributedDataParallel(mlp(ROOT_SEED + rank), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {
        "backend": dist.get_backend(group),
        "sum": tensor,
        "objects": objects,
        "ours": ours,
        "torch": params_of(model.module),
    }


TWO_RANKS = [
    collectives,
    plain,
    bucket_view,
    reordered,
    overlap,
    no_sync,
    unused,
    batchnorm,
    fp16,
    bf16,
    smddp_backend,
    missing_gradient,
    shm_plain,
    shm_bucket_view,
]
TWO_HOSTS_OF_TWO = [collectives, plain, flat, unused, fp16, shm_plain, shm_fp16]


# --- single-process references -----------------------------------------------------------------


def reference_global(
    world: int, factory: Callable[[int], nn.Module] = mlp
) -> dict[str, torch.Tensor]:
    """One process, rank 0's initialisation, the concatenated global batch."""
    model = factory(ROOT_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = global_batch(step, world)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return params_of(model)


def reference_no_sync(world: int) -> dict[str, torch.Tensor]:
    """Gradient accumulation alone: the sum over micro-batches of the global-batch loss."""
    model = mlp(ROOT_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(2):
            x, y = global_batch(step, world, micro)
            F.mse_loss(model(x), y).backward()
        optimizer.step()
    return params_of(model)


def reference_unused(world: int) -> dict[str, torch.Tensor]:
    """The mean over ranks of each rank's loss, each with its own branch choice."""
    model = Branchy(ROOT_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [
            F.mse_loss(model(x, uses_extra(step, rank)), y)
            for rank, (x, y) in ((r, batch(step, r)) for r in range(world))
        ]
        (sum(losses) / world).backward()
        optimizer.step()
    return params_of(model)


def reference_batchnorm(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parameters and rank 0's buffers after training, computed the way data parallel BN works.

    In train mode each rank normalises with its own batch's statistics, so the loss is the mean
    of per-rank losses (not the global-batch loss). Each forward starts from rank 0's buffers
    (broadcast), and only rank 0's running-statistics update survives the next broadcast.
    """
    net = bn_net(ROOT_SEED)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    bn = net[1]
    for step in range(STEPS):
        optimizer.zero_grad()
        start = buffers_of(bn)
        losses, rank0_after = [], start
        for rank in range(world):
            replace_buffers(bn, start)
            x, y = batch(step, rank)
            losses.append(F.mse_loss(net(x), y))
            if rank == 0:
                rank0_after = buffers_of(bn)
        replace_buffers(bn, rank0_after)
        (sum(losses) / world).backward()
        optimizer.step()
    return params_of(net), buffers_of(net)
