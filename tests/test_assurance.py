"""Regression tests for issue 12 (Assurance): items 2-5, 11 and 13-20.

Items 2-11 are holes the audit found; each test failed before its fix. Items
13-20 are behaviours the code had but no fast test pinned down; each test
names the injected bug (mutant) it kills.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cache import (
    AllocationFailed,
    BlockRemoved,
    BlockStored,
    BlockTrie,
    CacheConfig,
    CacheError,
    Copy,
    InvalidArgument,
    InvalidType,
    ManualCopies,
    OutOfBlocks,
    PinError,
    Sequence,
    SequenceNotLive,
)
from cache.lru import LRUIndex
from spec.snapshot import Snapshot
from tests.helpers import empty_state, frozen, kv_trie, ssm_trie, state

PROMPT = [1, 1, 1, 1, 2, 2, 2, 2, 3]


def _prefill(trie: BlockTrie, tokens: list[int], namespace: str = "") -> Sequence:
    seq = trie.match(tokens, namespace=namespace)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def _ckpt_steps(trie: BlockTrie) -> list[int]:
    return sorted(c["step"] for c in trie.snapshot()["checkpoints"].values())


# ------------------------------------------------------------------ item 2


def test_keyboard_interrupt_inside_a_copy_leaves_nothing_half_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    before = frozen(trie.snapshot())

    def interrupted(self: Copy) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Copy, "run", interrupted)
        with pytest.raises(KeyboardInterrupt):  # never swallowed
            trie.save(seq, 4, state(7.0))
    assert frozen(trie.snapshot()) == before, "the interrupted save is undone"
    assert trie.stats.pins == 0
    trie.check()
    trie.release(seq)
    hit = trie.match([*PROMPT[:4], 9])
    assert hit.restore is None, "no checkpoint whose data never arrived is matchable"
    trie.release(hit)
    trie.clear()  # nothing leaked: clear is allowed
    trie.check()


# ------------------------------------------------------------------ item 3


def test_manual_copies_fail_drops_the_checkpoint_releases_pins_and_errors_dependents() -> None:
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    save = trie.save(seq, 4, state(5.0))
    assert save is not None
    trie.release(seq)
    hit = trie.match([*PROMPT[:4], 9, 9])
    assert hit.restore is not None and hit.restore.step == 4  # published while in flight
    out = empty_state()
    restore = trie.restore(hit, out)
    copies.fail(save)  # type: ignore[attr-defined]
    assert save not in copies.pending()
    with pytest.raises(CacheError):
        copies.complete(restore)  # it read a slot whose data never arrived
    trie.poll()
    snap = trie.snapshot()
    assert snap["checkpoints"] == {}, "the failed save's checkpoint is dropped"
    assert snap["copies"] == {}
    assert trie.stats.pins == 0, "the failed copies' pins are released"
    assert trie.match([*PROMPT[:4], 9]).restore is None
    copies.complete_all()  # nothing left that can never complete
    trie.check()


def test_a_failing_copy_can_be_failed_and_later_copies_on_its_slot_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trie, copies = ssm_trie(slots=1)
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    broken = trie.save(seq, 4, state(1.0))
    assert broken is not None
    with monkeypatch.context() as patch:
        patch.setattr(Copy, "run", lambda self: (_ for _ in ()).throw(RuntimeError("CUDA error")))
        with pytest.raises(RuntimeError):
            copies.complete(broken)
    copies.fail(broken)  # type: ignore[attr-defined]
    trie.poll()
    again = trie.save(seq, 8, state(2.0))  # reuses the only slot
    assert again is not None
    copies.complete(again)
    assert trie.poll() == 1
    assert trie.stats.pins == 0
    trie.release(seq)
    trie.clear()
    trie.check()


def test_manual_copies_fail_refuses_bad_arguments() -> None:
    copies = ManualCopies()
    with pytest.raises(InvalidType, match="Copy"):
        copies.fail("copy")  # type: ignore[attr-defined]
    trie, _ = ssm_trie()
    seq = _prefill(trie, PROMPT)
    foreign = trie.save(seq, 4, state(1.0))
    with pytest.raises(InvalidArgument, match="ManualCopies"):
        copies.fail(foreign)  # type: ignore[attr-defined]


# ------------------------------------------------------------------ item 4


def test_an_oom_in_a_replacing_save_does_not_lose_the_old_checkpoint_silently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    assert trie.save(seq, 5, state(1.0)) is not None  # anchor: block 1, frozen tail [2]
    evicted = trie.stats.evicted_checkpoints

    def oom(self: Copy) -> None:
        raise torch.OutOfMemoryError("simulated OOM in copy_")

    with monkeypatch.context() as patch:
        patch.setattr(Copy, "run", oom)
        with pytest.raises(CacheError):
            trie.save(seq, 6, state(2.0))  # would replace step 5 on the same anchor
    trie.check()
    kept = _ckpt_steps(trie) == [5]
    counted = trie.stats.evicted_checkpoints == evicted + 1
    assert kept or counted, "a replaced checkpoint is either kept or counted as evicted"
    trie.release(seq)
    if kept:
        assert trie.match([*PROMPT[:5], 9]).num_cached_tokens == 5


# ------------------------------------------------------------------ item 5


def test_saving_a_state_that_requires_grad_keeps_the_pool_out_of_autograd() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    weight = torch.ones((), dtype=torch.float64, requires_grad=True)
    for i in range(20):
        runtime = {k: v * weight for k, v in state(float(i)).items()}  # forward without no_grad
        trie.save(seq, 1 + i % 8, runtime)
    for name, pool in trie.checkpoint_states.items():
        assert not pool.requires_grad and pool.grad_fn is None, name
    trie.release(seq)
    hit = trie.match([*PROMPT, 4])
    out = empty_state()
    trie.restore(hit, out)
    assert not out["conv"].requires_grad
    trie.release(hit)
    trie.check()


# ----------------------------------------------------------------- item 11


def test_concurrent_use_from_four_threads_is_detected() -> None:
    trie = kv_trie(num_blocks=64)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(k: int) -> None:
        try:
            for i in range(3000):
                if stop.is_set():
                    return
                tokens = [k, i % 3, 1, 2, (i * 7) % 5, 1, 2, 3, k]
                seq = trie.match(tokens)
                trie.allocate(seq, len(tokens))
                trie.commit(seq, len(tokens))
                trie.release(seq)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert errors, "concurrent use went unnoticed"
    wrong = [e for e in errors if not isinstance(e, CacheError)]
    assert not wrong, f"concurrent use surfaced as raw errors: {wrong!r}"
    assert any("thread" in str(e) or "concurrent" in str(e) for e in errors), errors


# ----------------------------------------------------------------- item 13


def test_make_room_blocked_by_a_pinned_interior_anchor_evicts_nothing() -> None:
    """Kills: `_reclaimable` ignoring the parent's pin (pins=0 in its implied state)."""
    trie, _ = ssm_trie(num_blocks=3, manual=False)
    seq = _prefill(trie, PROMPT)  # A=[1,1,1,1] and leaf L=[2,2,2,2] cached, one private block
    trie.save(seq, 4, state(1.0))  # checkpoint on A
    trie.release(seq)
    hit = trie.match([*PROMPT[:4], 5])
    receipt = trie.pin(hit)  # A: block refs 1 once hit is gone, pinned by the receipt
    trie.abort(hit)
    assert trie.num_free_blocks == 1 and trie.num_evictable_blocks == 1  # only L
    hungry = trie.match([9] * 9)  # 3 blocks: 1 free + L; A is pinned
    before = frozen(trie.snapshot())
    with pytest.raises(OutOfBlocks):
        trie.allocate(hungry, 9)
    assert frozen(trie.snapshot()) == before, "nothing was evicted before failing"
    trie.unpin(receipt)
    trie.allocate(hungry, 9)  # now A can go too
    assert trie.stats.evicted_blocks == 2
    trie.release(hungry)
    trie.check()


