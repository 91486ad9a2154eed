"""Contract details of `cache.eviction.Evictor` (mutation survivors).

Make-room decides feasibility before it evicts anything ([R16], [R17]): the
frozen tail of a checkpoint on an evictable leaf is one block, counted once
(by the leaf's cascade or by the frozen-tail pass, not both), so a request
one block beyond what eviction can free raises `OutOfBlocks` with the cache
unchanged. Freeing a node is refused unless it is an evictable leaf with a
parent, by the node lifecycle's own error naming it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from cache import (
    BlockTrie,
    CacheConfig,
    IllegalTransition,
    ManualCopies,
    OutOfBlocks,
    Sequence,
    eviction,
)
from cache.keys import pack_tokens
from cache.node import NO_BLOCK, NO_CHILD, NO_NODE, state_code
from spec.errors import InvariantViolation
from spec.lifecycle import NODE, NodeState, NodeTrigger, Residency
from tests.helpers import (
    NodeRef,
    frozen,
    hit,
    refused_changing_nothing,
    root_of,
    serve,
    ssm_trie,
    state,
)


def _prefill(trie: BlockTrie, tokens: list[int]) -> Sequence:
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def test_a_leafs_frozen_tail_is_counted_once_when_room_is_planned() -> None:
    """One evictable leaf with a partial checkpoint: 2 blocks reclaimable (the
    leaf's and its frozen tail), so 3 short fails at once and 2 short succeeds."""
    trie, _ = ssm_trie(num_blocks=8, manual=False)
    seq = _prefill(trie, [1] * 5)  # leaf L (block 0) and a private partial block
    trie.save(seq, 5, state(1.0))  # on L, with a frozen tail block
    trie.release(seq)  # L evictable; the partial block is free again
    hog = trie.match([2] * 4 * trie.num_free_blocks)
    trie.allocate(hog, len(hog.tokens))  # private blocks: not reclaimable
    assert trie.num_free_blocks == 0
    assert trie.num_evictable_blocks == 1
    hungry = trie.match([4] * 12)
    before = frozen(trie.snapshot())
    with pytest.raises(OutOfBlocks, match=r"^need 3 KV blocks: 0 free and fewer than 3 "):
        trie.allocate(hungry, 12)
    assert frozen(trie.snapshot()) == before, "nothing was evicted before failing"
    trie.allocate(hungry, 8)  # 2 blocks: the leaf's and its frozen tail
    assert trie.stats.evicted_blocks == 2
    assert trie.stats.evicted_checkpoints == 1
    assert trie.num_cached_blocks == 0
    trie.abort(hungry)
    trie.abort(hog)
    trie.check()


def test_attached_node_states_route_to_one_another() -> None:
    """Why `settle` never meets a missing route (the subject passed to the spec's
    route and step is only formatted for one: accepted equivalent mutants)."""
    attached = [
        NodeState.CACHED.value,
        NodeState.EVICTABLE.value,
        NodeState.PINNED.value,
        NodeState.OFFLOADED.value,  # with a host tier
    ]
    assert all((a, b) in NODE.routes for a in attached for b in attached)


def test_a_parent_is_reclaimable_once_all_its_children_are() -> None:
    """Two evictable leaves under one parent free three blocks: the parent becomes
    an evictable leaf when its second child goes, and make-room plans for that."""
    trie, _ = ssm_trie(num_blocks=8, manual=False)
    for tokens in ([1] * 4 + [2] * 4, [1] * 4 + [3] * 4):
        trie.release(_prefill(trie, tokens))
    assert trie.num_cached_blocks == 3
    assert trie.num_evictable_blocks == 2  # the two leaves; the parent is inner
    hog = trie.match([5] * 4 * trie.num_free_blocks)
    trie.allocate(hog, len(hog.tokens))
    hungry = trie.match([4] * 16)
    before = frozen(trie.snapshot())
    with pytest.raises(OutOfBlocks, match=r"^need 4 KV blocks: 0 free and fewer than 4 "):
        trie.allocate(hungry, 16)
    assert frozen(trie.snapshot()) == before
    trie.allocate(hungry, 12)
    assert trie.stats.evicted_blocks == 3
    assert trie.num_cached_blocks == 0
    trie.abort(hungry)
    trie.abort(hog)
    trie.check()


def _inner_and_pinned(trie: BlockTrie) -> tuple[NodeRef, NodeRef]:
    """A cached inner node (no checkpoint) and a pinned leaf (its save in flight)."""
    seq = _prefill(trie, [1] * 8 + [9])
    trie.save(seq, 8, state(1.0))  # ManualCopies: the copy's pin stays
    trie.release(seq)
    inner = root_of(trie).child_nodes()[0]
    (leaf,) = inner.child_nodes()
    return inner, leaf


def test_freeing_a_node_that_is_not_evictable_is_the_node_lifecycles_error() -> None:
    """The guard on eviction itself ([R23]): the spec's `free` is illegal from
    anything but `evictable`, the error names the node, and nothing changes."""
    trie, _ = ssm_trie()
    inner, leaf = _inner_and_pinned(trie)
    assert (inner.state, leaf.state) == ("cached", "pinned")
    for node in (inner, leaf):
        refused_changing_nothing(
            trie, partial(trie._evictor._free, node.id), ("node", "free", node.state), node
        )


def test_an_evictable_node_without_a_parent_is_a_topology_violation() -> None:
    trie, _ = ssm_trie()
    orphan = trie._nodes.new(
        NO_NODE, pack_tokens([1, 2, 3, 4]), 0, 7, 0, 0, NodeState.EVICTABLE.value, ""
    )
    with pytest.raises(InvariantViolation) as info:
        trie._evictor._free(orphan)
    assert info.value.invariant == "topology"
    assert info.value.detail == f"evictable {trie._nodes.describe(orphan)} has no parent"


def test_an_evicted_node_is_left_freed_and_detached() -> None:
    """A reference kept to an evicted node (from inspection, say) shows the
    node lifecycle's final state and no parent."""
    trie, _ = ssm_trie()
    trie.release(_prefill(trie, [1] * 8 + [9]))
    inner = root_of(trie).child_nodes()[0]
    (leaf,) = inner.child_nodes()
    assert trie.evict(2) == 2
    for node in (inner, leaf):
        assert node.state == NodeState.FREED.value
        assert node.parent is None
    trie.check()


def _host_trie(**kw: object) -> tuple[BlockTrie, ManualCopies]:
    """An attention-only trie with a host tier and ManualCopies (blocks of 2 tokens)."""
    config = CacheConfig(
        block_size=2,
        num_blocks=8,
        num_host_blocks=16,
        kv_block_shape=(2,),
        kv_dtype=torch.float64,
        enable_events=True,
        **kw,  # type: ignore[arg-type]
    )
    copies = ManualCopies()
    return BlockTrie(config, copies=copies), copies


def test_a_failed_load_gives_its_block_back_and_its_parent_is_a_device_leaf_again() -> None:
    """[R50]: a load that fails detaches the device block it was given: the block no
    longer counts as cached, and the parent, whose only child lives on the host
    again, is an evictable device leaf at once (no request holds it)."""
    trie, copies = _host_trie()
    trie.release(_prefill(trie, [1, 1, 2, 2, 9]))
    trie.release(_prefill(trie, [7, 7, 9]))  # a newer leaf, left alone
    copies.complete_all()  # the write-through stores
    trie.poll()
    assert trie.evict(1) == 1  # the leaf (2, 2) is offloaded; (1, 1) is a device leaf
    assert (trie.num_cached_blocks, trie.num_evictable_blocks) == (2, 2)
    hit = trie.match([1, 1, 2, 2, 9])
    assert (hit.num_cached_tokens, hit.num_host_tokens) == (4, 2)
    load = trie.load(hit)
    assert load is not None
    trie.release(hit)  # the load keeps its references until it is reaped
    (parent,) = [n for n in root_of(trie).child_nodes() if n.child_count()]  # (1, 1)
    assert parent.state == NodeState.CACHED.value  # its child is back on the device
    assert (trie.num_cached_blocks, trie.num_evictable_blocks) == (3, 1)
    copies.fail(load)
    assert trie.poll() == 1
    (child,) = parent.child_nodes()
    assert (child.residency, child.block) == (Residency.HOST.value, NO_BLOCK)
    assert parent.state == NodeState.EVICTABLE.value
    assert (trie.num_cached_blocks, trie.num_evictable_blocks) == (2, 2)
    trie.check()


def test_write_back_without_a_host_tier_frees_the_leaf_outright() -> None:
    """The write-back guard: with no host tier no store is begun (the leaf is freed
    as without write-back); the default store hook says why it cannot run."""
    trie, _ = ssm_trie()
    evictor = trie._evictor
    with pytest.raises(InvariantViolation) as info:
        evictor.queue_write_back([])
    assert info.value.invariant == "host tier"
    assert info.value.detail == "a write-back store with no host tier to queue it"
    trie.release(_prefill(trie, [1] * 4))
    evictor.write_back = True
    assert trie.evict(1) == 1
    assert trie.num_cached_blocks == 0
    assert trie.stats.evicted_blocks == 1
    trie.check()


def test_a_write_back_holds_its_leaf_by_a_legal_share() -> None:
    """Why starting a write-back never meets an illegal step: the leaf it holds is
    `evictable` (from the index, or the idle-chain parent just made so), and
    `share` is legal from there (the subject passed to the step is only formatted
    for an illegal one: accepted equivalent mutants)."""
    assert NODE.table[(NodeTrigger.SHARE.value, NodeState.EVICTABLE.value)] == "cached"


def _mirrored_leaf(trie: BlockTrie, copies: ManualCopies) -> NodeRef:
    """An evictable leaf whose write-through store has finished (`mirrored`)."""
    trie.release(_prefill(trie, [1, 1, 9]))
    copies.complete_all()
    trie.poll()
    (leaf,) = root_of(trie).child_nodes()
    assert (leaf.state, leaf.residency) == ("evictable", Residency.MIRRORED.value)
    return leaf


def test_offloading_a_leaf_with_no_host_copy_is_the_residency_lifecycles_error() -> None:
    """[R48]: only a `mirrored` leaf is offloaded; from any other residency the
    spec's `offload` is illegal, the error names the node, and nothing changes."""
    trie, _ = _host_trie(host_write="back")
    trie.release(_prefill(trie, [1, 1, 9]))  # write-back: no store yet
    (leaf,) = root_of(trie).child_nodes()
    assert (leaf.state, leaf.residency) == ("evictable", Residency.DEVICE.value)
    refused_changing_nothing(
        trie,
        lambda: trie._evictor._offload(leaf.id),
        ("residency", "offload", leaf.residency),
        leaf,
    )


def test_offloading_a_leaf_in_use_is_the_node_lifecycles_error() -> None:
    """A mirrored leaf a request holds (`cached`) is not offloaded: the spec's
    `offload` is illegal from anything but `evictable`, naming the node."""
    trie, copies = _host_trie()
    leaf = _mirrored_leaf(trie, copies)
    seq = trie.match([1, 1, 9])
    assert leaf.state == NodeState.CACHED.value
    refused_changing_nothing(
        trie, lambda: trie._evictor._offload(leaf.id), ("node", "offload", "cached"), leaf
    )
    trie.release(seq)
    trie.check()


def test_offloading_without_a_host_tier_is_a_residency_violation() -> None:
    trie, copies = _host_trie()
    leaf = _mirrored_leaf(trie, copies)
    evictor = trie._evictor
    host, evictor.host = evictor.host, None
    before = frozen(trie.snapshot())
    with pytest.raises(InvariantViolation) as info:
        evictor._offload(leaf.id)
    assert info.value.invariant == "residency"
    assert info.value.detail == f"{leaf!r} is offloaded without a host tier"
    evictor.host = host
    assert frozen(trie.snapshot()) == before
    trie.check()


def test_out_of_blocks_says_what_eviction_could_free_and_what_write_back_will() -> None:
    """[R16], [R52]: the two `OutOfBlocks` of make-room, word for word: nothing
    reclaimable (with the blocks write-back stores in flight will free, when
    there are any), and room that only finished write-back stores can make."""
    trie, _ = ssm_trie(num_blocks=4, manual=False)
    hog = trie.match([2] * 16)
    trie.allocate(hog, 16)
    with pytest.raises(OutOfBlocks) as info:
        trie.allocate(trie.match([3] * 4), 4)
    assert str(info.value) == (
        "need 1 KV blocks: 0 free and fewer than 1 reclaimable by eviction (capacity 4)"
    )
    trie.abort(hog)

    trie, copies = _host_trie(host_write="back")
    for tokens in ([1, 1, 9], [2, 2, 9]):
        trie.release(_prefill(trie, tokens))
    hog = trie.match([5] * 2 * trie.num_free_blocks)
    trie.allocate(hog, len(hog.tokens))
    assert (trie.num_free_blocks, trie.num_evictable_blocks) == (0, 2)
    hungry = trie.match([7] * 6)
    with pytest.raises(OutOfBlocks) as info:
        trie.allocate(hungry, 4)  # both leaves' stores queued, neither finished
    assert str(info.value) == (
        "need 2 KV blocks: 0 free; 2 more are freed when the write-back stores in "
        "flight finish (complete them, poll, retry)"
    )
    assert len(copies.pending()) == 1  # one store for both leaves
    with pytest.raises(OutOfBlocks) as info:
        trie.allocate(hungry, 6)
    assert str(info.value) == (
        "need 3 KV blocks: 0 free and fewer than 3 reclaimable by eviction (capacity 8); "
        "2 more are freed when the write-back stores in flight finish"
    )
    copies.complete_all()
    trie.poll()
    trie.allocate(hungry, 4)
    trie.abort(hungry)
    trie.abort(hog)
    trie.check()


def test_offloading_a_leaf_frees_its_checkpoints_frozen_tail_too() -> None:
    """[R48]: an offloaded leaf keeps its host copy but no checkpoint (checkpoints
    of this trie live on the device only): its block and its checkpoint's frozen
    tail are both freed, and counted."""
    trie, copies = ssm_trie(num_blocks=8, num_host_blocks=16)
    assert copies is not None
    seq = _prefill(trie, [1] * 5)  # leaf L and a private partial block
    trie.save(seq, 5, state(1.0))  # on L, with a frozen tail block
    copies.complete_all()  # L's write-through store and the save
    trie.poll()
    trie.release(seq)
    (leaf,) = root_of(trie).child_nodes()
    assert (leaf.state, leaf.residency) == ("evictable", Residency.MIRRORED.value)
    assert trie.num_free_blocks == 6
    block = leaf.block
    assert trie.evict(1) == 2
    assert (leaf.state, leaf.residency) == ("offloaded", Residency.HOST.value)
    assert leaf.checkpoint is None
    assert (trie.stats.evicted_blocks, trie.stats.evicted_checkpoints) == (2, 1)
    assert (trie.num_free_blocks, trie.num_cached_blocks) == (8, 0)
    trie.check()
    # The block no longer has an owner: a copy that holds it, taken again as a
    # request's private block, settles nothing when it is reaped.
    other = _hold_in_a_save_copy(trie, copies, block)
    trie.release(other)
    trie.check()


def _hold_in_a_save_copy(trie: BlockTrie, copies: ManualCopies, block: int) -> Sequence:
    """A new request whose one private block is `block` (the only free one taken), a save
    copy reading it, completed and reaped; returns the request, still live."""
    other = trie.match([2] * 3)
    trie.allocate(other, 3)
    assert other.block_ids == (block,)
    trie.save(other, 3, state(2.0))  # its copy reads the block
    copies.complete_all()
    assert trie.poll() == 1
    return other


def test_a_freed_block_has_no_owner_left_to_settle() -> None:
    """An evicted leaf's block, taken again as a request's private block and held
    by a copy, settles no node when that copy is reaped (its owner went with it)."""
    trie, copies = ssm_trie(num_blocks=8)
    assert copies is not None
    trie.release(_prefill(trie, [1] * 4))
    (leaf,) = root_of(trie).child_nodes()
    block = leaf.block
    assert trie.evict(1) == 1
    other = _hold_in_a_save_copy(trie, copies, block)
    assert leaf.state == NodeState.FREED.value
    trie.release(other)
    trie.check()


def test_write_back_stores_only_as_many_leaves_as_asked() -> None:
    """[R52], [R23]: evicting n blocks in write-back mode chooses the n oldest leaves
    and queues one store for them; the others stay evictable on the device."""
    trie, copies = _host_trie(host_write="back")
    for tokens in ([1, 1, 9], [2, 2, 9], [3, 3, 9]):
        trie.release(_prefill(trie, tokens))
    assert trie.num_evictable_blocks == 3
    assert trie.evict(1) == 0  # its store is queued: freed when it finishes
    (store,) = copies.pending()
    assert [trie._nodes.block[n] for n in store.nodes] == [0]  # the oldest leaf
    assert (trie.num_evictable_blocks, trie.num_free_blocks) == (2, 5)
    copies.complete_all()
    assert trie.poll() == 1
    assert (trie.num_evictable_blocks, trie.num_free_blocks) == (2, 6)
    assert trie.stats.evicted_blocks == 1
    trie.check()

    # Stores that finish when queued (CPU copies) free at once: still one leaf.
    trie = BlockTrie(trie.config)
    for tokens in ([1, 1, 9], [2, 2, 9], [3, 3, 9]):
        trie.release(_prefill(trie, tokens))
    assert trie.evict(1) == 1
    assert (trie.num_evictable_blocks, trie.num_free_blocks) == (2, 6)
    assert trie.stats.stored_blocks == 1
    trie.check()


def test_make_room_frees_leaves_then_only_the_frozen_tails_still_short() -> None:
    """[R17]: the leaves eviction frees count toward the room; the frozen-tail pass
    then evicts only the blocks still short (least recent first), and both count in
    `stats.evicted_blocks`."""
    trie, _ = ssm_trie(num_blocks=8, manual=False)
    prompt = [1] * 4 + [2] * 4 + [3] * 2
    held = _prefill(trie, prompt)  # 2 cached blocks and a private partial one, held
    trie.save(held, 5, state(1.0))  # a frozen tail on the inner node
    trie.save(held, 10, state(2.0))  # a frozen tail on the held leaf
    trie.release(_prefill(trie, [7] * 4))  # one evictable leaf
    assert (trie.num_free_blocks, trie.num_evictable_blocks) == (2, 1)
    hungry = trie.match([9] * 16)
    trie.allocate(hungry, 16)  # 4 blocks: 2 free, the leaf's, one frozen tail
    assert trie.num_free_blocks == 0
    assert (trie.stats.evicted_blocks, trie.stats.evicted_checkpoints) == (2, 1)
    assert trie.num_cached_blocks == 2, "the held nodes stay"
    trie.release(held)
    assert trie.match([*prompt[:5], 7]).num_cached_tokens == 0  # step 5's went
    assert trie.match([*prompt, 7]).num_cached_tokens == 10  # step 10's stays
    trie.abort(hungry)
    trie.check()


def test_write_back_eviction_counts_the_stores_it_has_begun_toward_its_budget() -> None:
    """[R52], [R23]: a leaf whose write-back store is begun counts toward the blocks
    asked for: evicting 2 stores the oldest leaf and offloads the next (mirrored),
    and the parent that offload leaves a device leaf stays, evictable."""
    trie, copies = _host_trie(host_write="back")
    device = _prefill(trie, [7, 7, 9])  # D, held while M is written back
    trie.release(_prefill(trie, [1, 1, 2, 2, 9]))  # P -> M
    assert trie.evict(1) == 0  # M's store queued
    again = trie.match([1, 1, 2, 2, 9])  # holds M: it stays when its store finishes
    copies.complete_all()
    trie.poll()
    parent = next(n for n in root_of(trie).child_nodes() if n.child_count())
    (mirrored,) = parent.child_nodes()
    assert mirrored.residency == Residency.MIRRORED.value
    (oldest,) = [n for n in root_of(trie).child_nodes() if n != parent]
    trie.release(device)  # D, older than M
    trie.release(again)
    assert trie.num_evictable_blocks == 2
    assert trie.evict(2) == 1  # M offloaded; D's store queued
    (store,) = copies.pending()
    assert store.nodes == [oldest.id]
    assert mirrored.residency == Residency.HOST.value
    assert parent.state == NodeState.EVICTABLE.value
    copies.complete_all()
    trie.poll()
    trie.check()


def test_write_back_eviction_counts_the_stores_finished_in_earlier_rounds() -> None:
    """[R52], [R23]: blocks freed by write-back stores that finished when queued count
    toward the blocks asked for in the rounds after: evicting 2 stores the leaf, then
    offloads its parent (a mirrored device leaf now), and the grandparent that leaves
    a device leaf stays on the device, evictable."""
    trie = BlockTrie(_host_trie(host_write="back")[0].config)  # stores finish when queued
    trie.release(_prefill(trie, [1, 1, 2, 2, 9]))
    assert trie.evict(1) == 1  # (2, 2) written back and offloaded
    hit = trie.match([1, 1, 2, 2, 3, 3, 9])
    load = trie.load(hit)
    assert load is not None
    trie.poll()  # (2, 2) loaded: mirrored
    trie.allocate(hit, 7)
    trie.commit(hit, 7)  # (3, 3) under it, on the device only
    trie.release(hit)
    grand = root_of(trie).child_nodes()[0]
    (mirrored,) = grand.child_nodes()
    assert mirrored.residency == Residency.MIRRORED.value
    assert trie.evict(2) == 2  # (3, 3) stored and offloaded, then (2, 2) offloaded
    assert mirrored.residency == Residency.HOST.value
    assert (grand.residency, grand.state) == (Residency.DEVICE.value, "evictable")
    trie.check()


def test_adopt_all_refuses_nodes_and_blocks_of_different_lengths() -> None:
    """`adopt_all` pairs nodes with blocks by index (not a strict zip), so it checks
    their lengths itself, before it records an owner or counts a cached node."""
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4, kv_block_shape=None))
    evictor = trie._evictor
    owners, cached = list(evictor.owner), evictor.num_cached
    with pytest.raises(ValueError, match="2 nodes for 1 blocks"):
        evictor.adopt_all([1, 2], [0])
    assert (list(evictor.owner), evictor.num_cached) == (owners, cached)


