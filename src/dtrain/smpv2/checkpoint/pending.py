"""A save planned over its group, in torch's DCP steps, which :mod:`.saving` runs at once or
spread over time.

torch's ``save`` runs three steps in one call: plan (every rank's local plan gathered by the
coordinator, which makes the global plan and scatters it back: a collective), write (each rank
its files: no collective), finish (the write results gathered by the coordinator, which writes
``.metadata``: a collective). An asynchronous save must not run collectives in a background
thread, where they would race the training's collectives on the same group, so here the steps
are apart: :meth:`PendingSave.plan` and :meth:`PendingSave.finish` run on the caller's thread on
every rank of the group, :meth:`PendingSave.write` anywhere. Every step is exception-robust as
torch's: a failure on one rank fails the step on all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class PendingSave:
    writer: StorageWriter
    planner: SavePlanner
    collectives: _DistWrapper
    ranks: tuple[int, ...]
    """The global ranks saving it together."""
    plan: SavePlan
    """This rank's part of the global plan."""
    metadata: Metadata | None
    """The checkpoint's metadata, on the coordinator."""

    @classmethod
    def planned(
        cls,
        state_dict: dict[str, Any],
        writer: StorageWriter,
        planner: SavePlanner,
        collectives: _DistWrapper,
        ranks: tuple[int, ...],
    ) -> PendingSave:
        """Plan saving ``state_dict`` (a collective over the group, as torch's ``save``)."""
        metadata: Metadata | None = None

        def local_step() -> SavePlan:
            _check_meshes(state_dict, ranks)
            planner.set_up_planner(
                state_dict=state_dict,
                storage_meta=writer.storage_meta(),
                is_coordinator=collectives.is_coordinator,
            )
            writer.set_up_storage_writer(collectives.is_coordinator)
            return writer.prepare_local_plan(planner.create_local_plan())

        def global_step(local_plans: list[SavePlan]) -> list[SavePlan]:
            nonlocal metadata
            local_plans, metadata = planner.create_global_plan(local_plans)
            return writer.prepare_global_plan(local_plans)

        central = collectives.reduce_scatter("plan", local_step, global_step)
        return cls(writer, planner, collectives, ranks, planner.finish_plan(central), metadata)

    def write(self) -> list[WriteResult]:
        """Write this rank's files (no collective)."""
        written = self.writer.write_data(self.plan, self.planner)
        written.wait()
        return written.value()

    def finish(self, written: Callable[[], list[WriteResult]]) -> Metadata:
        """Gather every rank's ``written()`` (its write results, or its write's failure) and
        write the metadata (a collective over the group)."""

        def finish_checkpoint(results: list[list[WriteResult]]) -> Metadata:
            assert self.metadata is not None  # the coordinator planned it
            self.writer.finish(metadata=self.metadata, results=results)
            return self.metadata

        return self.collectives.all_reduce("write", written, finish_checkpoint)


def _check_meshes(state_dict: dict[str, Any], ranks: tuple[int, ...]) -> None:
    """Fail where a DTensor is saved over ranks outside its mesh: they hold other tensors under
    its name (another tensor-parallel slice, as SMP's FSDP1 states them), which DCP would take
    for copies of it and drop."""

    def visit(path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, DTensor):
            held = set(value.device_mesh.mesh.flatten().tolist())
            if not set(ranks) <= held:
                raise ValueError(
                    f"{'.'.join(map(str, path))} is a DTensor over ranks {sorted(held)}, saved "
                    f"over ranks {list(ranks)}: the others hold other tensors under its name; "
                    "save over ranks within its mesh (SMP's scripts: each tp rank's folder over "
                    "its shard group, model.process_group)"
                )

    traverse_state_dict(state_dict, visit)
