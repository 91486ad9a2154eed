"""What a scrape of `cache.metrics` returns, stated from the reference model.

`cache.metrics` exports a trie's counters and pool counts under vLLM's prefix
cache names (docs/contract.md, "Metrics"). This module restates that table
without importing `cache` or `prometheus_client`: each exported name and the
model fact it reads. `ExportedMetrics.scrape()` gives the values a scrape taken
now returns, with the counters' rule: a Prometheus counter never decreases
between resets, so an `abort` that rolls a count back ([R42]) leaves the
exported value at its high-water mark, and `reset_stats` ([R69]) restarts every
counter from its current value (0).

The differential test scrapes the cache's collector and this model after every
step and requires the same values, except `blocktrie:peak_pins`: the most pins
outstanding *at once* can be reached inside one operation, where no step
observes it; the test checks that it is at least the pins of every state seen
since the last reset instead.
"""

from __future__ import annotations

from collections.abc import Callable

from spec.model import ReferenceCache

COUNTERS: dict[str, str] = {
    "vllm:prefix_cache_queries": "query_tokens",
    "vllm:prefix_cache_hits": "hit_tokens",
    "blocktrie:requests": "queries",
    "blocktrie:checkpoint_hits": "checkpoint_hits",
    "blocktrie:evicted_blocks": "evicted_blocks",
    "blocktrie:evicted_checkpoints": "evicted_checkpoints",
    "blocktrie:checkpoint_saves": "checkpoints_saved",
    "blocktrie:checkpoint_skips": "checkpoints_skipped",
    "blocktrie:checkpoint_dedups": "checkpoints_deduplicated",
    "blocktrie:checkpoint_restores": "restores",
    "blocktrie:copies_reaped": "copies_reaped",
    "blocktrie:copies_failed": "copies_failed",
    "blocktrie:host_hit_tokens": "host_hit_tokens",
    "blocktrie:host_loaded_blocks": "loaded_blocks",
    "blocktrie:host_stored_blocks": "stored_blocks",
    "blocktrie:host_evicted_blocks": "host_evicted_blocks",
    "blocktrie:host_stored_checkpoints": "checkpoints_stored",
    "blocktrie:offloaded_checkpoints": "checkpoints_offloaded",
    "blocktrie:host_evicted_checkpoints": "host_evicted_checkpoints",
}
"""Every exported counter (its sample carries the `_total` suffix) -> the model stat it reads."""

GAUGES: dict[str, Callable[[ReferenceCache], float]] = {
    "blocktrie:recent_hit_rate": lambda m: m.recent_hit_rate,
    "blocktrie:pins": lambda m: m.num_pins,
    "blocktrie:free_blocks": lambda m: m.num_free_blocks,
    "blocktrie:cached_blocks": lambda m: m.num_cached_blocks,
    "blocktrie:free_checkpoint_slots": lambda m: m.num_free_checkpoint_slots,
    "blocktrie:free_host_blocks": lambda m: m.num_free_host_blocks,
}
"""Every exported gauge but `blocktrie:peak_pins` -> how the model reads it now."""

UNMODELLED: frozenset[str] = frozenset({"blocktrie:peak_pins"})
"""Exported, but reached inside operations: bounded by the test, not modelled."""


class ExportedMetrics:
    """The exported values of one model, scrape after scrape."""

    def __init__(self, model: ReferenceCache) -> None:
        self._model = model
        self._high: dict[str, int] = {}
        self._resets = model.resets

    def scrape(self) -> dict[str, float]:
        """Sample name -> value, as a scrape taken now returns them (`UNMODELLED` left out)."""
        model = self._model
        if model.resets != self._resets:  # [R69]: the counters restart
            self._resets = model.resets
            self._high.clear()
        stats = model.stats
        out: dict[str, float] = {}
        for name, stat in COUNTERS.items():
            self._high[name] = max(stats[stat], self._high.get(name, 0))
            out[f"{name}_total"] = self._high[name]
        for name, read in GAUGES.items():
            out[name] = read(model)
        return out


__all__ = ["COUNTERS", "GAUGES", "UNMODELLED", "ExportedMetrics"]
