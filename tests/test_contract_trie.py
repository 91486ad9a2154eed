"""Contract tests for `cache.trie.BlockTrie` written to kill mutants that survived
`python -m tools.mutation --paths cache/trie.py`: the exact errors each operation
raises, the undo of copies that fail when queued (write-back stores, checkpoint
stores), waiting for write-back stores, and the state a request keeps after a
failed load.

Also pinned here, each with its full message and "nothing changed" after a refusal:
pools that cannot be allocated are a `ConfigError` naming every pool size (and
bind no engine); the `copies` property returns the engine and its setter refuses
a non-engine; `load` refuses while a load the request waits on has failed (its
own, or the load of a block it shares) and is not yet reaped; `commit` refuses a
block equal to one another request is loading (failed, or not done), adopts it
once the failed load is reaped, and shares it once the load is done; a load that
fails when queued gives back the shared blocks it held; an engine whose `wait`
returns before a write-back store is done leaves that store queued; a restore
without a frozen tail that fails when queued gives back no block; and
`repr(trie)` names the block size and counts."""

from __future__ import annotations

import re
import threading
from array import array
from collections.abc import Callable

import pytest
import torch

import cache.storage
from cache import (
    BlockTrie,
    CacheConfig,
    CacheError,
    ConcurrentUse,
    ConfigError,
    Copy,
    CopyEngine,
    DeviceCopies,
    HostTierError,
    ManualCopies,
    OutOfBlocks,
    Sequence,
)
from cache.node import Constant
from cache.sequence import PinReceipt
from spec.errors import (
    CheckpointError,
    InvalidArgument,
    InvalidType,
    PinError,
    SequenceNotLive,
)
from spec.invariants import rollback
from spec.lifecycle import CopyTrigger, Residency
from tests.helpers import empty_state, hit, serve, ssm_trie, state

B = 2
A = [1, 1, 2, 2, 3, 3, 9]  # three full blocks and one token
OTHER = [5, 5, 6, 6, 7, 7, 8, 8, 9]


def host_trie(
    num_blocks: int = 8, host_blocks: int = 16, copies: CopyEngine | None = None, **kw: object
) -> BlockTrie:
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
    return BlockTrie(config, copies=copies)


