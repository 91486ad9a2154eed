"""`cache.metrics`: a trie's counters in a Prometheus registry, scraped over HTTP."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from cache import BlockTrie, CacheConfig
from cache.metrics import COUNTERS, GAUGES, METRICS, register


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _scrape(registry: CollectorRegistry) -> dict[str, float]:
    """Serve `registry` on a loopback port of the OS's choosing, scrape it once, stop."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return _samples(reply.read().decode())
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_counters_are_scraped_over_http_under_vllm_names() -> None:
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    registry = CollectorRegistry()
    register(trie, registry, labels={"model_name": "m", "engine": "0"})
    seq = trie.match([1, 2, 3, 4, 5])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.release(seq)
    trie.release(trie.match([1, 2, 3, 4, 9]))
    trie.evict(1)
    got = _scrape(registry)
    assert got["vllm:prefix_cache_queries_total"] == 10
    assert got["vllm:prefix_cache_hits_total"] == 4
    assert got["blocktrie:requests_total"] == 2
    assert got["blocktrie:evicted_blocks_total"] == 1
    assert got["blocktrie:recent_hit_rate"] == 0.4
    assert got["blocktrie:free_blocks"] == 3
    assert got["blocktrie:cached_blocks"] == 1
    names = {name.removesuffix("_total") for name in got}
    assert set(METRICS) <= names


def test_metric_types_and_labels() -> None:
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    registry = CollectorRegistry()
    register(trie, registry, labels={"model_name": "m"})
    families = {f.name: f for f in text_string_to_metric_families(_exposition(registry))}
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    assert all(s.labels == {"model_name": "m"} for f in families.values() for s in f.samples)


def _exposition(registry: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_a_rolled_back_match_is_not_a_counter_reset_but_stats_reset_is() -> None:
    """`abort` lowers the stats ([R42]); the exported counter holds its high-water
    mark instead of going down. `stats.reset()` ([R69]) restarts it from 0."""
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    registry = CollectorRegistry()
    register(trie, registry)
    trie.release(trie.match([1, 2, 3]))
    seq = trie.match([1, 2, 3, 4, 5])
    assert _samples(_exposition(registry))["vllm:prefix_cache_queries_total"] == 8
    trie.abort(seq)
    assert trie.stats.query_tokens == 3
    assert _samples(_exposition(registry))["vllm:prefix_cache_queries_total"] == 8
    trie.release(trie.match([1, 2, 3, 4, 5, 6]))
    assert _samples(_exposition(registry))["vllm:prefix_cache_queries_total"] == 9
    trie.stats.reset()
    assert _samples(_exposition(registry))["vllm:prefix_cache_queries_total"] == 0


def test_register_refuses_what_is_not_a_trie_and_a_second_registration() -> None:
    registry = CollectorRegistry()
    with pytest.raises(TypeError):
        register(object(), registry)  # type: ignore[arg-type]
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    collector = register(trie, registry)
    with pytest.raises(ValueError):
        register(trie, registry)
    registry.unregister(collector)
    register(trie, registry)
