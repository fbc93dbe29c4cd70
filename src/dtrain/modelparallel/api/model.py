"""``smp.DistributedModel``: SMP's model API in front of the engine that runs the model.

The engine is chosen once, when the module is wrapped (:mod:`.engine`): the pipelined one
(:mod:`.pipelined`), which partitions the module at the first step, or with
``sharded_data_parallel_degree`` above 1 the sharded one (:mod:`.sharded`), which shards it
now. Tensor parallelism comes first, for either: with ``tensor_parallel_degree`` above 1 (or
modules marked for it) every rank takes rank 0's values and the marked modules are swapped for
distributed ones, split over the tp group, before the engine sees the module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dtrain.errors import ConfigError, did_you_mean
from dtrain.modelparallel import state
from dtrain.modelparallel.api import initial, placement
from dtrain.modelparallel.api.engine import Engine, MakeBody
from dtrain.modelparallel.api.partitioning import TRACE_DEVICES
from dtrain.modelparallel.api.pipelined import PipelinedEngine
from dtrain.modelparallel.api.precision import HalfParameters, LossScaling
from dtrain.modelparallel.api.state_dicts import (
    DEGREES_KEY,
    METADATA_KEYS,
    PARTIAL_KEY,
    check_degrees,
    degrees,
)
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.modules.caches import without_cache
from dtrain.modelparallel.modules.tasks import MicrobatchResult
from dtrain.modelparallel.plan.partition import PartitionPlan
from dtrain.modelparallel.scheduling.route import RouteSchedule
from dtrain.modelparallel.scheduling.schedule import Schedule
from dtrain.modelparallel.tensor import marks, translated
from dtrain.modelparallel.timeline import TimelineEvent


class DistributedModel(nn.Module):
    """Wraps the model to train with pipeline (and data) parallelism; one per process.

    The arguments SMP v1 takes for its internal DDP are accepted; ``bucket_cap_mb`` sizes the
    gradient reduction over the data-parallel group and ``average_grads_across_microbatches``
    chooses between the mean (default) and the sum of the microbatches' gradients.
    ``trace_device`` (``"gpu"``, SMP's default, or ``"cpu"``) is where rank 0 runs the
    profiling step, the module and the step's tensor arguments together, wherever the script
    left them; the module is back where it was afterwards.
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        bucket_cap_mb: float = 25,
        trace_memory_usage: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel wraps an nn.Module, got {type(module).__name__}")
        if trace_device not in TRACE_DEVICES:
            raise ConfigError(
                "DistributedModel.trace_device",
                trace_device,
                '"cpu" or "gpu"',
                did_you_mean(str(trace_device), TRACE_DEVICES),
            )
        st = self._state = state.current()
        from_rank_zero = False
        """Whether every rank holds rank 0's initial values (broadcast here, with tensor
        parallelism: each rank cuts its shards from them)."""
        if st.tp_size > 1 or marks.any_marked(module):
            # Imported for tensor parallelism only: DTensor takes a second to import.
            from dtrain.modelparallel.tensor import averages, shards, swap

            # a delayed model's shards are made now
            initial.sync_random_states([*module.parameters(), *module.buffers()], st)
            placed = placement.manual_placements(module)
            before = dict(module.named_modules())
            averages.restore_marks(module)  # the script may have moved it (``to``) before
            initial.broadcast_values(module, st)  # before shards are cut from its values
            from_rank_zero = True
            module = swap.distribute(module)  # SMP swaps in place when wrapping, too
            placement.keep_placements(module, placed, before)
            shards.split_delayed(module, st.device)
        state.register_model(self)
        self.module = module
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self._checkpointing: bool | None = None
        """Whether activation checkpointing marked some module: known at the first call."""
        self._post_partition_hooks: OrderedDict[int, Callable[[DistributedModel], None]] = (
            OrderedDict()  # a RemovableHandle holds a weak reference to it: not a plain dict
        )
        self.engine: Engine
        if st.config["sharded_data_parallel_degree"] > 1:
            # Imported here: FSDP2 and DTensor take seconds to import, for sharded models only.
            from dtrain.modelparallel.api.sharded import ShardedEngine

            self.engine = ShardedEngine(module, st, from_rank_zero, self._run_post_partition_hooks)
        else:
            self.engine = PipelinedEngine(
                module,
                st,
                trace_device,
                bucket_cap_mb,
                from_rank_zero,
                self._run_post_partition_hooks,
            )

    # --- calling the model -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._checkpointing is None:  # marks are made before the first step
            self._checkpointing = activations.marks_inside(self.module)
        return self.engine.forward(args, without_cache(self.module, kwargs, self._checkpointing))

    def backward(
        self,
        tensors: torch.Tensor | list[torch.Tensor],
        grad_tensors: torch.Tensor | list[torch.Tensor | None] | None = None,
    ) -> None:
        """Replaces ``loss.backward()`` inside a step; gradients are averaged over microbatches
        (and, with fp16, the loss scaled)."""
        outputs = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if grad_tensors is None:
            grads: list[torch.Tensor | None] = [None] * len(outputs)
        elif isinstance(grad_tensors, (list, tuple)):
            grads = list(grad_tensors)
        else:
            grads = [grad_tensors]
        scale = None
        if self.average_grads_across_microbatches:
            scale = 1.0 / self._state.config["microbatches"]
        scaling = self.loss_scaling
        if scaling is not None and scaling.loss_scale != 1.0:
            scale = (scale or 1.0) * scaling.loss_scale
        self.engine.backward(outputs, grads, scale)

    @property
    def loss_scaling(self) -> LossScaling | None:
        """The loss scale and overflow flag of a half model: the half parameters' with
        pipelines, the sharded model's with fp16; ``None`` for fp32 and sharded bf16."""
        return self.engine.loss_scaling

    @property
    def half_precision(self) -> HalfParameters | None:
        """``fp16``/``bf16`` with pipelines: the half model's fp32 masters and loss scale
        (:mod:`.precision`). A sharded model's fp32 shards are its masters: ``None``."""
        return self.engine.half_precision

    # --- steps -------------------------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self.engine.partitioned

    @property
    def forwards_set_up(self) -> bool:
        """Whether the first step has set up the modules' forwards (activation checkpointing's
        marks are applied then)."""
        return self.engine.forwards_set_up

    def run_step(self, count: int, make_body: MakeBody) -> list[MicrobatchResult]:
        """Called by ``@smp.step`` on every rank: partition if needed, run, reduce gradients.

        ``make_body(device)`` splits the step's arguments, their tensors moved to ``device``,
        and returns the step body of one microbatch (called on the leader only)."""
        return self.engine.run_step(count, make_body)

    def pipeline_schedule(self) -> Schedule | RouteSchedule:
        """The action lists each pipeline rank runs in a step, as planned for the partition
        plan's stage times (printable: ``print(model.pipeline_schedule())``); known after the
        first step."""
        return self.engine.pipeline_schedule()

    def partition_plan(self) -> PartitionPlan:
        """Module → partition with costs; known after the first step."""
        return self.engine.partition_plan()

    def register_post_partition_hook(
        self, hook: Callable[[DistributedModel], None]
    ) -> RemovableHandle:
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def _run_post_partition_hooks(self) -> None:
        for hook in list(self._post_partition_hooks.values()):
            hook(self)

    def get_module(self) -> nn.Module:
        return self.module

    # --- this rank's share -------------------------------------------------------------------

    def _local_state(self, persistent_only: bool) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """``(name, tensor, is_parameter)`` of this rank's modules under every name
        ``state_dict()`` uses (a tied parameter appears under each of its names)."""
        return translated.named_state(self.module, persistent_only, self.engine.owns)

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for name, tensor, is_param in self._local_state(persistent_only=True):
            if is_param and id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, tensor  # type: ignore[misc]  # is_param: it is an nn.Parameter

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.local_named_parameters():
            yield param

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, tensor, is_param in self._local_state(persistent_only=False):
            if not is_param and id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, tensor

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers():
            yield buffer

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        for name, module in self.module.named_modules():
            if self.engine.owns(module):
                yield name, module

    def local_modules(self) -> Iterator[nn.Module]:
        for _, module in self.local_named_modules():
            yield module

    # --- state dicts -------------------------------------------------------------------------

    def local_state_dict(self, cast_to_cpu: bool = True) -> dict[str, Any]:
        """This rank's parameters (its shards of them, when sharded) and persistent buffers, by
        their names in the full model."""
        partial = {PARTIAL_KEY: True, DEGREES_KEY: degrees(self._state)}
        return {**self.engine.local_state_dict(cast_to_cpu), **partial}

    def state_dict(  # type: ignore[override]  # SMP's keywords beside nn.Module's
        self,
        *args: Any,
        cast_to_cpu: bool = True,
        gather_to_rank0: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The full model's state, gathered; every rank must call it."""
        del args, kwargs, gather_to_rank0  # every rank gets the whole dict
        return self.engine.state_dict()

    def load_state_dict(  # type: ignore[override]  # SMP's signature, not nn.Module's
        self, state_dict: dict[str, Any], strict: bool = True
    ) -> Any:
        """Load a full or a partial (``local_state_dict``) state; before the first step a
        partial one is kept and applied once this rank knows its share. A full one may name a
        translated module's keys as its HF original does (SMP's fine-tuning from HF weights)."""
        partial = bool(state_dict.get(PARTIAL_KEY, False))
        if partial and DEGREES_KEY in state_dict:
            check_degrees(state_dict[DEGREES_KEY], self._state, "load_state_dict")
        values = {k: v for k, v in state_dict.items() if k not in METADATA_KEYS}
        if not partial:  # a model translated from HF takes its original's names too, as SMP's
            values = translated.from_hf(self.module, values)
        return self.engine.load_state_dict(values, partial, strict)

    # --- timeline ----------------------------------------------------------------------------

    def timeline(self, communication: bool = False) -> list[TimelineEvent]:
        """What this rank computed in the last step (pp rank as the row); with
        ``communication``, also its sends, receives and waits for replies."""
        return self.engine.timeline(communication)

    def export_timeline(self, path: str) -> None:
        """Chrome trace JSON of the last step of the whole pipeline, computations and
        communication; every pipeline rank calls it, the leader writes the file."""
        self.engine.export_timeline(path)

    def close(self) -> None:
        """Stop the pipeline runtime (every rank); the model stays usable for a new one."""
        self.engine.close()