def compute(trie: BlockTrie, seq: Sequence, tokens: list[int]) -> None:
    """What prefill does: write the KV of every uncached full block."""
    kv = trie.kv_cache
    assert kv is not None
    for i in range(seq.num_cached_tokens // B, len(tokens) // B):
        kv[seq.block_ids[i]] = torch.tensor(tokens[i * B : (i + 1) * B], dtype=torch.float64)


def refused(
    trie: BlockTrie, error: type[Exception], message: str, call: Callable[[], object]
) -> None:
    """`call()` raises `error` with exactly `message`, and the snapshot is unchanged."""
    before = trie.snapshot()
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        call()
    assert trie.snapshot() == before


def prefill(trie: BlockTrie, tokens: list[int]) -> Sequence:
    """match, allocate, compute, commit every full block (no load: nothing on the host)."""
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    compute(trie, seq, tokens)
    trie.commit(seq, len(tokens))
    return seq


def residency(trie: BlockTrie) -> dict[tuple[int, ...], str]:
    """Each attached node's residency, by its tokens."""
    return {
        tuple(n["key"][0]): n["residency"]  # type: ignore[index]
        for n in trie.snapshot()["nodes"].values()
        if n["parent"] is not None
    }


# ------------------------------------------------------------ single-threaded ([R45])


def _operations(trie: BlockTrie, seq: Sequence) -> dict[str, Callable[[], object]]:
    receipt = object()
    return {
        "match()": lambda: trie.match([1, 2, 3]),
        "append()": lambda: trie.append(seq, [4]),
        "allocate()": lambda: trie.allocate(seq, 1),
        "load()": lambda: trie.load(seq),
        "commit()": lambda: trie.commit(seq, 0),
        "release()": lambda: trie.release(seq),
        "abort()": lambda: trie.abort(seq),
        "evict()": lambda: trie.evict(1),
        "evict_host()": lambda: trie.evict_host(1),
        "evict_checkpoints()": lambda: trie.evict_checkpoints(1),
        "clear()": trie.clear,
        "save()": lambda: trie.save(seq, 1, None),
        "restore()": lambda: trie.restore(seq, None),
        "poll()": trie.poll,
        "pin()": lambda: trie.pin(seq),
        "unpin()": lambda: trie.unpin(receipt),  # type: ignore[arg-type]
        "drain_events()": trie.drain_events,
        "drain_event_records()": trie.drain_event_records,
        "copies": lambda: setattr(trie, "copies", ManualCopies()),
        "snapshot()": trie.snapshot,
        "check()": trie.check,
    }


OPERATIONS = [
    "match()", "append()", "allocate()", "load()", "commit()", "release()", "abort()",
    "evict()", "evict_host()", "evict_checkpoints()", "clear()", "save()", "restore()",
    "poll()", "pin()", "unpin()", "drain_events()", "drain_event_records()", "copies",
    "snapshot()", "check()",
]  # fmt: skip


@pytest.mark.parametrize("operation", OPERATIONS)
def test_an_operation_entered_while_another_runs_is_refused_by_name(operation: str) -> None:
    """While one operation holds the trie, any other is refused at once with
    `ConcurrentUse` naming it, before it changes anything; the trie stays usable."""
    trie = host_trie()
    seq = trie.match([1, 2, 3])
    call = _operations(trie, seq)[operation]
    before = trie.snapshot()
    gate = trie._gate
    assert gate.acquire(False)  # an operation is running (as if in another thread)
    # Never let a blocking acquire hang the suite: the gate opens after a while.
    opener = threading.Timer(5.0, gate.release)
    opener.start()
    try:
        message = (
            f"{operation}: this cache is already running an operation in another thread; "
            "a BlockTrie is single-threaded (one scheduler owns it)"
        )
        with pytest.raises(ConcurrentUse, match=f"^{re.escape(message)}$"):
            call()
    finally:
        opener.cancel()
        opener.join()
    assert gate.locked(), "the refused call must not release the running operation's gate"
    gate.release()
    assert trie.snapshot() == before
    trie.release(seq)
    trie.check()


# ----------------------------------------------------------- the hit on the host ([R50])


def test_operations_before_load_name_the_host_blocks_and_the_fix() -> None:
    trie = host_trie()
    trie.release(prefill(trie, A))
    trie.evict(3)
    seq = trie.match(A)
    message = f"allocate: {seq!r} has 3 matched blocks in the host tier; call load(seq) first"
    with pytest.raises(HostTierError, match=f"^{re.escape(message)}$"):
        trie.allocate(seq, 7)
    trie.release(seq)
    trie.check()


def test_after_a_failed_load_allocate_and_commit_refuse_and_say_to_abort() -> None:
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    trie.release(prefill(trie, A))
    copies.complete_all()
    trie.poll()
    trie.evict(10)
    seq = trie.match(A)
    copy = trie.load(seq)
    assert copy is not None
    copies.fail(copy)
    trie.poll()
    before = trie.snapshot()
    message = f"allocate: the load of {seq!r}'s host-resident blocks failed; abort it"
    with pytest.raises(HostTierError, match=f"^{re.escape(message)}$"):
        trie.allocate(seq, 7)
    message = f"commit: the load of {seq!r}'s host-resident blocks failed; abort it"
    with pytest.raises(HostTierError, match=f"^{re.escape(message)}$"):
        trie.commit(seq, 6)
    assert trie.snapshot() == before
    trie.abort(seq)
    trie.check()


def test_a_commit_that_computes_a_host_only_block_stamps_it_with_the_commit_tick() -> None:
    """[R49], [R8]: the adopted node is used at the commit's tick, like a deduplicated one."""
    trie = host_trie()
    trie.release(prefill(trie, A))
    assert trie.evict(1) == 1  # the leaf (3, 3) is host-only now
    seq = trie.match(A[:6])  # hits (1, 1), (2, 2) on the device; computes (3, 3) itself
    assert seq.num_cached_tokens == 4 and seq.num_host_tokens == 0
    trie.allocate(seq, 6)
    compute(trie, seq, A[:6])
    trie.commit(seq, 6)
    (leaf,) = [n for n in trie.snapshot()["nodes"].values() if n["key"] == ((3, 3), None)]
    assert leaf["residency"] == Residency.MIRRORED.value
    assert leaf["tick"] == trie.clock
    trie.abort(seq)  # abort leaves ticks alone
    (leaf,) = [n for n in trie.snapshot()["nodes"].values() if n["key"] == ((3, 3), None)]
    assert leaf["tick"] == trie.clock
    trie.check()


# ---------------------------------------------------------------- write-back ([R52])


class _FailsWhenQueued(DeviceCopies):
    """CPU copies; a copy of `kind` fails when queued while `failing` is set."""

    def __init__(self, kind: str, failing: bool = True) -> None:
        super().__init__()
        self.kind = kind
        self.failing = failing

    def _start(self, copy: Copy) -> None:
        if copy.kind == self.kind and self.failing:
            raise RuntimeError(f"simulated {self.kind} failure")
        super()._start(copy)


def test_a_write_back_store_that_fails_when_queued_leaves_the_leaves_on_the_device() -> None:
    """A failed write-back store is undone: its leaves are `device` leaves again,
    their host blocks free, and they can be evicted outright later."""
    trie = host_trie(copies=_FailsWhenQueued("store"), host_write="back")
    trie.release(prefill(trie, A))
    assert trie.evict(3) == 0  # each round's store fails: nothing freed
    assert set(residency(trie).values()) == {Residency.DEVICE.value}
    assert trie.num_free_host_blocks == 16 and trie.num_host_cached_blocks == 0
    assert trie.num_cached_blocks == 3 and trie.num_evictable_blocks == 1
    assert trie.stats.stored_blocks == 0 and trie.stats.evicted_blocks == 0
    trie.check()


class _WaitedCopies(CopyEngine):
    """An engine whose copies run only when waited on (as a device stream's would
    finish only later): `make_room` can wait for a write-back store."""

    def _start(self, copy: Copy) -> None:
        pass

    def wait(self, copy: Copy) -> None:
        if copy.done:
            return
        copy.run()
        copy.fire(CopyTrigger.FINISH)


def test_make_room_waits_for_the_write_back_stores_an_engine_can_wait_for() -> None:
    trie = host_trie(num_blocks=4, copies=_WaitedCopies(), host_write="back")
    trie.release(prefill(trie, A))  # 3 blocks cached, 1 free
    other = trie.match(OTHER[:3])
    trie.allocate(other, 3)  # 1 short: queues the leaf's store, waits for it, reaps it
    assert len(other.block_ids) == 2
    assert residency(trie) == {(1, 1): "device", (2, 2): "device", (3, 3): "host"}
    assert trie.stats.stored_blocks == 1 and trie.stats.evicted_blocks == 1
    assert trie.poll() == 0, "the waited stores were reaped (and forgotten) already"
    trie.release(other)
    trie.check()


def _short_of_room_behind_a_store(trie: BlockTrie) -> Sequence:
    """A write-back trie of 4 blocks holding A: a request for OTHER's 2 blocks makes room
    by queuing the store of A's last block, is still one short, and is refused with
    `OutOfBlocks` naming the stores in flight. Returns that request."""
    trie.release(prefill(trie, A))
    other = trie.match(OTHER[:3])
    message = (
        "need 2 KV blocks: 1 free; 1 more are freed when the write-back stores in flight "
        "finish (complete them, poll, retry)"
    )
    with pytest.raises(OutOfBlocks, match=f"^{re.escape(message)}$"):
        trie.allocate(other, 3)
    return other


def test_make_room_short_of_blocks_a_manual_store_holds_raises_and_keeps_the_store() -> None:
    """With `ManualCopies`, which cannot wait, room-making that queued a write-back
    store and is still short raises `OutOfBlocks` naming the stores in flight; once
    the test completes them, the same allocation succeeds."""
    copies = ManualCopies()
    trie = host_trie(num_blocks=4, copies=copies, host_write="back")
    other = _short_of_room_behind_a_store(trie)
    (store,) = copies.pending()
    assert store.kind == "store" and not store.done
    copies.complete(store)
    trie.poll()
    trie.allocate(other, 3)
    assert len(other.block_ids) == 2
    trie.release(other)
    trie.check()


# ------------------------------------------------------- checkpoint stores ([R53])


def _ssm_host_trie(copies: CopyEngine) -> BlockTrie:
    config = CacheConfig(
        block_size=B,
        num_blocks=16,
        kv_block_shape=(B,),
        kv_dtype=torch.float64,
        num_checkpoint_slots=2,
        state_shapes={"s": (2,)},
        state_dtype=torch.float64,
        num_host_checkpoint_slots=2,
        enable_events=True,
    )
    return BlockTrie(config, copies=copies)


def test_a_checkpoint_store_that_fails_when_queued_leaves_it_on_the_device_unpinned() -> None:
    """[R53]: a checkpoint store is best effort; one that fails when queued is undone:
    the save stands, the checkpoint stays `device`, its host slot is free again and
    it holds no pin (it can be evicted)."""
    trie = _ssm_host_trie(_FailsWhenQueued("store"))
    seq = prefill(trie, [1, 2, 3, 4, 5])
    save = trie.save(seq, 4, {"s": torch.tensor([7.0, -7.0], dtype=torch.float64)})
    assert save is not None and save.done
    trie.release(seq)
    (ck,) = trie.snapshot()["checkpoints"].values()
    assert ck["residency"] == Residency.DEVICE.value and ck["host_slot"] is None
    assert trie.num_free_host_checkpoint_slots == 2 and trie.num_host_checkpoints == 0
    assert trie.stats.checkpoints_stored == 0
    trie.check()
    assert trie.evict_checkpoints(1) == 1, "no pin left behind by the failed store"
    trie.check()


# ------------------------------------------------------------- argument errors ([R1])

SSM_PROMPT = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]  # two full blocks of 4 and a partial one


def _ssm_prefill(trie: BlockTrie, tokens: list[int], extra: object = None) -> Sequence:
    seq = trie.match(tokens, extra=extra)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def test_malformed_arguments_are_refused_saying_exactly_what_was_wrong() -> None:
    trie, _ = ssm_trie()
    seq = _ssm_prefill(trie, SSM_PROMPT)
    before = trie.snapshot()
    cases: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: trie.evict_host("1"), InvalidType, "n must be an int, got str"),  # type: ignore[arg-type]
        (lambda: trie.evict(1.0), InvalidType, "num_blocks must be an int, got float"),  # type: ignore[arg-type]
        (lambda: trie.evict_checkpoints("1"), InvalidType, "n must be an int, got str"),  # type: ignore[arg-type]
        (lambda: trie.save(seq, "4", state(1.0)), InvalidType, "step must be an int, got str"),  # type: ignore[arg-type]
        (lambda: trie.evict_host(-1), InvalidArgument, "evict_host: n must be >= 0, got -1"),
        (
            lambda: trie.evict_checkpoints(-1),
            InvalidArgument,
            "evict_checkpoints: n must be >= 0, got -1",
        ),
        (lambda: trie.evict(-2), InvalidArgument, "evict: num_blocks must be >= 0, got -2"),
        (lambda: trie.match([]), InvalidArgument, "match: tokens must hold at least one token"),
        (lambda: trie.match([1], namespace=3), InvalidType, "namespace must be a str, got int"),  # type: ignore[arg-type]
        (lambda: trie.allocate(seq, 2.5), InvalidType, "num_tokens must be an int, got float"),  # type: ignore[arg-type]
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=f"^{re.escape(message)}$"):
            call()
    assert trie.snapshot() == before
    trie.release(seq)
    trie.check()


