"""Contract details of `cache.stats.CacheStats`: `as_dict` and repr (mutation survivors),
the recent window and `reset()` ([R69])."""

from __future__ import annotations

import pytest

from cache import BlockTrie, CacheConfig, ConfigError
from cache.stats import CacheStats
from spec.snapshot import STAT_COUNTERS


def _stats() -> CacheStats:
    stats = CacheStats()
    stats.query_tokens = 8
    stats.hit_tokens = 2
    stats.peak_pins = 3
    stats.pins = 1
    return stats


def test_as_dict_adds_hit_rate_and_pin_counts_to_the_counters() -> None:
    out = _stats().as_dict()
    assert list(out) == [*STAT_COUNTERS, "hit_rate", "peak_pins", "pins"]
    assert out["hit_rate"] == 0.25
    assert out["peak_pins"] == 3
    assert out["pins"] == 1


def test_repr_lists_every_entry_of_as_dict() -> None:
    stats = _stats()
    body = ", ".join(f"{k}={v}" for k, v in stats.as_dict().items())
    assert repr(stats) == f"CacheStats({body})"
    assert "hit_tokens=2, checkpoint_hits=0" in repr(stats)
    assert repr(stats).endswith("hit_rate=0.25, peak_pins=3, pins=1)")


def test_a_fresh_stats_object_has_every_counter_at_zero() -> None:
    """Every counter, `peak_pins` and `pins` start at the int 0; `hit_rate` is 0.0
    before any query (no division by a zero `query_tokens`)."""
    stats = CacheStats()
    assert stats.counters() == dict.fromkeys(STAT_COUNTERS, 0)
    assert all(type(v) is int for v in stats.counters().values())
    assert stats.peak_pins == 0 and stats.pins == 0
    rate = stats.hit_rate
    assert rate == 0.0 and type(rate) is float
    assert stats.as_dict() == {
        **dict.fromkeys(STAT_COUNTERS, 0),
        "hit_rate": 0.0,
        "peak_pins": 0,
        "pins": 0,
    }


def test_hit_rate_is_hit_tokens_over_query_tokens() -> None:
    """`hit_rate` divides hit tokens by queried tokens (not the other way, not a product)."""
    stats = CacheStats()
    stats.query_tokens = 10
    assert stats.hit_rate == 0.0
    stats.hit_tokens = 4
    assert stats.hit_rate == 0.4
    stats.hit_tokens = 10
    assert stats.hit_rate == 1.0


def test_counters_reads_each_counter_under_its_own_name() -> None:
    """`counters()` maps each `STAT_COUNTERS` name to that attribute's current value."""
    stats = CacheStats()
    for i, name in enumerate(STAT_COUNTERS):
        setattr(stats, name, 100 + i)
    assert stats.counters() == {name: 100 + i for i, name in enumerate(STAT_COUNTERS)}


def _trie(window: int = 1000) -> BlockTrie:
    return BlockTrie(CacheConfig(block_size=2, num_blocks=8, stats_window=window))


def test_recent_hit_rate_covers_the_last_window_matches() -> None:
    """[R69]: with `stats_window=2`, only the last two matches count."""
    trie = _trie(2)
    seq = trie.match([1, 2, 3])
    trie.allocate(seq, 3)
    trie.commit(seq, 3)
    trie.release(seq)  # 3 queried, 0 hit
    assert trie.stats.recent_hit_rate == 0.0
    trie.release(trie.match([1, 2, 3]))  # 3 queried, 2 hit
    assert trie.stats.recent_hit_rate == 2 / 6
    trie.release(trie.match([1, 2, 5]))  # 3 queried, 2 hit: the first falls out
    assert trie.stats.recent_hit_rate == 4 / 6
    assert trie.stats.hit_rate == 4 / 9


def test_abort_takes_its_match_out_of_the_window() -> None:
    trie = _trie()
    seq = trie.match([1, 2, 3])
    trie.allocate(seq, 3)
    trie.commit(seq, 3)
    trie.release(seq)
    trie.abort(trie.match([1, 2, 3]))
    assert trie.stats.recent_hit_rate == 0.0
    assert len(trie.stats.recent) == 1


def test_reset_zeroes_counters_and_a_later_abort_rolls_nothing_back() -> None:
    """[R69]: a match made before `reset()` is not un-counted by its abort (no
    negative counters); one made after is."""
    trie = _trie()
    early = trie.match([1, 2, 3])
    trie.stats.reset()
    assert trie.stats.counters() == dict.fromkeys(STAT_COUNTERS, 0)
    assert trie.stats.recent_hit_rate == 0.0 and trie.stats.resets == 1
    late = trie.match([4, 5, 6])
    trie.abort(early)
    assert trie.stats.queries == 1 and trie.stats.query_tokens == 3
    trie.abort(late)
    assert trie.stats.counters() == dict.fromkeys(STAT_COUNTERS, 0)


def test_stats_window_must_be_a_positive_int() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="stats_window"):
            CacheConfig(block_size=2, num_blocks=8, stats_window=bad)  # type: ignore[arg-type]
    assert CacheConfig(block_size=2, num_blocks=8).stats_window == 1000


def test_reset_covers_a_live_match_that_left_the_window() -> None:
    """[R69]: a match pushed out of the window by one that was then aborted is still
    older than the reset: its abort rolls nothing back (no negative counters)."""
    trie = _trie(1)
    early = trie.match([1, 2, 3])
    trie.abort(trie.match([4, 5, 6]))  # pushed `early` out, then left: the window is empty
    trie.stats.reset()
    trie.abort(early)
    assert trie.stats.counters() == dict.fromkeys(STAT_COUNTERS, 0)
