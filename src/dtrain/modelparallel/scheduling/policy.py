"""A pipeline schedule's rules, in one object: what the runtime asks before each decision.

Every choice of order a rank makes goes through a :class:`SchedulePolicy`:

* who computes next: among the tasks waiting for the compute token, the lowest
  :meth:`~SchedulePolicy.priority`;
* whether the leader may start another microbatch (:meth:`~SchedulePolicy.may_admit`);
* whether a microbatch's backward may begin (:meth:`~SchedulePolicy.backward_may_start`);
* whether a backward is split into its input half (sent at once) and its weight half, which
  waits for idle time (:meth:`~SchedulePolicy.splits_backward`).

The plans of :mod:`.planner` are made by running the same object over a model of the pipeline
(each rank starts the ready work the policy ranks first), so the plan and the runtime cannot
follow different rules. The policy is plain data: its rules are tested as tables, without
threads or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.errors import did_you_mean
from dtrain.modelparallel.scheduling.rules import Phase, is_gradient

PIPELINES: tuple[str, ...] = ("simple", "interleaved")

MAIN_PRIORITY = (-1, 0)
"""The script's own thread, outside the step: before any task (see :mod:`..pipeline.executor`)."""
_WEIGHTS_LAST = 1 << 30
"""Ranks a weight half after every forward and backward, in either pipeline."""


@dataclass(frozen=True)
class SchedulePolicy:
    pipeline: str
    """The pipeline that runs (``simple`` may have been turned into ``interleaved``)."""
    microbatches: int
    active: int
    """At most this many microbatches in flight (started, backward not finished)."""
    split: tuple[int, ...] = ()
    """Per stage, how many of the step's last microbatches have their backward split (none
    where the tuple ends). :func:`~.planner.zero_bubble_policy` chooses them."""

    def __post_init__(self) -> None:
        check_pipeline(self.pipeline)
        if not 1 <= self.active <= self.microbatches:
            raise ValueError(
                f"active microbatches: got {self.active}; allowed: 1 to {self.microbatches}"
            )
        if any(not 0 <= count <= self.microbatches for count in self.split):
            raise ValueError(
                f"split backwards per stage: got {self.split}; allowed: 0 to {self.microbatches}"
            )

    @classmethod
    def for_config(cls, pipeline: str, microbatches: int, active: int) -> SchedulePolicy:
        """SMP's rule: a bound on microbatches in flight turns ``simple`` into
        ``interleaved`` (``simple`` keeps every microbatch in flight). ``active`` is clamped to
        ``microbatches``, since no more than that can ever be in flight. No backward is split."""
        active = min(active, microbatches)
        if pipeline == "simple" and active < microbatches:
            pipeline = "interleaved"
        return cls(pipeline, microbatches, active)

    def priority(self, phase: Phase, microbatch: int, terminal: bool = False) -> tuple[int, int]:
        """Among tasks waiting for the compute token, the lowest goes first.

        ``interleaved``: backward work first, then forward work, then the lowest microbatch
        (1F1B-like); a *terminal* backward (the leader's, once no other rank waits for it: the
        first stage's, or what is left of a microbatch's backward after its last remote one)
        after forward work, which feeds the other stages. ``simple``: forward work first (every
        forward before any backward, on every rank), then the lowest microbatch. A weight half
        comes after everything else in both: nothing waits for it but the optimizer step, so
        it fills time the rank would otherwise sit idle.
        """
        if phase == "W":
            return (_WEIGHTS_LAST, microbatch)
        backward = is_gradient(phase)
        if self.pipeline == "simple":
            return (int(backward), microbatch)
        return (2 if terminal else int(not backward), microbatch)

    def may_admit(self, in_flight: int) -> bool:
        """Whether the leader may start another microbatch with ``in_flight`` unfinished."""
        return in_flight < self.active

    def backward_may_start(self, forwards_done: int) -> bool:
        """Whether a backward may begin once ``forwards_done`` microbatches finished their
        forward: ``simple`` runs every forward before any backward."""
        return self.pipeline != "simple" or forwards_done == self.microbatches

    def splits_backward(self, stage: int, microbatch: int) -> bool:
        """Whether ``microbatch``'s backward on ``stage`` sends its inputs' gradients first and
        leaves its weights' for idle time: one of the step's last ``split[stage]``
        microbatches, whose weight halves fill the drain, where this stage would otherwise
        wait while the stages before it finish their last backwards. (Not every backward: on
        a CPU the two halves cost about a fifth more than the whole.)"""
        count = self.split[stage] if stage < len(self.split) else 0
        return microbatch >= self.microbatches - count


def check_pipeline(pipeline: object) -> None:
    if pipeline not in PIPELINES:
        suggestion = did_you_mean(pipeline, PIPELINES) if isinstance(pipeline, str) else None
        hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
        allowed = ", ".join(repr(p) for p in PIPELINES)
        raise ValueError(f"pipeline: got {pipeline!r}; allowed: {allowed}{hint}")