def test_unpin_names_what_it_was_given_and_why_it_refuses_it() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 8, state(1.0))
    trie.release(seq)
    hit = trie.match([*SSM_PROMPT[:8], 9])
    with pytest.raises(InvalidType, match=r"^unpin takes a PinReceipt, got int$"):
        trie.unpin(5)  # type: ignore[arg-type]
    receipt = hit.match_receipt  # this cache's, but the match's: not from pin()
    assert isinstance(receipt, PinReceipt)
    with pytest.raises(PinError, match=r"was not issued by this cache's pin\(\)$"):
        trie.unpin(receipt)
    trie.release(hit)
    trie.check()


# ---------------------------------------------------------------------- save ([R25]-[R31])


def test_save_without_ssm_says_checkpoints_are_disabled() -> None:
    trie = host_trie()
    seq = prefill(trie, A)
    message = "save: SSM checkpoints are disabled (num_checkpoint_slots=0)"
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
        trie.save(seq, 2, None)
    trie.release(seq)


def test_save_past_the_committed_blocks_counts_whole_blocks() -> None:
    trie, _ = ssm_trie()
    seq = trie.match(SSM_PROMPT)
    trie.allocate(seq, 10)
    trie.commit(seq, 6)  # one full block and two tokens of the next
    message = f"save: step=8 anchors at block 2, but {seq!r} has committed only 1 blocks"
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
        trie.save(seq, 8, state(1.0))
    trie.release(seq)
    trie.check()


def test_a_block_aligned_checkpoint_has_no_tail_identity() -> None:
    """A checkpoint at a block boundary has an empty tail, so no extra identity of
    the (absent) partial block, even when the request has one for that block."""
    trie, _ = ssm_trie(manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT, extra=("a", "b", "c"))
    trie.save(seq, 4, state(1.0))
    trie.save(seq, 10, state(2.0))
    tails = {
        ck["step"]: (ck["tail"], ck["tail_extra"]) for ck in trie.snapshot()["checkpoints"].values()
    }
    assert tails == {4: ((), None), 10: ((3, 3), "c")}
    trie.release(seq)
    trie.check()


def test_a_save_at_the_same_step_with_another_tail_replaces_and_each_duplicate_counts() -> None:
    trie, _ = ssm_trie(manual=False)
    first = _ssm_prefill(trie, SSM_PROMPT)
    assert trie.save(first, 10, state(1.0)) is not None
    assert trie.save(first, 10, state(1.0)) is None  # [R25]: the same checkpoint
    assert trie.save(first, 10, state(1.0)) is None
    assert trie.stats.checkpoints_deduplicated == 2
    trie.release(first)
    second = _ssm_prefill(trie, [*SSM_PROMPT[:8], 7, 7])  # same anchor, another tail
    assert trie.save(second, 10, state(2.0)) is not None  # replaces, not a duplicate
    assert trie.stats.checkpoints_deduplicated == 2
    (ck,) = trie.snapshot()["checkpoints"].values()
    assert ck["tail"] == (7, 7)
    trie.release(second)
    trie.check()


# --------------------------------------------------------------------- clear ([R22])


def _clear_refused(trie: BlockTrie, counts: str) -> None:
    """`clear()` raises its `CacheError` naming `counts` and changes nothing."""
    before = trie.snapshot()
    message = f"clear: {counts} and 0 block pins must be finished first"
    with pytest.raises(CacheError, match=f"^{re.escape(message)}$"):
        trie.clear()
    assert trie.snapshot() == before


def test_clear_refuses_while_an_explicit_pin_is_held() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 8, state(1.0))
    trie.release(seq)
    hit = trie.match([*SSM_PROMPT[:8], 9])
    receipt = trie.pin(hit)
    trie.release(hit)
    _clear_refused(trie, "0 live sequences, 0 copies in flight, 1 explicit pins")
    trie.unpin(receipt)
    trie.clear()
    assert trie.snapshot()["checkpoints"] == {}
    trie.check()


def test_clear_refuses_while_a_sequence_is_live_with_no_copy_in_flight() -> None:
    # A live sequence alone (synchronous copies: nothing in flight) must stop
    # clear: `self._live and inflight` in its refusal would let it through.
    trie = BlockTrie(CacheConfig(num_blocks=8, block_size=2))
    seq = trie.match([1, 2, 3, 4, 5])
    _clear_refused(trie, "1 live sequences, 0 copies in flight, 0 explicit pins")
    trie.release(seq)
    trie.clear()
    trie.check()


def test_clear_counts_a_root_checkpoint_on_top_of_earlier_evictions() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 8, state(1.0))
    assert trie.evict_checkpoints(1) == 1
    assert trie.stats.evicted_checkpoints == 1
    trie.save(seq, 2, state(2.0))  # anchored at the root
    trie.release(seq)
    trie.clear()
    assert trie.stats.evicted_checkpoints == 2
    assert trie.num_free_checkpoint_slots == 4
    trie.check()


def test_clear_keeps_write_back_for_later_evictions() -> None:
    trie = host_trie(host_write="back")
    trie.release(prefill(trie, A))
    trie.clear()
    assert trie.stats.stored_blocks == 0  # dropped, not stored
    trie.release(prefill(trie, A))
    assert trie.evict(3) == 3
    assert trie.stats.stored_blocks == 3  # written back, as before the clear
    assert set(residency(trie).values()) == {Residency.HOST.value}
    trie.check()


# ------------------------------------------------------------------- restore ([R32]-[R34])


def test_restore_errors_name_the_checkpoint_and_what_to_do() -> None:
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _ssm_prefill(trie, SSM_PROMPT)
    save = trie.save(seq, 10, state(1.0))
    assert save is not None
    trie.release(seq)
    hit = trie.match([*SSM_PROMPT, 9, 9, 9])
    trie.allocate(hit, 13)
    trie.commit(hit, 12)  # commits block 2, where the frozen tail would be written
    message = (
        f"restore: {hit!r} already committed block 2, where the frozen tail "
        "would be written; restore before prefill"
    )
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
        trie.restore(hit, empty_state())
    trie.release(hit)
    other = trie.match([*SSM_PROMPT, 8])
    assert other.restore is not None
    ck = other.restore.checkpoint
    copies.fail(save)  # withdraws the checkpoint other matched
    message = f"restore: {ck!r} was withdrawn (its save copy failed); abort {other!r}"
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
        trie.restore(other, empty_state())
    trie.abort(other)
    trie.poll()
    trie.check()


def test_restore_takes_a_private_block_only_for_a_frozen_tail_and_counts_each() -> None:
    trie, _ = ssm_trie(manual=False)
    aligned_seq = _ssm_prefill(trie, [4, 4, 4, 4, 5])
    trie.save(aligned_seq, 4, state(3.0))
    trie.release(aligned_seq)
    aligned = trie.match([4, 4, 4, 4, 6])
    assert aligned.num_cached_tokens == 4 and len(aligned.block_ids) == 1
    free = trie.num_free_blocks
    copy = trie.restore(aligned, empty_state())
    assert copy.step == 4
    assert len(aligned.block_ids) == 1 and trie.num_free_blocks == free  # no block taken
    again = trie.match([4, 4, 4, 4, 7])
    trie.restore(again, empty_state())
    assert trie.stats.restores == 2
    trie.release(again)
    trie.release(aligned)
    trie.check()


def test_restore_of_a_frozen_tail_needs_exactly_one_free_block() -> None:
    trie, _ = ssm_trie(num_blocks=4, manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 10, state(2.0))  # two blocks cached, one frozen tail
    trie.release(seq)
    hit = trie.match([*SSM_PROMPT, 9])  # holds the two blocks; the tail is pinned
    assert trie.num_free_blocks == 1
    tail = trie.restore(hit, empty_state())
    assert tail.step == 10 and len(hit.block_ids) == 3 and trie.num_free_blocks == 0
    trie.release(hit)
    trie.check()


