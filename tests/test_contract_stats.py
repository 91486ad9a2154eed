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