# ----------------------------------------------------------------- item 14


def test_make_room_evicts_exactly_the_missing_frozen_tails() -> None:
    """Kills: `_free_node` not counting the frozen tail it frees; `evict_frozen_tails`
    using `>` for its stop test; `_reclaimable` not counting an evicted leaf's tail."""
    trie, _ = ssm_trie(num_blocks=10, slots=4, manual=False)
    idle = _prefill(trie, PROMPT)
    trie.save(idle, 5, state(1.0))  # on A (inner once L exists), frozen tail
    trie.save(idle, 9, state(2.0))  # on the leaf L, frozen tail
    trie.release(idle)  # L then A evictable: 2 nodes + 2 tails reclaimable by KV eviction
    held = _prefill(trie, [7, 7, 7, 7, 8, 8, 8, 8, 9])
    trie.save(held, 6, state(3.0))  # on held nodes: only their tails are reclaimable
    trie.save(held, 9, state(4.0))
    assert trie.num_free_blocks == 1
    evicted_ckpts = trie.stats.evicted_checkpoints
    hungry = trie.match([5] * 21)
    trie.allocate(hungry, 21)  # 6 blocks: 1 free + 4 by KV eviction + exactly 1 frozen tail
    assert trie.stats.evicted_blocks == 5
    assert trie.stats.evicted_checkpoints == evicted_ckpts + 3
    assert _ckpt_steps(trie) == [9], "the least recent held tail (step 6) went, step 9 stayed"
    assert trie.num_free_blocks == 0
    trie.release(hungry)
    trie.release(held)
    trie.check()


