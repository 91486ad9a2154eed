"""Invariant 10 over the wire: a subscriber's index, built only from decoded ZMQ
messages, holds exactly the hashes of the trie's cached blocks."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytest.importorskip("xxhash")

import msgspec
import zmq

from cache.block_hash import to_wire
from cache.events import BlockRemoved, BlockStored
from cache.kv_publisher import KVEventPublisher
from tests.helpers import kv_trie, serve


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Ev(msgspec.Struct, tag=True, gc=False):
    pass


class _Stored(_Ev, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _Removed(_Ev, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(_Ev, tag="AllBlocksCleared"):
    pass


class _WireBatch(_Batch):
    events: list[_Stored | _Removed | _Cleared]


def _is_probe(batch: _WireBatch) -> bool:
    return [type(e) for e in batch.events] == [_Removed] and not batch.events[0].block_hashes


def test_subscriber_index_equals_the_cached_blocks() -> None:
    rng = random.Random(5)
    trie = kv_trie(num_blocks=40, block_size=4, enable_events=True)
    decoder = msgspec.msgpack.Decoder(_WireBatch)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    index: Counter[int] = Counter()  # what a router keeps: wire hash -> live copies
    lora_of: dict[int, str | None] = {}  # wire hash -> lora_name it was stored under
    hash_of: dict[int, tuple[str, int]] = {}  # in process: block id -> (namespace, hash)
    published = 0
    try:
        with KVEventPublisher("tcp://127.0.0.1:*", topic="r0") as pub:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"r0")
            sub.setsockopt(zmq.RCVTIMEO, 5_000)
            sub.connect(pub.endpoint)
            while not sub.poll(20):  # PUB drops until the subscription arrives: probe
                pub.publish([BlockRemoved((), (), "")])
            prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
            for step in range(120):
                tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(8))]
                serve(trie, tokens, namespace=rng.choice(["", "lora-a"]))
                if step % 40 == 39:
                    trie.evict(5)
                events = trie.drain_events()
                for e in events:
                    if isinstance(e, BlockStored):
                        for h, b in zip(e.block_hashes, e.block_ids, strict=True):
                            hash_of[b] = (e.namespace, h)
                if events:
                    assert pub.publish(events)
                    published += 1
            received = 0
            while received < published:
                batch = decoder.decode(sub.recv_multipart()[2])
                if _is_probe(batch):
                    continue
                received += 1
                for ev in batch.events:
                    if isinstance(ev, _Stored):
                        for h in ev.block_hashes:
                            index[h] += 1
                            lora_of[h] = ev.lora_name
                    elif isinstance(ev, _Removed):
                        for h in ev.block_hashes:
                            assert index[h] > 0, "removed a block that was never stored"
                            index[h] -= 1
                    else:
                        index.clear()
            sub.close(linger=0)
        assert pub.dropped_batches == 0
    finally:
        ctx.destroy(linger=0)
    cached = {n["block"] for n in trie.snapshot()["nodes"].values() if n["block"] is not None}
    assert len(cached) == trie.num_cached_blocks > 0
    assert trie.stats.evicted_blocks > 0
    assert +index == Counter(to_wire(hash_of[b][1]) for b in cached)
    for b in cached:
        ns, h = hash_of[b]
        assert lora_of[to_wire(h)] == (ns or None)
    assert {ns for ns, _ in hash_of.values()} == {"", "lora-a"}
