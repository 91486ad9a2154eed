"""SSM checkpoints, pins bound to copy completion, and the seed bug made impossible."""

from __future__ import annotations

import pytest
import torch

from cache import (
    BlockTrie,
    CacheError,
    CheckpointError,
    Copy,
    DeviceCopies,
    IllegalTransition,
    InvalidArgument,
    InvalidType,
    ManualCopies,
    OutOfBlocks,
    PinError,
    Sequence,
)
from tests.helpers import empty_state, frozen, root_of, ssm_trie, state

PROMPT = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]  # two full blocks of 4 and a partial one


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    """Tests that move data with ManualCopies run on CUDA too, where present."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return str(request.param)


def _prefill(trie: BlockTrie, tokens: list[int]) -> Sequence:
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def test_seed_regression_pinned_leaf_is_skipped_until_the_copy_finishes(device: str) -> None:
    trie, copies = ssm_trie(device=device)
    assert copies is not None
    seq = _prefill(trie, [1, 1, 1, 1, 9])
    copy = trie.save(seq, 4, state(1.0, device))  # pins the checkpoint on the leaf
    assert copy is not None and not copy.done
    trie.release(seq)  # the leaf's block is now held by the trie alone
    assert trie.evict(1) == 0, "a leaf whose checkpoint is pinned is never evicted"
    assert trie.num_cached_blocks == 1
    trie.check()
    copies.complete(copy)
    assert trie.evict(1) == 0, "the pin lasts until the copy is reaped"
    assert trie.poll() == 1
    assert trie.evict(1) == 1
    assert trie.num_cached_blocks == 0
    assert trie.num_free_checkpoint_slots == 4
    trie.check()


def test_evicting_a_pinned_node_is_an_illegal_transition() -> None:
    trie, _ = ssm_trie()
    seq = _prefill(trie, [1, 1, 1, 1, 9])
    trie.save(seq, 4, state(1.0))
    trie.release(seq)
    node = root_of(trie).child_nodes()[0]
    with pytest.raises(IllegalTransition):
        trie._evictor._free(node.id)  # what lmdeploy's eviction did
    trie.check()


def test_an_ssm_hit_checks_atomic_spans_at_its_checkpoint_not_at_block_ends() -> None:
    """[R13], [R65]: an SSM hit ends at a checkpoint, which may sit inside a block, so
    the spans are checked at the checkpoint's step. A hit of 6 tokens ends inside
    neither (7, 9) nor (3, 5), though the block ends around it (8, then 4) each end
    inside one: the hit is the checkpoint's 6 tokens, not cut back to nothing."""
    trie, _copies = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    assert trie.save(seq, 6, state(6.0)) is not None
    trie.release(seq)
    for spans, hit in (([], 6), ([(7, 9), (3, 5)], 6), ([(5, 7)], 0)):
        again = trie.match(PROMPT, atomic_spans=spans)
        assert again.num_cached_tokens == hit, spans
        trie.abort(again)
    trie.check()


def test_ssm_match_ends_at_the_deepest_published_checkpoint() -> None:
    trie, _copies = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(4.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 5])
    assert hit.num_cached_tokens == 4, "KV deeper than the checkpoint is not a hit"
    assert hit.branch_step == 8
    assert hit.restore is not None and hit.restore.step == 4
    assert len(hit.block_ids) == 1
    trie.check()


def test_kv_only_path_is_a_miss_under_ssm() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.release(seq)
    hit = trie.match([*PROMPT, 5])
    assert hit.num_cached_tokens == 0 and hit.restore is None
    assert hit.branch_step == 8, "branch_step still tells where the KV path ends"
    trie.check()


def test_restore_reads_back_exactly_what_was_saved(device: str) -> None:
    trie, copies = ssm_trie(device=device)
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    saved = state(42.0, device)
    save_copy = trie.save(seq, 8, saved)
    assert save_copy is not None
    saved["ssm"].fill_(-1)  # late copy: the engine must wait before overwriting
    trie.release(seq)
    hit = trie.match([*PROMPT, 5])
    out = empty_state(device)
    restore_copy = trie.restore(hit, out)
    copies.complete(restore_copy)  # completes the save first (same slot)
    assert save_copy.done
    assert torch.equal(out["ssm"].cpu(), torch.full((3,), -1.0, dtype=torch.float64))
    assert torch.equal(out["conv"].cpu(), torch.full((2, 3), 42.0, dtype=torch.float64))
    assert trie.poll() == 2
    trie.check()