def _attention_chain(blocks: int) -> tuple[BlockTrie, list[int]]:
    """An attention-only trie (no host tier: eviction's inlined path) holding one idle
    chain of `blocks` blocks; returns it and the chain's node ids, root side first."""
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=8, kv_block_shape=None))
    trie.release(_prefill(trie, list(range(1, 2 * blocks + 2))))
    chain: list[int] = []
    node = root_of(trie)
    while node.child_nodes():
        (node,) = node.child_nodes()
        chain.append(node.id)
    assert len(chain) == blocks
    return trie, chain


def test_inlined_eviction_frees_a_whole_chain_as_the_methods_would() -> None:
    """Each parent's new state comes from the memo, or (a miss) from `_implied`.
    With the memo emptied just before, every lookup misses; warmed with the states
    of facts next to the parent's (a pin, off the device, no reference), a lookup
    built from a wrong fact would hit one of them. Either way the chain goes leaf
    first, in one pass, and its last node is left evictable."""
    cached = state_code(NodeState.CACHED.value)
    neighbours = [
        (cached, True, 1, 1, True),
        (cached, True, 1, 0, False),
        (cached, True, 0, 0, False),
    ]
    for warm in (False, True):
        trie, chain = _attention_chain(3)
        eviction._SETTLED.clear()
        if warm:
            for facts in neighbours:
                eviction._settled("warm-up", *facts)
        assert trie.evict(2) == 2  # the leaf, then its parent, older than nothing indexed
        t = trie._nodes
        assert [t.parent[node] for node in chain[1:]] == [NO_NODE, NO_NODE]  # freed rows
        assert t.child[chain[0]] == NO_CHILD  # the survivor is a leaf now
        assert trie.num_cached_blocks == 1 and trie.stats.evicted_blocks == 2
        assert root_of(trie).child_nodes()[0].state == "evictable"  # settled and indexed
        trie.check()
        assert eviction._SETTLED  # memoized again


