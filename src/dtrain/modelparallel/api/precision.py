"""Half-precision parameters (SMP's ``fp16`` / ``bf16``): a half model and fp32 master weights.

SMP v1 wraps the model in ``Bit16_Module`` and the optimizer in an ``FP16_Optimizer``, as
apex's and Megatron's FP16 module and optimizer do: every floating parameter and buffer of the
model is half (``module.to(dtype)``, norms included), floating inputs enter the model in half and
its floating outputs leave it in fp32, and the optimizer steps an fp32 copy of each parameter
(its *master*), which is then rounded back into the model. Here each rank converts only the
partition it owns, right after placing it (:meth:`HalfParameters.cast`), so a rank holds
2 bytes per own parameter in the model plus 4 in its master (and the optimizer's state, which
follows the masters' fp32).

After each step the half gradients move into the masters' fp32 ``.grad`` (divided by the loss
scale, so what the optimizer, clipping and state dicts see is the true gradient) and are then
averaged over the data-parallel group in fp32. fp16 needs the loss scaled so that small
gradients do not vanish: ``model.backward(loss)`` multiplies by :class:`LossScaler`'s scale, an
inf/NaN in any rank's gradients makes every rank skip that optimizer step (the flag is agreed over
the world by :func:`overflowed`, as the sharded model's and :mod:`.amp`'s are), and a dynamic
scale backs off on it and grows after ``scale_window`` clean steps. bf16 has fp32's range and is
not scaled.

With tensor parallelism the parameters of distributed modules are DTensors, and so are their
masters (a master is made as its parameter is, and carries its marks); the step, the rounding
and the overflow check run on DTensors alike, the clipping norm counts a shard's squares once over
the tp group, and checkpoints hold the masters whole or as this rank's shards, as the model's and
the optimizer's states are held.

This is the pipelines' half precision; a sharded model (:mod:`.sharded`) is half on FSDP2's
mixed precision, its fp32 shards the masters, and with fp16 it scales its loss and skips its
overflowing steps by the same :class:`LossScaling`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtrain.dataparallel.collectives import ReduceOp, all_reduce
from dtrain.errors import ConfigError, did_you_mean
from dtrain.modelparallel.modules.unfetched import Unfetched
from dtrain.modelparallel.tensor.dtensors import local, whole
from dtrain.modelparallel.transport.structure import map_leaves

Saved = Callable[[torch.Tensor], torch.Tensor]
"""How a master is saved: as it is, or (tensor parallelism) its whole value or this rank's part."""

Loaded = Callable[[torch.Tensor, torch.Tensor], None]
"""How a saved value is copied into a master: as it is, or (tensor parallelism) cut or wrapped."""