def test_partial_checkpoint_tail_identity_and_frozen_block() -> None:
    trie, _copies = ssm_trie(num_blocks=8, manual=False)
    seq = _prefill(trie, PROMPT)
    kv = trie.kv_cache
    assert kv is not None
    kv[seq.block_ids[2]].fill_(7.0)  # the partial block's KV
    free_before = trie.num_free_blocks
    copy = trie.save(seq, 10, state(10.0))
    assert copy is not None and copy.done
    assert trie.num_free_blocks == free_before - 1, "frozen tail block taken from the pool"
    trie.release(seq)
    trie.check()
    other = trie.match([*PROMPT[:9], 4, 5])  # tail differs at token 9
    assert other.num_cached_tokens == 0
    trie.abort(other)
    hit = trie.match([*PROMPT, 5, 6])
    assert hit.num_cached_tokens == 10 and hit.restore is not None and hit.restore.partial
    assert len(hit.block_ids) == 2
    out = empty_state()
    trie.restore(hit, out)  # allocates the private block 2 and copies the frozen tail into it
    assert len(hit.block_ids) == 3
    assert torch.equal(kv[hit.block_ids[2]], torch.full((4, 2), 7.0, dtype=torch.float64))
    assert torch.equal(out["conv"], torch.full((2, 3), 10.0, dtype=torch.float64))
    trie.release(hit)
    trie.check()
    # Evicting the anchor leaf frees its block and the frozen tail together.
    assert trie.evict(1) == 2
    trie.check()


def test_hit_needs_a_token_left_after_the_checkpoint() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 10, state(1.0))
    trie.save(seq, 4, state(2.0))
    trie.release(seq)
    assert trie.match(PROMPT).num_cached_tokens == 4  # 10 would leave nothing to compute
    trie.check()


def test_replacement_at_the_same_anchor_reuses_the_slot() -> None:
    trie, _ = ssm_trie(num_blocks=8, manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 9, state(1.0))
    slots, blocks = trie.num_free_checkpoint_slots, trie.num_free_blocks
    trie.save(seq, 10, state(2.0))  # newer, same anchor (depth 2)
    assert trie.num_free_checkpoint_slots == slots
    assert trie.num_free_blocks == blocks, "the frozen block was reused"
    trie.save(seq, 8, state(3.0))  # block-aligned replacement frees the frozen block
    assert trie.num_free_blocks == blocks + 1
    assert trie.save(seq, 8, state(3.0)) is None
    assert trie.stats.checkpoints_deduplicated == 1
    trie.release(seq)
    trie.check()


def test_a_pinned_checkpoint_is_never_replaced() -> None:
    trie, _copies = ssm_trie()
    seq = _prefill(trie, PROMPT)
    first = trie.save(seq, 9, state(1.0))
    assert first is not None
    assert trie.save(seq, 10, state(2.0)) is None, "in flight: skipped, not replaced"
    assert trie.stats.checkpoints_skipped == 1
    assert trie.save(seq, 10, state(3.0)) is None, "still in flight"
    assert trie.stats.checkpoints_skipped == 2, "each skip is counted"
    trie.release(seq)
    trie.check()


def test_save_is_skipped_when_no_slot_can_be_found() -> None:
    trie, copies = ssm_trie(slots=1)
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    assert trie.save(seq, 4, state(1.0)) is not None
    assert trie.save(seq, 8, state(2.0)) is None  # the only slot is pinned
    assert trie.stats.checkpoints_skipped == 1
    copies.complete_all()
    trie.poll()
    assert trie.save(seq, 8, state(2.0)) is not None  # evicts the LRU checkpoint
    assert trie.stats.evicted_checkpoints == 1
    trie.release(seq)
    trie.check()


def test_evict_checkpoints_keeps_the_kv_nodes() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.save(seq, 10, state(2.0))
    trie.release(seq)
    cached, free = trie.num_cached_blocks, trie.num_free_blocks
    assert trie.evict_checkpoints(5) == 2
    assert trie.num_cached_blocks == cached
    assert trie.num_free_blocks == free + 1, "frozen tail returned"
    assert trie.num_free_checkpoint_slots == 4
    trie.check()


def test_explicit_pins_are_single_use_receipts() -> None:
    trie, _copies = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 1])
    receipt = trie.pin(hit)
    trie.restore(hit, empty_state())  # CPU: done at once, the match pin goes
    trie.release(hit)
    assert trie.evict(10) == 1, "the pinned anchor and its ancestors stay"
    before = frozen(trie.snapshot())
    trie.unpin(receipt)
    with pytest.raises(PinError):
        trie.unpin(receipt)
    other, _ = ssm_trie()
    with pytest.raises(PinError):
        other.unpin(receipt)
    with pytest.raises(InvalidType):
        trie.unpin("receipt")  # type: ignore[arg-type]
    assert frozen(trie.snapshot()) != before
    assert trie.evict(10) == 1
    trie.check()


