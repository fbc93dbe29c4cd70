"""A pipeline schedule's rules, in one object: what the runtime asks before each decision.

Every choice of order a rank makes goes through a :class:`SchedulePolicy`:

* who computes next: among the tasks waiting for the compute token, the lowest
  :meth:`~SchedulePolicy.priority`;
* whether the leader may start another microbatch (:meth:`~SchedulePolicy.may_admit`);
* whether a microbatch's backward may begin (:meth:`~SchedulePolicy.backward_may_start`);
* whether a backward is split into its input half (sent at once) and its weight half
  (:meth:`~SchedulePolicy.splits_backward`).

The action lists of :mod:`.schedule` (the plan, its checker, its simulated timeline) ask the
same object, so the plan and the runtime cannot follow different rules. The policy is plain
data: its rules are tested as tables, without threads or processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.errors import did_you_mean

Phase = Literal["F", "B", "I", "W"]
"""Forward, backward, and a split backward's input (``I``) and weight (``W``) halves."""
PIPELINES: tuple[str, ...] = ("simple", "interleaved")

MAIN_PRIORITY = (-1, 0)
"""The script's own thread, outside the step: before any task (see :mod:`.executor`)."""


@dataclass(frozen=True)
class SchedulePolicy:
    pipeline: str
    """The pipeline that runs (``simple`` may have been turned into ``interleaved``)."""
    microbatches: int
    active: int
    """At most this many microbatches in flight (started, backward not finished)."""
    split_backward: bool = True

    def __post_init__(self) -> None:
        check_pipeline(self.pipeline)
        if not 1 <= self.active <= self.microbatches:
            raise ValueError(
                f"active microbatches: got {self.active}; allowed: 1 to {self.microbatches}"
            )

    @classmethod
    def for_config(
        cls, pipeline: str, microbatches: int, active: int, split_backward: bool = True
    ) -> SchedulePolicy:
        """SMP's rule: a bound on microbatches in flight turns ``simple`` into
        ``interleaved`` (``simple`` keeps every microbatch in flight). ``active`` is clamped to
        ``microbatches``, since no more than that can ever be in flight."""
        active = min(active, microbatches)
        if pipeline == "simple" and active < microbatches:
            pipeline = "interleaved"
        return cls(pipeline, microbatches, active, split_backward)

    def priority(self, phase: Phase, microbatch: int) -> tuple[int, int]:
        """Among tasks waiting for the compute token, the lowest goes first.

        ``interleaved``: backward work first, then the lowest microbatch (1F1B-like).
        ``simple``: the lowest microbatch first, its backward before its forward. A weight half
        comes last: nothing waits for it but the optimizer step.
        """
        urgency = {"B": 0, "I": 0, "F": 1, "W": 2}[phase]
        if self.pipeline == "simple":
            return (microbatch, urgency)
        return (urgency, microbatch)

    def may_admit(self, in_flight: int) -> bool:
        """Whether the leader may start another microbatch with ``in_flight`` unfinished."""
        return in_flight < self.active

    def backward_may_start(self, forwards_done: int) -> bool:
        """Whether a backward may begin once ``forwards_done`` microbatches finished their
        forward: ``simple`` runs every forward before any backward."""
        return self.pipeline != "simple" or forwards_done == self.microbatches

    def splits_backward(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s backward sends its inputs' gradients before computing its
        weights': the step's last microbatch, whose backward the earlier stages wait for with
        nothing else left to do. (Split earlier, the weight half, run at once, would only
        delay this rank's next work; the split itself costs about a fifth of a backward.)"""
        return self.split_backward and microbatch == self.microbatches - 1


def check_pipeline(pipeline: object) -> None:
    if pipeline not in PIPELINES:
        suggestion = did_you_mean(pipeline, PIPELINES) if isinstance(pipeline, str) else None
        hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
        allowed = ", ".join(repr(p) for p in PIPELINES)
        raise ValueError(f"pipeline: got {pipeline!r}; allowed: {allowed}{hint}")