def test_inlined_eviction_leaves_a_held_parent_cached_on_a_memo_miss() -> None:
    """A parent another request holds stays `cached` when its leaf is evicted, also
    when its facts are not memoized yet (the derivation decides, not a default)."""
    trie, chain = _attention_chain(3)
    holder = trie.match([1, 2, 3, 4, 99])  # holds the first two blocks
    assert holder.num_cached_tokens == 4
    eviction._SETTLED.clear()
    assert trie.evict(1) == 1
    t = trie._nodes
    assert t.parent[chain[2]] == NO_NODE and t.child[chain[1]] == NO_CHILD
    assert t.state[chain[1]] == state_code(NodeState.CACHED.value)
    assert chain[1] not in trie._evictor.index
    trie.check()
    trie.release(holder)
    trie.check()


def test_inlined_eviction_refuses_an_indexed_node_that_is_not_evictable() -> None:
    """A leaf the index holds but whose state is not `evictable` (a corrupted index) is
    the node lifecycle's `free` error, as `_free` raises it; an indexed leaf without
    a parent is a topology violation."""
    trie, chain = _attention_chain(2)
    leaf = chain[-1]
    cached = NodeState.CACHED.value
    trie._nodes.state[leaf] = state_code(cached)
    with pytest.raises(IllegalTransition) as info:
        trie.evict(1)
    assert (info.value.machine, info.value.trigger, info.value.state) == ("node", "free", cached)

    trie, chain = _attention_chain(2)
    trie._nodes.parent[chain[-1]] = NO_NODE
    with pytest.raises(InvariantViolation) as topology:
        trie.evict(1)
    assert topology.value.invariant == "topology"