def test_pin_after_the_checkpoint_was_evicted_is_impossible() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 1])
    trie.restore(hit, empty_state())  # the pin is released with the finished copy
    assert trie.evict_checkpoints(1) == 1
    with pytest.raises(IllegalTransition):
        trie.pin(hit)
    trie.release(hit)
    trie.check()


def test_abort_releases_the_match_pin_and_undoes_stats() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 8, state(1.0))
    trie.release(seq)
    before = frozen(trie.snapshot())
    hit = trie.match([*PROMPT, 1])
    assert hit.restore is not None
    trie.abort(hit)
    assert frozen(trie.snapshot()) == before


def test_abort_after_restore_keeps_the_copy_pin_until_it_finishes(device: str) -> None:
    trie, copies = ssm_trie(device=device)
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    copies.complete_all()
    trie.save(seq, 10, state(1.0, device))
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    hit = trie.match([*PROMPT, 1])
    copy = trie.restore(hit, empty_state(device))
    trie.abort(hit)
    assert trie.evict(10) == 0, "the restore copy still reads the checkpoint"
    trie.check()
    copies.complete(copy)
    trie.poll()
    assert trie.evict(10) == 3  # two blocks and the frozen tail
    trie.check()


def test_restore_errors() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = trie.match([1, 2, 3])
    with pytest.raises(CheckpointError):
        trie.restore(seq, empty_state())
    with pytest.raises(CheckpointError):
        trie.pin(seq)
    trie.allocate(seq, 3)
    trie.commit(seq, 3)
    trie.save(seq, 2, state(1.0))
    trie.release(seq)
    hit = trie.match([1, 2, 3])
    trie.restore(hit, empty_state())
    with pytest.raises(CheckpointError, match="already restored"):
        trie.restore(hit, empty_state())
    trie.release(hit)
    trie.check()


@pytest.mark.parametrize(
    ("step", "runtime", "error"),
    [
        (0, None, InvalidArgument),
        (11, None, InvalidArgument),
        (True, None, InvalidType),
        (9, {"conv": torch.zeros(2, 3)}, InvalidArgument),  # missing "ssm"
        (9, {"conv": torch.zeros(2, 3), "ssm": torch.zeros(4)}, InvalidArgument),
        (9, {"conv": torch.zeros(2, 3), "ssm": [0, 0, 0]}, InvalidType),
        (9, [1, 2], InvalidType),
    ],
)
def test_save_validates_and_changes_nothing(step: int, runtime: object, error: type) -> None:
    trie, _ = ssm_trie()
    seq = _prefill(trie, PROMPT)
    before = frozen(trie.snapshot())
    with pytest.raises(error):
        trie.save(seq, step, runtime if runtime is not None else state(1.0))  # type: ignore[arg-type]
    assert frozen(trie.snapshot()) == before


def test_save_needs_the_anchor_committed() -> None:
    trie, _ = ssm_trie()
    seq = trie.match(PROMPT)
    trie.allocate(seq, 10)
    trie.commit(seq, 3)
    with pytest.raises(CheckpointError, match="committed"):
        trie.save(seq, 8, state(1.0))
    assert trie.save(seq, 3, state(1.0)) is not None  # anchor 0: the root
    trie.release(seq)
    trie.check()


