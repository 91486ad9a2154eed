"""The host-memory tier ([R47]-[R51]): store, offload, load, adopt, host eviction.

Every KV block here holds its own token ids as float64, so a block read after a
round trip through the host tier is checked bit for bit against the tokens it
claims to hold.
"""

from __future__ import annotations

import re
import warnings
from types import FrameType

import pytest
import torch

import cache.config
from cache import (
    BlockTrie,
    CacheConfig,
    ConfigError,
    Copy,
    HostTierError,
    HostTierUnusedWarning,
    InvalidArgument,
    ManualCopies,
    OutOfBlocks,
    Sequence,
)
from cache.events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, replay
from spec.invariants import rollback
from spec.lifecycle import NodeState, Residency
from tests.helpers import NodeRef, hit, refused_changing_nothing, root_of

B = 2


def host_trie(
    num_blocks: int = 8, host_blocks: int = 16, manual: bool = False, **kw: object
) -> tuple[BlockTrie, ManualCopies | None]:
    """An attention-only trie with a host tier; KV blocks hold float64 token ids."""
    kw.setdefault("enable_events", True)
    config = CacheConfig(
        block_size=B,
        num_blocks=num_blocks,
        num_host_blocks=host_blocks,
        kv_block_shape=(B,),
        kv_dtype=torch.float64,
        **kw,  # type: ignore[arg-type]
    )
    copies = ManualCopies() if manual else None
    return BlockTrie(config, copies=copies), copies