def test_a_restore_that_fails_when_queued_can_be_tried_again() -> None:
    engine = _FailsWhenQueued("restore")
    trie, _ = ssm_trie(manual=False)
    trie = BlockTrie(trie.config, copies=engine)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 10, state(1.0))
    trie.release(seq)
    hit = trie.match([*SSM_PROMPT, 9])
    before = trie.snapshot()
    with pytest.raises(CacheError, match="simulated restore failure"):
        trie.restore(hit, empty_state())
    assert hit.restored is False and hit.match_receipt is not None
    assert rollback(before, trie.snapshot()) == []
    engine.failing = False
    runtime = empty_state()
    trie.restore(hit, runtime)
    assert hit.restored is True
    assert torch.equal(runtime["ssm"], state(1.0)["ssm"])
    trie.release(hit)
    trie.check()


# ------------------------------------------------------------------------ load ([R50])


def _host_only(trie: BlockTrie, copies: ManualCopies) -> None:
    """A's three blocks committed, stored and offloaded: host-only."""
    trie.release(prefill(trie, A))
    copies.complete_all()
    trie.poll()
    assert trie.evict(10) == 3


def test_a_load_shared_with_two_loads_in_flight_finishes_after_both() -> None:
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    first = trie.match(A[:3])  # (1, 1)
    c1 = trie.load(first)
    second = trie.match(A[:5])  # (1, 1) shared with c1, (2, 2) its own
    c2 = trie.load(second)
    assert c1 is not None and c2 is not None and c1 is not c2
    third = trie.match(A[:5])  # both blocks loading by others
    wait = trie.load(third)
    assert wait is not None
    copies.complete(wait)
    assert c1.done and c2.done
    for seq in (first, second, third):
        trie.release(seq)
    trie.poll()
    trie.check()


def test_a_load_of_its_own_blocks_is_ordered_after_the_shared_load_it_waits_on() -> None:
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    other = trie.match([9, 9, 9, 9, 9])
    trie.allocate(other, 5)  # the loads land in other device blocks than their host ids
    first = trie.match(A[:3])
    c1 = trie.load(first)
    second = trie.match(A[:5])
    c2 = trie.load(second)
    assert c1 is not None and c2 is not None
    copies.complete(c2)
    assert c1.done, "the shared block's load must come first"
    trie.poll()
    trie.release(first)
    trie.release(second)
    trie.release(other)
    trie.check()


def test_loading_again_while_waiting_on_another_requests_load_returns_that_load() -> None:
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    first, second = trie.match(A), trie.match(A)
    copy = trie.load(first)
    assert copy is not None
    assert trie.load(second) is copy
    assert trie.load(second) is copy  # nothing new: still that load
    copies.complete(copy)
    trie.poll()
    assert trie.load(second) is None
    trie.release(first)
    trie.release(second)
    trie.check()


def test_a_load_finished_before_the_request_loads_leaves_nothing_to_wait_on() -> None:
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    first, second = trie.match(A), trie.match(A)
    copy = trie.load(first)
    assert copy is not None
    copies.complete(copy)
    trie.poll()
    assert trie.load(second) is None
    assert second.num_cached_tokens == 6 and len(second.block_ids) == 3
    trie.release(first)
    trie.release(second)
    trie.check()


def test_commit_before_its_own_load_finishes_is_refused() -> None:
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    tokens = [*A[:6], 4, 4, 9]  # A's three blocks (on the host) and a new one
    seq = trie.match(tokens)
    copy = trie.load(seq)
    assert copy is not None
    trie.allocate(seq, 9)
    message = f"commit: {seq!r} reads blocks that {copy!r} is loading; wait for it"
    with pytest.raises(HostTierError, match=f"^{re.escape(message)}$"):
        trie.commit(seq, 8)
    copies.complete(copy)
    trie.poll()
    trie.commit(seq, 8)
    trie.release(seq)
    trie.check()


def test_a_load_that_fails_when_queued_is_undone_and_can_be_tried_again() -> None:
    engine = _FailsWhenQueued("load")
    trie = host_trie(copies=engine)
    trie.release(prefill(trie, A))
    assert trie.evict(2) == 2  # (2, 2) and (3, 3) host-only
    seq = trie.match(A)
    assert seq.num_host_tokens == 4
    before = trie.snapshot()
    blocks, free = list(seq.block_ids), trie.num_free_blocks
    with pytest.raises(CacheError, match=r"^load: the copy failed and was undone: simulated"):
        trie.load(seq)
    after = trie.snapshot()
    # The same blocks are free again (the free list's order may differ: LIFO).
    assert sorted(after["free_blocks"]) == sorted(before["free_blocks"])
    assert rollback({**before, "free_blocks": []}, {**after, "free_blocks": []}) == []  # type: ignore[typeddict-item]
    assert list(seq.block_ids) == blocks and trie.num_free_blocks == free
    assert set(residency(trie).values()) == {Residency.MIRRORED.value, Residency.HOST.value}
    trie.check()
    engine.failing = False
    copy = trie.load(seq)
    assert copy is not None and copy.done and not copy.failed  # CPU copies finish at once
    assert len(seq.block_ids) == 3
    trie.allocate(seq, 7)
    trie.commit(seq, 6)
    trie.release(seq)
    trie.check()


def test_a_partial_checkpoint_replaced_at_its_anchor_reuses_its_frozen_tail() -> None:
    """[R27]: a new partial checkpoint at the anchor of a partial one writes into the
    old frozen tail block (one token of tail is enough), taking no new block."""
    trie, _ = ssm_trie(manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 10, state(1.0))
    (old,) = trie.snapshot()["checkpoints"].values()
    free = trie.num_free_blocks
    assert trie.save(seq, 9, state(2.0)) is not None  # same anchor, a one-token tail
    (new,) = trie.snapshot()["checkpoints"].values()
    assert (new["step"], new["frozen_block"]) == (9, old["frozen_block"])
    assert trie.num_free_blocks == free
    trie.release(seq)
    trie.check()


def test_save_takes_the_last_free_block_evicts_one_tail_or_skips_when_none_can_be_had() -> None:
    """[R29]: a partial save needs one block: the last free one is taken; with none
    free it evicts what it can (an unpinned frozen tail); with nothing to evict the
    save is skipped and counted, each time."""
    trie, copies = ssm_trie(num_blocks=4)
    assert copies is not None
    seq = trie.match(SSM_PROMPT)
    trie.allocate(seq, 10)
    trie.commit(seq, 10)  # the request holds 3 of the 4 blocks
    assert trie.num_free_blocks == 1
    first = trie.save(seq, 10, state(1.0))  # takes the last free block
    assert first is not None and trie.num_free_blocks == 0
    # Nothing evictable: the request holds its blocks, the save copy pins its tail.
    assert trie.save(seq, 6, state(2.0)) is None
    assert trie.save(seq, 6, state(2.0)) is None
    assert trie.stats.checkpoints_skipped == 2
    copies.complete(first)
    trie.poll()  # the tail at step 10 is unpinned now: exactly one block to reclaim
    second = trie.save(seq, 6, state(2.0))
    assert second is not None
    assert trie.stats.checkpoints_skipped == 2
    assert {ck["step"] for ck in trie.snapshot()["checkpoints"].values()} >= {6}
    copies.complete(second)
    trie.poll()
    trie.release(seq)
    trie.check()


