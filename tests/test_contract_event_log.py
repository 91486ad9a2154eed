"""Contract details of `cache.event_log` (mutation survivors).

The checkpoint slots that events replay to include the events already drained
(invariant 10 holds after a drain); checkpoint events carry the exact chain
hash, parent hash, namespace and extra keys, and a commit's `BlockStored` its
tokens and extra keys whatever the key shape; removals come one event per run of
one namespace; a disabled or muted log emits nothing. Host-tier removals name
each block's hash, host block and namespace in medium CPU, and the host blocks
that events replay to include the events already drained (and only host
events). A block moving between tiers is one full `BlockStored` per block: its
hash, block, parent hash (None under a root), tokens, namespace, medium and
extra keys; a device block freed while its node stays is a `BlockRemoved`
naming its namespace.
"""

from __future__ import annotations

import pytest

from cache import BlockTrie
from cache.block_hash import BlockHasher, extra_keys
from cache.event_log import EventLog
from cache.events import (
    CHECKPOINT_GROUP,
    KIND_FULL_ATTENTION,
    KV_GROUP,
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
)
from cache.keys import pack_tokens
from cache.node import NO_BLOCK, NO_NODE, Node, NodeTable
from tests.helpers import kv_trie, ssm_trie, state

pytest.importorskip("xxhash")  # events on: the block hasher needs the `events` extra


def test_drained_checkpoint_events_still_count_and_removal_names_the_namespace() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    assert copies is not None
    seq = trie.match([1, 2, 3, 4, 5, 6], namespace="tenant")
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    trie.save(seq, 4, state(1.0))
    stored = [
        e
        for e in trie.drain_events()
        if isinstance(e, BlockStored) and e.group_idx == CHECKPOINT_GROUP
    ]
    assert [e.namespace for e in stored] == ["tenant"]
    (slot,) = stored[0].block_ids
    assert trie._events.replayed_checkpoint_slots() == {slot}
    trie.check()
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    assert trie.evict_checkpoints(1) == 1
    removed = [e for e in trie.drain_events() if isinstance(e, BlockRemoved)]
    assert [(e.namespace, e.group_idx, e.block_ids) for e in removed] == [
        ("tenant", CHECKPOINT_GROUP, (slot,))
    ]
    assert trie._events.replayed_checkpoint_slots() == set()
    trie.check()


