"""Named random streams: a block under ``fork`` draws from its stream and leaves the default
stream as it was; saved states replay the same numbers (as activation checkpointing needs)."""

from __future__ import annotations

import pytest
import torch

from dtrain.smpv2.rng import MODEL_PARALLEL_RNG, RngStateTracker


def tracker(seed: int) -> RngStateTracker:
    streams = RngStateTracker("cpu")
    streams.add(MODEL_PARALLEL_RNG, seed)
    return streams


def test_fork_draws_from_its_stream_and_leaves_the_default_one() -> None:
    torch.manual_seed(0)
    undisturbed = torch.rand(3)
    torch.manual_seed(0)
    streams = tracker(7)
    with streams.fork():
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), undisturbed)
    torch.manual_seed(7)
    assert torch.equal(inside, torch.rand(3))  # the stream seeded 7, from its start


def test_a_stream_goes_on_where_its_last_block_left_it() -> None:
    streams, reference = tracker(3), torch.Generator().manual_seed(3)
    with streams.fork():
        first = torch.rand(2)
    torch.rand(5)  # the default stream moves meanwhile
    with streams.fork():
        second = torch.rand(2)
    assert torch.equal(torch.cat([first, second]), torch.rand(4, generator=reference))


def test_each_tensor_parallel_rank_gets_its_own_numbers() -> None:
    draws = []
    for tp_rank in range(2):
        with tracker(12345 + tp_rank).fork():
            draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])


def test_saved_states_replay_the_same_numbers() -> None:
    streams = tracker(1)
    saved = streams.get_states()
    with streams.fork():
        first = torch.rand(3)
    streams.set_states(saved)
    with streams.fork():
        assert torch.equal(torch.rand(3), first)


def test_misuse_is_named() -> None:
    streams = tracker(1)
    with pytest.raises(ValueError, match="exists already"):
        streams.add(MODEL_PARALLEL_RNG, 2)
    with pytest.raises(KeyError, match="no random stream 'other'"), streams.fork("other"):
        pass
    with pytest.raises(ValueError, match="only cpu or cuda"):
        RngStateTracker("mps")
