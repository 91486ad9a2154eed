"""`bench.paired.PairedTimedCache`: both caches get every call, in turns, timed apart."""

from __future__ import annotations

from typing import Any

import pytest

from bench.paired import PairedSequence, PairedTimedCache
from cache import BlockTrie, CacheConfig
from spec.errors import OutOfBlocks


def _trie(events: bool = False, blocks: int = 8) -> BlockTrie:
    return BlockTrie(
        CacheConfig(block_size=4, num_blocks=blocks, kv_block_shape=None, enable_events=events)
    )


class _Order:
    """Records which cache each call reached, in order."""

    def __init__(self, cache: Any, name: str, log: list[str]) -> None:
        self._cache, self._name, self._log = cache, name, log

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._cache, attr)
        if not callable(value):
            return value

        def call(*args: Any) -> Any:
            self._log.append(self._name)
            return value(*args)

        return call


def test_every_call_reaches_both_caches_in_turns_and_each_side_is_timed() -> None:
    log: list[str] = []
    ticks = iter(range(0, 10**6, 10))
    pair = PairedTimedCache(
        _Order(_trie(), "a", log),
        _Order(_trie(events=True), "b", log),
        4,
        clock=lambda: next(ticks),
    )
    seq = pair.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert isinstance(seq, PairedSequence) and seq.num_cached_tokens == 0  # the first's
    pair.allocate(seq, 9)
    pair.commit(seq, 8)
    pair.release(seq)
    again = pair.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert again.num_cached_tokens == 8 and again.second.num_cached_tokens == 8
    pair.abort(again)
    assert pair.poll() == 0
    # Turns, per operation: the second cache goes first on every other call of each.
    first_calls = ["b", "a"] * 4  # match, allocate, commit, release: each its first call
    assert log == [*first_calls, "a", "b", "b", "a", "b", "a"]  # match again; abort; poll
    for times in (pair.t, pair.t2):  # each call took one tick of the fake clock
        assert times.ns["match"] == 20 and times.ns["allocate"] == 10
        assert times.ns["commit"] == 10 and times.ns["release"] == 10
        assert times.other_ns == 20 and times.calls == 7
        assert times.blocks["match"] == 4 and times.blocks["commit"] == 2
    assert pair.num_cached_blocks == 2 and pair.num_free_blocks == 6  # cached, idle


def test_a_replay_pattern_of_even_length_does_not_fix_who_goes_first() -> None:
    # A replay calls match, allocate, commit, release and poll per request: with one
    # turn for all calls, an even pattern put the same side first on every match.
    log: list[str] = []
    pair = PairedTimedCache(_Order(_trie(), "a", log), _Order(_trie(events=True), "b", log), 4)
    firsts: dict[str, list[str]] = {"match": [], "poll": []}
    for _ in range(4):
        start = len(log)
        seq = pair.match([1, 2, 3, 4, 5])
        firsts["match"].append(log[start])
        pair.release(seq)
        start = len(log)
        pair.poll()
        firsts["poll"].append(log[start])
        pair.check()
    assert firsts == {"match": ["b", "a", "b", "a"], "poll": ["b", "a", "b", "a"]}


def test_eviction_is_explicit_and_shared_and_out_of_blocks_reaches_the_replay() -> None:
    pair = PairedTimedCache(_trie(blocks=2), _trie(events=True, blocks=2), 4)
    seq = pair.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    with pytest.raises(OutOfBlocks):  # 3 blocks in 2: both refuse, changing nothing
        pair.allocate(seq, 9)
    pair.allocate(seq, 8)
    pair.commit(seq, 8)
    pair.release(seq)
    other = pair.match([5, 5, 5, 5, 6, 6, 6, 6, 7])
    pair.allocate(other, 8)  # evicts the two idle blocks from both tries first
    assert pair.t.blocks["evict"] == pair.t2.blocks["evict"] == 2
    assert pair.first.num_cached_blocks == pair.second.num_cached_blocks == 0


def test_caches_that_differ_are_caught() -> None:
    lying = _trie()
    seq = lying.match([1, 2, 3, 4, 5])
    lying.allocate(seq, 5)
    lying.commit(seq, 4)
    lying.release(seq)  # it holds a block the other does not
    pair = PairedTimedCache(_trie(), lying, 4)
    with pytest.raises(RuntimeError, match="the paired caches differ: hit 0 vs 4"):
        pair.match([1, 2, 3, 4, 5])
    with pytest.raises(TypeError, match="attention-only"):
        pair.save(PairedSequence(None, None), 4, {})