# ----------------------------------------------------------------- item 15


def test_match_falls_back_to_a_shallower_checkpoint_when_the_tail_differs() -> None:
    """Kills: `_matching_checkpoint` stopping (break / return None) at the first
    checkpoint whose partial tail differs instead of trying shallower anchors."""
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, [1, 2, 3, 4, 5, 6, 7])
    trie.save(seq, 2, state(1.0))  # root anchor, tail [1, 2]
    trie.save(seq, 5, state(2.0))  # depth-1 anchor, tail [5]
    trie.release(seq)
    hit = trie.match([1, 2, 3, 4, 9, 9])
    assert hit.num_cached_tokens == 2
    assert hit.restore is not None and hit.restore.step == 2
    assert hit.block_ids == ()
    trie.release(hit)
    assert trie.match([1, 2, 3, 4, 5, 9]).num_cached_tokens == 5
    trie.check()


# ----------------------------------------------------------------- item 16


def test_clear_frees_and_counts_a_root_anchored_checkpoint() -> None:
    """Kills: `clear` skipping root checkpoints, or not counting them."""
    trie, _ = ssm_trie(num_blocks=8, slots=2, manual=False)
    seq = _prefill(trie, [1, 2, 3, 4, 5, 6])
    trie.save(seq, 3, state(1.0))  # root anchor, frozen tail [1, 2, 3]
    trie.release(seq)
    evicted = trie.stats.evicted_checkpoints
    trie.clear()
    assert trie.num_free_checkpoint_slots == 2
    assert trie.num_free_blocks == 8, "the frozen tail block is freed too"
    assert trie.stats.evicted_checkpoints == evicted + 1
    assert trie.snapshot()["checkpoints"] == {}
    assert trie.match([1, 2, 3, 4]).restore is None
    trie.check()


# ----------------------------------------------------------------- item 17


class _Item:
    def __init__(self, tick: int, serial: int) -> None:
        self.tick = tick
        self.serial = serial

    def __repr__(self) -> str:
        return f"_Item({self.tick}, {self.serial})"


def test_lru_index_equal_ticks_keep_both_lower_serial_first_either_removable() -> None:
    """Kills: the bucket kept in insertion order (append for insort), a bucket
    overwritten on an equal tick, `remove` dropping the whole bucket."""
    index: LRUIndex[_Item] = LRUIndex()
    late, early, other = _Item(5, 9), _Item(5, 2), _Item(7, 1)
    index.add(other)
    index.add(late)
    index.add(early)
    assert len(index) == 3 and late in index and early in index
    assert index.oldest() is early
    assert list(index) == [early, late, other]
    index.remove(late)
    assert len(index) == 2 and late not in index and index.oldest() is early
    index.add(late)
    index.remove(early)
    assert index.oldest() is late and list(index) == [late, other]
    index.remove(late)
    assert index.oldest() is other and len(index) == 1
    index.remove(other)
    assert not index and len(index) == 0 and list(index) == []


