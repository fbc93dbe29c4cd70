"""What ``smp.DistributedModel`` and ``smp.DistributedOptimizer`` leave to the model's engine.

One model, two ways to run it, chosen once when the model is wrapped: the pipelined engine
(:mod:`.pipelined`: the module partitioned over the pipeline, with data and tensor parallelism,
a half model's fp32 masters kept apart) and, with ``sharded_data_parallel_degree`` above 1, the
sharded engine (:mod:`.sharded`: FSDP2's shards, which are their own fp32 masters). The SMP
API in front (:mod:`.model`, :mod:`.optimizer`) is the same for both: what differs is here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from dtrain.modelparallel.api.precision import HalfParameters, LossScaling
    from dtrain.modelparallel.modules.tasks import MicrobatchResult
    from dtrain.modelparallel.plan.partition import PartitionPlan
    from dtrain.modelparallel.scheduling.route import RouteSchedule
    from dtrain.modelparallel.scheduling.schedule import Schedule
    from dtrain.modelparallel.timeline import TimelineEvent

MakeBody = Callable[[torch.device], Callable[[int], Any]]
"""``@smp.step``'s: given the device, splits the step's arguments there and returns the step
body of one microbatch."""


class Engine(Protocol):
    """Runs one wrapped model's steps and holds its precision, gradients and state."""

    half_precision: HalfParameters | None
    """A half model's fp32 masters kept apart from its parameters (and its loss scaling);
    ``None`` where the parameters the optimizer steps are the model's own."""

    @property
    def loss_scaling(self) -> LossScaling | None:
        """fp16's loss scale and overflow flag (bf16's, which scales nothing, with pipelines);
        ``None`` where nothing is scaled."""

    @property
    def partitioned(self) -> bool:
        """Whether this rank knows its share of the model (and holds only that)."""

    @property
    def forwards_set_up(self) -> bool:
        """Whether the modules' forwards are set up (activation checkpointing's marks applied)."""

    # --- steps -----------------------------------------------------------------------------

    def run_step(self, count: int, make_body: MakeBody) -> list[MicrobatchResult]:
        """``@smp.step`` on every rank: ``count`` microbatches, gradients averaged after."""

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model called inside a step."""

    def backward(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor | None], scale: float | None
    ) -> None:
        """``model.backward`` inside a step; the gradients multiplied by ``scale`` (the
        microbatch average and the loss scale)."""

    def owns(self, module: nn.Module) -> bool:
        """Whether this rank holds ``module``'s parameters (its shards of them)."""

    # --- state dicts -----------------------------------------------------------------------

    def local_state_dict(self, cast_to_cpu: bool) -> dict[str, Any]:
        """This rank's parameters (its shards of them) and persistent buffers, by name."""

    def state_dict(self) -> dict[str, Any]:
        """The whole model's state, gathered (every rank calls it)."""

    def load_state_dict(self, values: dict[str, Any], partial: bool, strict: bool) -> Any:
        """Load a full or (``partial``) this rank's saved state."""

    # --- what the optimizer steps ----------------------------------------------------------

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for model parameter ``param``."""

    def adapt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``smp.DistributedOptimizer``'s optimizer what scripts read of this engine's."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        """The optimizer's ``step`` (``step``), with what precision and clipping ask around it;
        ``None`` when an overflow skipped it."""

    def zero_grad(self) -> None:
        """After the optimizer's ``zero_grad``: forget what this engine keeps of the
        gradients."""

    def clip_master_grads(self, max_norm: float, norm_type: float) -> float:
        """Clip the stepped gradients to a global norm over every rank; the norm before
        clipping, -1 after an fp16 overflow."""

    # --- the pipeline ----------------------------------------------------------------------

    def partition_plan(self) -> PartitionPlan:
        """Module -> partition with costs."""

    def pipeline_schedule(self) -> Schedule | RouteSchedule:
        """The action lists each pipeline rank runs in a step."""

    def timeline(self, communication: bool) -> list[TimelineEvent]:
        """What this rank computed in the last step."""

    def export_timeline(self, path: str) -> None:
        """Chrome trace JSON of the last step (every rank calls it)."""

    def close(self) -> None:
        """Stop what runs the steps; the model stays usable."""