@pytest.mark.parametrize("point", range(4))
def test_allocation_failure_at_each_point_leaves_the_snapshot_unchanged(point: int) -> None:
    """Fault injection: every allocation point of match, restore and save."""
    trie, copies = ssm_trie(num_blocks=16)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 10, state(1.0))
    assert copies is not None
    copies.complete_all()
    trie.poll()
    trie.release(seq)

    def scenario() -> None:
        hit = trie.match([*PROMPT, 5, 6, 7])  # match: no allocation point
        trie.restore(hit, empty_state())  # restore: the private tail block (kv.take)
        trie.allocate(hit, 13)
        trie.commit(hit, 13)
        trie.save(hit, 13, state(2.0))  # save: slot, then frozen block

    trie.faults.reset()
    base = frozen(trie.snapshot())
    scenario()
    points = list(trie.faults.points)
    assert points == ["kv.take", "kv.take", "slots.take", "kv.take"]
    # Rebuild the same state and fail at `point`.
    trie2, copies2 = ssm_trie(num_blocks=16)
    seq2 = _prefill(trie2, PROMPT)
    trie2.save(seq2, 10, state(1.0))
    assert copies2 is not None
    copies2.complete_all()
    trie2.poll()
    trie2.release(seq2)
    assert frozen(trie2.snapshot()) == base
    trie2.faults.arm(after=point)
    hit = trie2.match([*PROMPT, 5, 6, 7])
    steps = [
        lambda: trie2.restore(hit, empty_state()),
        lambda: trie2.allocate(hit, 13),
        lambda: trie2.save(hit, 13, state(2.0)),
        lambda: trie2.save(hit, 13, state(2.0)),
    ]
    if point >= 2:
        steps[0]()
        steps[1]()
        trie2.commit(hit, 13)
    elif point == 1:
        steps[0]()
    before = frozen(trie2.snapshot())
    with pytest.raises(CacheError, match="injected"):
        steps[point]()
    assert frozen(trie2.snapshot()) == before
    trie2.check()


def test_manual_copies_complete_dependencies_first(device: str) -> None:
    trie, copies = ssm_trie(device=device)
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    save = trie.save(seq, 8, state(5.0, device))
    trie.release(seq)
    hit = trie.match([*PROMPT, 1])
    out = empty_state(device)
    restore = trie.restore(hit, out)
    assert save is not None
    assert copies.pending() == [save, restore]
    copies.complete(restore)
    assert save.done and restore.done
    assert torch.equal(out["conv"].cpu(), torch.full((2, 3), 5.0, dtype=torch.float64))
    with pytest.raises(CacheError):
        ManualCopies().complete(save)


def test_cuda_copies_when_a_gpu_is_present() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    trie, _ = ssm_trie(manual=False, device="cuda")
    seq = _prefill(trie, PROMPT)
    runtime = {k: v.cuda() for k, v in state(3.0).items()}
    copy = trie.save(seq, 10, runtime)
    assert copy is not None
    trie.release(seq)
    assert trie.evict(10) == 0
    copy.wait()
    torch.cuda.synchronize()
    assert copy.done
    assert trie.poll() == 1
    hit = trie.match([*PROMPT, 1])
    out = {k: v.cuda() for k, v in empty_state().items()}
    trie.restore(hit, out).wait()
    torch.cuda.synchronize()
    assert torch.equal(out["conv"].cpu(), state(3.0)["conv"])
    trie.poll()
    trie.release(hit)
    trie.check()


def test_restore_refuses_to_write_a_frozen_tail_into_a_committed_block() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 10, state(1.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 3, 3, 5])  # hit 10; block 2 = [3, 3, 3, 3]
    trie.allocate(hit, 13)
    trie.commit(hit, 12)  # block 2 is now a shared trie node
    before = frozen(trie.snapshot())
    with pytest.raises(CheckpointError, match="restore before prefill"):
        trie.restore(hit, empty_state())
    assert frozen(trie.snapshot()) == before
    trie.release(hit)
    trie.check()


def test_slot_pool_raises_out_of_state_slots_when_full() -> None:
    from cache import OutOfStateSlots
    from cache.faults import Faults
    from cache.state_pool import CheckpointSlotPool

    pool = CheckpointSlotPool(1, {"ssm": (2,)}, torch.float32, torch.device("cpu"), Faults())
    slot = pool.take()
    with pytest.raises(OutOfStateSlots):
        pool.take()
    pool.give(slot)
    with pytest.raises(CacheError, match="double release"):
        pool.give(slot)
    assert pool.num_free == 1


def test_faults_fail_the_armed_point_once() -> None:
    from cache.faults import Faults

    faults = Faults()
    faults.arm(after=1)
    faults.check("a")
    with pytest.raises(CacheError, match="injected allocation failure at b"):
        faults.check("b")
    faults.check("c")  # disarmed after firing
    assert faults.points == ["a", "b", "c"]
    with pytest.raises(ValueError):
        faults.arm(after=-1)


