"""Counters a `BlockTrie` keeps, under the names of `spec.snapshot.STAT_COUNTERS`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from spec.snapshot import STAT_COUNTERS

DEFAULT_STATS_WINDOW = 1000
"""Requests `recent_hit_rate` looks back over by default (vLLM's `CachingMetrics`)."""


class CacheStats:
    """Running counters (see `spec.snapshot.STAT_COUNTERS` for each meaning).

    `hit_rate` = hit_tokens / query_tokens since the trie was built (or since
    `reset()`); `recent_hit_rate` the same over the last `window` matches
    ([R69]). `peak_pins` is the most checkpoint pins outstanding at once (a
    high-water mark `abort` never rolls back, [R42]); `pins` the number
    outstanding now.
    """

    __slots__ = (
        *STAT_COUNTERS,
        "_last_serial",
        "peak_pins",
        "pins",
        "recent",
        "reset_serial",
        "resets",
        "window",
    )

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
    recent: deque[tuple[int, int, int]]
    """The last `window` matches not aborted, oldest first: `(sequence serial,
    tokens queried, tokens hit)` ([R69]). `match` appends; `abort` removes its own."""
    reset_serial: int
    """No sequence with a serial above this was matched before the last `reset()` (0:
    never reset); `abort` rolls back only the counters of a match made after it."""
    resets: int
    """How many times `reset()` ran (a metrics exporter's cue that counters restarted)."""
    window: int
    """How many matches `recent_hit_rate` looks back over (`CacheConfig.stats_window`)."""

    def __init__(
        self, window: int = DEFAULT_STATS_WINDOW, last_serial: Callable[[], int] | None = None
    ) -> None:
        """`last_serial` reads the serial of the newest sequence matched so far (the
        trie's counter); without it every match counts as made after a reset."""
        if type(window) is not int or window <= 0:
            raise ValueError(f"CacheStats: window must be an int > 0, got {window!r}")
        self._last_serial: Callable[[], int] = last_serial or (lambda: 0)
        for name in (*STAT_COUNTERS, "peak_pins", "pins", "reset_serial", "resets"):
            setattr(self, name, 0)
        self.window = window
        self.recent = deque(maxlen=window)

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from cache (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def recent_hit_rate(self) -> float:
        """`hit_rate` over the last `window` matches ([R69]): their hit tokens over their
        queried tokens (0.0 before any query). Read in O(window): for a scrape or a
        log line, not per request."""
        queried = hit = 0
        for _, q, h in tuple(self.recent):  # one C call: a scrape thread may read it
            queried += q
            hit += h
        return hit / queried if queried else 0.0

    def reset(self) -> None:
        """Start every counter again from 0 and empty the recent window ([R69]).

        `pins` (outstanding now) stays, and `peak_pins` restarts from it. A match
        made before the reset is not rolled back by a later `abort`: its counts
        were reset already. What vLLM does on `reset_prefix_cache`'s stats reset.
        """
        for name in STAT_COUNTERS:
            setattr(self, name, 0)
        self.peak_pins = self.pins
        self.reset_serial = self._last_serial()
        self.recent.clear()
        self.resets += 1

    def forget_match(self, serial: int) -> bool:
        """`abort` of the match that made sequence `serial`: take it out of the recent
        window. Returns whether its counters are still counted (it was matched after
        the last `reset`), so the caller rolls them back."""
        if serial <= self.reset_serial:
            return False
        recent = self.recent
        for i in range(len(recent) - 1, -1, -1):  # usually the newest
            if recent[i][0] == serial:
                del recent[i]
                break
        return True

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