def compute(trie: BlockTrie, seq: Sequence, tokens: list[int]) -> None:
    """What prefill does: write the KV of every uncached full block."""
    kv = trie.kv_cache
    assert kv is not None
    for i in range(seq.num_cached_tokens // B, len(tokens) // B):
        kv[seq.block_ids[i]] = torch.tensor(tokens[i * B : (i + 1) * B], dtype=torch.float64)


def assert_reads(trie: BlockTrie, seq: Sequence, tokens: list[int]) -> None:
    """Every cached block of `seq` holds exactly its tokens."""
    kv = trie.kv_cache
    assert kv is not None
    for i in range(seq.num_cached_tokens // B):
        assert kv[seq.block_ids[i]].tolist() == tokens[i * B : (i + 1) * B], f"block {i}"


def serve(trie: BlockTrie, tokens: list[int]) -> Sequence:
    """match, load, wait, check the hit's data, allocate, compute, commit, release."""
    seq = trie.match(tokens)
    copy = trie.load(seq)
    if copy is not None:
        copy.wait()
        trie.poll()
    assert_reads(trie, seq, tokens)
    trie.allocate(seq, len(tokens))
    compute(trie, seq, tokens)
    trie.commit(seq, len(tokens))
    trie.release(seq)
    trie.poll()
    trie.check()
    return seq


def residency(trie: BlockTrie) -> dict[tuple[int, ...], str]:
    """Each attached node's residency, by its tokens."""
    snap = trie.snapshot()
    return {
        tuple(n["key"][0]): n["residency"]  # type: ignore[index]
        for n in snap["nodes"].values()
        if n["parent"] is not None
    }


A = [1, 1, 2, 2, 3, 3, 9]  # three full blocks and one token
OTHER = [5, 5, 6, 6, 7, 7, 8, 8, 9]


def test_config_validates_the_host_tier() -> None:
    with pytest.raises(ConfigError, match="num_host_blocks"):
        CacheConfig(block_size=2, num_blocks=4, num_host_blocks=-1)
    with pytest.raises(ConfigError, match="host_write"):
        CacheConfig(block_size=2, num_blocks=4, num_host_blocks=4, host_write="around")
    with pytest.raises(ConfigError, match="num_checkpoint_slots=0"):
        CacheConfig(
            block_size=2, num_blocks=4, num_host_blocks=4, host_write="back", num_checkpoint_slots=1
        )
    assert not CacheConfig(block_size=2, num_blocks=4).host_tier
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    assert trie.num_free_host_blocks == 0 and trie.host_cache is None
    assert trie.evict_host(3) == 0
    seq = trie.match([1, 2, 3])
    assert seq.num_host_tokens == 0 and trie.load(seq) is None


def test_commit_writes_through_and_device_eviction_keeps_the_host_copy() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    assert trie.num_host_cached_blocks == 3 and trie.stats.stored_blocks == 3
    assert set(residency(trie).values()) == {Residency.MIRRORED.value}
    assert trie.evict(3) == 3
    assert trie.num_cached_blocks == 0
    assert set(residency(trie).values()) == {Residency.HOST.value}
    assert trie.num_evictable_host_blocks == 1  # only the deepest is a host leaf
    trie.check()


def test_round_trip_returns_bit_identical_kv() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    host = trie.host_cache
    assert host is not None
    trie.evict(3)
    trie.kv_cache.fill_(-1.0)  # type: ignore[union-attr]  # the device copies are gone
    seq = trie.match(A)
    assert (seq.num_cached_tokens, seq.num_host_tokens) == (6, 6)
    assert len(seq.block_ids) == 0
    copy = trie.load(seq)
    assert copy is not None and (copy.kind, copy.step) == ("load", 0)
    trie.poll()
    assert len(seq.block_ids) == 3
    assert_reads(trie, seq, A)
    assert trie.stats.loaded_blocks == 3 and trie.stats.host_hit_tokens == 6
    assert set(residency(trie).values()) == {Residency.MIRRORED.value}
    trie.release(seq)
    trie.check()


def committed_with_its_store_pending(**kw: object) -> tuple[BlockTrie, ManualCopies, Copy]:
    """A trie (ManualCopies) where A was committed and released; its store is queued."""
    trie, copies = host_trie(manual=True, **kw)
    assert copies is not None
    seq = trie.match(A)
    trie.allocate(seq, len(A))
    compute(trie, seq, A)
    trie.commit(seq, len(A))
    trie.release(seq)
    (store,) = copies.pending()
    assert store.kind == "store"
    assert repr(store) == f"<Copy #{store.serial} store step=0 queued>"  # no token step
    return trie, copies, store


def test_store_and_load_copies_name_every_block_they_touch() -> None:
    """`Copy.resources` (built on first use from the copy's id lists) names each
    device block and host block a store or load reads or writes, and a load
    also the device blocks of the loads it is ordered after."""
    trie, copies, store = committed_with_its_store_pending()
    nodes = trie.snapshot()["nodes"].values()
    pairs = [(n["block"], n["block_host"]) for n in nodes if n["block"] is not None]
    assert len(pairs) == 3
    expected = {("block", d) for d, _ in pairs} | {("host_block", h) for _, h in pairs}
    assert store.resources == expected
    assert store.resources is store.resources  # built once
    copies.complete(store)
    trie.poll()
    assert trie.evict(10) == 3
    seq = trie.match(A)
    load = trie.load(seq)
    assert load is not None and load.kind == "load"
    device = seq.block_ids[:3]
    hosts = [h for _, h in pairs]
    assert load.resources == {("block", b) for b in device} | {("host_block", h) for h in hosts}
    copies.complete(load)
    trie.poll()
    trie.release(seq)
    trie.check()


def test_a_storing_block_is_not_evictable_nor_loadable_until_its_copy_is_reaped() -> None:
    trie, copies, store = committed_with_its_store_pending()
    assert set(residency(trie).values()) == {Residency.STORING.value}
    assert trie.evict(10) == 0  # the store copy reads every device block
    trie.check()
    copies.complete(store)
    assert trie.evict(10) == 0  # finished but not reaped: still held
    trie.poll()
    assert trie.evict(10) == 3
    trie.check()


def test_a_failed_store_leaves_the_block_device_only() -> None:
    trie, copies, store = committed_with_its_store_pending()
    copies.fail(store)
    trie.poll()
    assert set(residency(trie).values()) == {Residency.DEVICE.value}
    assert trie.num_free_host_blocks == 16 and trie.stats.copies_failed == 1
    assert trie.evict(10) == 3  # freed outright: no host copy to keep
    assert trie.num_host_cached_blocks == 0
    trie.check()


def test_two_requests_share_one_load() -> None:
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    trie.evict(10)
    first, second = trie.match(A), trie.match(A)
    copy = trie.load(first)
    assert copy is not None
    assert second.num_host_tokens == 6
    assert trie.load(second) is copy  # the same copy: no second load
    assert len(copies.pending()) == 1
    trie.check()
    copies.complete(copy)
    trie.poll()
    assert trie.stats.loaded_blocks == 3
    assert_reads(trie, first, A)
    assert_reads(trie, second, A)
    trie.release(first)
    trie.release(second)
    trie.check()


def test_a_request_matching_a_block_being_loaded_waits_on_that_copy() -> None:
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    trie.evict(10)
    first = trie.match(A)
    copy = trie.load(first)
    longer = [*A[:6], 4, 4, 9]
    late = trie.match(longer)  # the blocks have device blocks now, still loading
    assert late.num_host_tokens == 6 and late.num_cached_tokens == 6
    assert late.block_ids == first.block_ids
    trie.faults.reset()
    assert trie.load(late) is copy
    assert trie.faults.points == []  # nothing of its own to load: nothing allocated
    trie.allocate(late, len(longer))
    with pytest.raises(HostTierError, match="loading"):
        trie.commit(late, 8)
    assert copy is not None
    copies.complete(copy)
    trie.commit(late, 8)  # done (not yet reaped) is enough
    trie.poll()
    trie.release(first)
    trie.release(late)
    trie.check()


LONGER = [1, 1, 2, 2, 3, 3, 4, 4, 9]  # A's three blocks and one more


def chained_loads(trie: BlockTrie, copies: ManualCopies) -> tuple[Sequence, Copy, Sequence, Copy]:
    """LONGER served and offloaded; a request for A loads its three blocks, then one
    for LONGER shares that load and queues its own for the fourth block."""
    serve_manual(trie, copies, LONGER)
    trie.evict(10)
    short = trie.match(A)
    first = trie.load(short)
    seq = trie.match(LONGER)
    assert seq.num_host_tokens == 8
    own = trie.load(seq)
    assert own is not None and first is not None and own is not first
    return short, first, seq, own


def test_load_of_a_longer_prompt_is_ordered_after_the_shared_load() -> None:
    trie, copies = host_trie(manual=True)
    assert copies is not None
    short, first, seq, own = chained_loads(trie, copies)
    copies.complete(own)  # completes the shared load first: a stream runs in order
    assert first.done
    trie.poll()
    assert_reads(trie, seq, LONGER)
    trie.release(short)
    trie.release(seq)
    trie.check()


def test_a_request_waiting_on_two_loads_commits_once_both_finish() -> None:
    """A request whose hit two other requests' loads cover gets an empty copy
    ordered after both to wait on; its commit needs only the two loads, which
    are what its block table reads, not that ordering copy."""
    trie, copies = host_trie(manual=True)
    assert copies is not None
    short, first, seq, own = chained_loads(trie, copies)
    tokens = [*LONGER[:8], 7, 7, 9]
    third = trie.match(tokens)
    assert third.num_host_tokens == 8 and third.block_ids == seq.block_ids
    after_both = trie.load(third)
    assert after_both is not None and after_both not in (first, own)
    copies.complete(own)  # and the shared load before it
    assert first.done and own.done and not after_both.done
    trie.allocate(third, len(tokens))
    compute(trie, third, tokens)
    trie.commit(third, len(tokens))
    copies.complete_all()
    trie.poll()
    assert_reads(trie, third, tokens)
    for request in (short, seq, third):
        trie.release(request)
    trie.check()


def serve_manual(trie: BlockTrie, copies: ManualCopies, tokens: list[int]) -> None:
    seq = trie.match(tokens)
    trie.load(seq)
    copies.complete_all()
    trie.allocate(seq, len(tokens))
    compute(trie, seq, tokens)
    trie.commit(seq, len(tokens))
    trie.release(seq)
    copies.complete_all()
    trie.poll()


def test_match_then_abort_with_a_host_part_is_an_exact_undo() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(2)
    before = trie.snapshot()
    seq = trie.match(A)
    assert seq.num_host_tokens == 4 and seq.num_cached_tokens == 6
    assert trie.num_evictable_host_blocks == 0  # the request reads both host blocks
    trie.abort(seq)
    assert rollback(before, trie.snapshot()) == []
    trie.check()


def test_operations_that_need_the_hit_on_device_refuse_before_load() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    seq = trie.match(A)
    for operation in (lambda: trie.allocate(seq, 7), lambda: trie.commit(seq, 6)):
        with pytest.raises(HostTierError, match="load"):
            operation()
    trie.check()
    trie.release(seq)
    assert trie.num_evictable_host_blocks == 1
    trie.check()


def test_load_without_room_raises_and_changes_nothing() -> None:
    trie, _ = host_trie(num_blocks=4)
    serve(trie, A)
    trie.evict(3)
    holder = trie.match(OTHER[:7])
    trie.allocate(holder, 7)  # every device block is held now
    seq = trie.match(A)
    before = trie.snapshot()
    with pytest.raises(OutOfBlocks):
        trie.load(seq)
    assert rollback(before, trie.snapshot()) == []
    trie.release(holder)
    assert trie.load(seq) is not None
    trie.release(seq)
    trie.check()


def test_a_failed_load_cuts_every_request_that_reads_it() -> None:
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    trie.evict(10)
    first, second = trie.match(A), trie.match(A)
    copy = trie.load(first)
    assert copy is not None and trie.load(second) is copy
    copies.fail(copy)
    trie.poll()
    for seq in (first, second):
        assert seq.block_ids  # its private blocks stay until released
        with pytest.raises(HostTierError, match="abort"):
            trie.commit(seq, 6)
        with pytest.raises(HostTierError, match="abort"):
            trie.load(seq)
    assert set(residency(trie).values()) == {Residency.HOST.value}
    trie.check()
    trie.abort(first)
    trie.release(second)
    assert trie.num_free_blocks == 8
    trie.check()
    serve_manual(trie, copies, A)  # the prefix loads again
    trie.check()


def test_a_bounded_match_cut_by_a_failed_load_is_bounded_again() -> None:
    """[R50], [R65]: a failed load not yet reaped ends the hit at the node it was
    loading. For a bounded match that cut is bounded again: a cut after block 2 (4
    tokens) would end inside the span (3, 5), so the hit is 1 block."""
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    assert trie.evict(1) == 1  # the leaf (block 3) goes to the host tier
    first = trie.match(A)
    assert (first.num_cached_tokens, first.num_host_tokens) == (6, 2)
    copy = trie.load(first)
    assert copy is not None
    copies.fail(copy)  # not reaped: block 3's load has failed
    for spans, expected in (((), 4), ([(3, 5)], 2)):
        seq = trie.match(A, atomic_spans=spans)
        assert (seq.num_cached_tokens, seq.num_host_tokens) == (expected, 0), spans
        trie.abort(seq)
    trie.poll()
    trie.abort(first)
    trie.check()


def test_a_commit_before_poll_sees_a_failed_load_and_says_to_abort() -> None:
    """A commit that reads a load which failed but is not yet polled is refused,
    telling the engine to abort (not to wait: the load will never finish); one
    that reads an unfinished load is told to wait."""
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    trie.evict(10)
    seq = trie.match(LONGER)  # A's three blocks on the host, and one more
    copy = trie.load(seq)
    assert copy is not None
    trie.allocate(seq, len(LONGER))
    trie.commit(seq, 6)  # no block past the hit: nothing read, nothing refused
    loading = f"commit: {seq!r} reads blocks that {copy!r} is loading"
    with pytest.raises(HostTierError, match=f"^{re.escape(loading)}; wait for it$"):
        trie.commit(seq, 8)
    copies.fail(copy)
    loading = f"commit: {seq!r} reads blocks that {copy!r} is loading"  # now failed
    failed = f"^{re.escape(loading)}; it failed: abort the request$"
    with pytest.raises(HostTierError, match=failed):
        trie.commit(seq, 8)
    trie.poll()
    trie.abort(seq)
    trie.check()


def test_a_load_ordered_after_a_failed_one_fails_too() -> None:
    trie, copies = host_trie(manual=True)
    assert copies is not None
    short, first, seq, own = chained_loads(trie, copies)
    copies.fail(first)
    assert own.failed
    trie.poll()
    trie.abort(short)
    trie.abort(seq)
    trie.check()
    assert trie.num_free_blocks == 8


def test_a_commit_of_a_host_only_block_adopts_the_computed_block() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    seq = trie.match([1, 1, 2])  # hits the first block only
    trie.load(seq)
    trie.poll()
    trie.append(seq, [2, 3, 3, 4])
    trie.allocate(seq, 7)
    compute(trie, seq, [1, 1, 2, 2, 3, 3, 4])
    trie.commit(seq, 6)  # blocks 2 and 3 exist, host-only: adopted
    assert trie.stats.loaded_blocks == 1
    assert set(residency(trie).values()) == {Residency.MIRRORED.value}
    trie.release(seq)
    trie.check()


def test_host_eviction_is_lru_and_skips_blocks_a_request_reads() -> None:
    trie, _ = host_trie(num_blocks=8, host_blocks=16)
    serve(trie, A)
    serve(trie, OTHER)
    trie.evict(10)
    reader = trie.match(OTHER)  # pins OTHER's host blocks
    assert trie.evict_host(100) == 3  # A's chain only
    assert trie.num_host_cached_blocks == 4
    trie.check()
    trie.release(reader)
    assert trie.evict_host(1) == 1
    trie.check()
    with pytest.raises(InvalidArgument):
        trie.evict_host(-1)


def test_evicting_a_device_only_block_drops_the_host_nodes_below_it() -> None:
    trie, _ = host_trie(num_blocks=8, host_blocks=2)
    serve(trie, A)  # only two blocks find a host block: the third stays device-only
    assert sorted(residency(trie).values()) == ["device", "mirrored", "mirrored"]
    assert trie.evict(10) == 3
    assert trie.stats.host_evicted_blocks == 0
    trie.check()
    serve(trie, [5, 5, 9])  # needs a host block: evicts A's chain from the host tier
    trie.check()


def test_clear_empties_both_tiers() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    serve(trie, OTHER)
    trie.evict(2)
    trie.clear()
    assert trie.num_cached_blocks == 0 and trie.num_host_cached_blocks == 0
    assert trie.num_free_host_blocks == 16
    trie.check()


def test_events_announce_each_tier_under_its_medium() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    events = trie.drain_events()
    assert replay(events, medium=MEDIUM_GPU) == set()
    host_blocks = replay(events, medium=MEDIUM_CPU)
    assert len(host_blocks) == 3
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU]
    assert len(stored) == 3 and len(removed) == 3
    assert {e.block_hashes[0] for e in stored} == {e.block_hashes[0] for e in removed}
    seq = trie.match(A)
    trie.load(seq)
    trie.poll()
    events = trie.drain_events()
    loaded = replay(events, medium=MEDIUM_GPU)
    assert loaded == set(seq.block_ids)
    trie.release(seq)
    trie.evict(3)
    trie.evict_host(3)
    assert replay(trie.drain_events(), set(host_blocks), medium=MEDIUM_CPU) == set()
    trie.check()


def test_ssm_tries_never_serve_a_hit_from_the_host() -> None:
    config = CacheConfig(
        block_size=B,
        num_blocks=8,
        num_host_blocks=8,
        num_checkpoint_slots=2,
        enable_events=True,
    )
    trie = BlockTrie(config)
    seq = trie.match(A)
    trie.allocate(seq, len(A))
    trie.commit(seq, len(A))
    trie.save(seq, 6, {})
    trie.release(seq)
    trie.evict(10)
    seq = trie.match(A)
    assert seq.num_cached_tokens == 0 and seq.num_host_tokens == 0
    trie.release(seq)
    trie.check()


def test_offloaded_node_state_is_the_spec_state() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(1)
    states = {n["state"] for n in trie.snapshot()["nodes"].values() if n["parent"] is not None}
    assert NodeState.OFFLOADED.value in states


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_host_tier_is_pinned_and_round_trips_on_the_side_stream() -> None:
    config = CacheConfig(
        block_size=B,
        num_blocks=8,
        num_host_blocks=16,
        kv_block_shape=(B,),
        kv_dtype=torch.float64,
        device="cuda",
        enable_events=True,
    )
    trie = BlockTrie(config)
    host = trie.host_cache
    assert host is not None and host.is_pinned() and host.device.type == "cpu"
    seq = trie.match(A)
    trie.allocate(seq, len(A))
    compute(trie, seq, A)
    trie.commit(seq, len(A))
    trie.release(seq)
    torch.cuda.synchronize()
    trie.poll()
    assert trie.stats.stored_blocks == 3
    assert trie.evict(10) == 3
    trie.kv_cache.fill_(-1.0)  # type: ignore[union-attr]
    seq = trie.match(A)
    copy = trie.load(seq)
    assert copy is not None
    copy.wait()  # the current stream waits on the load's event
    assert_reads(trie, seq, A)
    torch.cuda.synchronize()
    trie.poll()
    trie.release(seq)
    trie.check()


# ------------------------------------------------------------------ write-back ([R52])


def test_write_back_stores_nothing_at_commit_and_offloads_on_eviction() -> None:
    trie, _ = host_trie(host_write="back")
    serve(trie, A)
    assert trie.stats.stored_blocks == 0 and trie.num_host_cached_blocks == 0
    assert set(residency(trie).values()) == {Residency.DEVICE.value}
    assert trie.evict(3) == 3  # CPU copies finish when queued: freed at once
    assert trie.stats.stored_blocks == 3 and trie.stats.evicted_blocks == 3
    assert set(residency(trie).values()) == {Residency.HOST.value}
    serve(trie, A)  # loaded back, bit for bit (serve checks the data)
    assert trie.stats.loaded_blocks == 3
    trie.check()


def test_write_back_with_manual_copies_frees_when_the_store_finishes() -> None:
    trie, copies = host_trie(num_blocks=4, manual=True, host_write="back")
    assert copies is not None
    seq = trie.match(A)
    trie.allocate(seq, len(A))
    compute(trie, seq, A)
    trie.commit(seq, len(A))
    trie.release(seq)
    assert copies.pending() == []
    assert trie.evict(3) == 0  # the leaf's store is queued; its block is freed later
    (store,) = copies.pending()
    assert store.kind == "store"
    trie.check()
    other = trie.match([5, 5, 6, 6, 7])
    with pytest.raises(OutOfBlocks, match="write-back stores in flight"):
        trie.allocate(other, 5)
    trie.check()
    copies.complete(store)
    trie.poll()
    assert trie.stats.evicted_blocks == 1
    assert sorted(residency(trie).values()) == ["device", "device", "host"]
    trie.release(other)
    trie.check()


def test_a_request_matching_a_block_being_written_back_keeps_it() -> None:
    trie, copies = host_trie(manual=True, host_write="back")
    assert copies is not None
    serve_manual(trie, copies, A)
    assert trie.evict(1) == 0
    seq = trie.match(A)  # holds the leaf being stored
    (store,) = copies.pending()
    copies.complete(store)
    trie.poll()
    assert trie.stats.stored_blocks == 1
    assert trie.num_cached_blocks == 3  # mirrored, still on the device: it is in use
    assert_reads(trie, seq, A)
    trie.release(seq)
    trie.check()


def test_clear_with_write_back_drops_instead_of_storing() -> None:
    trie, copies = host_trie(manual=True, host_write="back")
    assert copies is not None
    serve_manual(trie, copies, A)
    trie.clear()
    assert copies.pending() == [] and trie.num_free_blocks == 8
    trie.check()


def test_host_tier_events_reach_the_wire_with_their_medium() -> None:
    msgspec = pytest.importorskip("msgspec")
    from cache.kv_events import encode_batch

    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    _ts, events, _rank = msgspec.msgpack.decode(encode_batch(trie.drain_events(), ts=1.0))
    media = [(e["type"], e["medium"]) for e in events]
    assert ("BlockStored", "GPU") in media and ("BlockStored", "CPU") in media
    assert ("BlockRemoved", "GPU") in media  # the device copies went; the host ones stay
    assert ("BlockRemoved", "CPU") not in media


def test_a_host_allocation_failure_skips_the_store_and_the_commit_stands() -> None:
    trie, _ = host_trie()
    seq = trie.match(A)
    trie.allocate(seq, len(A))
    compute(trie, seq, A)
    trie.faults.arm(0)  # the next allocation point: the commit's host blocks
    trie.commit(seq, len(A))  # stands: its blocks stay device-only
    assert seq.num_committed_tokens == len(A) and trie.num_cached_blocks == 3
    assert trie.faults.points[-1] == "host.take"
    assert set(residency(trie).values()) == {Residency.DEVICE.value}
    trie.release(seq)
    trie.check()


def test_write_back_with_the_host_tier_full_frees_outright() -> None:
    trie, _ = host_trie(host_blocks=1, host_write="back")
    serve(trie, A)
    serve(trie, OTHER)
    assert trie.evict(1) == 1  # A's leaf written back: the host tier is full
    pinned = trie.match(A)  # pins that host block (its host part)
    assert pinned.num_host_tokens == 2 and trie.num_free_host_blocks == 0
    assert trie.evict(1) == 1  # OTHER's leaf: no host block to be had, freed outright
    assert trie.stats.stored_blocks == 1 and trie.num_host_cached_blocks == 1
    assert (8, 8) not in residency(trie)
    trie.release(pinned)
    trie.check()


def test_a_device_only_parent_takes_its_host_only_children_along() -> None:
    """[R48]: a leaf with no host copy of its own (the host tier was full when it was
    committed) whose children were offloaded is freed with them."""
    trie, _ = host_trie(num_blocks=16, host_blocks=2)
    serve(trie, [5, 5, 6, 6, 9])  # fills the host tier
    serve(trie, [1, 1, 9])  # (1, 1) finds no host block: device-only
    assert residency(trie)[(1, 1)] == Residency.DEVICE.value
    assert trie.evict(2) == 2 and trie.evict_host(2) == 2  # the host tier is free again
    serve(trie, [1, 1, 2, 2, 9])
    serve(trie, [1, 1, 3, 3, 9])  # two mirrored children under the device-only parent
    before = trie.stats.host_evicted_blocks
    assert trie.evict(16) == 3
    assert trie.stats.host_evicted_blocks == before + 2
    assert trie.num_host_cached_blocks == 0 and residency(trie) == {}
    trie.check()


def test_host_eviction_leaves_the_node_freed_and_detached() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    root = root_of(trie)
    leaf = root.child_nodes()[0].child_nodes()[0].child_nodes()[0]
    assert leaf.state == NodeState.OFFLOADED.value
    assert trie.evict_host(1) == 1
    assert leaf.state == NodeState.FREED.value and leaf.parent is None
    trie.check()


def test_host_evicted_blocks_adds_up_across_calls() -> None:
    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    assert trie.evict_host(1) == 1 and trie.evict_host(1) == 1
    assert trie.stats.host_evicted_blocks == 2


def test_a_store_one_block_short_evicts_one_host_leaf_for_it() -> None:
    """[R47]: write-through with the host tier full and one block short evicts one LRU
    host-only leaf, so the new block is stored."""
    trie, _ = host_trie(host_blocks=2)
    serve(trie, [1, 1, 2, 2, 9])
    trie.evict(10)  # both blocks host-only; the host tier is full
    assert residency(trie) == {(1, 1): "host", (2, 2): "host"}
    serve(trie, [5, 5, 9])
    assert residency(trie) == {(1, 1): "host", (5, 5): "mirrored"}
    trie.check()


def test_a_prefix_on_the_device_matches_while_another_is_loading() -> None:
    """[R50]: with a load in flight, `match` of a prefix wholly on the device (none
    of it loading) is an ordinary device hit; it waits on nothing."""
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    trie.evict(10)  # A's blocks: host only
    serve_manual(trie, copies, OTHER)  # on the device
    loading = trie.match(A)
    copy = trie.load(loading)
    assert copy is not None and not copy.done
    other = trie.match(OTHER)
    assert other.num_cached_tokens == 8 and other.num_host_tokens == 0
    assert trie.load(other) is None
    copies.complete_all()
    trie.poll()
    trie.release(loading)
    trie.release(other)
    trie.check()


def test_host_eviction_guards_name_the_invariant_and_the_node() -> None:
    """The guards for states that cannot arise say which invariant broke and where
    (they are reached here by corrupting the structure on purpose)."""
    from cache import InvariantViolation

    trie, _ = host_trie()
    serve(trie, A)
    trie.evict(3)
    leaf = NodeRef(trie, trie._host.index.oldest())  # type: ignore[union-attr]
    trie._host_pool.refs[leaf.host] += 1  # a reference nobody owns
    with pytest.raises(InvariantViolation, match=r"host conservation.*still held") as held:
        trie.evict_host(1)
    assert repr(leaf) in str(held.value) and held.value.invariant == "host conservation"
    trie2, _ = host_trie()
    serve(trie2, A)
    trie2.evict(3)
    leaf2 = NodeRef(trie2, trie2._host.index.oldest())  # type: ignore[union-attr]
    leaf2.parent = None  # an attached node without a parent
    with pytest.raises(InvariantViolation, match=r"topology.*has no parent") as orphan:
        trie2.evict_host(1)
    assert repr(leaf2) in str(orphan.value) and orphan.value.invariant == "topology"


def test_the_cascade_guard_names_a_device_block_below_a_device_leaf() -> None:
    """drop_below's guard (a state that cannot arise, reached by corrupting one)."""
    from cache import InvariantViolation

    trie, _ = host_trie(num_blocks=16, host_blocks=2)
    serve(trie, [5, 5, 6, 6, 9])
    serve(trie, [1, 1, 9])  # device-only
    trie.evict(2)
    trie.evict_host(2)
    serve(trie, [1, 1, 2, 2, 9])
    assert trie.evict(1) == 1  # (2, 2) offloaded: (1, 1) is a device leaf now
    parent = root_of(trie).child_nodes()[0]
    (below,) = parent.child_nodes()
    below.state = NodeState.CACHED.value  # as if it still owned a device block
    with pytest.raises(InvariantViolation, match=r"residency.*below a device leaf") as err:
        trie.evict(1)
    assert repr(below) in str(err.value)


def test_a_host_tier_with_ssm_checkpoints_warns_that_it_is_never_read() -> None:
    """[R56]'s consequence, stated at configuration time: with SSM checkpoints a hit ends
    at a checkpoint, and a block offloaded to the host loses its checkpoint, so the
    KV host tier is written through and never read. The warning names the caller's line."""
    with pytest.warns(HostTierUnusedWarning, match="never serves") as caught:
        config = CacheConfig(block_size=B, num_blocks=4, num_host_blocks=8, num_checkpoint_slots=2)
    assert [w.filename for w in caught] == [__file__]
    trie = BlockTrie(config)
    seq = trie.match([1, 2, 3, 4])
    trie.allocate(seq, 4)
    trie.commit(seq, 4)
    assert trie.save(seq, 4, None) is not None
    trie.release(seq)
    trie.poll()
    assert trie.num_host_cached_blocks == 2  # written through
    assert trie.evict(2) == 2  # offloaded: the blocks stay on the host...
    assert trie.num_host_cached_blocks == 2 and trie.num_host_checkpoints == 0
    again = trie.match([1, 2, 3, 4, 5])
    assert again.num_cached_tokens == 0 and again.num_host_tokens == 0  # ...and are never read
    trie.abort(again)
    trie.check()
    # Wrapper frames from another module (as a profiler's or mutmut's trampolines
    # add) around __post_init__ or the frame walk itself move nothing.
    post_init = CacheConfig.__post_init__
    walk = cache.config._caller_stacklevel

    def wrapped(self: CacheConfig) -> None:
        post_init(self)

    def wrapped_walk(frame: FrameType) -> int:
        return walk(frame)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CacheConfig, "__post_init__", wrapped)
        mp.setattr(cache.config, "_caller_stacklevel", wrapped_walk)
        with pytest.warns(HostTierUnusedWarning) as caught:
            CacheConfig(block_size=B, num_blocks=4, num_host_blocks=8, num_checkpoint_slots=2)
    assert [w.filename for w in caught] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # either tier alone does not warn
        CacheConfig(block_size=B, num_blocks=4, num_host_blocks=8)
        CacheConfig(block_size=B, num_blocks=4, num_checkpoint_slots=2, num_host_checkpoint_slots=2)