def test_a_save_with_no_free_slot_evicts_exactly_one_checkpoint_and_ticks_once() -> None:
    """[R28]: one LRU checkpoint is evicted for the slot; [R31]: a save that queues a
    copy ticks the clock once."""
    trie, _ = ssm_trie(slots=2, manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.save(seq, 8, state(2.0))
    assert trie.num_free_checkpoint_slots == 0
    clock = trie.clock
    assert trie.save(seq, 2, state(3.0)) is not None  # a third anchor: the root
    assert trie.clock == clock + 1
    assert trie.stats.evicted_checkpoints == 1
    assert sorted(ck["step"] for ck in trie.snapshot()["checkpoints"].values()) == [2, 8]
    trie.release(seq)
    trie.check()


def test_a_failed_save_anchored_at_a_new_namespace_root_leaves_no_root_behind() -> None:
    """[R6], [R11]: the root a save created for its namespace goes with the save."""
    trie, _ = ssm_trie(manual=False)
    trie = BlockTrie(trie.config, copies=_FailsWhenQueued("save"))
    seq = trie.match([1, 2, 3], namespace="fresh")
    trie.allocate(seq, 3)
    trie.commit(seq, 3)  # no full block: the namespace has no root yet
    assert "fresh" not in trie.snapshot()["roots"]
    before, clock = trie.snapshot(), trie.clock
    with pytest.raises(CacheError, match="simulated save failure"):
        trie.save(seq, 2, state(1.0))
    after = trie.snapshot()
    assert after["nodes"] == before["nodes"]
    assert rollback(before, after) == [] and trie.clock == clock
    trie.release(seq)
    trie.check()


def test_blocks_completed_by_appended_tokens_keep_the_requests_extra_identity() -> None:
    """[R7]: a commit ticks the clock exactly once; the keys of blocks that tokens
    appended after `match` completed carry the request's extra identity, so the
    same extra hits them all and another extra hits none."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    seq = trie.match([1, 1], extra=["x", "y"])
    trie.append(seq, [2, 2, 3])
    trie.allocate(seq, 5)
    clock = trie.clock
    trie.commit(seq, 4)
    assert trie.clock == clock + 1
    trie.release(seq)
    assert trie.match([1, 1, 2, 2, 9], extra=["x", "y"]).num_cached_tokens == 4
    assert trie.match([1, 1, 2, 2, 9], extra=["x", "z"]).num_cached_tokens == 2
    assert trie.match([1, 1, 2, 2, 9], extra=["x"]).num_cached_tokens == 2


def test_a_copied_sequence_is_refused_naming_it_a_copy() -> None:
    """[R2]: liveness is the trie's registry, not a flag: a copy of a live sequence
    is refused with a message saying why, and nothing changes."""
    import copy

    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    seq = trie.match([1, 1, 2])
    twin = copy.copy(seq)
    message = (
        f"{twin!r} is not live in this cache: not the object its match returned "
        "(a copy, or built by hand)"
    )
    refused(trie, SequenceNotLive, message, lambda: trie.release(twin))
    trie.release(seq)
    trie.check()


def test_allocate_with_nothing_to_add_allocates_nothing_and_release_ticks_once() -> None:
    """An allocate whose block table already covers the tokens reaches no allocation
    point; a release ticks the clock exactly once."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    seq = trie.match([1, 1, 2])
    trie.allocate(seq, 3)
    trie.faults.reset()
    trie.allocate(seq, 3)
    trie.allocate(seq, 2)
    assert trie.faults.points == []
    clock = trie.clock
    trie.release(seq)
    assert trie.clock == clock + 1
    trie.check()


def test_the_key_hash_hook_sees_every_full_block_match_looks_up() -> None:
    """The `key_hash` testing hook replaces the hash of every block key, those
    `match` builds included (a degenerate hook must make its lookups collide)."""
    seen: list[object] = []

    def key_hash(block: object) -> int:
        seen.append(block)
        return 0

    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8, key_hash=key_hash))
    seq = trie.match([1, 1, 2, 2, 3])
    assert seen == [(1, 1), (2, 2)]
    trie.release(seq)


def test_a_config_that_is_not_one_is_refused_naming_its_type() -> None:
    with pytest.raises(InvalidType, match=r"^config must be a CacheConfig, got int$"):
        BlockTrie(5)  # type: ignore[arg-type]
    config = CacheConfig(block_size=B, num_blocks=2)
    with pytest.raises(InvalidType, match=r"^copies must be a CopyEngine, got str$"):
        BlockTrie(config, copies="manual")  # type: ignore[arg-type]


def test_every_device_pool_lives_on_the_configured_device() -> None:
    """The KV pool and the checkpoint slots are built on `config.device` (torch's
    `meta` device here: the one a CPU-only host can tell from its default)."""
    config = CacheConfig(
        block_size=B,
        num_blocks=4,
        kv_block_shape=(B,),
        num_checkpoint_slots=2,
        state_shapes={"s": (2,)},
        device="meta",
    )
    trie = BlockTrie(config)
    assert trie.device == torch.device("meta")
    assert trie.kv_cache is not None and trie.kv_cache.device.type == "meta"
    assert {states.device.type for states in trie.checkpoint_states.values()} == {"meta"}


def test_a_whole_cached_prompt_holds_only_the_blocks_of_its_hit() -> None:
    """[R13]: a prompt cached to its last token still computes one token, so its hit
    stops a block short, and the sequence holds only the blocks of that hit."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    serve(trie, [1, 1, 2, 2])
    seq = trie.match([1, 1, 2, 2])
    assert seq.num_cached_tokens == 2 and len(seq.block_ids) == 1
    trie.release(seq)
    trie.check()


def test_every_checkpoint_hit_is_counted() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.release(seq)
    for _ in range(2):
        trie.release(trie.match(SSM_PROMPT))
    assert trie.stats.checkpoint_hits == 2
    trie.check()


def test_namespace_roots_have_serials_no_node_has() -> None:
    """Each namespace root gets its own serial, apart from every node's (the
    snapshot and every index name nodes by serial): roots count down from -1,
    nodes up from 1."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    for namespace in ("a", "b", "c"):
        seq = trie.match([1, 1], namespace=namespace)
        trie.allocate(seq, 2)
        trie.commit(seq, 2)
        trie.release(seq)
    snap = trie.snapshot()
    assert snap["roots"] == {"a": -1, "b": -2, "c": -3}
    assert sorted(snap["nodes"]) == [-3, -2, -1, 1, 2, 3]
    trie.check()


def test_a_failed_save_that_replaced_a_checkpoint_counts_it_once_and_gives_its_tick_back() -> None:
    """[R38]: the checkpoint a failed save replaced is lost with its slot's data, so it
    adds one to `evicted_checkpoints` (on top of earlier evictions); the save's tick
    is given back, so the clock is where it was, not restarted."""
    config = ssm_trie(slots=2, manual=False)[0].config
    engine = _FailsWhenQueued("save", failing=False)
    trie = BlockTrie(config, copies=engine)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.save(seq, 8, state(2.0))
    trie.save(seq, 2, state(3.0))  # no free slot: the checkpoint at 4 is evicted
    assert trie.stats.evicted_checkpoints == 1
    clock = trie.clock
    assert clock > 1
    engine.failing = True
    with pytest.raises(CacheError, match="simulated save failure"):
        trie.save(seq, 9, state(4.0))  # replaces the one at 8 (same anchor), then fails
    assert trie.stats.evicted_checkpoints == 2
    assert trie.clock == clock
    assert sorted(ck["step"] for ck in trie.snapshot()["checkpoints"].values()) == [2]
    trie.release(seq)
    trie.check()


# ------------------------------------------------------------ construction and inspection


