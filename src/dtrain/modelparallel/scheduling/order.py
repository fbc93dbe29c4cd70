"""A rank's compute in the plan's order, the same on every data-parallel replica (SMP's
``deterministic_server``).

Normally the compute token goes to whichever waiting task the policy ranks first, so the order
among ready microbatches depends on timing and differs between replicas. With a
:class:`PlanOrder` a task computes only while its action (its phase and microbatch) is the
rank's current one in the plan (:func:`~.planner.schedule_of`); the runtime says when an action
has ended, and the next one becomes current once no work of the ended one is left on the rank
(:meth:`PlanOrder.advance`): an end can be known before the work it ends has run here (a
notice overtakes the requests that its sender queued first). A split backward's input half is
the plan's backward of that microbatch (``I`` counts as ``B``), its weight half the plan's
``W``.

A microbatch may come back to a rank (a head tied to the embedding keeps the leader's forward
going after the other partitions): each stage the rank holds on the microbatch's way is a
*visit*, and the plan has an action per visit (``F0`` twice on the leader, then ``B0`` twice).

Plain data: the rules are tested as tables, without threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dtrain.modelparallel.scheduling.rules import plan_phase

Key = tuple[str, int, int]
"""An action: ``("F" | "B" | "W", microbatch, visit)``, ``visit`` the rank's stage of the
microbatch's way, counted from 0 in forward order."""


PlanRow = tuple[tuple[str, int] | Key, ...]
"""A rank's compute actions in plan order, ``(kind, microbatch)`` or with the visit."""


def action_key(phase: str, microbatch: int, visit: int = 0) -> Key:
    return (plan_phase(phase), microbatch, visit)


@dataclass
class PlanOrder:
    """The plan's compute actions for one rank and one step, and how far the rank has come."""

    actions: tuple[Key, ...]
    ended: set[Key] = field(default_factory=set)
    cursor: int = 0

    @classmethod
    def of(cls, actions: PlanRow) -> PlanOrder:
        """From a plan's ``(kind, microbatch)`` or ``(kind, microbatch, visit)`` compute
        actions, in order."""
        return cls(tuple(action_key(*action) for action in actions))

    @property
    def current(self) -> Key | None:
        """The action whose work may run now (None once every action has ended)."""
        return self.actions[self.cursor] if self.cursor < len(self.actions) else None

    def admits(self, phase: str, microbatch: int, visit: int = 0) -> bool:
        return self.current == action_key(phase, microbatch, visit)

    def has(self, phase: str, microbatch: int, visit: int) -> bool:
        """Whether the plan has this action (a visit the microbatch makes here)."""
        return action_key(phase, microbatch, visit) in self.actions

    def has_ended(self, phase: str, microbatch: int, visit: int = 0) -> bool:
        """Whether the action's turn has passed: work for it comes too late."""
        return action_key(phase, microbatch, visit) in self.actions[: self.cursor]

    def end(self, phase: str, microbatch: int, visit: int | None = None) -> None:
        """The runtime says an action is over (it may be ahead of the current one: its turn
        will pass once it comes); :meth:`advance` moves on. Without ``visit``, every visit of
        it: the microbatch's forward or backward is over here."""
        key = action_key(phase, microbatch)
        if visit is not None:
            self.ended.add(action_key(phase, microbatch, visit))
            return
        self.ended.add(key)
        self.ended.update(a for a in self.actions if a[:2] == key[:2])

    def advance(self, busy: Callable[[Key], bool] = lambda key: False) -> None:
        """Pass every current action that has ended and has no work left here (``busy``)."""
        while self.current is not None and self.current in self.ended and not busy(self.current):
            self.cursor += 1

    def describe(self) -> str:
        current = self.current
        if current is None:
            return "every action of the plan ended"
        kind, microbatch, visit = current
        return f"{kind}{microbatch}" + (f" (visit {visit})" if visit else "")
