"""``smp.DistributedOptimizer``: the user's optimizer, restricted to this rank's parameters.

Like SMP v1 it returns the same optimizer object with some methods replaced, so learning-rate
schedulers and code that reads ``param_groups`` keep working. The optimizer is usually created
before the first step, with every parameter of the model; at its first ``step()`` after
partitioning it drops the parameters other ranks own, so their state is never allocated here.

State dicts are keyed by parameter *name* (not position), so a full optimizer state saved with
one partitioning loads into another, and partial states merge without renumbering.

With ``fp16``/``bf16`` and pipelines (:mod:`.precision`) the optimizer steps the parameters'
fp32 masters: at the first ``step()`` its param groups switch from the model's half parameters
to their masters, the state dicts hold the optimizer's state of the masters plus the masters
themselves and the loss scale under ``"fp16_states"`` (SMP's ``local_fp16_state_dict``), and a
step that overflowed on any rank is skipped by every rank. The loss-scale arguments apply to
fp16 models only; with bf16 or fp32 SMP ignores them, and so does this. A sharded half model
(:mod:`.sharded`) keeps no masters apart: its parameters are the fp32 shards the optimizer
steps, so its state dicts have no ``"fp16_states"`` with bf16, and with fp16 only the loss
scaler there.

State loaded before the first step (``smp.resume_from_checkpoint`` usually runs then) is placed
beside its parameter as the parameter is then, on the CPU; partitioning moves parameters to the
rank's GPU, so the first ``step()`` places every state again beside its parameter, as torch's
``Optimizer.load_state_dict`` places it.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtrain.modelparallel import state
from dtrain.modelparallel.api.model import DistributedModel
from dtrain.modelparallel.api.precision import FP16_STATES, MASTERS, LossScaler
from dtrain.modelparallel.api.state_dicts import PARTIAL_KEY
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import dtensors
from dtrain.sealed import all_gather_objects

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    static_loss_scale: float | None = 1.0,
    dynamic_loss_scale: bool = False,
    **dynamic_loss_args: Any,
) -> torch.optim.Optimizer:
    """Adapt ``optimizer`` to the partitioned model (create it after ``DistributedModel``).

    ``dynamic_loss_args`` may also come as one dict, ``dynamic_loss_args={...}`` (SMP's source
    spells it so); its keys and defaults are :data:`.precision.DYNAMIC_LOSS_ARGS`.
    ``static_loss_scale=None`` (SMP's sharded examples pass it beside a dynamic scale) is 1.
    """
    if set(dynamic_loss_args) == {"dynamic_loss_args"}:
        dynamic_loss_args = dynamic_loss_args["dynamic_loss_args"] or {}
    scaler = LossScaler.of(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
    model = state.current_model()
    if not isinstance(model, DistributedModel):
        raise ModelParallelError(
            "smp.DistributedOptimizer needs the model: create smp.DistributedModel(module) "
            "before smp.DistributedOptimizer(optimizer)"
        )
    names = {id(p): n for n, p in model.module.named_parameters(remove_duplicate=True)}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in names:
                raise ModelParallelError(
                    f"the optimizer's param group {index} holds a parameter of shape "
                    f"{tuple(param.shape)} that is not in the DistributedModel: create the "
                    "optimizer from model.parameters() (or model.local_parameters())"
                )
    adapter = _Adapter(optimizer, model, names)
    original_step, original_zero_grad = optimizer.step, optimizer.zero_grad
    engine = model.engine
    if model.loss_scaling is not None:
        model.loss_scaling.scaler = scaler

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        adapter.prune()
        run = original_step if adapter.zero is None else adapter.zero_step
        result = engine.optimizer_step(self, lambda: run(*args, **kwargs))
        self.overflow = model.loss_scaling is not None and model.loss_scaling.skipped  # type: ignore[attr-defined]  # SMP's attribute on the script's optimizer
        return result

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original_zero_grad(set_to_none)
        adapter.zero_distributed_grads(set_to_none)
        engine.zero_grad()

    optimizer.overflow = False  # type: ignore[attr-defined]  # SMP's attribute
    """SMP's: whether the last ``step()`` was skipped, an fp16 gradient having overflowed on some
    rank (AWS's scripts then leave the learning rate where it was)."""
    engine.adapt_optimizer(optimizer)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]  # SMP patches the script's optimizer
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]  # SMP patches the script's optimizer
    optimizer.clip_master_grads = adapter.clip_master_grads  # type: ignore[attr-defined]  # SMP's method
    optimizer.local_optimizer_state_dict = adapter.local_optimizer_state_dict  # type: ignore[attr-defined]  # SMP's method
    optimizer.local_fp16_state_dict = adapter.local_fp16_state_dict  # type: ignore[attr-defined]  # SMP's method
    optimizer.local_state_dict = adapter.local_state_dict  # type: ignore[attr-defined]  # SMP's method
    optimizer.state_dict = adapter.state_dict  # type: ignore[method-assign]  # SMP's state, not torch's
    optimizer.load_state_dict = adapter.load_state_dict  # type: ignore[method-assign]  # SMP's state, not torch's
    state.register_optimizer(optimizer)
    return optimizer