def test_pools_that_cannot_be_allocated_are_a_config_error_naming_every_pool() -> None:
    """A pool tensor torch cannot allocate is a `ConfigError` naming each pool's size
    and torch's reason (not chained); the engine is left unbound, so it can serve
    another trie."""
    config = CacheConfig(
        block_size=B,
        num_blocks=2,
        kv_block_shape=(2**61,),  # 2**64 bytes a block: torch's size computation overflows
        kv_dtype=torch.float64,
        num_checkpoint_slots=3,
        state_shapes={"s": (5,)},
        state_dtype=torch.float32,
        num_host_checkpoint_slots=1,
    )
    with pytest.raises(RuntimeError) as torch_error:
        torch.zeros((2, 2**61), dtype=torch.float64)
    engine = ManualCopies()
    message = (
        f"cannot allocate the pools of 2 KV blocks ({2**64} B each), 0 host blocks "
        "and 3 + 1 (host) checkpoint slots (20 B each) on cpu: "
        f"{torch_error.value}"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$") as error:
        BlockTrie(config, copies=engine)
    assert error.value.__cause__ is None and error.value.__suppress_context__
    trie = host_trie(copies=engine)  # not bound by the failed construction
    assert trie.copies is engine


def test_the_copies_property_returns_the_engine_and_refuses_a_non_engine() -> None:
    """`copies` is the engine copies are queued on; setting it to anything but a
    `CopyEngine` raises `InvalidType` naming the type and keeps the engine; setting
    an engine makes later copies queue on it."""
    first = ManualCopies()
    trie = host_trie(copies=first)
    assert trie.copies is first
    before = trie.snapshot()
    with pytest.raises(InvalidType, match=r"^copies must be a CopyEngine, got int$"):
        trie.copies = 5  # type: ignore[assignment]
    assert trie.copies is first
    assert trie.snapshot() == before
    second = ManualCopies()
    trie.copies = second
    assert trie.copies is second
    trie.release(prefill(trie, A))  # write-through: one store copy, queued on `second`
    assert first.pending() == []
    (store,) = second.pending()
    assert store.kind == "store"
    second.complete(store)
    assert trie.poll() == 1
    trie.check()


def test_the_engine_is_not_swapped_while_a_copy_is_in_flight() -> None:
    """Swapping engines with a copy still queued on the old one would strand it: `poll`
    only reaps the new engine's copies, and `clear()` would refuse forever. The swap
    is refused (`CacheError`, nothing changed) until the copy is reaped."""
    first = ManualCopies()
    trie = host_trie(copies=first)
    trie.release(prefill(trie, A))  # write-through: one store, queued on `first`
    (store,) = first.pending()
    before = trie.snapshot()
    second = ManualCopies()
    with pytest.raises(CacheError) as raised:
        trie.copies = second
    assert str(raised.value) == (
        "copies: 1 copies in flight on the current engine; complete and poll() them "
        "before swapping engines"
    )
    assert trie.copies is first and trie.snapshot() == before
    first.complete(store)
    assert trie.poll() == 1
    trie.copies = second
    assert trie.copies is second
    trie.clear()
    trie.check()
    with pytest.raises(CacheError, match=r"^ManualCopies is already bound"):
        host_trie(copies=second)  # `second` serves `trie` now


def test_an_engine_serving_another_trie_is_refused_and_the_current_one_kept() -> None:
    """An engine serves one trie (`CopyEngine.bind`): setting one already bound to
    another trie raises `CacheError` as the constructor does, and keeps the engine.
    Setting the current engine again changes nothing."""
    mine = ManualCopies()
    trie = host_trie(copies=mine)
    theirs = ManualCopies()
    host_trie(copies=theirs)
    before = trie.snapshot()
    with pytest.raises(CacheError, match=r"^ManualCopies is already bound to another BlockTrie$"):
        trie.copies = theirs
    assert trie.copies is mine and trie.snapshot() == before
    trie.copies = mine
    assert trie.copies is mine
    trie.release(prefill(trie, A))
    assert len(mine.pending()) == 1 and theirs.pending() == []


def test_copies_the_host_tier_builds_take_the_tries_next_serials() -> None:
    """Copies are numbered 1, 2, 3, ... in the order they are queued, whether the trie
    builds them or its host tier does (`Transfers.number`): no serial is skipped."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    trie.release(prefill(trie, A))  # write-through: the first store
    trie.release(prefill(trie, OTHER))  # and the second
    assert [(c.kind, c.serial) for c in copies.pending()] == [("store", 1), ("store", 2)]


def test_the_snapshot_names_the_nodes_a_host_copy_moves() -> None:
    """`snapshot()["copies"]` lists, for a host-tier copy, the serials of the nodes it
    moves, beside its device and host blocks."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    trie.release(prefill(trie, A))  # write-through: one store of A's three blocks
    snap = trie.snapshot()
    chain = sorted(serial for serial, node in snap["nodes"].items() if node["parent"] is not None)
    assert snap["copies"] == {
        1: {
            "kind": "store",
            "blocks": [0, 1, 2],
            "pins": [],
            "done": False,
            "state": "queued",
            "host_blocks": [0, 1, 2],
            "nodes": chain,
        }
    }
    assert chain == [1, 2, 3]


def test_the_snapshot_replays_host_blocks_only_with_a_host_tier() -> None:
    """`snapshot()["event_host_blocks"]`, the host blocks the drained events say are
    cached, is None without a host tier, and the replayed set with one."""
    plain = BlockTrie(CacheConfig(block_size=B, num_blocks=8, enable_events=True))
    assert plain.snapshot()["event_host_blocks"] is None
    copies = ManualCopies()
    trie = host_trie(copies=copies)  # events on
    trie.release(prefill(trie, A))
    copies.complete_all()
    trie.poll()
    assert trie.snapshot()["event_host_blocks"] == {0, 1, 2}  # A's three, stored


def test_repr_names_the_block_size_and_the_block_and_slot_counts() -> None:
    """`repr(trie)`: the block size, free and cached KV blocks out of the capacity,
    and free checkpoint slots out of theirs, as they are now."""
    trie = host_trie()
    assert repr(trie) == "<BlockTrie B=2 blocks free=8 cached=0/8 slots free=0/0>"
    seq = prefill(trie, A)  # holds 4 blocks, 3 of them cached
    assert repr(trie) == "<BlockTrie B=2 blocks free=4 cached=3/8 slots free=0/0>"
    trie.release(seq)
    ssm, _ = ssm_trie(manual=False)
    held = _ssm_prefill(ssm, SSM_PROMPT)
    ssm.save(held, 8, state(1.0))
    assert repr(ssm) == "<BlockTrie B=4 blocks free=13 cached=2/16 slots free=3/4>"
    ssm.release(held)


# ----------------------------------------------------------- failed loads ([R50], [R46])


def test_load_refuses_while_its_own_failed_load_is_not_yet_reaped() -> None:
    """A request whose load failed (not yet reaped) cannot load again: `HostTierError`
    says to abort it, nothing changed; once reaped, it is cut and refused as such."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    seq = trie.match(A)
    copy = trie.load(seq)
    assert copy is not None
    copies.fail(copy)
    before = trie.snapshot()
    message = f"load: a load {seq!r} waits on failed; abort it"
    with pytest.raises(HostTierError, match=f"^{re.escape(message)}$"):
        trie.load(seq)
    assert trie.snapshot() == before
    assert seq.loads == [copy] and not seq.load_failed
    assert trie.poll() == 1
    message = f"load: the load of {seq!r}'s host-resident blocks failed; abort it"
    with pytest.raises(HostTierError, match=f"^{re.escape(message)}$"):
        trie.load(seq)
    trie.abort(seq)
    trie.check()


def test_load_refuses_while_another_requests_failed_load_of_a_shared_block_is_not_reaped() -> None:
    """A request that matched host-only blocks another request then loaded, in a
    load that failed, is refused (naming that load) until it is reaped; then it
    loads them anew itself."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    second = trie.match(A)  # matched before the blocks are loaded: no load to wait on
    first = trie.match(A)
    c1 = trie.load(first)
    assert c1 is not None and second.loads == []
    copies.fail(c1)
    message = (
        f"load: {c1!r}, loading a block {second!r} reads, "
        "failed; poll() and load again (it will be loaded anew)"
    )
    refused(trie, HostTierError, message, lambda: trie.load(second))
    assert second.block_ids == () and second.num_host_tokens == 6
    assert trie.poll() == 1  # reaped: `first` is cut, the blocks are host-only again
    assert set(residency(trie).values()) == {Residency.HOST.value}
    c2 = trie.load(second)
    assert c2 is not None and c2 is not c1
    copies.complete(c2)
    trie.poll()
    assert len(second.block_ids) == 3
    trie.abort(first)
    trie.release(second)
    trie.check()


def test_a_commit_refused_for_another_requests_load_keeps_the_requests_own_loads() -> None:
    """[R6]: a commit refused because a block equals one another request is loading
    leaves the request's own (finished) loads in place, as they were."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    _host_only(trie, copies)
    mine = trie.match(A[:3])  # (1, 1) on the host: its own load
    own = trie.load(mine)
    assert own is not None
    copies.complete(own)  # done, not yet reaped
    theirs = trie.match(A)
    loading = trie.load(theirs)  # (2, 2) and (3, 3), still running
    assert loading is not None and not loading.done
    trie.append(mine, A[3:])
    trie.allocate(mine, 7)
    compute(trie, mine, A)
    before = trie.snapshot()
    with pytest.raises(HostTierError, match=r"is being loaded by"):
        trie.commit(mine, 6)
    assert mine.loads == [own]
    assert trie.snapshot() == before
    copies.complete(loading)
    trie.poll()
    trie.commit(mine, 6)
    assert mine.loads == [] and mine.num_committed_tokens == 6
    trie.release(mine)
    trie.release(theirs)
    trie.check()


def _commit_refused(trie: BlockTrie, seq: Sequence, message: str) -> None:
    """`commit(seq, 6)` raises `HostTierError` with exactly `message`, changing nothing."""
    refused(trie, HostTierError, message, lambda: trie.commit(seq, 6))


def test_commit_of_a_block_another_request_is_loading_waits_for_that_load() -> None:
    """A commit whose computed block equals one another request is loading is refused,
    naming the block and the load: while it is not done, and while it failed but is
    not reaped; after the reap, the commit adopts its computed blocks ([R49])."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    computing = trie.match(A)  # nothing cached yet: it will compute all of A itself
    trie.allocate(computing, 7)
    _host_only(trie, copies)
    residencies = {Residency.HOST.value}
    assert set(residency(trie).values()) == residencies
    loader = trie.match(A[:3])  # (1, 1)
    first = trie.load(loader)
    assert first is not None
    copies.complete(first)
    trie.poll()
    trie.release(loader)  # (1, 1) mirrored, not loading
    loader = trie.match(A)
    copy = trie.load(loader)  # loads (2, 2) and (3, 3)
    assert copy is not None and not copy.done
    compute(trie, computing, A)
    _commit_refused(
        trie,
        computing,
        f"commit: block 1 of {computing!r} is being loaded by {copy!r}; "
        "commit it once that copy is done",
    )
    copies.fail(copy)
    _commit_refused(
        trie,
        computing,
        f"commit: block 1 of {computing!r} equals a block whose load {copy!r} "
        "failed; poll() and commit again (the computed block is adopted)",
    )
    assert computing.num_committed_tokens == 0
    trie.poll()
    blocks = computing.block_ids
    trie.commit(computing, 6)
    assert computing.num_committed_tokens == 6
    assert computing.block_ids[1:3] == blocks[1:3]  # its computed blocks, adopted
    assert set(residency(trie).values()) == {Residency.MIRRORED.value}
    trie.abort(loader)
    trie.release(computing)
    trie.check()


def test_commit_of_a_block_whose_load_finished_but_is_not_reaped_shares_the_loaded_block() -> None:
    """A load that is done has delivered its data even before `poll()` reaps it: a
    commit computing the same blocks deduplicates against them ([R18])."""
    copies = ManualCopies()
    trie = host_trie(copies=copies)
    computing = trie.match(A)
    trie.allocate(computing, 7)
    _host_only(trie, copies)
    loader = trie.match(A)
    copy = trie.load(loader)
    assert copy is not None
    copies.complete(copy)  # done, not reaped: the nodes are still `loading`
    assert set(residency(trie).values()) == {Residency.LOADING.value}
    compute(trie, computing, A)
    trie.commit(computing, 6)
    assert computing.num_committed_tokens == 6
    assert computing.block_ids[:3] == loader.block_ids
    trie.poll()
    trie.release(loader)
    trie.release(computing)
    trie.check()


def test_a_load_that_fails_when_queued_gives_back_the_shared_blocks_it_held() -> None:
    """A load of its own blocks that also reads blocks already loaded for another
    request takes a reference on those; if the copy fails when queued, those
    references are dropped with the rest: every count is as before."""
    engine = _FailsWhenQueued("load")
    engine.failing = False
    trie = host_trie(copies=engine)
    trie.release(prefill(trie, A))
    assert trie.evict(3) == 3
    second = trie.match(A)  # all three host-only
    first = trie.match(A[:3])
    assert trie.load(first) is not None  # (1, 1) is on the device again, held by `first`
    trie.poll()
    engine.failing = True
    before = trie.snapshot()
    with pytest.raises(CacheError, match=r"^load: the copy failed and was undone: simulated"):
        trie.load(second)
    after = trie.snapshot()
    assert sorted(after["free_blocks"]) == sorted(before["free_blocks"])
    assert after["refcounts"] == before["refcounts"]
    assert rollback({**before, "free_blocks": []}, {**after, "free_blocks": []}) == []  # type: ignore[typeddict-item]
    assert second.block_ids == () and second.num_host_tokens == 6
    trie.release(first)
    trie.check()
    engine.failing = False
    assert trie.load(second) is not None
    assert len(second.block_ids) == 3
    trie.release(second)
    trie.check()


# ------------------------------------------------------------- waits and restores


class _UnfinishedWaits(CopyEngine):
    """An engine whose `wait` returns before the copy is done (copies finish only
    when the test runs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list[Copy] = []

    def _start(self, copy: Copy) -> None:
        self.queued.append(copy)

    def wait(self, copy: Copy) -> None:
        pass


def test_a_write_back_store_still_running_after_the_wait_stays_queued() -> None:
    """Room-making waits for its write-back store; a store not done after the wait
    is neither forgotten nor reaped: `OutOfBlocks`, and a later poll reaps it."""
    engine = _UnfinishedWaits()
    trie = host_trie(num_blocks=4, copies=engine, host_write="back")
    other = _short_of_room_behind_a_store(trie)
    (store,) = engine.queued
    assert store.kind == "store" and not store.done
    assert trie.poll() == 0, "not done: still queued on the engine"
    assert residency(trie)[(3, 3)] == "storing"
    store.run()
    store.fire(CopyTrigger.FINISH)
    assert trie.poll() == 1
    assert residency(trie)[(3, 3)] == Residency.HOST.value
    trie.allocate(other, 3)
    assert len(other.block_ids) == 2
    trie.release(other)
    trie.check()


def test_a_restore_without_a_frozen_tail_that_fails_when_queued_takes_back_no_block() -> None:
    """A block-aligned restore takes no private block, so its undo gives none back:
    the request keeps its blocks, pin and counts, and can restore again."""
    engine = _FailsWhenQueued("restore")
    trie, _ = ssm_trie(manual=False)
    trie = BlockTrie(trie.config, copies=engine)
    seq = _ssm_prefill(trie, SSM_PROMPT)
    trie.save(seq, 8, state(1.0))  # block-aligned: no frozen tail
    trie.release(seq)
    hit = trie.match([*SSM_PROMPT[:8], 9])
    blocks, receipt, clock = hit.block_ids, hit.match_receipt, trie.clock
    assert len(blocks) == 2
    before = trie.snapshot()
    message = "restore: the copy failed and was undone: simulated restore failure"
    with pytest.raises(CacheError, match=f"^{re.escape(message)}$"):
        trie.restore(hit, empty_state())
    assert trie.snapshot() == before
    assert hit.block_ids == blocks and hit.match_receipt is receipt and not hit.restored
    assert trie.clock == clock and trie.stats.restores == 0
    engine.failing = False
    runtime = empty_state()
    trie.restore(hit, runtime)
    assert hit.block_ids == blocks and trie.stats.restores == 1
    assert torch.equal(runtime["ssm"], state(1.0)["ssm"])
    trie.release(hit)
    trie.check()


def test_the_node_table_is_made_up_front_up_to_a_bound_and_grows_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Room for every block a trie holds (device and host) and 8 roots: made up front
    while that is at most `_ROWS_UP_FRONT` rows (bound shrunk to 64 here), else an
    eighth of the bound up front and the rest as the table fills."""
    monkeypatch.setattr(cache.storage, "_ROWS_UP_FRONT", 64)
    at_bound = BlockTrie(CacheConfig(block_size=B, num_blocks=56))
    assert (at_bound._nodes.capacity, at_bound._nodes.limit) == (64, 64)
    with_host = BlockTrie(CacheConfig(block_size=B, num_blocks=20, num_host_blocks=10))
    assert (with_host._nodes.capacity, with_host._nodes.limit) == (38, 38)
    past = BlockTrie(CacheConfig(block_size=B, num_blocks=57))
    assert (past._nodes.capacity, past._nodes.limit) == (8, 65)
    tokens = [t for i in range(20) for t in (i, i)]  # 20 distinct full blocks
    serve(past, [*tokens, 99])
    assert past.num_cached_blocks == 20 and past._nodes.capacity >= 21
    past.check()


def test_columns_a_configuration_never_varies_cost_no_memory_per_node() -> None:
    """Without events no node has a block hash; without a host tier every node is on
    the device with no host block: those columns are `Constant`s. With events, the
    hashes are 64-bit (`xxh3`: an `array("Q")`) or arbitrary ints (`vllm`: a list)."""
    plain = BlockTrie(CacheConfig(block_size=B, num_blocks=4))._nodes
    assert isinstance(plain.block_hash, Constant)
    assert isinstance(plain.host, Constant) and isinstance(plain.residency, Constant)
    xxh3 = BlockTrie(CacheConfig(block_size=B, num_blocks=4, enable_events=True))._nodes
    assert isinstance(xxh3.block_hash, array) and xxh3.block_hash.typecode == "Q"
    vllm = BlockTrie(
        CacheConfig(block_size=B, num_blocks=4, enable_events=True, block_hash="vllm")
    )._nodes
    assert isinstance(vllm.block_hash, list)
    hosted = BlockTrie(CacheConfig(block_size=B, num_blocks=4, num_host_blocks=4))._nodes
    assert isinstance(hosted.host, array) and isinstance(hosted.residency, list)


def test_a_new_tries_clock_reads_zero_and_its_first_commit_ticks_it_to_one() -> None:
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=4))
    assert trie.clock == 0
    seq = trie.match([1, 1, 2])
    trie.allocate(seq, 3)
    trie.commit(seq, 3)
    assert trie.clock == 1
    trie.release(seq)
    assert trie.clock == 2


