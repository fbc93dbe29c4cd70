"""The cost model of a partition plan (SMP v1's): what a module costs, and what a call between
two partitions costs in time.

A module's **compute** is the forward and backward time of its own code (exclusive of the modules
it calls), its **memory** ``3 × parameter bytes`` (weights, gradients and optimizer state)
``+ buffer bytes + activation bytes``, and its **cost** ``memory_weight × memory + (1 −
memory_weight) × compute``, each part normalised to the model total (the whole model costs one).
A partition's predicted time adds the **traffic** of the runtime: a call whose caller runs on
another partition sends its tensor arguments to the owner and its outputs back (and the same
sizes again as gradients in backward), which both ranks spend time on.

Timings are noisy (a busy machine makes one layer's time jump several fold): modules built and
called alike (repeated identical layers) get one compute time, the median of theirs.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable

from dtrain.modelparallel.errors import PartitionError
from dtrain.modelparallel.plan.profile import ModelProfile

DEFAULT_BANDWIDTH = 1e9
"""Bytes per second assumed between two partitions (a cautious figure for gloo on one host)."""

PARAMETER_COST_MULTIPLIER = 3
"""Weights, their gradients and the optimizer state: SMP's factor for parameter memory."""

ESTIMATED_FLOP_RATE = 5e10
"""Floating-point operations per second assumed where a profile has no times: only the ratio
of compute to traffic (:data:`DEFAULT_BANDWIDTH`) depends on it, not the balance of compute."""


def estimated_time(flops: int) -> float:
    """Seconds of a module's forward and backward (about twice the forward's operations)."""
    return 3 * flops / ESTIMATED_FLOP_RATE


def check_weights(memory_weight: float, bandwidth: float) -> None:
    if not 0.0 <= memory_weight <= 1.0:
        raise PartitionError(f"memory_weight is {memory_weight}; allowed: 0 to 1")
    if bandwidth <= 0:
        raise PartitionError(f"bandwidth is {bandwidth} bytes/s; it must be positive")


class CostModel:
    """Per-module time and memory, the traffic of every call, and the normalised cost."""

    def __init__(self, profile: ModelProfile, memory_weight: float, bandwidth: float) -> None:
        self.memory_weight = memory_weight
        self.time = _pooled_times(profile)
        self.memory = {
            name: PARAMETER_COST_MULTIPLIER * m.param_bytes + m.buffer_bytes + m.activation_bytes
            for name, m in profile.modules.items()
        }
        self.total_time = sum(self.time.values())
        self.total_memory = sum(self.memory.values())
        # Gradients of the outputs go to the owner in backward, those of the inputs come back.
        self.seconds_per_byte = (2 if profile.backward_measured else 1) / bandwidth
        self.calls = [
            (profile.calls[call.caller].module, call.module, call.input_bytes, call.output_bytes)
            for call in profile.calls
            if call.caller >= 0
        ]

    def comm_time(self, moved: int) -> float:
        return moved * self.seconds_per_byte

    def cost(self, time: float, memory: float) -> float:
        w = self.memory_weight
        memory_share = memory / self.total_memory if self.total_memory else 0.0
        time_share = time / self.total_time if self.total_time else 0.0
        return w * memory_share + (1 - w) * time_share


def _pooled_times(profile: ModelProfile) -> dict[str, float]:
    """Each module's own forward and backward time, as the median over the modules alike: layers
    doing the same work cost the same, so noise cannot favour one cut between them over another.
    A profile without times (a model planned from the meta device) has them estimated from its
    exact operation counts."""
    if not _timed(profile):
        return {name: estimated_time(m.flops) for name, m in profile.modules.items()}
    kinds = _kinds(profile)
    alike: dict[Hashable, list[float]] = {}
    for name, m in profile.modules.items():
        alike.setdefault(kinds[name], []).append(m.forward_exclusive + m.backward_exclusive)
    median = {kind: statistics.median(times) for kind, times in alike.items()}
    return {name: median[kinds[name]] for name in profile.modules}


def _timed(profile: ModelProfile) -> bool:
    return any(m.forward_exclusive or m.backward_exclusive for m in profile.modules.values())


def _kinds(profile: ModelProfile) -> dict[str, Hashable]:
    """A key per module, equal for modules built and called alike: type, own parameters and
    buffers, calls with their tensor sizes, activation bytes, and the same of every module below."""
    sizes: dict[str, list[tuple[int, int]]] = {}
    for call in profile.calls:
        sizes.setdefault(call.module, []).append((call.input_bytes, call.output_bytes))
    kinds: dict[str, Hashable] = {}
    for name, m in reversed(profile.modules.items()):  # children before their parents
        below = tuple((child[len(name) :], kinds[child]) for child in m.children)
        kinds[name] = (
            m.type,
            m.param_bytes,
            m.buffer_bytes,
            m.activation_bytes,
            tuple(sizes.get(name, ())),
            below,
        )
    return kinds