class _Adapter:
    """What the replaced methods share: the optimizer, the model and parameter names."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: DistributedModel, names: dict[int, str]
    ) -> None:
        self.optimizer = optimizer
        self.model = model
        self.names = names
        self.pruned = False
        self.pending_fp16: tuple[dict[str, Any], bool] | None = None
        """fp16 states loaded before the masters existed, and whether they were partial."""
        self.zero: ZeroRedundancyOptimizer | None = None
        """With ``shard_optimizer_state``, what steps and holds the state (see :meth:`_shard`)."""
        self.proxies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """With ``shard_optimizer_state`` and tensor parallelism: id(proxy) → (the DTensor the
        optimizer would step, its proxy), a plain tensor sharing the DTensor's local memory."""
        self._proxy_of: dict[int, torch.Tensor] = {}
        """id(DTensor) → its proxy."""

    def prune(self) -> None:
        """Keep only the local parameters (their fp32 masters for a half model), once the model
        is partitioned, with their state where partitioning put them."""
        if self.pruned or not self.model.partitioned:
            return
        stepped = {id(p): self.model.engine.master(p) for p in self.model.local_parameters()}
        for param in self.model.local_parameters():
            self.names[id(stepped[id(param)])] = self.names[id(param)]
        states = self.optimizer.state
        for group in self.optimizer.param_groups:
            group["params"] = [stepped[id(p)] for p in group["params"] if id(p) in stepped]
        for key in list(states):
            values = states.pop(key)
            if id(key) in stepped:
                states[stepped[id(key)]] = values
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param in states:
                    states[param] = placed(param, states[param], group)
        self.pruned = True
        if self.pending_fp16 is not None:
            self._load_masters(*self.pending_fp16)
            self.pending_fp16 = None
        st = state.current()
        if st.config["shard_optimizer_state"] and st.rdp_size > 1:
            self._shard(st.rdp_process_group)

    def _shard(self, group: dist.ProcessGroup) -> None:
        """``shard_optimizer_state``: torch's ``ZeroRedundancyOptimizer`` over this rank's
        parameters and its replicas' ``group`` (the rdp group: the data-parallel group without
        tensor parallelism), with the script's optimizer class and options. Each replica keeps
        the state of, and steps, its share of the parameters (whole ones, balanced by size) and
        broadcasts them to the others. The script's optimizer object stays what the script
        holds: its ``param_groups`` become ZeRO's, so learning-rate schedulers still reach every
        step; state loaded before the first step moves into ZeRO's for the parameters this rank
        steps. ZeRO broadcasts plain tensors: a DTensor is stepped through a proxy (see
        :attr:`proxies`), whose gradient is pointed at the DTensor's local one before each
        step; the tp group's ranks hold equal shards, so they step the same share."""
        # Imported here: torch.distributed.optim scripts its functional optimizers on import.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = self.optimizer
        for options in optimizer.param_groups:
            options["params"] = [self._proxy(p) for p in options["params"]]
        for param in list(optimizer.state):
            if dtensors.is_distributed(param):
                values = optimizer.state.pop(param)
                optimizer.state[self._proxy(param)] = {
                    k: dtensors.local(v) if isinstance(v, torch.Tensor) else v
                    for k, v in values.items()
                }
        first, *others = optimizer.param_groups
        options = {key: first[key] for key in optimizer.defaults if key in first}
        zero = ZeroRedundancyOptimizer(
            first["params"], type(optimizer), process_group=group, **options
        )
        for other in others:
            zero.add_param_group(dict(other))
        stepped = {id(p) for g in zero.optim.param_groups for p in g["params"]}
        for param, values in optimizer.state.items():
            if id(param) in stepped:
                zero.optim.state[param] = values
        optimizer.state.clear()
        optimizer.param_groups = zero.param_groups
        self.zero = zero

    def _proxy(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor ZeRO steps for ``param``: itself, or a DTensor's proxy (made once)."""
        if not dtensors.is_distributed(param):
            return param
        proxy = self._proxy_of.get(id(param))
        if proxy is None:
            proxy = dtensors.local(param).detach().requires_grad_(param.requires_grad)
            self.proxies[id(proxy)] = (param, proxy)
            self._proxy_of[id(param)] = proxy
            self.names[id(proxy)] = self.names[id(param)]
        return proxy

    def zero_step(self, *args: Any, **kwargs: Any) -> Any:
        """ZeRO's step, each proxy's gradient first pointed at its DTensor's local one."""
        assert self.zero is not None
        for distributed, proxy in self.proxies.values():
            grad = distributed.grad
            proxy.grad = None if grad is None else dtensors.local(grad)
        return self.zero.step(*args, **kwargs)

    def zero_distributed_grads(self, set_to_none: bool) -> None:
        """The DTensors' own gradients, which the optimizer's ``zero_grad`` (holding proxies)
        does not reach."""
        for distributed, _ in self.proxies.values():
            if set_to_none:
                distributed.grad = None
            elif distributed.grad is not None:
                distributed.grad.zero_()

    def _distributed(self, param: torch.Tensor) -> torch.Tensor:
        """The DTensor a proxy stands for; any other tensor itself."""
        pair = self.proxies.get(id(param))
        return param if pair is None else pair[0]

    @property
    def _holder(self) -> torch.optim.Optimizer:
        """The optimizer holding this rank's state: ZeRO's local one, or the script's."""
        return self.optimizer if self.zero is None else self.zero.optim

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients the optimizer steps (an fp32 model's own, a half model's masters')
        to a global norm over every partition, a tensor-parallel parameter's norm its whole
        one's; returns that norm (-1 after an fp16 overflow: the step will be skipped). Every
        rank calls it, after the step function."""
        self.prune()
        return self.model.engine.clip_master_grads(max_norm, norm_type)

    def local_fp16_state_dict(self, full: bool = False) -> dict[str, Any]:
        """This rank's fp32 masters by parameter name (a sharded model's are its parameters;
        a distributed module's this rank's shards, or with ``full`` their whole values,
        gathered) and the loss scale (empty for an fp32 or sharded bf16 model)."""
        self.prune()
        scaling = self.model.loss_scaling
        if scaling is None:
            return {}
        return scaling.state_dict(self.names, dtensors.whole if full else dtensors.local)

    def _load_masters(self, fp16: dict[str, Any], partial: bool) -> None:
        """Copy saved masters into this rank's (none kept apart: nothing): a distributed
        module's is cut from its whole value, or (``partial``) taken as this rank's part."""
        scaling = self.model.loss_scaling
        assert scaling is not None

        def load(master: torch.Tensor, value: torch.Tensor) -> None:
            what = "optimizer load_state_dict: a master of the fp16 states"
            dtensors.load_into(what, master, value, whole_value=not partial)

        scaling.load_masters(fp16, self.names, load)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state by parameter name, with its fp16 states if any."""
        result = self.local_optimizer_state_dict()
        if self.model.loss_scaling is not None:
            result[FP16_STATES] = self.local_fp16_state_dict()
        return result

    def local_optimizer_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, by parameter name."""
        return self._optimizer_state(full=False)

    def _optimizer_state(self, full: bool) -> dict[str, Any]:
        """This rank's optimizer state, by parameter name; a sharded parameter's its shard, or
        (``full``) its whole state, gathered (every rank calls it)."""
        self.prune()
        local = self._stepped_ids()
        groups = []
        for group in self.optimizer.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            options["params"] = [self.names[id(p)] for p in group["params"] if id(p) in local]
            groups.append(options)
        return {"state": self._states(full), "param_groups": groups, PARTIAL_KEY: True}

    def _states(self, full: bool) -> dict[str, dict[str, Any]]:
        """This rank's parameters' states by name, on the CPU; of a sharded parameter its
        shard, or (``full``) the whole state, gathered (every rank calls it)."""
        local = self._stepped_ids()
        holder = self._holder

        def value(p: torch.Tensor, key: str, v: Any) -> Any:
            """A proxy's state laid out as its DTensor's."""
            if id(p) in self.proxies and _is_state_tensor(key, v):
                what = f"the optimizer state of {self.names[id(p)]!r}"
                return dtensors.laid_out_as(what, self._distributed(p), v, whole_value=False)
            return v

        return {
            self.names[id(p)]: {
                k: dtensors.saved(value(p, k, v), full) for k, v in holder.state[p].items()
            }
            for group in holder.param_groups
            for p in group["params"]
            if id(p) in local and p in holder.state
        }

    def state_dict(self) -> dict[str, Any]:
        """The whole model's optimizer state, gathered; every pipeline rank (every rank, with
        ``shard_optimizer_state``) must call it."""
        local = self._optimizer_state(full=True)
        if self.model.loss_scaling is not None:
            local[FP16_STATES] = self.local_fp16_state_dict(full=True)
        st = state.current()
        parts = [local]
        if self.zero is not None:
            parts = all_gather_objects(local, st.object_groups["world"], st.seals)
        elif self.model.partitioned and st.pp_size > 1:
            parts = all_gather_objects(local, st.pp_message_group, st.seals)
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for part in parts:
            merged["state"].update(part["state"])
            if FP16_STATES in part:  # the loss scaler, and each partition's masters
                fp16 = merged.setdefault(FP16_STATES, {})
                for key, value in part[FP16_STATES].items():
                    if key == MASTERS:
                        fp16.setdefault(key, {}).update(value)
                    else:
                        fp16.setdefault(key, value)
            for index, group in enumerate(part["param_groups"]):
                if index == len(merged["param_groups"]):
                    merged["param_groups"].append({**group, "params": []})
                names = merged["param_groups"][index]["params"]
                names.extend(name for name in group["params"] if name not in names)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full or partial state saved by :meth:`state_dict`/:meth:`local_state_dict`."""
        self.prune()
        partial = bool(state_dict.get(PARTIAL_KEY, False))
        by_name = {
            self.names[id(p)]: (p, g) for g in self.optimizer.param_groups for p in g["params"]
        }
        for group, saved in zip(
            self.optimizer.param_groups, state_dict["param_groups"], strict=True
        ):
            group.update({k: v for k, v in saved.items() if k != "params"})
        holder = self._holder
        stepped = {id(p) for g in holder.param_groups for p in g["params"]}
        for name, saved_state in state_dict["state"].items():
            if name in by_name and id(by_name[name][0]) in stepped:
                param, group = by_name[name]
                distributed = self._distributed(param)  # a proxy's state is its local part
                pick = dtensors.local if distributed is not param else _as_it_is
                what = f"optimizer load_state_dict: state of {name!r}"
                saved_state = {
                    k: pick(dtensors.laid_out_as(what, distributed, v, not partial))
                    if _is_state_tensor(k, v)
                    else v
                    for k, v in saved_state.items()
                }
                holder.state[param] = placed(param, saved_state, group)
        fp16 = state_dict.get(FP16_STATES)
        scaling = self.model.loss_scaling
        if fp16 is not None and scaling is not None:
            scaling.scaler.load_state_dict(fp16["loss_scaler"])
            if self.pruned:
                self._load_masters(fp16, partial)
            else:  # the masters are made at partitioning
                self.pending_fp16 = (fp16, partial)

    def _stepped_ids(self) -> set[int]:
        """ids of the tensors the optimizer steps for this rank's parameters."""
        stepped = [self.model.engine.master(p) for p in self.model.local_parameters()]
        return {id(self._proxy_of.get(id(p), p)) for p in stepped}


def placed(param: torch.Tensor, values: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """``param``'s optimizer state where torch's optimizers expect it: tensors on the
    parameter's device (floating ones in its dtype), except ``step``, which stays where it is
    (the CPU) unless the group is fused or capturable, then a float32 on the device (torch's
    ``Optimizer._process_value_according_to_param_policy``)."""
    result = {}
    for key, value in values.items():
        if not isinstance(value, torch.Tensor):
            result[key] = value
        elif key == "step":
            steps_on_device = group.get("fused") or group.get("capturable")
            result[key] = value.to(param.device, torch.float32) if steps_on_device else value
        elif param.is_floating_point():
            result[key] = value.to(param.device, param.dtype)
        else:
            result[key] = value.to(param.device)
    return result


def _as_it_is(value: Any) -> Any:
    return value


def _is_state_tensor(key: str, value: Any) -> bool:
    """Whether an optimizer state value is shaped like its parameter (not ``step``)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() > 0
