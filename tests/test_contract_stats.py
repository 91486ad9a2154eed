"""Contract details of `cache.stats.CacheStats` (mutation survivors): `as_dict` and repr."""

from __future__ import annotations

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