def _by_type(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by their class (plain tensors, DTensors) and a DTensor's mesh:
    torch's fused kernels take one kind at a time, and a DTensor group's results are resolved
    over its mesh (a sharded tensor-parallel model holds DTensors on two: FSDP2's shards of
    plain parameters, and of the tp group's shards)."""
    groups: dict[tuple[type, Any], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((type(tensor), getattr(tensor, "device_mesh", None)), []).append(tensor)
    return list(groups.values())


def _keep_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` the attributes set on ``source`` that it lacks (marks such as tensor
    parallelism's, which decide over which group a parameter's gradient averages)."""
    for key, value in vars(source).items():
        vars(target).setdefault(key, value)


def convert(tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Make ``tensor`` ``dtype`` in place: the model, the optimizer and the masters hold the
    object. A tensor made of other tensors (a DTensor: ``.data`` would change its wrapper, not
    the local tensor inside) is swapped with its converted copy, as ``nn.Module.to`` does,
    attributes included (the model puts tensor parallelism's marks back at every step)."""
    converted = tensor.data.to(dtype)
    if is_traceable_wrapper_subclass(converted):
        if isinstance(tensor, nn.Parameter):
            converted = nn.Parameter(converted, tensor.requires_grad)
        torch.utils.swap_tensors(tensor, converted)
    else:
        tensor.data = converted


def average_in_place(
    grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int | None = None
) -> None:
    """``grads`` (one dtype and device) reduced in one collective over ``group``: their mean,
    or (``divisor``) their sum divided by that; with no ``group``, divided only."""
    if group is None:
        assert divisor is not None, "a mean needs a group"
        torch._foreach_div_(grads, divisor)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if divisor is None:
        all_reduce(flat, ReduceOp.AVERAGE, group=group)
    else:
        if dist.get_world_size(group) > 1:
            all_reduce(flat, ReduceOp.SUM, group=group)
        flat /= divisor
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def clip_gradients(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> float:
    """Clip ``params``' gradients to a global norm ``max_norm`` over every partition (``group``:
    the pipeline, each rank holding its own parameters); returns the norm before clipping.
    ``torch.nn.utils.clip_grad_norm_`` refuses a mix of tensors and DTensors: here a DTensor
    gradient's norm is its whole parameter's (the tp group's shards resolved in one collective
    per clip), counted once. ``device``: where the total is reduced."""
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for kind in _by_type(grads):
        norms = whole(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in kind]))
        if norm_type == math.inf:
            total = torch.maximum(total, norms.max().to(total.device))
        else:
            total += norms.pow(norm_type).sum().to(total.device)
    if group is not None:
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=group)
    if norm_type != math.inf:
        total = total.pow(1.0 / norm_type)
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # torch's
    if coefficient < 1.0:  # max_norm inf measures the norm only
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient)
    return float(total)


def overflowed(
    grads: Iterable[torch.Tensor],
    inverse: torch.Tensor | float,
    device: torch.device,
    world: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Multiply ``grads`` (this rank's parts of them) by ``inverse`` in place, and agree over
    ``world`` (every rank calls it, whatever it holds; ``None``: this rank alone) whether any
    rank's held an inf or a NaN: a float flag on ``device``, 1 for yes, the same on every rank.
    Each rank checks what it holds with torch's ``GradScaler`` kernel, by device and dtype as
    the kernel takes them: shards and partitions differ, and one rank's overflow must make
    every rank skip the step and back the scale off together, or their parameters and scales
    drift apart."""
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        part = local(grad)
        kinds.setdefault((part.device, part.dtype), []).append(part)
    found = torch.zeros((), dtype=torch.float32, device=device)
    for (where, _), same in kinds.items():
        flag = torch.zeros((), dtype=torch.float32, device=where)
        scale = torch.as_tensor(inverse, dtype=torch.float32, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(same, flag, scale)
        found += flag.to(device)
    if world is not None:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=world)
    return (found > 0).float()


HALF_KEYS = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""``smp.init`` parameters that make the model half, and the dtype each gives."""

DYNAMIC_LOSS_ARGS: dict[str, Any] = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}
"""SMP's ``dynamic_loss_args`` keys and their defaults."""

FP16_STATES = "fp16_states"
"""The key of the masters and loss scale in an optimizer state dict (SMP's file name)."""

MASTERS = "fp32_master_params"
"""The key of the masters in the fp16 states."""


def half_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The parameters' dtype the config asks for (``None``: fp32)."""
    for key, dtype in HALF_KEYS.items():
        if config.get(key):
            return dtype
    return None


class LossScaler:
    """SMP's (Megatron's) loss scaler: a static scale, or a dynamic one.

    Dynamic: an overflow divides the scale by ``scale_factor`` (not below ``min_scale``) once
    ``delayed_shift`` overflows have been seen (the hysteresis, refilled after each scale change,
    or after any clean step with ``consecutive_hysteresis``); ``scale_window`` steps without
    overflow since the last one multiply it by ``scale_factor``.
    """

    def __init__(self, scale: float = 1.0, dynamic: bool = False, **dynamic_args: Any) -> None:
        self.dynamic = dynamic
        self.scale = float(scale)
        args = {**DYNAMIC_LOSS_ARGS, **dynamic_args}
        self.scale_factor = float(args["scale_factor"])
        self.scale_window = int(args["scale_window"])
        self.min_scale = float(args["min_scale"])
        self.delayed_shift = int(args["delayed_shift"])
        self.consecutive_hysteresis = bool(args["consecutive_hysteresis"])
        self.hysteresis = self.delayed_shift
        self.iteration = 0
        self.last_overflow = -1

    @classmethod
    def of(
        cls, static_loss_scale: float | None, dynamic_loss_scale: bool, dynamic_loss_args: Any
    ) -> LossScaler:
        """The scaler ``smp.DistributedOptimizer``'s arguments ask for; bad values name the
        argument."""
        where = "smp.DistributedOptimizer"
        args = dict(dynamic_loss_args or {})
        for key in args:
            if key not in DYNAMIC_LOSS_ARGS:
                raise ConfigError(
                    f"{where}.dynamic_loss_args",
                    key,
                    ", ".join(DYNAMIC_LOSS_ARGS),
                    did_you_mean(key, DYNAMIC_LOSS_ARGS),
                )
        if dynamic_loss_scale:
            scaler = cls(args.pop("init_scale", DYNAMIC_LOSS_ARGS["init_scale"]), True, **args)
        else:
            scaler = cls(1.0 if static_loss_scale is None else static_loss_scale)
        positive = {
            "static_loss_scale" if not dynamic_loss_scale else "init_scale": scaler.scale,
            "scale_factor": scaler.scale_factor,
            "scale_window": scaler.scale_window,
            "min_scale": scaler.min_scale,
            "delayed_shift": scaler.delayed_shift,
        }
        for key, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{where}.{key}", value, "a finite number > 0")
        return scaler

    def update(self, overflow: bool) -> None:
        """After an optimizer step (``overflow``: it was skipped)."""
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.hysteresis == 1:
                    self.scale = max(self.scale / self.scale_factor, self.min_scale)
                    self.hysteresis = self.delayed_shift
                else:
                    self.hysteresis -= 1
                self.last_overflow = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis = self.delayed_shift
                if (self.iteration - self.last_overflow) % self.scale_window == 0:
                    self.hysteresis = self.delayed_shift
                    self.scale *= self.scale_factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, values: dict[str, Any]) -> None:
        vars(self).update(values)


class LossScaling:
    """A half model's loss scale and whether its gradients overflowed since the last optimizer
    step, on any rank: that step is then skipped on every rank and the scale follows (SMP's
    ``FP16_Optimizer``). Only fp16 scales and skips; bf16 has fp32's range."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.scaler = LossScaler()
        """Replaced by ``smp.DistributedOptimizer``'s (fp16 only)."""
        self.overflow = False
        """An inf/NaN gradient since the last optimizer step, on any rank (fp16 only); whoever
        checks the gradients sets it, the same on every rank."""
        self.skipped = False
        """Whether the last optimizer step was skipped (SMP's ``optimizer.overflow``)."""

    @property
    def scaled(self) -> bool:
        """Whether losses are scaled and overflows skip steps: fp16 only."""
        return self.dtype == torch.float16

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaled else 1.0

    def step(self, step: Callable[[], Any]) -> Any:
        """The optimizer's ``step``, skipped (returning ``None``) after an overflow. The loss
        scale follows."""
        overflow, self.overflow = self.overflow, False
        self.skipped = overflow
        if self.scaled:
            self.scaler.update(overflow)
        return None if overflow else step()

    def state_dict(self, names: dict[int, str], saved: Saved) -> dict[str, Any]:
        """What a checkpoint keeps under ``"fp16_states"`` (``names``: id of a model parameter
        → its name, ``saved``: how a tensor is saved, for the masters a subclass keeps): the
        loss scaler."""
        return {"loss_scaler": self.scaler.state_dict()}

    def load_masters(self, values: dict[str, Any], names: dict[int, str], load: Loaded) -> None:
        """Load the masters kept apart from :meth:`state_dict`'s ``values``: none here (a
        sharded model's parameters are their own masters; :class:`HalfParameters` keeps
        some)."""


class HalfParameters(LossScaling):
    """One rank's half model: its own parameters' fp32 masters, beside the loss scaling. The
    model creates it; the optimizer steps the masters."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, world: dist.ProcessGroup | None
    ) -> None:
        super().__init__(dtype)
        self._device = device
        self._world = world
        self._masters: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        """id(model parameter) → (the parameter, its fp32 master)."""

    def cast(self, own: Iterable[nn.Parameter], tensors: Iterable[torch.Tensor]) -> None:
        """Make the model half: ``own`` (this rank's parameters, where they will compute) get
        fp32 masters holding their values as they are now, then every floating tensor in
        ``tensors`` (the model's parameters and buffers, placed or freed) becomes half; another
        rank's tensors never made (on the meta device) stay as they are. A master is laid out as
        its parameter (a DTensor for a distributed module's) and carries its attributes (such
        as tensor parallelism's mark of which gradients average over which group)."""
        for param in own:
            if param.is_floating_point() and id(param) not in self._masters:
                master = nn.Parameter(
                    param.detach().to(torch.float32, copy=True), param.requires_grad
                )
                _keep_attributes(param, master)
                self._masters[id(param)] = (param, master)
        with torch.no_grad():
            for tensor in tensors:
                if tensor.is_floating_point() and not tensor.is_meta:
                    convert(tensor, self.dtype)

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for model parameter ``param``."""
        pair = self._masters.get(id(param))
        return param if pair is None else pair[1]

    def masters(self) -> list[nn.Parameter]:
        return [master for _, master in self._masters.values()]

    # --- a step --------------------------------------------------------------------------------

    def inputs(self, args: Any) -> Any:
        """The model's floating tensor inputs in half."""
        return map_leaves(
            args,
            lambda v: (
                v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            ),
        )

    def outputs(self, outputs: Any) -> Any:
        """The model's floating outputs in fp32 (a deferred value is fetched to convert it)."""

        def to_float(value: Any) -> Any:
            if isinstance(value, Unfetched):
                value = value.fetch()
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.float()
            return value

        return map_leaves(outputs, to_float)

    def after_backward(self, average: Callable[[list[nn.Parameter]], None]) -> None:
        """Every rank, after a step's backward: the half gradients, unscaled, are added to the
        masters' fp32 gradients (and freed), ``average`` averages those over the data-parallel
        group (the model readied the earlier steps' for it), and with fp16 every rank learns
        whether any rank's gradients overflowed."""
        inverse = 1.0 / self.loss_scale
        with torch.no_grad():
            for param, master in self._masters.values():
                if param.grad is None:
                    continue
                if master.grad is None:
                    master.grad = param.grad.to(torch.float32).mul_(inverse)
                else:  # accumulating over steps: no fp32 temporary
                    master.grad.add_(param.grad, alpha=inverse)
                param.grad = None
        average(self.masters())
        if not self.scaled:
            return
        grads = [m.grad for m in self.masters() if m.grad is not None]
        found = overflowed(grads, 1.0, self._device, self._world)  # unscaled already
        self.overflow = self.overflow or bool(found.item())

    def step(self, step: Callable[[], Any]) -> Any:
        """The optimizer's step on the masters, rounded back into the model; skipped on every
        rank after an overflow."""

        def rounded() -> Any:
            result = step()
            self.copy_to_model()
            return result

        return super().step(rounded)

    def copy_to_model(self) -> None:
        with torch.no_grad():
            for param, master in self._masters.values():
                param.copy_(master)

    def zero_grad(self) -> None:
        """Forget the model's half gradients of a step that did not finish."""
        for param, _ in self._masters.values():
            param.grad = None

    def clip_master_grads(
        self, max_norm: float, norm_type: float, group: dist.ProcessGroup | None
    ) -> float:
        """Clip the masters' gradients to a global norm ``max_norm`` over every partition
        (``group``: the pipeline); returns the norm before clipping, -1 after an overflow
        (apex's convention: the step will be skipped, nothing to clip)."""
        if self.overflow:
            return -1.0
        return clip_gradients(self.masters(), max_norm, norm_type, group, self._device)

    # --- state dicts ---------------------------------------------------------------------------

    def state_dict(self, names: dict[int, str], saved: Saved) -> dict[str, Any]:
        """The masters by parameter name, each as ``saved`` gives it, on the CPU, and the loss
        scaler."""
        masters = {
            names[id(param)]: saved(master.detach()).cpu()
            for param, master in self._masters.values()
        }
        return {MASTERS: masters, **super().state_dict(names, saved)}

    def load_masters(self, values: dict[str, Any], names: dict[int, str], load: Loaded) -> None:
        """Load the masters this rank owns from :meth:`state_dict`'s ``values`` (each copied
        in by ``load``) and round them into the model (the loss scaler is loaded at once: the
        next backward uses it)."""
        saved = values[MASTERS]
        with torch.no_grad():
            for param, master in self._masters.values():
                name = names[id(param)]
                if name in saved:
                    load(master, saved[name])
                    param.copy_(master)
