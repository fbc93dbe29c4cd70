"""The pipeline chain's rules, written once: what each action needs, which work is a backward,
and which microbatches are in flight.

The planner (:func:`~.planner.schedule_of`), the simulator (:func:`~.schedule.simulate`) and
the checker (:func:`~.check.check`) all read the table :data:`NEEDS`; the runtime's core
(:mod:`.scheduler`, :mod:`.order`, :mod:`.policy`) asks :func:`is_gradient` and
:func:`plan_phase` where it asks the same questions. Plain data, tested as tables.

Chain abstraction: microbatch ``mb`` goes forward through stages ``0..P-1`` and backward
through ``P-1..0``; a need on another stage comes as a message (``RECV_F``/``SEND_F`` forward,
``RECV_B``/``SEND_B`` gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["F", "B", "I", "W"]
"""Forward, backward, and a split backward's input (``I``) and weight (``W``) halves."""

GRADIENT_PHASES: tuple[Phase, ...] = ("B", "I")
"""The phases that compute the gradients a stage sends to the previous one: a whole backward
or a split one's input half. Wherever an order or a priority asks for "the backward of a
microbatch", ``I`` counts as ``B``."""

GRADIENTS = "G"
"""In :data:`NEEDS`: whichever of :data:`GRADIENT_PHASES` the stage runs."""


def is_gradient(phase: str) -> bool:
    return phase in GRADIENT_PHASES


def plan_phase(phase: str) -> str:
    """The phase a plan order knows work by: an input half is its microbatch's backward."""
    return "B" if is_gradient(phase) else phase


def backward_phases(split: bool) -> tuple[Phase, ...]:
    """A stage's backward of one microbatch: ``B``, or split, ``I`` then ``W``."""
    return ("I", "W") if split else ("B",)


@dataclass(frozen=True)
class Need:
    """What an action waits for: ``kind`` (a phase, or :data:`GRADIENTS`) of the same
    microbatch on the stage ``offset`` away (-1 the previous, +1 the next); from another stage
    it comes as a message."""

    kind: str
    offset: int = 0

    @property
    def phases(self) -> tuple[str, ...]:
        return GRADIENT_PHASES if self.kind == GRADIENTS else (self.kind,)

    @property
    def direction(self) -> str:
        """The messages it comes in: ``"F"`` (activations) or ``"B"`` (gradients)."""
        return "F" if self.offset < 0 else "B"

    def describe(self, microbatch: int, stage: int) -> str:
        name = "B" if self.kind == GRADIENTS else self.kind
        if self.offset == 0:
            return f"its own {name}{microbatch}"
        return f"{name}{microbatch} on rank {stage + self.offset}"


ACTIVATIONS = Need("F", -1)
"""A forward needs the previous stage's: sent in ``SEND_F``, received in ``RECV_F``."""
GRADIENTS_IN = Need(GRADIENTS, +1)
"""A backward needs the next stage's gradients: sent in ``SEND_B``, received in ``RECV_B``."""
MESSAGES = (ACTIVATIONS, GRADIENTS_IN)

NEEDS: dict[str, tuple[Need, ...]] = {
    "F": (ACTIVATIONS,),
    "B": (Need("F"), GRADIENTS_IN),
    "I": (Need("F"), GRADIENTS_IN),
    "W": (Need("I"),),
    **{f"SEND_{m.direction}": (Need(m.kind),) for m in MESSAGES},
}
"""Per action kind, what it needs first; a need on a stage that does not exist is dropped (the
first stage's forward, the last stage's backward). Receives wait for their send's message."""


def needs(kind: str, stage: int, stages: int) -> tuple[Need, ...]:
    """What ``kind`` needs on ``stage`` of ``stages``."""
    return tuple(n for n in NEEDS.get(kind, ()) if 0 <= stage + n.offset < stages)


def receives(kind: str, stage: int, stages: int) -> list[str]:
    """The receives a compute action of ``kind`` on ``stage`` waits for."""
    return [f"RECV_{n.direction}" for n in needs(kind, stage, stages) if n.offset]


def sends(kind: str, stage: int, stages: int) -> list[str]:
    """The sends that follow a compute action of ``kind`` on ``stage``: what it computed is
    what the neighbouring stage needs."""
    return [
        f"SEND_{m.direction}"
        for m in MESSAGES
        if kind in m.phases and 0 <= stage - m.offset < stages
    ]


def ordering_pairs() -> list[tuple[str, str]]:
    """``(first, second)``: on one rank, ``first`` of a microbatch must come before
    ``second`` of it (a need on the same stage, or the receive a need from another one comes
    in)."""
    pairs: list[tuple[str, str]] = []
    for kind, kind_needs in NEEDS.items():
        for need in kind_needs:
            firsts = need.phases if need.offset == 0 else (f"RECV_{need.direction}",)
            pairs += [(first, kind) for first in firsts if (first, kind) not in pairs]
    return pairs


def ready_at(
    kind: str,
    microbatch: int,
    stage: int,
    stages: int,
    ended: Callable[[str, int, int], float | None],
    latency: float = 0.0,
) -> tuple[float | None, Need | None]:
    """When ``kind`` of ``microbatch`` on ``stage`` may start: every need ended (``ended(phase,
    microbatch, stage)``: when, or None), a message ``latency`` later. None and the first need
    not met while one is missing."""
    ready = 0.0
    for need in needs(kind, stage, stages):
        where = stage + need.offset
        times = [t for p in need.phases if (t := ended(p, microbatch, where)) is not None]
        if not times:
            return None, need
        ready = max(ready, min(times) + (latency if need.offset else 0.0))
    return ready, None


@dataclass
class Flight:
    """One rank's microbatches, counted two ways.

    *In flight*: from its forward until its gradients (``B`` or ``I``): what
    ``active_microbatches`` bounds. The leader's admission (:attr:`.Scheduler.in_flight`)
    counts the same span on the first stage, from a little earlier (admitted, not started) to
    a little later (its task ends after its backward); every other stage's span lies inside the
    first's (its forward needs the first's, the first's backward needs its gradients), so no
    rank has more in flight than the leader admitted.

    *Held*: from its forward until its backward's last half (``B`` or ``W``): the activations
    the rank keeps, what memory estimates count. A split backward's weight half can run after
    the leader admitted another microbatch, so a rank may hold more than ``active``.
    """

    flying: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)
    peak: int = 0
    peak_held: int = 0

    def start(self, kind: str, microbatch: int) -> None:
        """``kind`` of ``microbatch`` starts here."""
        if kind == "F":
            self.flying.add(microbatch)
            self.held.add(microbatch)
        if is_gradient(kind):
            self.flying.discard(microbatch)
        if kind in ("B", "W"):
            self.held.discard(microbatch)
        self.peak = max(self.peak, len(self.flying))
        self.peak_held = max(self.peak_held, len(self.held))

    @classmethod
    def of(cls, actions: Iterable[tuple[str, int]]) -> Flight:
        """The counts over a rank's actions ``(kind, microbatch)``, in order."""
        flight = cls()
        for kind, microbatch in actions:
            flight.start(kind, microbatch)
        return flight