def _parent_touched_after_an_unrelated_leaf(trie: BlockTrie) -> None:
    """Parent P and child C, then leaf L, then P used again, then leaf D, the newest."""
    serve(trie, [1, 1, 1, 1, 2, 2, 2, 2])  # P and C
    serve(trie, [3, 3, 3, 3])  # L
    serve(trie, [1, 1, 1, 1])  # P touched again (C is not)
    serve(trie, [5, 5, 5, 5])  # D


def _evicting_two_takes_the_child_then_the_older_leaf(trie: BlockTrie) -> None:
    assert trie.evict(2) == 2  # C (the oldest leaf), then L (older than P)
    assert hit(trie, [1, 1, 1, 1, 2, 2, 2, 2, 9]) == 4  # P stays, C is gone
    assert hit(trie, [3, 3, 3, 3, 9]) == 0  # L went before P
    assert hit(trie, [5, 5, 5, 5, 9]) == 4
    trie.check()


@pytest.mark.parametrize("events", [False, True])
def test_a_freed_leafs_parent_goes_next_only_if_it_is_older_than_every_indexed_leaf(
    events: bool,
) -> None:
    """[R10] through eviction's chain shortcut: when freeing a leaf makes its parent
    evictable, the parent is freed in the same step only if no indexed leaf is older
    (by tick, then serial); else it waits its turn in the index. Here the parent was
    touched after an unrelated leaf, so evicting two blocks takes the child and that
    leaf, and the parent stays cached."""
    trie = BlockTrie(
        CacheConfig(block_size=4, num_blocks=8, kv_block_shape=None, enable_events=events)
    )
    _parent_touched_after_an_unrelated_leaf(trie)
    _evicting_two_takes_the_child_then_the_older_leaf(trie)


