"""Prometheus metrics for a `BlockTrie` (the `metrics` extra: `prometheus_client`).

`register(trie, registry)` adds one collector that reads `trie.stats` and the
pool counts when the registry is scraped: nothing runs on the cache's hot path.
The two metrics vLLM exports for its prefix cache keep vLLM's names, types and
meaning, so a dashboard built for vLLM reads blocktrie unchanged:

| metric | type | what |
|---|---|---|
| `vllm:prefix_cache_queries` | counter | tokens queried (`stats.query_tokens`) |
| `vllm:prefix_cache_hits` | counter | tokens served from cache (`stats.hit_tokens`) |

The rest carry the `blocktrie:` prefix (`METRICS` lists every one): requests,
the recent hit rate, evictions, checkpoint saves / skips / restores, pins, copies
and host-tier traffic, and the pools' free and cached counts.

Counters are exported as Prometheus counters: never decreasing between resets.
`abort` rolls a match's counts back ([R42]); the exported value then holds at its
high-water mark until the count passes it again, so a rollback is not read as a
counter reset. `stats.reset()` ([R69]) is one: the values restart from 0.

A scrape runs on the HTTP server's thread while the scheduler thread owns the
trie ([R45]): it only reads ints, without the trie's gate, so one scrape may see
an operation half-counted (its query counted, its hit not yet); the next one
sees it whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from cache.extras import requires_extra
from cache.trie import BlockTrie

with requires_extra("metrics", "cache.metrics"):
    import prometheus_client  # noqa: F401  # named first: the extra's module, not a submodule
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

Reading = Callable[[BlockTrie], float]


def _stat(name: str) -> Reading:
    return lambda trie: getattr(trie.stats, name)


COUNTERS: dict[str, tuple[str, Reading]] = {
    "vllm:prefix_cache_queries": (
        "Prefix cache queries, in terms of number of queried tokens.",
        _stat("query_tokens"),
    ),
    "vllm:prefix_cache_hits": (
        "Prefix cache hits, in terms of number of cached tokens.",
        _stat("hit_tokens"),
    ),
    "blocktrie:requests": ("Requests matched (match calls not aborted).", _stat("queries")),
    "blocktrie:checkpoint_hits": ("Matches that hit an SSM checkpoint.", _stat("checkpoint_hits")),
    "blocktrie:evicted_blocks": (
        "KV blocks freed by eviction (node blocks and frozen tails).",
        _stat("evicted_blocks"),
    ),
    "blocktrie:evicted_checkpoints": (
        "SSM checkpoints released by any eviction.",
        _stat("evicted_checkpoints"),
    ),
    "blocktrie:checkpoint_saves": (
        "Checkpoint saves that queued a copy.",
        _stat("checkpoints_saved"),
    ),
    "blocktrie:checkpoint_skips": (
        "Checkpoint saves skipped: no slot, no frozen block, or a pinned anchor.",
        _stat("checkpoints_skipped"),
    ),
    "blocktrie:checkpoint_dedups": (
        "Checkpoint saves skipped: the same checkpoint already existed.",
        _stat("checkpoints_deduplicated"),
    ),
    "blocktrie:checkpoint_restores": ("Checkpoint restore copies queued.", _stat("restores")),
    "blocktrie:copies_reaped": (
        "Copies whose pins and references were released.",
        _stat("copies_reaped"),
    ),
    "blocktrie:copies_failed": ("Reaped copies that failed.", _stat("copies_failed")),
    "blocktrie:host_hit_tokens": (
        "Hit tokens that had to be loaded from the host tier.",
        _stat("host_hit_tokens"),
    ),
    "blocktrie:host_loaded_blocks": (
        "KV blocks loaded back from the host tier.",
        _stat("loaded_blocks"),
    ),
    "blocktrie:host_stored_blocks": ("KV blocks stored to the host tier.", _stat("stored_blocks")),
    "blocktrie:host_evicted_blocks": (
        "Host-tier blocks freed by host eviction.",
        _stat("host_evicted_blocks"),
    ),
    "blocktrie:host_stored_checkpoints": (
        "Checkpoints stored to a host slot.",
        _stat("checkpoints_stored"),
    ),
    "blocktrie:offloaded_checkpoints": (
        "Mirrored checkpoints that gave their device slot back.",
        _stat("checkpoints_offloaded"),
    ),
    "blocktrie:host_evicted_checkpoints": (
        "Host-only checkpoints dropped for a host slot.",
        _stat("host_evicted_checkpoints"),
    ),
}
"""Every counter: Prometheus name (exposed with the `_total` suffix) -> (help, reading)."""

GAUGES: dict[str, tuple[str, Reading]] = {
    "blocktrie:recent_hit_rate": (
        "Prefix cache hit rate over the last stats_window requests.",
        lambda trie: trie.stats.recent_hit_rate,
    ),
    "blocktrie:pins": ("Checkpoint pins outstanding.", _stat("pins")),
    "blocktrie:peak_pins": ("Most checkpoint pins outstanding at once.", _stat("peak_pins")),
    "blocktrie:free_blocks": ("KV blocks in the free list.", lambda trie: trie.num_free_blocks),
    "blocktrie:cached_blocks": (
        "KV blocks owned by cached prefixes.",
        lambda trie: trie.num_cached_blocks,
    ),
    "blocktrie:free_checkpoint_slots": (
        "Checkpoint slots in the free list.",
        lambda trie: trie.num_free_checkpoint_slots,
    ),
    "blocktrie:free_host_blocks": (
        "Host-tier blocks in the free list.",
        lambda trie: trie.num_free_host_blocks,
    ),
}
"""Every gauge: name -> (help, reading)."""

METRICS: tuple[str, ...] = (*COUNTERS, *GAUGES)
"""Every metric name `register` exports."""


class TrieCollector(Collector):
    """Reads one trie's counters at scrape time (see the module docstring)."""

    def __init__(self, trie: BlockTrie, labels: Mapping[str, str]) -> None:
        self._trie = trie
        self._label_names = list(labels)
        self._label_values = [str(v) for v in labels.values()]
        self._high: dict[str, float] = {}
        self._resets = trie.stats.resets

    def collect(self) -> Iterator[Metric]:
        trie = self._trie
        if trie.stats.resets != self._resets:  # a reset: counters restart from 0
            self._resets = trie.stats.resets
            self._high.clear()
        for name, (doc, read) in COUNTERS.items():
            value = max(read(trie), self._high.get(name, 0))
            self._high[name] = value
            counter = CounterMetricFamily(name, doc, labels=self._label_names)
            counter.add_metric(self._label_values, value)
            yield counter
        for name, (doc, read) in GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=self._label_names)
            gauge.add_metric(self._label_values, read(trie))
            yield gauge

    def describe(self) -> Iterator[Metric]:
        """The metric families without values, so registering reads no counter."""
        for name, (doc, _) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, labels=self._label_names)
        for name, (doc, _) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, labels=self._label_names)


def register(
    trie: BlockTrie,
    registry: CollectorRegistry = REGISTRY,
    *,
    labels: Mapping[str, str] | None = None,
) -> TrieCollector:
    """Register `trie`'s metrics (`METRICS`) in `registry` (prometheus_client's default
    one unless given); returns the collector (`registry.unregister` takes it back).

    `labels`: constant labels on every metric, e.g. vLLM's
    `{"model_name": ..., "engine": "0"}`. One trie per registry (the names are
    the registry's keys). Raises `TypeError` for a `trie` that is not a
    `BlockTrie`, and prometheus_client's `ValueError` when the registry already
    holds these names.
    """
    if not isinstance(trie, BlockTrie):
        raise TypeError(f"register: expected a BlockTrie, got {type(trie).__name__}")
    collector = TrieCollector(trie, dict(labels or {}))
    registry.register(collector)
    return collector


__all__ = ["COUNTERS", "GAUGES", "METRICS", "TrieCollector", "register"]
