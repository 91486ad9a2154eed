"""Counters a `BlockTrie` keeps, under the names of `spec.snapshot.STAT_COUNTERS`."""

from __future__ import annotations

from spec.snapshot import STAT_COUNTERS


class CacheStats:
    """Running counters (see `spec.snapshot.STAT_COUNTERS` for each meaning).

    `hit_rate` = hit_tokens / query_tokens. `peak_pins` is the most checkpoint
    pins outstanding at once (a high-water mark `abort` never rolls back,
    [R42]); `pins` the number outstanding now.
    """

    __slots__ = (*STAT_COUNTERS, "peak_pins", "pins")

    queries: int
    query_tokens: int
    hit_tokens: int
    checkpoint_hits: int
    evicted_blocks: int
    evicted_checkpoints: int
    checkpoints_saved: int
    checkpoints_skipped: int
    checkpoints_deduplicated: int
    restores: int
    copies_reaped: int
    copies_failed: int
    host_hit_tokens: int
    loaded_blocks: int
    stored_blocks: int
    host_evicted_blocks: int
    checkpoints_stored: int
    checkpoints_offloaded: int
    host_evicted_checkpoints: int
    peak_pins: int
    pins: int

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from cache (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def counters(self) -> dict[str, int]:
        """The shared counters, as the snapshot carries them."""
        return {name: getattr(self, name) for name in STAT_COUNTERS}

    def as_dict(self) -> dict[str, float | int]:
        """Every counter plus `hit_rate`, `peak_pins` and `pins`."""
        out: dict[str, float | int] = dict(self.counters())
        out.update(hit_rate=self.hit_rate, peak_pins=self.peak_pins, pins=self.pins)
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"CacheStats({body})"