def test_a_row_freed_with_a_wide_key_reads_as_the_block_that_reuses_it() -> None:
    """`Evictor._free` (the path eviction takes once a checkpoint exists) gives a
    freed row back without the wide key it held (64-bit token ids are kept apart
    from the packed uint32 keys): a plain block that reuses the row reads as its own
    tokens, not as those of the block that held the row before, and is matched."""
    trie, _ = ssm_trie(num_blocks=8, manual=False)
    keep = _prefill(trie, [1] * 5)
    trie.save(keep, 5, state(1.0))  # a checkpoint, held: eviction leaves its inline form
    wide = _prefill(trie, [2**40] * 4 + [3] * 4)  # a block whose key is wide, and a child
    trie.release(wide)
    assert trie._nodes.wide  # (where a 64-bit key is kept)
    assert trie.evict(2) == 2  # both, through `_free`
    plain = _prefill(trie, [5] * 8)  # takes the rows back, most recently freed first
    trie.save(plain, 8, state(2.0))  # (a hybrid hit ends at a checkpoint)
    trie.release(plain)
    keys = [v["key"] for v in trie.snapshot()["nodes"].values() if v["key"] is not None]
    assert sorted(list(tokens) for tokens, _ in keys) == [[1] * 4, [5] * 4, [5] * 4]
    again = trie.match([5] * 8 + [9])
    assert again.num_cached_tokens == 8
    trie.abort(again)
    trie.abort(keep)
    trie.check()


def test_the_parent_shortcut_compares_with_the_oldest_leaf_wherever_rows_lie() -> None:
    """[R10] as above, in a table whose every row is in use and whose last row holds
    the newest leaf: the parent is compared with the oldest indexed leaf, not with
    whatever node a row index happens to name, so it still waits its turn."""
    trie = BlockTrie(CacheConfig(block_size=4, num_blocks=4, kv_block_shape=None))
    for i in range(1, 8):  # seven more namespaces: their roots fill the spare rows
        serve(trie, [7] * 4, f"n{i}")
    trie.evict(4)
    _parent_touched_after_an_unrelated_leaf(trie)
    t = trie._nodes
    assert t.fresh == t.capacity and not t.free_rows  # every row in use
    assert t.tokens_of(t.capacity - 1) == (5, 5, 5, 5)  # the last row holds D
    _evicting_two_takes_the_child_then_the_older_leaf(trie)