def test_the_host_tier_evicts_its_least_recently_used_leaf_not_its_oldest() -> None:
    """[R47] by the logical clock: of two host-only leaves, a store that needs a host
    block evicts the one used least recently, though the other was created first."""
    trie, _ = host_trie(num_blocks=4, host_blocks=2)
    serve(trie, [1, 1, 9])  # A, created first
    serve(trie, [2, 2, 9])  # B
    serve(trie, [1, 1, 9])  # A used again: now the more recent
    assert trie.evict(2) == 2  # both offloaded: host-only leaves
    serve(trie, [3, 3, 9])  # its store needs one of their host blocks
    assert (hit(trie, [1, 1, 9]), hit(trie, [2, 2, 9])) == (2, 0)  # B went; A stays
    trie.check()


def test_each_host_tier_step_refuses_a_node_in_the_wrong_state_naming_it() -> None:
    """The host tier's lifecycle steps are the spec's: storing, finishing or failing
    a store, loading and adopting a node whose residency does not allow it, or
    freeing a node a request holds, raises the spec's `IllegalTransition` naming
    the node, and changes nothing (the hot paths' table lookups fall back to the
    spec's step for any state they do not hold)."""
    trie, _ = host_trie()
    held = trie.match([1, 1, 2, 2, 9])
    trie.allocate(held, 5)
    compute(trie, held, [1, 1, 2, 2, 9])
    trie.commit(held, 5)  # two nodes, stored at commit: `mirrored`, `cached` (held)
    host = trie._host
    assert host is not None
    node = NodeRef(trie, held.path[-1])
    assert (node.state, node.residency) == (NodeState.CACHED.value, Residency.MIRRORED.value)

    def finished(failed: bool) -> Copy:
        copy = Copy("store", 0, [], (), 0)
        copy.nodes.append(node.id)
        copy.failed = failed
        return copy

    attempts = [
        (lambda: host.begin_store(node.id, 0), ("residency", "store", "mirrored")),
        (lambda: host.stored(finished(False)), ("residency", "stored", "mirrored")),
        (lambda: host.stored(finished(True)), ("residency", "store_failed", "mirrored")),
        (lambda: host.begin_load(node.id), ("residency", "load", "mirrored")),
        (lambda: host.adopt(node.id), ("residency", "adopt", "mirrored")),
        (lambda: host._free(node.id), ("node", "free", "cached")),
    ]
    for attempt, transition in attempts:
        refused_changing_nothing(trie, attempt, transition, node)
    trie.release(held)
    trie.check()


