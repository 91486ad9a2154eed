"""Hand-built scenarios for the reference model `spec.model.ReferenceCache`.

Each test pins one rule of docs/semantics.md on a tiny cache (block size 4
unless stated), so a failure names the rule that broke.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from spec import invariants
from spec.errors import (
    CacheError,
    CheckpointError,
    ConfigError,
    IllegalTransition,
    InvalidArgument,
    InvalidType,
    OutOfBlocks,
    PinError,
    SequenceNotLive,
)
from spec.model import ModelSequence, ReferenceCache
from spec.snapshot import STAT_COUNTERS, Snapshot, node_path, observe

B = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def consistent(cache: ReferenceCache) -> Snapshot:
    """Every spec invariant plus cheap structural checks over the snapshot; returns it."""
    snap = cache.snapshot()
    assert invariants.violations(snap) == []
    refs = snap["refcounts"]
    assert sorted(snap["free_blocks"]) == sorted(b for b, n in refs.items() if n == 0)
    assert set(refs) == set(range(snap["capacity"]))
    cached = [n for n in snap["nodes"].values() if n["parent"] is not None]
    in_use = sum(1 for n in refs.values() if n > 0) - len(cached)
    assert len(snap["free_blocks"]) + len(cached) + in_use == snap["capacity"]
    assert cache.num_free_blocks == len(snap["free_blocks"])
    assert cache.num_cached_blocks == len(cached)
    assert cache.num_free_checkpoint_slots == len(snap["free_slots"])
    evictable = {nid for nid, n in snap["nodes"].items() if n["state"] == "evictable"}
    assert set(snap["evictable_index"]) == evictable
    order = [
        (snap["nodes"][i]["tick"], snap["nodes"][i]["serial"]) for i in snap["evictable_index"]
    ]
    assert order == sorted(order)
    published = {cid for cid, c in snap["checkpoints"].items() if c["state"] == "published"}
    assert set(snap["checkpoint_index"]) == published
    for nid, n in snap["nodes"].items():
        if n["parent"] is None:
            assert n["state"] == "root"
        else:
            assert nid in snap["nodes"][n["parent"]]["children"]
            assert n["depth"] == snap["nodes"][n["parent"]]["depth"] + 1
        if n["checkpoint"] is not None:
            assert snap["checkpoints"][n["checkpoint"]]["anchor"] == nid
    for c in snap["checkpoints"].values():
        assert (c["state"] == "pinned") == (c["pins"] > 0)
        assert len(c["tail"]) == c["step"] % snap["block_size"]
    used_slots = [c["slot"] for c in snap["checkpoints"].values() if c["slot"] is not None]
    assert len(used_slots) == len(set(used_slots))
    assert sorted(used_slots + snap["free_slots"]) == list(range(snap["slot_capacity"]))
    assert set(snap["stats"]) == set(STAT_COUNTERS)
    return snap


def unchanged(cache: ReferenceCache, op: Callable[[], object], error: type[Exception]) -> None:
    """`op` raises `error` (exactly that class) and leaves the whole snapshot as it was."""
    before = cache.snapshot()
    with pytest.raises(CacheError) as info:
        op()
    assert type(info.value) is error, info.value
    assert cache.snapshot() == before


def names(cache: ReferenceCache, key: str) -> list[Any]:
    snap = cache.snapshot()
    return [node_path(snap, nid)[1] for nid in snap[key]]  # type: ignore[literal-required]


def fill(
    cache: ReferenceCache,
    tokens: list[int],
    namespace: str = "",
    release: bool = True,
    extra: list[Any] | None = None,
) -> ModelSequence:
    """match + allocate + commit all full blocks (+ release)."""
    seq = cache.match(tokens, namespace, extra)
    cache.allocate(seq, len(tokens))
    cache.commit(seq, len(tokens) // B * B)
    if release:
        cache.release(seq)
    return seq


def ssm(num_blocks: int = 16, slots: int = 4, manual: bool = True) -> ReferenceCache:
    return ReferenceCache(B, num_blocks, slots, manual_copies=manual)


def settle(cache: ReferenceCache) -> None:
    for cp in cache.pending():
        cache.complete(cp)
    cache.poll()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "args",
    [(0, 4), (-1, 4), (4, 0), (4, -3), (4, 4, -1), (4.0, 4), (True, 4), (4, "8"), (4, 4, None)],
)
def test_config_errors(args: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError):
        ReferenceCache(*args)


def test_fresh_cache() -> None:
    cache = ReferenceCache(B, 8, 2)
    snap = consistent(cache)
    assert cache.num_free_blocks == 8
    assert cache.num_cached_blocks == 0
    assert cache.num_free_checkpoint_slots == 2
    assert snap["stats"] == dict.fromkeys(STAT_COUNTERS, 0)
    assert cache.stats == dict.fromkeys(STAT_COUNTERS, 0)


# --------------------------------------------------------------------------- attention-only


def test_miss_then_shared_prefix_hit() -> None:
    cache = ReferenceCache(B, 16)
    first = fill(cache, toks(0, 10))
    assert first.num_cached_tokens == 0
    assert cache.num_cached_blocks == 2
    assert cache.num_free_blocks == 16 - 2  # the third, partial block went back
    second = cache.match([*toks(0, 8), 50, 51, 52, 53, 54])
    assert second.num_cached_tokens == 8
    assert second.block_ids == first.block_ids[:2]
    assert second.num_committed_tokens == 8
    assert second.branch_step == 8
    assert second.restore is None
    st = cache.stats
    assert (st["queries"], st["query_tokens"], st["hit_tokens"]) == (2, 23, 8)
    snap = consistent(cache)
    assert all(n["state"] == "cached" for n in snap["nodes"].values() if n["parent"] is not None)
    assert snap["refcounts"][second.block_ids[0]] == 2


def test_hit_leaves_at_least_one_token() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 8))
    seq = cache.match(toks(0, 8))  # the whole request is cached
    assert seq.num_cached_tokens == 4
    assert seq.branch_step == 8
    assert len(seq.block_ids) == 1
    seq2 = cache.match(toks(0, 9))
    assert seq2.num_cached_tokens == 8
    tiny = cache.match(toks(0, 3))
    assert tiny.num_cached_tokens == 0


def test_dedupe_on_commit() -> None:
    cache = ReferenceCache(B, 16)
    a = cache.match(toks(0, 9))
    b = cache.match(toks(0, 9))
    cache.allocate(a, 9)
    cache.allocate(b, 9)
    assert cache.num_free_blocks == 16 - 6
    cache.commit(a, 8)
    private = list(b.block_ids)
    cache.commit(b, 8)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] == private[2]
    assert cache.num_cached_blocks == 2
    assert cache.num_free_blocks == 16 - 4  # b's two private blocks were freed
    snap = consistent(cache)
    assert snap["refcounts"][a.block_ids[0]] == 3  # node + a + b
    for p in private[:2]:
        assert snap["refcounts"][p] == 0
    nodes = [n for n in snap["nodes"].values() if n["parent"] is not None]
    assert {n["tick"] for n in nodes} == {2}  # the deduplicating commit set it
    seqview = next(s for s in snap["sequences"].values() if s["blocks"] == b.block_ids)
    assert len(seqview["path"]) == 2


def test_commit_ticks_and_incremental_commit() -> None:
    cache = ReferenceCache(B, 16)
    seq = cache.match(toks(0, 12))
    cache.allocate(seq, 12)
    cache.commit(seq, 3)  # no full block: still ticks
    assert cache.clock == 1
    assert cache.num_cached_blocks == 0
    cache.commit(seq, 5)
    assert cache.num_cached_blocks == 1
    cache.commit(seq, 12)
    assert cache.num_cached_blocks == 3
    assert seq.num_committed_tokens == 12
    snap = consistent(cache)
    ticks = sorted(n["tick"] for n in snap["nodes"].values() if n["parent"] is not None)
    assert ticks == [2, 3, 3]
    assert cache.clock == 3


def test_namespaces_isolated() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 9), namespace="lora-a")
    assert cache.match(toks(0, 9)).num_cached_tokens == 0
    assert cache.match(toks(0, 9), namespace="lora-b").num_cached_tokens == 0
    assert cache.match(toks(0, 9), namespace="lora-a").num_cached_tokens == 8
    fill(cache, toks(0, 9), namespace="lora-b")
    assert cache.num_cached_blocks == 4
    snap = consistent(cache)
    assert set(snap["roots"]) == {"", "lora-a", "lora-b"}


def test_extra_identity() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 9), extra=["img-1"])
    assert cache.match(toks(0, 9)).num_cached_tokens == 0
    assert cache.match(toks(0, 9), extra=["img-2"]).num_cached_tokens == 0
    assert cache.match(toks(0, 9), extra=("img-1",)).num_cached_tokens == 8
    assert cache.match(toks(0, 9), extra=["img-1", None, None, None]).num_cached_tokens == 8
    assert cache.match(toks(0, 9), extra=["img-1", "x"]).num_cached_tokens == 4
    fill(cache, toks(100, 5))
    assert cache.match(toks(100, 5), extra=[None]).num_cached_tokens == 4


def test_append_extends_tokens_only() -> None:
    cache = ReferenceCache(B, 16)
    seq = cache.match(toks(0, 3))
    before = observe(cache.snapshot())
    cache.append(seq, [7, 8])
    cache.append(seq, ())
    assert seq.tokens == (0, 1, 2, 7, 8)
    after = observe(cache.snapshot())
    assert after["stats"] == before["stats"]
    assert after["sequences"][0][1] == (0, 1, 2, 7, 8)
    assert cache.clock == 0


def test_release_drops_refs_and_keeps_committed() -> None:
    cache = ReferenceCache(B, 16)
    seq = cache.match(toks(0, 10))
    cache.allocate(seq, 10)
    cache.commit(seq, 8)
    assert cache.num_free_blocks == 13
    cache.release(seq)
    assert cache.num_free_blocks == 14
    assert cache.num_cached_blocks == 2
    snap = consistent(cache)
    assert snap["sequences"] == {}
    assert [n["tick"] for n in snap["nodes"].values() if n["parent"] is not None] == [2, 2]
    assert names(cache, "evictable_index") == [(((0, 1, 2, 3), None), ((4, 5, 6, 7), None))]
    unchanged(cache, lambda: cache.release(seq), SequenceNotLive)
    unchanged(cache, lambda: cache.commit(seq, 8), SequenceNotLive)


# --------------------------------------------------------------------------- eviction


def test_lru_eviction_order() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 8))  # a: commit tick 1, release tick 2
    fill(cache, toks(100, 8))  # b: ticks 3, 4
    a2 = (((0, 1, 2, 3), None), ((4, 5, 6, 7), None))
    b2 = (((100, 101, 102, 103), None), ((104, 105, 106, 107), None))
    assert names(cache, "evictable_index") == [a2, b2]
    # touching a again makes b the LRU
    seq = cache.match(toks(0, 9))
    cache.release(seq)
    assert names(cache, "evictable_index") == [b2, a2]
    assert cache.evict(1) == 1
    assert names(cache, "evictable_index") == [b2[:1], a2]  # b's parent became evictable
    assert cache.evict(1) == 1
    assert names(cache, "evictable_index") == [a2]
    assert cache.stats["evicted_blocks"] == 2
    consistent(cache)


def test_eviction_tie_break_is_serial() -> None:
    # Ties are unreachable through the API (every tick touches one chain), so force one.
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 4))
    fill(cache, toks(100, 4))
    for node in cache._nodes:
        node.tick = 7
    assert names(cache, "evictable_index") == [
        (((0, 1, 2, 3), None),),
        (((100, 101, 102, 103), None),),
    ]
    cache.evict(1)
    assert names(cache, "evictable_index") == [(((100, 101, 102, 103), None),)]


def test_parent_becomes_evictable_in_same_call() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 12))
    fill(cache, toks(100, 4))
    assert cache.evict(3) == 3
    assert names(cache, "evictable_index") == [(((100, 101, 102, 103), None),)]
    assert cache.evict(10) == 1
    assert cache.evict(1) == 0
    assert cache.evict(0) == 0
    assert cache.num_free_blocks == 16
    assert cache.stats["evicted_blocks"] == 4


def test_evict_skips_shared_and_inner_nodes() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 8))
    holder = cache.match(toks(0, 9))  # holds both blocks
    assert cache.evict(5) == 0
    cache.release(holder)
    assert cache.evict(5) == 2


def test_allocate_evicts_lru_when_short() -> None:
    cache = ReferenceCache(B, 4)
    fill(cache, toks(0, 8))
    fill(cache, toks(100, 4))
    assert cache.num_free_blocks == 1
    seq = cache.match(toks(200, 12))
    cache.allocate(seq, 12)  # needs 3: evicts a's leaf, then a's root child
    assert len(seq.block_ids) == 3
    assert cache.num_free_blocks == 0
    assert names(cache, "evictable_index") == [(((100, 101, 102, 103), None),)]
    assert cache.stats["evicted_blocks"] == 2
    cache.allocate(seq, 5)  # already covered: nothing happens
    assert len(seq.block_ids) == 3
    consistent(cache)


def test_out_of_blocks_leaves_state_unchanged() -> None:
    cache = ReferenceCache(B, 4)
    fill(cache, toks(0, 4))  # one evictable node
    holder = cache.match(toks(100, 8))
    cache.allocate(holder, 8)
    cache.commit(holder, 8)  # two cached, shared with holder
    seq = cache.match(toks(200, 12))
    assert cache.num_free_blocks == 1
    unchanged(cache, lambda: cache.allocate(seq, 12), OutOfBlocks)  # 1 free + 1 reclaimable < 3
    cache.allocate(seq, 8)  # exactly enough
    assert cache.num_free_blocks == 0
    assert cache.num_cached_blocks == 2


# --------------------------------------------------------------------------- abort


def test_abort_restores_everything() -> None:
    cache = ReferenceCache(B, 16)
    fill(cache, toks(0, 8))
    before = cache.snapshot()
    seq = cache.match(toks(0, 9))
    assert seq.num_cached_tokens == 8
    cache.abort(seq)
    assert cache.snapshot() == before
    unchanged(cache, lambda: cache.abort(seq), SequenceNotLive)


def test_abort_keeps_committed_blocks_and_subtracts_match_stats_only() -> None:
    cache = ReferenceCache(B, 16)
    seq = cache.match(toks(0, 9))
    cache.append(seq, [1, 2, 3])
    cache.allocate(seq, 12)
    cache.commit(seq, 12)
    cache.abort(seq)
    assert cache.num_cached_blocks == 3
    assert cache.num_free_blocks == 13
    assert cache.stats["queries"] == 0
    assert cache.stats["query_tokens"] == 0
    assert cache.clock == 1  # abort never ticks
    snap = consistent(cache)
    assert [n["tick"] for n in snap["nodes"].values() if n["parent"] is not None] == [1, 1, 1]


def test_abort_ssm_unpins() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    cache.save(seq, 6)
    settle(cache)
    cache.release(seq)
    before = cache.snapshot()
    hit = cache.match(toks(0, 9))
    assert hit.num_cached_tokens == 6
    snap = consistent(cache)
    assert [c["state"] for c in snap["checkpoints"].values()] == ["pinned"]
    assert cache.stats["checkpoint_hits"] == 1
    cache.abort(hit)
    assert cache.snapshot() == before


# --------------------------------------------------------------------------- SSM match


def test_ssm_match_at_deepest_checkpoint() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 12), release=False)
    assert cache.save(seq, 4) is not None
    settle(cache)
    assert cache.save(seq, 8) is not None
    settle(cache)
    cache.release(seq)
    hit = cache.match([*toks(0, 12), 99])
    assert hit.branch_step == 12
    assert hit.num_cached_tokens == 8
    assert hit.restore is not None
    assert hit.restore.step == 8
    assert len(hit.block_ids) == 2
    assert hit.num_committed_tokens == 8
    assert cache.stats["checkpoint_hits"] == 1
    # diverging inside block 1: only the step-4 checkpoint is on its path
    other = cache.match([*toks(0, 6), 77, 78, 79])
    assert other.branch_step == 4
    assert other.num_cached_tokens == 4
    # the step-8 checkpoint is only usable when at least one token is left
    exact = cache.match(toks(0, 8))
    assert exact.num_cached_tokens == 4
    snap = consistent(cache)
    assert sorted(c["pins"] for c in snap["checkpoints"].values()) == [1, 2]


def test_ssm_kv_only_path_is_a_miss() -> None:
    cache = ssm()
    fill(cache, toks(0, 12))
    seq = cache.match(toks(0, 13))
    assert seq.branch_step == 12
    assert seq.num_cached_tokens == 0
    assert seq.block_ids == []
    assert seq.restore is None
    assert cache.stats["hit_tokens"] == 0
    assert cache.stats["checkpoint_hits"] == 0


def test_partial_checkpoint_tail_identity() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False, extra=[None, "pic"])
    free = cache.num_free_blocks
    copy = cache.save(seq, 6)  # anchor depth 1, tail (4, 5), identity "pic"
    assert copy is not None
    assert cache.num_free_blocks == free - 1  # the frozen tail block
    settle(cache)
    cache.release(seq)
    snap = consistent(cache)
    (c,) = snap["checkpoints"].values()
    assert (c["step"], c["tail"], c["tail_extra"]) == (6, (4, 5), "pic")
    assert c["frozen_block"] is not None
    assert snap["refcounts"][c["frozen_block"]] == 1
    hit = cache.match([0, 1, 2, 3, 4, 5, 60], extra=[None, "pic"])
    assert hit.num_cached_tokens == 6
    assert hit.block_ids == seq.block_ids[:1]
    assert cache.match([0, 1, 2, 3, 4, 9, 60], extra=[None, "pic"]).num_cached_tokens == 0
    assert cache.match([0, 1, 2, 3, 4, 5, 60], extra=[None, "other"]).num_cached_tokens == 0
    assert cache.match([0, 1, 2, 3, 4, 5, 60]).num_cached_tokens == 0
    assert cache.match([0, 1, 2, 3, 4, 5], extra=[None, "pic"]).num_cached_tokens == 0


def test_root_checkpoint() -> None:
    cache = ssm()
    seq = cache.match(toks(0, 3))
    cache.allocate(seq, 3)
    copy = cache.save(seq, 2)
    assert copy is not None
    settle(cache)
    cache.release(seq)
    hit = cache.match([0, 1, 9])
    assert hit.num_cached_tokens == 2
    assert hit.block_ids == []
    cache.release(hit)
    snap = consistent(cache)
    (c,) = snap["checkpoints"].values()
    assert snap["nodes"][c["anchor"]]["state"] == "root"
    assert cache.evict(10) == 0  # a root's checkpoint is not KV-evictable
    assert cache.evict_checkpoints(1) == 1
    assert cache.num_free_blocks == 16


# --------------------------------------------------------------------------- save


def test_save_rule1_deduplicated() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    assert cache.save(seq, 6) is not None
    clock = cache.clock
    before = cache.snapshot()
    assert cache.save(seq, 6) is None  # even while pinned by its producer copy
    after = cache.snapshot()
    assert cache.clock == clock
    assert after["stats"]["checkpoints_deduplicated"] == 1
    after["stats"]["checkpoints_deduplicated"] = 0
    assert after == before


def test_save_rule2_pinned_anchor_skipped() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    assert cache.save(seq, 5) is not None  # producer pin held
    before = cache.snapshot()
    assert cache.save(seq, 6) is None
    after = cache.snapshot()
    assert after["stats"]["checkpoints_skipped"] == 1
    after["stats"]["checkpoints_skipped"] = 0
    assert after == before


def test_save_rule3_replaces_unpinned() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    cache.save(seq, 5)
    settle(cache)
    old = next(iter(cache.snapshot()["checkpoints"].values()))
    free = cache.num_free_blocks
    assert cache.save(seq, 6) is not None
    snap = consistent(cache)
    (new,) = snap["checkpoints"].values()
    assert new["step"] == 6
    assert new["slot"] == old["slot"]
    assert new["frozen_block"] == old["frozen_block"]
    assert new["serial"] > old["serial"]
    assert cache.num_free_blocks == free
    assert cache.stats["evicted_checkpoints"] == 0
    # partial -> aligned frees the frozen block; aligned -> partial takes one
    settle(cache)
    assert cache.save(seq, 4) is not None
    assert cache.num_free_blocks == free + 1
    settle(cache)
    assert cache.save(seq, 7) is not None
    assert cache.num_free_blocks == free
    assert cache.stats["checkpoints_saved"] == 4
    assert cache.stats["evicted_blocks"] == 0


def test_save_rule4_evicts_lru_checkpoint_slot() -> None:
    cache = ssm(slots=2)
    a = fill(cache, toks(0, 5), release=False)
    b = fill(cache, toks(100, 5), release=False)
    c = fill(cache, toks(200, 5), release=False)
    cache.save(a, 4)
    cache.save(b, 4)
    assert cache.num_free_checkpoint_slots == 0
    # both pinned by their producer copies: no slot
    assert cache.save(c, 4) is None
    assert cache.stats["checkpoints_skipped"] == 1
    settle(cache)
    assert cache.save(c, 4) is not None
    assert cache.stats["evicted_checkpoints"] == 1
    snap = consistent(cache)
    steps = sorted(node_path(snap, ck["anchor"])[1][0][0][0] for ck in snap["checkpoints"].values())
    assert steps == [100, 200]  # a's (the LRU) went
    assert cache.num_cached_blocks == 3  # nodes stay


def test_save_rule5_takes_the_frozen_tail_freed_by_rule4() -> None:
    cache = ReferenceCache(B, 4, 1)
    a = cache.match(toks(0, 3))
    cache.allocate(a, 3)
    assert cache.save(a, 2) is not None  # root checkpoint with a frozen block
    settle(cache)
    cache.release(a)
    seq = fill(cache, toks(100, 10), release=False)  # 3 blocks, 2 of them cached
    assert cache.num_free_blocks == 0
    # Nothing is KV-evictable, but the unpinned root checkpoint's frozen tail is
    # reclaimable: rule 4 evicts it for its slot, and rule 5 takes its block.
    assert cache.save(seq, 6) is not None
    assert cache.stats["evicted_checkpoints"] == 1
    assert cache.stats["evicted_blocks"] == 0
    assert cache.num_free_blocks == 0


def test_save_rule5_skips_when_no_block_can_be_freed() -> None:
    cache = ReferenceCache(B, 5, 2)
    a = cache.match(toks(0, 3))
    cache.allocate(a, 3)
    assert cache.save(a, 2) is not None  # frozen tail, still pinned by its copy
    cache.release(a)  # its block stays with the copy
    seq = fill(cache, toks(100, 10), release=False)
    assert cache.num_free_blocks == 0
    before = cache.snapshot()
    assert cache.save(seq, 6) is None  # no free block, nothing evictable, tail pinned
    after = cache.snapshot()
    assert after["stats"]["checkpoints_skipped"] == 1
    after["stats"]["checkpoints_skipped"] = 0
    assert after == before
    assert cache.save(seq, 8) is not None  # an aligned step needs no frozen block


def test_save_rule5_uses_kv_eviction() -> None:
    cache = ReferenceCache(B, 3, 2)
    fill(cache, toks(100, 4))  # one evictable node
    seq = cache.match(toks(0, 6))
    cache.allocate(seq, 6)
    cache.commit(seq, 4)
    assert cache.num_free_blocks == 0
    assert cache.save(seq, 5) is not None
    assert cache.stats["evicted_blocks"] == 1
    assert cache.num_cached_blocks == 1


def test_save_ticks_and_copy_holds_block() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    clock = cache.clock
    copy = cache.save(seq, 6)
    assert copy is not None
    assert cache.clock == clock + 1
    snap = consistent(cache)
    (cv,) = snap["copies"].values()
    assert cv["kind"] == "save"
    assert cv["blocks"] == [seq.block_ids[1]]
    assert not cv["done"]
    assert snap["refcounts"][seq.block_ids[1]] == 3  # node + seq + copy
    (ck,) = snap["checkpoints"].values()
    assert ck["tick"] == clock + 1
    assert (ck["state"], ck["pins"]) == ("pinned", 1)
    aligned = cache.save(seq, 8)
    assert aligned is not None
    assert cache.snapshot()["copies"][2]["blocks"] == []


# --------------------------------------------------------------------------- restore


def test_restore_partial_allocates_block_d() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    cache.save(seq, 6)
    settle(cache)
    cache.release(seq)
    hit = cache.match(toks(0, 9))
    assert len(hit.block_ids) == 1
    unchanged(cache, lambda: cache.commit(hit, 6), InvalidArgument)  # block 1 not covered
    clock = cache.clock
    copy = cache.restore(hit)
    assert copy.kind == "restore"
    assert len(hit.block_ids) == 2
    assert cache.clock == clock + 1
    snap = consistent(cache)
    (ck,) = snap["checkpoints"].values()
    assert ck["tick"] == clock + 1
    assert ck["pins"] == 1
    (sv,) = snap["sequences"].values()
    assert not sv["holds_match_pin"]
    (cv,) = snap["copies"].values()
    assert cv["blocks"] == [hit.block_ids[1]]
    assert cache.stats["restores"] == 1
    unchanged(cache, lambda: cache.restore(hit), CheckpointError)
    # the pin is the copy's now: release does not drop it
    cache.release(hit)
    assert next(iter(cache.snapshot()["checkpoints"].values()))["pins"] == 1
    settle(cache)
    assert next(iter(cache.snapshot()["checkpoints"].values()))["pins"] == 0
    assert cache.stats["copies_reaped"] == 2


def test_restore_out_of_blocks_unchanged() -> None:
    cache = ReferenceCache(B, 3, 2)
    seq = fill(cache, toks(0, 6), release=False)
    cache.save(seq, 6)
    settle(cache)
    cache.release(seq)
    hit = cache.match(toks(0, 7))
    filler = cache.match(toks(100, 8))
    cache.allocate(filler, 4)
    assert cache.num_free_blocks == 0
    unchanged(cache, lambda: cache.restore(hit), OutOfBlocks)


def test_restore_without_checkpoint() -> None:
    cache = ssm()
    seq = cache.match(toks(0, 5))
    unchanged(cache, lambda: cache.restore(seq), CheckpointError)


def test_release_drops_match_pin() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    cache.save(seq, 8)
    settle(cache)
    cache.release(seq)
    hit = cache.match(toks(0, 9))
    snap = consistent(cache)
    (sv,) = snap["sequences"].values()
    assert sv["holds_match_pin"]
    assert snap["nodes"][snap["checkpoints"][sv["restore_checkpoint"]]["anchor"]]["state"] == (
        "pinned"
    )
    cache.release(hit)
    snap = consistent(cache)
    assert [c["state"] for c in snap["checkpoints"].values()] == ["published"]


# --------------------------------------------------------------------------- pins, copies, poll


def test_pinned_leaf_skipped_by_evict_then_evicted_after_complete_and_poll() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 8), release=False)
    copy = cache.save(seq, 8)
    assert copy is not None
    cache.release(seq)
    leaf = (((0, 1, 2, 3), None), ((4, 5, 6, 7), None))
    snap = consistent(cache)
    assert observe(snap)["nodes"][("", leaf)] == "pinned"
    assert cache.evict(5) == 0
    assert cache.num_cached_blocks == 2
    cache.complete(copy)
    assert copy.done
    assert cache.evict(5) == 0  # done but not reaped: still pinned
    assert cache.poll() == 1
    assert cache.poll() == 0
    assert observe(cache.snapshot())["nodes"][("", leaf)] == "evictable"
    assert cache.evict(5) == 2
    assert cache.stats["evicted_checkpoints"] == 1
    assert cache.num_free_checkpoint_slots == 4


def test_explicit_pin_and_double_unpin() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 8), release=False)
    cache.save(seq, 8)
    settle(cache)
    cache.release(seq)
    hit = cache.match(toks(0, 9))
    receipt = cache.pin(hit)
    cache.restore(hit)
    cache.release(hit)
    settle(cache)
    snap = consistent(cache)
    (ck,) = snap["checkpoints"].values()
    assert (ck["state"], ck["pins"]) == ("pinned", 1)
    assert snap["explicit_pins"] == [next(iter(snap["checkpoints"]))]
    assert cache.evict_checkpoints(1) == 0
    cache.unpin(receipt)
    assert cache.snapshot()["explicit_pins"] == []
    unchanged(cache, lambda: cache.unpin(receipt), PinError)
    assert cache.evict_checkpoints(1) == 1


def test_pin_errors() -> None:
    cache = ssm()
    plain = cache.match(toks(0, 5))
    unchanged(cache, lambda: cache.pin(plain), CheckpointError)
    seq = fill(cache, toks(0, 8), release=False)
    cache.save(seq, 8)
    settle(cache)
    cache.release(seq)
    hit = cache.match(toks(0, 9))
    cache.restore(hit)
    settle(cache)
    cache.evict_checkpoints(1)
    unchanged(cache, lambda: cache.pin(hit), IllegalTransition)
    other = ReferenceCache(B, 4, 1)
    foreign = fill(other, toks(0, 8), release=False)
    other.save(foreign, 8)
    settle(other)
    other.release(foreign)
    foreign_receipt = other.pin(other.match(toks(0, 9)))
    unchanged(cache, lambda: cache.unpin(foreign_receipt), PinError)
    unchanged(cache, lambda: cache.unpin("receipt"), InvalidType)  # type: ignore[arg-type]


def test_complete_runs_dependencies_first() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    save_a = cache.save(seq, 8)
    other = fill(cache, toks(100, 5), release=False)
    save_b = cache.save(other, 4)
    assert save_a is not None and save_b is not None
    hit = cache.match(toks(0, 10))  # matches the still-pinned checkpoint
    assert hit.num_cached_tokens == 8
    restore = cache.restore(hit)
    assert cache.pending() == [save_a, save_b, restore]
    cache.complete(restore)  # shares the slot with save_a, not with save_b
    assert save_a.done and restore.done and not save_b.done
    assert cache.pending() == [save_b]
    snap = cache.snapshot()
    assert sorted(c["done"] for c in snap["copies"].values()) == [False, True, True]
    assert cache.poll() == 2
    cache.complete(restore)  # already done: no-op
    assert cache.pending() == [save_b]


def test_complete_orders_copies_of_one_checkpoint() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    save = cache.save(seq, 6)  # reads seq block 1, writes slot + frozen block
    assert save is not None
    first = cache.match(toks(0, 7))
    second = cache.match(toks(0, 8))
    r1 = cache.restore(first)  # each restore allocates its own block 1
    r2 = cache.restore(second)
    assert first.block_ids[1] != second.block_ids[1]
    assert [c["pins"] for c in cache.snapshot()["checkpoints"].values()] == [3]
    cache.complete(r2)
    assert save.done and r1.done and r2.done
    assert cache.poll() == 3
    consistent(cache)


def test_manual_copies_false_reaps_at_once() -> None:
    cache = ssm(manual=False)
    seq = fill(cache, toks(0, 9), release=False)
    copy = cache.save(seq, 6)
    assert copy is not None
    assert copy.done
    assert cache.pending() == []
    assert cache.snapshot()["copies"] == {}
    assert cache.stats["copies_reaped"] == 1
    assert cache.poll() == 0
    cache.release(seq)
    hit = cache.match(toks(0, 9))
    cache.restore(hit)
    snap = consistent(cache)
    assert [c["state"] for c in snap["checkpoints"].values()] == ["published"]
    assert cache.stats["copies_reaped"] == 2


def test_poll_reaps_only_done_copies() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 12), release=False)
    a = cache.save(seq, 4)
    b = cache.save(seq, 8)
    assert a is not None and b is not None
    cache.complete(b)
    assert cache.poll() == 1
    assert cache.pending() == [a]
    assert cache.stats["copies_reaped"] == 1


# --------------------------------------------------------------------------- evict_checkpoints


def test_evict_checkpoints_lru_keeps_nodes() -> None:
    cache = ssm()
    a = fill(cache, toks(0, 9), release=False)
    b = fill(cache, toks(100, 9), release=False)
    cache.save(b, 6)  # older
    cache.save(a, 8)
    settle(cache)
    free = cache.num_free_blocks
    assert cache.evict_checkpoints(1) == 1
    snap = consistent(cache)
    (ck,) = snap["checkpoints"].values()
    assert ck["step"] == 8
    assert cache.num_free_blocks == free + 1  # b's frozen tail
    assert cache.num_cached_blocks == 4
    assert cache.stats["evicted_checkpoints"] == 1
    assert cache.stats["evicted_blocks"] == 0
    assert cache.evict_checkpoints(5) == 1
    assert cache.evict_checkpoints(5) == 0


def test_kv_eviction_releases_checkpoint_and_frozen_tail() -> None:
    cache = ssm()
    seq = fill(cache, toks(0, 9), release=False)
    cache.save(seq, 6)
    settle(cache)
    cache.release(seq)
    assert cache.evict(1) == 1  # the leaf (block 1) has no checkpoint
    assert cache.stats["evicted_checkpoints"] == 0
    assert cache.evict(1) == 2  # its parent, the anchor: node block + frozen tail
    assert cache.stats["evicted_blocks"] == 3
    assert cache.stats["evicted_checkpoints"] == 1
    assert cache.num_free_checkpoint_slots == 4


# --------------------------------------------------------------------------- validation


def _validation_cases() -> list[
    tuple[str, Callable[[ReferenceCache, ModelSequence], object], type[Exception]]
]:
    return [
        ("match tokens str", lambda c, s: c.match("abc"), InvalidType),  # type: ignore[arg-type]
        ("match token float", lambda c, s: c.match([1, 2.0]), InvalidType),
        ("match token float", lambda c, s: c.match([1.0]), InvalidType),  # type: ignore[list-item]
        ("match negative", lambda c, s: c.match([1, -1]), InvalidArgument),
        ("match empty", lambda c, s: c.match([]), InvalidArgument),
        ("match namespace", lambda c, s: c.match([1], 3), InvalidType),  # type: ignore[arg-type]
        ("match extra str", lambda c, s: c.match([1], "", "x"), InvalidType),  # type: ignore
        ("match extra unhashable", lambda c, s: c.match([1], "", [[1]]), InvalidType),
        ("append not seq", lambda c, s: c.append(object(), [1]), InvalidType),  # type: ignore
        ("append tokens", lambda c, s: c.append(s, {1}), InvalidType),  # type: ignore[arg-type]
        ("append negative", lambda c, s: c.append(s, [-2]), InvalidArgument),
        ("allocate type", lambda c, s: c.allocate(s, 2.0), InvalidType),  # type: ignore
        ("allocate bool", lambda c, s: c.allocate(s, True), InvalidType),
        ("allocate negative", lambda c, s: c.allocate(s, -1), InvalidArgument),
        ("allocate too many", lambda c, s: c.allocate(s, 15), InvalidArgument),
        ("commit uncovered", lambda c, s: c.commit(s, 9), InvalidArgument),
        ("commit backwards", lambda c, s: c.commit(s, 7), InvalidArgument),
        ("commit type", lambda c, s: c.commit(s, "4"), InvalidType),  # type: ignore[arg-type]
        ("evict negative", lambda c, s: c.evict(-1), InvalidArgument),
        ("evict type", lambda c, s: c.evict(None), InvalidType),  # type: ignore[arg-type]
        ("evict_checkpoints negative", lambda c, s: c.evict_checkpoints(-1), InvalidArgument),
        ("evict_checkpoints type", lambda c, s: c.evict_checkpoints(1.5), InvalidType),  # type: ignore
        ("save step type", lambda c, s: c.save(s, "1"), InvalidType),  # type: ignore[arg-type]
        ("save step 0", lambda c, s: c.save(s, 0), InvalidArgument),
        ("save step past end", lambda c, s: c.save(s, 15), InvalidArgument),
        ("save anchor uncommitted", lambda c, s: c.save(s, 12), CheckpointError),
        ("save partial unallocated", lambda c, s: c.save(s, 9), CheckpointError),
        ("restore none", lambda c, s: c.restore(s), CheckpointError),
        ("pin none", lambda c, s: c.pin(s), CheckpointError),
        ("unpin type", lambda c, s: c.unpin(s), InvalidType),  # type: ignore[arg-type]
        ("release not seq", lambda c, s: c.release(None), InvalidType),  # type: ignore
        ("complete type", lambda c, s: c.complete(s), InvalidType),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize(
    ("label", "op", "error"), _validation_cases(), ids=[c[0] for c in _validation_cases()]
)
def test_validation_errors(
    label: str, op: Callable[[ReferenceCache, ModelSequence], object], error: type[Exception]
) -> None:
    cache = ssm()
    fill(cache, toks(0, 4))
    seq = cache.match(toks(0, 14))  # no checkpoint: miss
    cache.allocate(seq, 8)
    cache.commit(seq, 8)
    unchanged(cache, lambda: op(cache, seq), error)
    assert cache.save(seq, 8) is not None  # the same cache accepts a valid call


def test_builtin_bases() -> None:
    assert issubclass(InvalidType, TypeError)
    assert issubclass(InvalidArgument, ValueError)


def test_save_requires_ssm() -> None:
    cache = ReferenceCache(B, 8)
    seq = fill(cache, toks(0, 8), release=False)
    unchanged(cache, lambda: cache.save(seq, 4), CheckpointError)
    unchanged(cache, lambda: cache.save(seq, "x"), InvalidType)  # type: ignore[arg-type]


def test_validation_order() -> None:
    cache = ssm()
    seq = cache.match(toks(0, 5))
    cache.release(seq)
    # sequence checks come before the argument after it
    unchanged(cache, lambda: cache.commit(seq, "x"), SequenceNotLive)  # type: ignore[arg-type]
    # per argument: tokens (value) before namespace (type)
    unchanged(cache, lambda: cache.match([-1], 5), InvalidArgument)  # type: ignore[arg-type]
    # element types before values before emptiness
    unchanged(cache, lambda: cache.match([-1, "a"]), InvalidType)  # type: ignore[list-item]
    live = cache.match(toks(0, 5))
    no_ssm = ReferenceCache(B, 8)
    s2 = no_ssm.match(toks(0, 5))
    unchanged(no_ssm, lambda: no_ssm.save(s2, 99), CheckpointError)  # SSM before range
    unchanged(cache, lambda: cache.save(live, 99), InvalidArgument)


def test_foreign_objects() -> None:
    a = ssm()
    b = ssm()
    seq = b.match(toks(0, 5))
    unchanged(a, lambda: a.release(seq), SequenceNotLive)
    unchanged(a, lambda: a.allocate(seq, 1), SequenceNotLive)
    bseq = fill(b, toks(0, 9), release=False)
    copy = b.save(bseq, 8)
    assert copy is not None
    unchanged(a, lambda: a.complete(copy), InvalidArgument)


def test_observe_runs_on_busy_cache() -> None:
    cache = ssm(num_blocks=12, slots=2)
    seq = fill(cache, toks(0, 11), release=False, extra=["x", "y"])
    cache.save(seq, 6)
    cache.save(seq, 8)
    cache.save(seq, 3)
    hit = cache.match(toks(0, 10), extra=["x", "y"])
    cache.pin(hit)
    cache.restore(hit)
    cache.release(seq)
    view = observe(consistent(cache))
    assert view["free_blocks"] == cache.num_free_blocks
    assert len(view["copies"]) == 3


# --------------------------------------------------------------------------- random walk


@pytest.mark.parametrize("seed", range(40))
def test_random_walk_is_transactional_and_drains(seed: int) -> None:
    """Random operations: every failure changes nothing, the snapshot stays consistent,
    and once every sequence, copy and receipt is gone, eviction empties every pool."""
    rng = random.Random(seed)
    cache = ReferenceCache(
        B, rng.choice([3, 6, 12]), rng.choice([0, 0, 1, 3]), manual_copies=rng.random() < 0.7
    )
    seqs: list[ModelSequence] = []
    receipts: list[Any] = []

    prompts = [[rng.choice([0, 1]) for _ in range(12)] for _ in range(3)]

    def some_tokens() -> list[int]:
        head = rng.choice(prompts)[: rng.randint(1, 12)]
        return head + [rng.choice([0, 1, 2]) for _ in range(rng.randint(0, 3))]

    def act(kind: int, seq: ModelSequence | None) -> None:
        if kind == 0 or seq is None:
            extra = rng.choice([None, None, ["a"], ["b", "a"]])
            seqs.append(cache.match(some_tokens(), rng.choice(["", "x"]), extra))
        elif kind == 1:
            cache.allocate(seq, rng.choice([len(seq.tokens), rng.randint(0, len(seq.tokens))]))
        elif kind == 2:
            covered = min(len(seq.tokens), len(seq.block_ids) * B)
            high = max(covered, seq.num_committed_tokens)
            cache.commit(seq, rng.choice([high, rng.randint(seq.num_committed_tokens, high)]))
        elif kind == 3:
            cache.save(seq, rng.randint(1, len(seq.tokens)))
        elif kind == 4:
            cache.restore(seq)
        elif kind == 5:
            (cache.release if rng.random() < 0.7 else cache.abort)(seq)
        elif kind == 6:
            cache.append(seq, [rng.choice([0, 1, 2])])
        elif kind == 7:
            receipts.append(cache.pin(seq))
        elif kind == 8 and receipts:
            cache.unpin(receipts.pop(rng.randrange(len(receipts))))
        elif kind == 9:
            cache.evict(rng.randint(0, 3))
        elif kind == 10:
            cache.evict_checkpoints(rng.randint(0, 2))
        elif kind == 11 and cache.pending():
            cache.complete(rng.choice(cache.pending()))
        else:
            cache.poll()

    def checked(kind: int, seq: ModelSequence | None) -> None:
        before = cache.snapshot()
        try:
            act(kind, seq)
        except CacheError:
            assert cache.snapshot() == before
        consistent(cache)

    for _ in range(200):
        count = len(seqs)
        checked(
            rng.choice([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 11, 12]),
            rng.choice(seqs) if seqs else None,
        )
        if len(seqs) > count and seqs[-1].restore is not None and rng.random() < 0.5:
            checked(4, seqs[-1])  # restore right after a checkpoint hit
        seqs = [s for s in seqs if s.live]

    for s in seqs:
        cache.release(s)
    for r in receipts:
        cache.unpin(r)
    settle(cache)
    cache.evict(10**6)
    cache.evict_checkpoints(10**6)
    snap = consistent(cache)
    assert cache.num_free_blocks == snap["capacity"]
    assert cache.num_free_checkpoint_slots == snap["slot_capacity"]
    assert cache.num_cached_blocks == 0
    st = cache.stats
    assert all(v >= 0 for v in st.values())
    assert st["hit_tokens"] <= st["query_tokens"]
