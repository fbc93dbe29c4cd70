"""Named random-number streams for tensor-parallel code (``tsm.state.get_rng_state_tracker()``).

Dropout inside a tensor-parallel region must draw different numbers on each tp rank (each holds
a different slice of the activations), while the rest of the model draws the same numbers on all
of them. Megatron's convention, which Transformer Engine's activation checkpointing calls into
(``get_states``, ``set_states``, ``fork``), keeps such streams apart from the default one: a block
run under ``fork(name)`` draws from stream ``name`` and leaves the default stream as it found it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The stream ``fork()`` uses by default; ``tsm.init`` seeds it with ``random_seed`` plus the
tensor-parallel rank."""


class RngStateTracker:
    """Named generator states of one device type (``"cpu"`` or ``"cuda"``: the current device's
    default generator)."""

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"random streams on {device_type!r}: only cpu or cuda")
        self.device_type = device_type
        self._states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device_type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def reset(self) -> None:
        self._states.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (activation checkpointing saves them before a
        forward it will run again)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``; the default stream is left as it was."""
        if name in self._states:
            raise ValueError(f"random stream {name!r} exists already")
        saved = self._get()
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        self._states[name] = self._get()
        self._set(saved)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``, which goes on from where the block leaves it."""
        if name not in self._states:
            raise KeyError(f"no random stream {name!r}; known: {sorted(self._states)}")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)