def test_write_back_host_pressure_reclaims_a_duplicate_before_any_host_only_block() -> None:
    """[R71]: with write-back, a full host tier gives up the host copy of a block still
    on the device (it is stored again if the device evicts it) rather than a
    host-only block, or rather than losing the block being written back."""
    trie, _ = host_trie(num_blocks=8, host_blocks=1, host_write="back")
    x, y = [1, 1, 9], [4, 4, 9]
    serve(trie, x)
    assert trie.evict(1) == 1  # written back: x is host-only, the host tier is full
    serve(trie, x)  # loaded back: x is mirrored, a duplicate
    assert residency(trie) == {(1, 1): Residency.MIRRORED.value}
    serve(trie, y)
    serve(trie, x)  # y is the LRU device leaf now
    assert trie.evict(1) == 1  # y is written back into x's reclaimed host block
    assert residency(trie) == {(1, 1): Residency.DEVICE.value, (4, 4): Residency.HOST.value}
    assert trie.stats.host_evicted_blocks == 1
    assert serve(trie, y).num_host_tokens == 2  # y's KV came back from the host
    serve(trie, y)
    assert trie.evict(1) == 1  # x, device-only again, is written back: nothing was lost
    assert residency(trie) == {(1, 1): Residency.HOST.value, (4, 4): Residency.DEVICE.value}
    assert serve(trie, x).num_host_tokens == 2
    trie.check()


def test_write_through_host_pressure_keeps_duplicates() -> None:
    """[R71] applies to write-back only: with write-through a dropped host copy would
    be lost when the device evicts the block, so host eviction stays [R51]'s."""
    trie, _ = host_trie(num_blocks=8, host_blocks=1)
    serve(trie, [1, 1, 9])  # stored: mirrored, the host tier is full
    serve(trie, [4, 4, 9])  # no host block for it: device-only
    assert residency(trie) == {
        (1, 1): Residency.MIRRORED.value,
        (4, 4): Residency.DEVICE.value,
    }
    assert trie.evict_host(1) == 0
    trie.check()