def test_checkpoint_events_carry_the_exact_chain_hash_parent_and_extra_keys() -> None:
    # "vllm" hashes the namespace into each block (xxh3 takes it from the root only).
    trie, _ = ssm_trie(num_blocks=16, slots=4, block_hash="vllm")
    hasher = BlockHasher("vllm", 0)
    extra = ("img0", "img1", "img2")
    seq = trie.match(list(range(1, 11)), namespace="tenant", extra=extra)
    trie.allocate(seq, 10)
    trie.commit(seq, 10)
    (kv,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    h0, h1 = kv.block_hashes
    assert kv.block_ids[0] == 0  # the anchor below is block 0: `block < 0` is the root test
    trie.save(seq, 2, state(1.0))  # partial tail anchored at the namespace root
    trie.save(seq, 6, state(2.0))  # partial tail (5, 6) past block 0
    trie.save(seq, 8, state(3.0))  # block boundary: block 1, whose parent is block 0
    at_root, past_0, at_1 = [
        e
        for e in trie.drain_events()
        if isinstance(e, BlockStored) and e.group_idx == CHECKPOINT_GROUP
    ]
    keys0, keys1 = extra_keys("img0", "tenant"), extra_keys("img1", "tenant")
    root = hasher.root("tenant")
    assert at_root.block_hashes == (hasher.chain(root, (1, 2), "img0", "tenant"),)
    assert (at_root.parent_block_hash, at_root.token_ids) == (None, (1, 2))
    assert at_root.extra_keys == (keys0,)
    assert past_0.block_hashes == (hasher.chain(h0, (5, 6), "img1", "tenant"),)
    assert (past_0.parent_block_hash, past_0.token_ids) == (h0, (5, 6))
    assert at_1.block_hashes == (h1,)
    assert (at_1.parent_block_hash, at_1.token_ids) == (h0, (5, 6, 7, 8))
    for event in (past_0, at_1):
        assert (event.block_size, event.namespace, event.extra_keys) == (4, "tenant", (keys1,))
    trie.check()


def test_muted_log_publishes_no_checkpoint() -> None:
    trie, _ = ssm_trie(num_blocks=16, slots=2)
    seq = trie.match([1, 2, 3, 4, 5, 6])
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    trie.save(seq, 6, state(1.0))
    trie.drain_events()
    checkpoint = trie._nodes.checkpoint.get(seq.path[0])
    assert checkpoint is not None
    with trie._events.muted():
        trie._events.checkpoint_published(checkpoint, 4)
    assert trie.drain_events() == []


def _log(enabled: bool = True) -> EventLog:
    """A log with a node table of its own (blocks of 2 tokens)."""
    log = EventLog(enabled)
    log.nodes = NodeTable(2, 4)
    return log


def _node(log: EventLog, namespace: str, block: int, host: int = NO_BLOCK) -> Node:
    """A detached node of `log`'s table: block `block`, hash `100 + block`."""
    assert log.nodes is not None
    node = log.nodes.new(
        NO_NODE, pack_tokens([block, block]), block, block, 0, 100 + block, "x", namespace
    )
    log.nodes.host[node] = host
    return node


def _removed(log: EventLog, *blocks: tuple[str, int]) -> None:
    """`log.removed` of evicted blocks given as (namespace, block), hash `100 + block`."""
    log.removed([100 + b for _, b in blocks], [b for _, b in blocks], [ns for ns, _ in blocks])


def test_removed_emits_one_event_per_run_of_one_namespace() -> None:
    log = _log()
    _removed(log, ("", 1), ("", 2), ("t", 3), ("", 4))
    assert log.drain() == [
        BlockRemoved((101, 102), (1, 2), ""),
        BlockRemoved((103,), (3,), "t"),
        BlockRemoved((104,), (4,), ""),
    ]
    log.removed([], [], [])
    assert log.drain() == []


def test_removed_refuses_columns_of_different_lengths() -> None:
    log = _log()
    with pytest.raises(ValueError, match="2 hashes, 1 blocks, 2 namespaces"):
        log.removed([101, 102], [1], ["", ""])
    assert log.drain() == []


def test_a_disabled_or_muted_log_emits_no_removal() -> None:
    off = _log(False)
    _removed(off, ("", 1))
    assert off.drain() == []
    log = _log()
    with log.muted():
        _removed(log, ("", 1))
    assert log.drain() == []
    assert log.enabled


def _stored(trie: BlockTrie, extra: tuple[str, ...] | None = None) -> BlockStored:
    seq = trie.match(list(range(1, 9)), extra=extra)
    trie.allocate(seq, 8)
    trie.commit(seq, 8)
    (event,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    trie.release(seq)
    trie.check()
    return event


def test_a_plain_commit_carries_its_tokens_and_no_extra_keys() -> None:
    event = _stored(kv_trie())
    assert event.token_ids == tuple(range(1, 9))
    assert event.extra_keys is None


def test_a_commit_with_extra_identity_carries_its_tokens_and_extra_keys() -> None:
    event = _stored(kv_trie(), extra=("a", "b"))
    assert event.token_ids == tuple(range(1, 9))
    assert event.extra_keys == (extra_keys("a", ""), extra_keys("b", ""))


def test_a_commit_under_an_injected_key_hash_carries_its_tokens_and_no_extra_keys() -> None:
    event = _stored(kv_trie(key_hash=lambda block: 0))
    assert event.token_ids == tuple(range(1, 9))
    assert event.extra_keys is None


def test_a_namespaced_commit_carries_namespace_and_identity_in_its_extra_keys() -> None:
    trie = kv_trie()
    seq = trie.match(list(range(1, 9)), namespace="t", extra=("a", "b"))
    trie.allocate(seq, 8)
    trie.commit(seq, 8)
    (event,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    assert event.extra_keys == (extra_keys("a", "t"), extra_keys("b", "t"))
    assert event.extra_keys[0] != extra_keys(None, "t")


def test_a_commit_under_block_zero_names_it_as_parent() -> None:
    trie = kv_trie()
    first = _stored_prefix(trie, 4)
    assert first.block_ids == (0,)
    second = _stored_prefix(trie, 8)
    assert second.parent_block_hash == first.block_hashes[0]


def _stored_prefix(trie: BlockTrie, length: int) -> BlockStored:
    seq = trie.match(list(range(1, length + 1)))
    trie.allocate(seq, length)
    trie.commit(seq, length)
    (event,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    trie.release(seq)
    return event


def test_root_hash_is_zero_with_events_off() -> None:
    assert EventLog(False).root_hash("t") == 0
    assert EventLog(True).root_hash("t") == BlockHasher("xxh3", 0).root("t")


def test_removed_from_one_namespace_is_one_event_naming_it() -> None:
    """The one-namespace fast path names the namespace (not None, not the default)."""
    log = _log()
    _removed(log, ("t", 1), ("t", 2))
    assert log.drain() == [BlockRemoved((101, 102), (1, 2), "t")]


def test_a_commit_announces_full_attention_blocks_in_the_device_tier() -> None:
    """A commit's `BlockStored` (built positionally on the hot path) says what vLLM's
    router reads: KV group 0, kind "full_attention", medium "GPU"."""
    event = _stored(kv_trie())
    assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == (
        "GPU",
        0,
        "full_attention",
    )
    assert event.lora_id is None


def test_host_removals_name_hash_host_block_and_namespace() -> None:
    log = _log()
    log.host_removed([_node(log, "t", 1, 7), _node(log, "", 2, 8)])
    assert log.drain() == [
        BlockRemoved((101,), (7,), "t", MEDIUM_CPU),
        BlockRemoved((102,), (8,), "", MEDIUM_CPU),
    ]
    off = _log(False)
    off.host_removed([_node(off, "", 1, 7)])
    assert off.drain() == []


def test_drained_host_events_still_count() -> None:
    log = _log()
    stored = [_node(log, "", 1, 7), _node(log, "", 2, 8)]
    log.host_stored(stored)
    log.back_on_device([_node(log, "", 3)])  # a device event: not a host block
    log.drain()
    assert log.replayed_host_blocks() == {7, 8}
    log.host_removed(stored[:1])
    assert log.replayed_host_blocks() == {8}
    log.drain()
    assert log.replayed_host_blocks() == {8}


def _chain(log: EventLog, namespace: str) -> tuple[Node, Node]:
    """A block under a root and a block with an extra identity under it."""
    t = log.nodes
    assert t is not None
    root = t.new(NO_NODE, None, NO_BLOCK, -1, 0, 50, "root", namespace)
    first = t.new(root, pack_tokens([1, 2]), 1, 1, 0, 101, "x", namespace)
    second = t.new(first, (pack_tokens([3, 4]), "img"), 2, 2, 0, 102, "x", namespace)
    t.host[first], t.host[second] = 7, 8
    return first, second


@pytest.mark.parametrize("namespace", ["", "tenant"])
def test_blocks_moving_between_tiers_are_announced_in_full(namespace: str) -> None:
    log = _log()
    first, second = _chain(log, namespace)
    log.host_stored([first, second])
    log.back_on_device([second])
    t = log.nodes
    assert t is not None

    def event(node: Node, block: int, parent: int | None, medium: str) -> BlockStored:
        extra = t.extra_of(node)
        keys = (extra_keys(extra, namespace),) if namespace or extra else None
        return BlockStored((t.block_hash[node],), (block,), parent, t.tokens_of(node), 2,
                           namespace, medium, KV_GROUP, KIND_FULL_ATTENTION, keys)  # fmt: skip

    assert log.drain() == [
        event(first, 7, None, MEDIUM_CPU),
        event(second, 8, 101, MEDIUM_CPU),
        event(second, 2, 101, MEDIUM_GPU),
    ]


def test_a_freed_device_block_names_its_namespace() -> None:
    log = _log()
    first, _ = _chain(log, "tenant")
    log.removed_blocks(first, 1)
    assert log.drain() == [BlockRemoved((101,), (1,), "tenant")]


@pytest.mark.parametrize(
    ("extra", "key_hash", "tokens"),
    [
        (("a", "b", "c", "d"), None, list(range(1, 17))),  # an extra identity
        (None, lambda block: 0, list(range(1, 17))),  # an injected key hash
        (None, None, [1 << 40, *range(2, 9), 1 << 41, *range(10, 17)]),  # 64-bit ids
    ],
)
def test_a_commit_whose_keys_are_not_plain_names_its_parent_and_namespace(
    extra: tuple[str, ...] | None, key_hash: object, tokens: list[int]
) -> None:
    """The commits recorded as built events (not stored runs) carry the same parent
    hash, namespace, hashes and block ids as a plain commit's."""
    trie = kv_trie(key_hash=key_hash) if key_hash is not None else kv_trie()
    stored: list[BlockStored] = []
    for length in (8, 16):  # the second commit extends the first one's chain
        seq = trie.match(tokens[:length], namespace="t", extra=extra)
        trie.allocate(seq, length)
        trie.commit(seq, length)
        (event,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
        stored.append(event)
        trie.release(seq)
    first, second = stored
    assert first.parent_block_hash is None  # under the root
    assert second.parent_block_hash == first.block_hashes[-1] != 0
    assert first.namespace == second.namespace == "t"
    assert len(second.block_hashes) == len(second.block_ids) == 2
    assert list(second.token_ids) == tokens[8:16]
    trie.check()


def test_a_log_without_its_trie_says_so() -> None:
    log = EventLog(True)
    with pytest.raises(RuntimeError) as info:
        log.host_stored([0])
    assert str(info.value) == "EventLog: the trie has not given it its nodes"


def test_a_muted_log_or_an_empty_run_records_no_stored_block() -> None:
    log = EventLog(True)
    key = pack_tokens(range(4))
    with log.muted():
        log.stored(None, [7], [key], [3], 0, 1, 4, "")
    log.stored(None, [], [key], [3], 1, 1, 4, "")
    assert log.drain() == []
    log.stored(None, [7], [key], [3], 0, 1, 4, "")
    assert [e.block_ids for e in log.drain()] == [(3,)]
