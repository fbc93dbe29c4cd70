"""The checker: a schedule (planned, or recorded from a real run) against its policy's rules,
without a model: every action once, in an order the rules allow, within the in-flight bound,
and free of deadlock."""

from __future__ import annotations

from collections.abc import Collection

from dtrain.modelparallel.scheduling.costs import check_partitions
from dtrain.modelparallel.scheduling.rules import (
    Flight,
    backward_phases,
    is_gradient,
    ordering_pairs,
    receives,
    sends,
)
from dtrain.modelparallel.scheduling.schedule import (
    BACKWARD_HALVES,
    MESSAGE_KINDS,
    NO_PEER,
    Schedule,
    ScheduleError,
    simulate,
)


def check(schedule: Schedule, whole_partitions: Collection[int] = ()) -> None:
    """Raise :class:`ScheduleError` listing every rule ``schedule`` breaks.

    Rules: each rank runs ``F`` and ``B`` (or its halves ``I`` then ``W``) of each microbatch of
    its own stage exactly once, ``F`` before the backward, and the ranks of
    ``whole_partitions`` (which recompute checkpointed modules) only ``B``, so one plan may
    mix split and whole backwards, per rank and per microbatch; every send has exactly one matching
    receive on the neighbouring rank (forward results go to the next stage, gradients to the
    previous), received before use and sent after being computed; ``simple`` runs all forwards
    before any backward; no rank has more than ``active_microbatches`` in flight (forwarded,
    gradients not yet computed: :class:`~.rules.Flight`). Then it must run to the end
    (:class:`ScheduleDeadlock`).
    """
    problems: list[str] = []
    stages = schedule.stages
    check_partitions("whole_partitions", whole_partitions, stages)
    policy = schedule.policy
    for rank, rank_actions in enumerate(schedule.actions):
        where = f"rank {rank}"
        positions: dict[tuple[str, int], list[int]] = {}
        for index, action in enumerate(rank_actions):
            if action.stage != rank:
                problems.append(f"{where}: {action} belongs to stage {action.stage}")
            positions.setdefault((action.kind, action.microbatch), []).append(index)
        # Once per microbatch: its forward and the messages of the chain around its work.
        expected = {
            "F",
            *(m for k in ("F", "B") for m in (*receives(k, rank, stages), *sends(k, rank, stages))),
        }
        halves_allowed = [
            [int(k in backward_phases(split)) for k in BACKWARD_HALVES] for split in (False, True)
        ]
        for mb in range(schedule.microbatches):
            halves = [len(positions.get((kind, mb), [])) for kind in BACKWARD_HALVES]
            if halves == [0, 0, 0]:
                problems.append(f"{where}: B{mb} missing")
            elif halves not in halves_allowed:
                problems.append(
                    f"{where}: microbatch {mb} needs B{mb}, or I{mb} and W{mb}, once each; got "
                    + ", ".join(f"{n} {k}{mb}" for k, n in zip("BIW", halves, strict=True))
                )
            elif rank in whole_partitions and halves != halves_allowed[False]:
                problems.append(f"{where}: B{mb} is split, but this rank's backwards run whole")
            for kind in ("F", *MESSAGE_KINDS):
                count = len(positions.get((kind, mb), []))
                if kind not in expected and count:
                    problems.append(f"{where}: unexpected {kind}{mb} ({NO_PEER[kind]})")
                elif kind in expected and count != 1:
                    problems.append(
                        f"{where}: {kind}{mb} missing"
                        if count == 0
                        else f"{where}: {kind}{mb} appears {count} times"
                    )
            for first, second in ordering_pairs():
                before = positions.get((first, mb), [])
                after = positions.get((second, mb), [])
                if len(before) == 1 and len(after) == 1 and before[0] > after[0]:
                    problems.append(f"{where}: {first}{mb} must come before {second}{mb}")
        kinds = [a.kind for a in rank_actions]
        backwards = [i for i, kind in enumerate(kinds) if is_gradient(kind)]
        if backwards and not policy.backward_may_start(kinds[: backwards[0]].count("F")):
            problems.append(f"{where}: simple pipeline runs a backward before its last forward")
        in_flight = Flight.of((a.kind, a.microbatch) for a in rank_actions).peak
        if in_flight and not policy.may_admit(in_flight - 1):
            problems.append(
                f"{where}: {in_flight} microbatches in flight, more than "
                f"active_microbatches={schedule.active_microbatches}"
            )
    if problems:
        shown = problems[:20]
        more = f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ScheduleError(f"invalid schedule: {'; '.join(shown)}{more}")
    simulate(schedule)