def test_checkpoint_pools_hold_the_state_dtype_and_host_pools_stay_on_the_cpu() -> None:
    """Both checkpoint pools (device and host) hold `state_dtype`; the host KV pool
    and the host checkpoint pool are on the CPU even when torch's default device is
    another (here `meta`), since they are made with the CPU named."""
    config = CacheConfig(
        block_size=B,
        num_blocks=4,
        kv_block_shape=(B,),
        num_checkpoint_slots=2,
        num_host_blocks=4,
        num_host_checkpoint_slots=2,
        state_shapes={"s": (2,)},
        state_dtype=torch.float16,
    )
    with torch.device("meta"):
        trie = BlockTrie(config)
    assert trie.host_cache is not None and trie.host_cache.device.type == "cpu"
    hosted = trie.host_checkpoint_states["s"]
    assert hosted.device.type == "cpu" and hosted.dtype == torch.float16
    assert trie.checkpoint_states["s"].dtype == torch.float16


def test_a_request_with_an_extra_identity_never_matches_plain_blocks() -> None:
    """A trie holding only plain blocks (no key with an extra identity yet): a request
    whose blocks carry one finds no hit on the same tokens, then caches its own."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    serve(trie, [1, 1, 2, 2, 3])
    assert serve(trie, [1, 1, 2, 2, 3], extra=["img", None]) == 0
    assert trie.num_cached_blocks == 4
    assert serve(trie, [1, 1, 2, 2, 3], extra=["img", None]) == 4
    trie.check()


def test_a_request_whose_ids_need_64_bits_never_matches_32_bit_blocks() -> None:
    """Token ids are stored by value: a request packed as uint64 (one id needs 64 bits)
    must not match blocks cached as uint32 whose bytes happen to spell its ids, as the
    cached chain [5, 7] [3, 0] does for [5 + 7 * 2**32, 3] (the first id's low and high
    halves are 5 and 7)."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    serve(trie, [5, 7, 3, 0, 9])
    wide = [5 + 7 * 2**32, 3, 4, 4, 9]
    assert hit(trie, wide) == 0
    assert serve(trie, wide) == 0
    assert trie.num_cached_blocks == 4
    assert hit(trie, wide) == 4 and hit(trie, [5, 7, 3, 0, 9]) == 4
    trie.check()