def test_lru_index_survives_heap_rebuilds_and_stale_ticks() -> None:
    index: LRUIndex[_Item] = LRUIndex()
    items = [_Item(t, t) for t in range(300)]
    for item in items:
        index.add(item)
    for item in items[:250]:
        index.remove(item)
    assert index.oldest() is items[250]
    for t in range(300, 500):  # many new ticks: the stale heap is rebuilt
        index.add(_Item(t, t))
    assert index.oldest() is items[250]
    assert len(index) == 250
    assert sorted(o.tick for o in index.unordered()) == [o.tick for o in index]


# ----------------------------------------------------------------- item 18


def test_event_hashes_differ_per_block_and_chain_to_the_parent() -> None:
    """Kills: every block hash set to 0 (or to the key's hash alone, without the parent)."""
    trie = kv_trie()
    serve_tokens = [1, 1, 1, 1, 1, 1, 1, 1, 2]  # two blocks with equal tokens, different parents
    seq = _prefill(trie, serve_tokens)
    trie.release(seq)
    seq = _prefill(trie, [1, 1, 1, 1, 1, 1, 1, 1, 5, 5, 5, 5, 6])
    trie.release(seq)
    seq = _prefill(trie, [1, 1, 1, 1, 1], namespace="other")
    trie.release(seq)
    first, second, third = trie.drain_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert isinstance(third, BlockStored)
    hashes = [*first.block_hashes, *second.block_hashes, *third.block_hashes]
    assert len(set(hashes)) == len(hashes) == 4, hashes
    assert second.parent_block_hash == first.block_hashes[-1]
    assert first.parent_block_hash is None and third.parent_block_hash is None
    trie.evict(10)
    removed = [
        h for e in trie.drain_events() if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert sorted(removed) == sorted(hashes), "a removed block carries its stored hash"


# ----------------------------------------------------------------- item 19


def test_evict_checkpoints_skips_pinned_checkpoints() -> None:
    """Kills: pinned checkpoints left in the checkpoint LRU (entering `pinned` not removing it)."""
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.save(seq, 8, state(2.0))
    trie.release(seq)
    hit = trie.match([*PROMPT[:4], 9])  # pins step 4
    assert trie.evict_checkpoints(10) == 1
    assert _ckpt_steps(trie) == [4]
    trie.release(hit)
    assert trie.evict_checkpoints(10) == 1
    trie.check()


def test_frozen_tail_reclaim_skips_pinned_checkpoints() -> None:
    """Kills: make-room counting or evicting the frozen tail of a pinned checkpoint."""
    trie, _ = ssm_trie(num_blocks=4, manual=False)
    seq = _prefill(trie, [1, 1, 1, 1, 2, 2, 3])
    trie.save(seq, 6, state(1.0))  # frozen tail on A, which seq holds
    hit = trie.match([1, 1, 1, 1, 2, 2, 9])
    receipt = trie.pin(hit)
    trie.abort(hit)
    assert trie.num_free_blocks == 1
    hungry = trie.match([9] * 5)
    before = frozen(trie.snapshot())
    with pytest.raises(OutOfBlocks):
        trie.allocate(hungry, 5)  # 2 blocks: 1 free, and the only tail is pinned
    assert frozen(trie.snapshot()) == before
    trie.unpin(receipt)
    trie.allocate(hungry, 5)
    assert _ckpt_steps(trie) == []
    trie.release(hungry)
    trie.release(seq)
    trie.check()


def test_reaping_a_copy_releases_only_its_own_pin() -> None:
    """Kills: unpin firing `unpin_last` regardless of the count (the checkpoint
    re-enters the LRU while a receipt still pins it, and is then evicted)."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    save = trie.save(seq, 4, state(1.0))
    assert save is not None
    trie.release(seq)
    hit = trie.match([*PROMPT[:4], 9])
    receipt = trie.pin(hit)
    trie.abort(hit)
    copies.complete(save)
    assert trie.poll() == 1
    assert trie.evict_checkpoints(1) == 0, "the receipt still pins it"
    assert trie.evict(10) == 1, "only the unpinned leaf goes; the pinned anchor stays"
    assert _ckpt_steps(trie) == [4]
    trie.unpin(receipt)
    with pytest.raises(PinError):
        trie.unpin(receipt)
    assert trie.evict_checkpoints(1) == 1
    trie.check()


def test_a_restore_completed_first_runs_after_the_save_it_reads() -> None:
    """Kills: `ManualCopies.complete` not completing earlier copies on the same slot."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    save = trie.save(seq, 6, state(6.0))
    assert save is not None
    trie.release(seq)
    hit = trie.match([*PROMPT[:6], 9])
    out = empty_state()
    restore = trie.restore(hit, out)
    copies.complete(restore)
    assert save.done and restore.done
    assert torch.equal(out["conv"], state(6.0)["conv"])
    assert torch.equal(out["ssm"], state(6.0)["ssm"])
    block = hit.block_ids[1]
    assert trie.kv_cache is not None
    assert torch.equal(trie.kv_cache[block], trie.kv_cache[seq.block_ids[1]])
    trie.poll()
    trie.release(hit)
    trie.check()


# ----------------------------------------------------------------- item 20


def test_error_messages_name_the_object_and_the_rule() -> None:
    """Kills: mutated or emptied messages (mutmut's string mutants) on these paths."""
    trie, _ = ssm_trie(num_blocks=3, manual=False)
    seq = _prefill(trie, PROMPT)
    with pytest.raises(OutOfBlocks, match=r"need 3 KV blocks: 0 free .*\(capacity 3\)"):
        trie.allocate(trie.match([9] * 9), 9)
    with pytest.raises(InvalidArgument, match=r"allocate: num_tokens=10 outside 0\.\.9"):
        trie.allocate(seq, 10)
    with pytest.raises(InvalidArgument, match=r"commit: num_tokens=1 must be in 9\.\.9"):
        trie.commit(seq, 1)
    with pytest.raises(InvalidType, match=r"^num_tokens must be an int, got str$"):
        trie.commit(seq, "1")
    with pytest.raises(InvalidArgument, match=r"save: step=10 outside 1\.\.9 for <Sequence #1"):
        trie.save(seq, 10, state(1.0))
    trie.release(seq)
    with pytest.raises(SequenceNotLive, match=r"<Sequence #1 done .*> was already released"):
        trie.release(seq)
    with pytest.raises(InvalidType, match=r"expected a Sequence from this cache, got int"):
        trie.release(1)
    with pytest.raises(InvalidArgument, match=r"tokens must be in \[0, 2\*\*64\); found -1"):
        trie.match([1, -1])
    with pytest.raises(InvalidType, match=r"tokens must contain only integers; found 'a'"):
        trie.match([1, "a"])
    from cache import ConfigError

    with pytest.raises(ConfigError, match=r"CacheConfig\.block_size must be > 0, got 0"):
        CacheConfig(block_size=0, num_blocks=1)
    with pytest.raises(ConfigError, match=r"CacheConfig\.num_checkpoint_slots must be >= 0"):
        CacheConfig(block_size=1, num_blocks=1, num_checkpoint_slots=-1)


# ------------------------------------------- fault injection under capacity pressure


def _script() -> list[tuple[str, Callable[[BlockTrie, dict[str, Any]], object]]]:
    """A workload on a small cache that is full from op 7 on: allocate, save and
    restore must make room (KV leaves, frozen tails, a checkpoint for a slot)."""

    def match(name: str, tokens: list[int]) -> Callable[[BlockTrie, dict[str, Any]], object]:
        return lambda t, c: c.__setitem__(name, t.match(tokens))

    def alloc(name: str, n: int) -> Callable[[BlockTrie, dict[str, Any]], object]:
        return lambda t, c: t.allocate(c[name], n)

    def commit(name: str, n: int) -> Callable[[BlockTrie, dict[str, Any]], object]:
        return lambda t, c: t.commit(c[name], n)

    def save(name: str, step: int, value: float) -> Callable[[BlockTrie, dict[str, Any]], object]:
        return lambda t, c: t.save(c[name], step, state(value))

    def restore(name: str) -> Callable[[BlockTrie, dict[str, Any]], object]:
        return lambda t, c: t.restore(c[name], empty_state())

    def release(name: str) -> Callable[[BlockTrie, dict[str, Any]], object]:
        return lambda t, c: t.release(c[name])

    a = [1, 1, 1, 1, 2, 2, 2, 2, 3]
    return [
        ("match a", match("a", a)),
        ("allocate a", alloc("a", 9)),
        ("commit a", commit("a", 9)),
        ("save a@6", save("a", 6, 1.0)),
        ("save a@9", save("a", 9, 2.0)),
        ("release a", release("a")),
        ("match b", match("b", [4, 4, 4, 4, 5, 5, 5, 5, 6])),
        ("allocate b", alloc("b", 9)),
        ("commit b", commit("b", 9)),
        ("save b@8", save("b", 8, 3.0)),
        ("save b@9", save("b", 9, 4.0)),
        ("release b", release("b")),
        ("match c", match("c", [7] * 13)),
        ("allocate c", alloc("c", 13)),
        ("commit c", commit("c", 13)),
        ("save c@13", save("c", 13, 5.0)),
        ("match d", match("d", [*a, 9])),
        ("restore d", restore("d")),
        ("allocate d", alloc("d", 10)),
        ("commit d", commit("d", 10)),
        ("save d@10", save("d", 10, 6.0)),
        ("release c", release("c")),
        ("match e", match("e", [8] * 17)),
        ("allocate e", alloc("e", 17)),
        ("commit e", commit("e", 17)),
        ("save e@14", save("e", 14, 7.0)),
        ("release d", release("d")),
        ("release e", release("e")),
    ]


def _fresh() -> BlockTrie:
    trie, _ = ssm_trie(num_blocks=10, slots=3, manual=False)
    return trie


def _comparable(snap: Snapshot) -> dict[str, Any]:
    out = frozen(snap)
    out["free_blocks"] = sorted(out["free_blocks"])
    out["free_slots"] = sorted(out["free_slots"])
    return out


def _only_make_room_evictions(before: Snapshot, after: Snapshot) -> None:
    """`after` is `before` less some evicted nodes / checkpoints, counted in the stats."""
    for key in ("sequences", "copies", "explicit_pins", "roots", "refcounts"):
        if key != "refcounts":
            assert after[key] == before[key], key
    gone_nodes = set(before["nodes"]) - set(after["nodes"])
    gone_ckpts = set(before["checkpoints"]) - set(after["checkpoints"])
    assert set(after["nodes"]) <= set(before["nodes"])
    assert set(after["checkpoints"]) <= set(before["checkpoints"])
    for cid in after["checkpoints"]:
        assert after["checkpoints"][cid] == before["checkpoints"][cid], cid
    for nid, node in after["nodes"].items():
        old = before["nodes"][nid]
        for field_name in ("key", "block", "tick", "depth", "parent"):
            assert node[field_name] == old[field_name], (nid, field_name)
    freed = {before["nodes"][n]["block"] for n in gone_nodes}
    freed |= {
        before["checkpoints"][c]["frozen_block"]
        for c in gone_ckpts
        if before["checkpoints"][c]["frozen_block"] is not None
    }
    assert set(after["free_blocks"]) == set(before["free_blocks"]) | freed
    stats_before, stats_after = before["stats"], after["stats"]
    for name, value in stats_after.items():
        if name == "evicted_blocks":
            assert value - stats_before[name] == len(freed)
        elif name == "evicted_checkpoints":
            assert value - stats_before[name] == len(gone_ckpts)
        else:
            assert value == stats_before[name], name


def test_allocation_failures_under_capacity_pressure_leave_only_make_room_evictions() -> None:
    """Every allocation point of every allocate / save / restore of a workload on a
    full cache: the failing operation changes nothing except the make-room evictions
    it did first (they stay done, counted); check() passes; retrying then gives the
    same end state as a run that never failed."""
    script = _script()
    reference = _fresh()
    ctx: dict[str, Any] = {}
    points_per_op: list[int] = []
    for _, op in script:
        reference.faults.reset()
        op(reference, ctx)
        points_per_op.append(len(reference.faults.points))
    reference.check()
    final = _comparable(reference.snapshot())
    assert sum(points_per_op) >= 12, points_per_op
    injected = with_evictions = 0
    for i, points in enumerate(points_per_op):
        for k in range(points):
            trie = _fresh()
            ctx = {}
            for _, op in script[:i]:
                op(trie, ctx)
            before = trie.snapshot()
            clock = trie.clock
            trie.faults.arm(after=k)
            with pytest.raises(AllocationFailed):
                script[i][1](trie, ctx)
            trie.faults.disarm()
            injected += 1
            after = trie.snapshot()
            trie.check()
            assert trie.clock == clock
            if frozen(after) != frozen(before):
                with_evictions += 1
                _only_make_room_evictions(before, after)
            for _, op in script[i:]:
                op(trie, ctx)
            trie.check()
            assert _comparable(trie.snapshot()) == final, f"{script[i][0]}, point {k}"
    assert injected == sum(points_per_op)
    assert with_evictions > 0, "the script must exercise failures after make-room evictions"


def _copy_fault(error: BaseException) -> Callable[[Copy], None]:
    """A `Copy.run` whose first call raises `error`; later calls move the data."""
    real = Copy.run
    calls = [0]

    def run(copy: Copy) -> None:
        calls[0] += 1
        if calls[0] == 1:
            # a fresh instance: the parameter's own would carry this traceback, and so
            # keep this run's trie alive past exit (nanobind's leak check reports it)
            raise type(error)(*error.args)
        real(copy)

    return run


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("CUDA error: an illegal memory access"), id="Exception"),
        pytest.param(KeyboardInterrupt(), id="BaseException"),
    ],
)  # fmt: skip
def test_copy_failures_under_capacity_pressure_leave_only_make_room_evictions(
    error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every save / restore of the full-cache workload, its copy raising when queued:
    the operation raises (a `CacheError`, or the `BaseException` itself), and leaves
    only make-room evictions (a replaced checkpoint counts as evicted); check() passes."""
    script = _script()
    copy_ops = [i for i, (name, _) in enumerate(script) if name.startswith(("save", "restore"))]
    for i in copy_ops:
        trie = _fresh()
        ctx: dict[str, Any] = {}
        for _, op in script[:i]:
            op(trie, ctx)
        before = trie.snapshot()
        with monkeypatch.context() as patch:
            patch.setattr(Copy, "run", _copy_fault(error))
            expected = CacheError if isinstance(error, Exception) else type(error)
            with pytest.raises(expected):
                script[i][1](trie, ctx)
        trie.check()
        if frozen(trie.snapshot()) != frozen(before):
            _only_make_room_evictions(before, trie.snapshot())
        for seq in list(trie.snapshot()["sequences"]):
            trie.release(next(s for s in ctx.values() if s.serial == seq))
        trie.check()
        trie.clear()  # nothing leaked: no copy in flight, no pin left


def test_an_unarmed_fault_injector_does_not_record_every_allocation_forever() -> None:
    """The 10^6-step soak's traced memory grew 215 KiB -> 1.6 MiB: `Faults.points`
    keeps a string per pool take for the trie's whole life, armed or not."""
    trie = kv_trie(num_blocks=4)
    for i in range(2000):
        seq = trie.match([i % 7, 1, 2, 3, 4])
        trie.allocate(seq, 5)
        trie.release(seq)
    assert len(trie.faults.points) < 1000


def test_a_million_allocation_points_leave_the_fault_injector_flat() -> None:
    """Issue 8, item 4: a million unarmed `Faults.check` calls (one per pool take)
    hold no more memory than the first thousand do."""
    import tracemalloc

    from cache.faults import Faults

    faults = Faults()
    tracemalloc.start()
    try:
        for i in range(1_000):
            faults.check(f"kv.take#{i}")
        after_thousand = tracemalloc.get_traced_memory()[0]
        for _ in range(1_000_000):
            faults.check("kv.take")
        after_million = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after_million <= after_thousand + 4096
    assert len(faults.points) < 1_000
