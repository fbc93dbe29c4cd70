"""What a model's and an optimizer's state dicts carry beside their tensors, and what loads.

A *partial* state holds one rank's tensors (one partition's, its tp group's shards of them, or
its shard group's shards) under their names in the full model; it says so, and at which
degrees it was saved, since it loads only at the same ones. A *full* state holds every tensor
whole.
"""

from __future__ import annotations

from collections.abc import Iterable

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError

PARTIAL_KEY = "_smp_is_partial"

DEGREES_KEY = "_dtrain_degrees"
"""The pipeline and tensor-parallel degrees a partial state dict was saved at: its tensors are
one partition's (and one tp rank's shards), which load only at the same degrees."""

PIECES_KEY = "_dtrain_pieces"
"""In a sharded model's partial state: for each tensor that is a piece of a larger one (a
DTensor's part), the whole tensor's shape and where the piece begins in it, so that the files of
a partial checkpoint can be put back together without a job
(:mod:`.sharded_checkpoint`)."""

METADATA_KEYS = (PARTIAL_KEY, DEGREES_KEY, PIECES_KEY)
"""What a model's state dict carries beside its tensors."""


def degrees(st: state.MPState) -> dict[str, int]:
    """The degrees that lay a model's tensors out over the ranks, as a partial state names them."""
    return {"pipeline_parallel_degree": st.pp_size, "tensor_parallel_degree": st.tp_size}


def check_degrees(saved: dict[str, int], st: state.MPState, what: str) -> None:
    """A partial state saved at ``saved`` degrees loads only at the same ones."""
    here = degrees(st)
    if saved != here:
        shown = " x ".join(f"{name} {value}" for name, value in saved.items())
        raise ModelParallelError(
            f"{what}: the partial state was saved at {shown}, this job runs at "
            f"{' x '.join(f'{name} {value}' for name, value in here.items())}; allowed: the "
            "same degrees (a partial state holds one partition's tensors, split over its tp "
            "group); save a full one (partial=False) to load it at other degrees"
        )


def check_keys(given: Iterable[str], wanted: Iterable[str], known: Iterable[str]) -> None:
    """A strict load: every key this rank ``wanted`` is ``given``, and every given key is one
    the model ``known``s (a rank's partition holds some of them)."""
    given = set(given)
    missing = sorted(set(wanted) - given)
    unexpected = sorted(given - set(known))
    if missing or unexpected:
        raise ModelParallelError(
            f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
        )