def test_nodes_are_numbered_one_up_in_the_order_commits_attach_them() -> None:
    """[R43]: node ids (serials) count the nodes made, from 1, however many commits
    of one request attach them."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    seq = trie.match([1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7])
    trie.allocate(seq, 13)
    for committed in (4, 8, 12):
        trie.commit(seq, committed)
    trie.release(seq)
    serve(trie, [8, 8, 9])
    assert sorted(trie.snapshot()["nodes"]) == [-1, 1, 2, 3, 4, 5, 6, 7]
    trie.check()


# ------------------------------------------- accepted "equivalents" that were observable


@pytest.mark.parametrize("identity", [b"img", "img", 7])
def test_an_identity_on_a_later_block_never_hits_a_plain_block_with_its_tokens(
    identity: object,
) -> None:
    """Invariant 5 with the identity on block 1, under an only child: the walk must not
    take its bytes-only fast path for a request that carries identities (a bytes
    identity would make `bytes.startswith((tokens, identity))` a wrong hit; other
    identities a TypeError). Kills trie.py `match__mutmut_54`."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    serve(trie, [1, 1, 2, 2, 3])  # two plain blocks: the root's child has an only child
    seq = trie.match([1, 1, 2, 2, 3], extra=(None, identity))
    assert seq.num_cached_tokens == B  # block 0 only: block 1's identity differs
    trie.abort(seq)
    assert hit(trie, [1, 1, 2, 2, 3]) == 2 * B
    trie.check()


def test_an_aligned_save_at_the_end_of_the_block_table_publishes() -> None:
    """A block-aligned save whose step is the whole block table (no block past it) has no
    frozen tail and reads no block past the table. Kills checkpointing.py `save__mutmut_173`
    (an IndexError after the checkpoint was reserved)."""
    trie, copies = ssm_trie(block_size=B)
    seq = trie.match([1, 1, 2, 2, 3])
    trie.allocate(seq, 4)
    trie.commit(seq, 4)
    assert len(seq.block_ids) == 2
    copy = trie.save(seq, 4, state(1.0))
    assert copy is not None and copies is not None
    copies.complete(copy)
    trie.poll()
    trie.release(seq)
    trie.check()
    again = trie.match([1, 1, 2, 2, 3])
    assert again.num_cached_tokens == 4 and again.restore is not None
    trie.abort(again)


def test_a_root_has_tick_zero_in_the_snapshot() -> None:
    """[R11]: roots have tick 0, visible in the public `snapshot()`. Kills trie.py
    `_root__mutmut_8` / `_23` (tick None / 1)."""
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8))
    serve(trie, [1, 1, 2], namespace="a")
    serve(trie, [1, 1, 2])
    snap = trie.snapshot()
    assert len(snap["roots"]) == 2
    for root in snap["roots"].values():
        assert snap["nodes"][root]["tick"] == 0


@pytest.mark.parametrize("extra", [None, ["img"]])
def test_a_commit_of_no_full_block_attaches_nothing_not_even_a_root(extra: object) -> None:
    """[R19]: only full blocks are attached; a commit that completes none leaves the
    trie as it was, without making its namespace's root."""
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=8))
    seq = trie.match([1, 2, 3], namespace="ns", extra=extra)
    trie.allocate(seq, 3)
    trie.commit(seq, 1)
    assert seq.num_committed_tokens == 1
    assert trie.snapshot()["nodes"] == {}
    trie.commit(seq, 2)
    assert len(trie.snapshot()["nodes"]) == 2  # the root and the block