def test_allocate_reclaims_frozen_tails_of_unpinned_checkpoints() -> None:
    """KV eviction alone cannot make room (the tails sit on held or inner
    nodes), but unpinned checkpoints' frozen tails are cache too."""
    trie, _ = ssm_trie(num_blocks=6, manual=False)
    seq = _prefill(trie, PROMPT)  # 3 blocks; blocks 0 and 1 cached
    trie.save(seq, 5, state(1.0))  # frozen tail on an inner node
    trie.save(seq, 10, state(2.0))  # frozen tail on the leaf
    assert trie.num_free_blocks == 1
    hungry = trie.match([9] * 16)
    before = frozen(trie.snapshot())
    with pytest.raises(OutOfBlocks):
        trie.allocate(hungry, 16)  # 4 blocks: beyond even that, so nothing changes
    assert frozen(trie.snapshot()) == before
    trie.allocate(hungry, 8)  # 2 blocks: 1 free + the least recent frozen tail
    assert trie.stats.evicted_checkpoints == 1
    assert trie.stats.evicted_blocks == 1
    assert trie.num_cached_blocks == 2, "the KV nodes stay"
    trie.release(seq)
    assert trie.match([*PROMPT[:5], 7]).num_cached_tokens == 0  # step 5's went first
    assert trie.match([*PROMPT, 7]).num_cached_tokens == 10  # step 10's stays
    trie.check()


def test_collect_looks_at_each_copy_once() -> None:
    """A copy whose event completes while `collect` runs must be reaped then or later."""
    from cache.copies import Copy, CopyEngine
    from spec.lifecycle import CopyTrigger

    class Flaky(CopyEngine):
        def _start(self, copy: Copy) -> None:
            pass

    engine = Flaky()
    finished = Copy("save", 1, [], [], 1)
    finished.fire(CopyTrigger.FINISH)
    racing = Copy("save", 2, [], [], 2)
    engine.queue(finished)
    engine.queue(racing)
    looks = iter([False, True, True])

    class Event:
        def query(self) -> bool:
            return next(looks)

    racing._event = Event()  # type: ignore[assignment]
    assert engine.collect() == [finished]  # `racing` was not done at its one look
    assert engine.collect() == [racing]  # so it is still tracked, and reaped now


def test_runtime_state_that_cannot_take_a_copy_is_refused_up_front() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 8, state(1.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 1])
    before = frozen(trie.snapshot())
    grad = {k: v.clone().requires_grad_(True) for k, v in empty_state().items()}
    with pytest.raises(InvalidArgument, match="requires grad"):
        trie.restore(hit, grad)
    meta = {k: torch.empty_like(v, device="meta") for k, v in state(2.0).items()}
    with pytest.raises(InvalidArgument, match="meta"):
        trie.save(hit, 8, meta)
    assert frozen(trie.snapshot()) == before
    trie.release(hit)
    trie.check()


class _FailingCopies(DeviceCopies):
    """CPU copies that fail while running, after moving part of the data."""

    def _start(self, copy: Copy) -> None:
        raise RuntimeError("simulated copy failure")


def test_a_copy_that_fails_when_queued_is_undone() -> None:
    trie, _ = ssm_trie(manual=False)
    failing = BlockTrie(trie.config, copies=_FailingCopies())
    seq = _prefill(failing, PROMPT)
    before = frozen(failing.snapshot())
    with pytest.raises(CacheError, match="copy failed and was undone"):
        failing.save(seq, 10, state(1.0))
    after = frozen(failing.snapshot())
    assert after["checkpoints"] == {} and after["copies"] == {}
    assert after["free_blocks"] == before["free_blocks"]
    assert after["free_slots"] == before["free_slots"]
    assert failing.stats.checkpoints_saved == 0
    failing.release(seq)
    failing.check()


def test_a_failing_restore_copy_leaves_the_sequence_as_it_was() -> None:
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 10, state(1.0))
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    hit = trie.match([*PROMPT, 3, 9])
    trie.copies = _FailingCopies()  # the next copy fails when queued
    before = frozen(trie.snapshot())
    clock = trie.clock
    with pytest.raises(CacheError, match="undone"):
        trie.restore(hit, empty_state())
    assert frozen(trie.snapshot()) == before
    assert trie.clock == clock
    trie.abort(hit)
    trie.check()


def test_an_engine_serves_one_trie() -> None:
    engine = ManualCopies()
    trie, _ = ssm_trie()
    BlockTrie(trie.config, copies=engine)
    with pytest.raises(CacheError, match="already bound"):
        BlockTrie(trie.config, copies=engine)


def test_completing_another_engines_copy_is_refused() -> None:
    trie, _copies = ssm_trie()
    seq = _prefill(trie, PROMPT)
    copy = trie.save(seq, 8, state(1.0))
    assert copy is not None
    with pytest.raises(InvalidArgument):
        ManualCopies().complete(copy)
    with pytest.raises(InvalidType):
        ManualCopies().complete("copy")  # type: ignore[arg-type]
