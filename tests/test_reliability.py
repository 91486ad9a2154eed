"""Issue 44: the ways out of the documented model an audit found, each pinned by a
test that failed before its fix.

1. User code after validation ([R57]): identities and namespaces the cache cannot
   own are refused by `match`, before anything changes.
2. Copy completion and failure from other threads ([R58]): recorded at once, applied
   by the owning thread; `check()` / `snapshot()` from a monitor thread are
   consistent or `ConcurrentUse`.
3. An error after a copy was queued on a stream ([R59]): tests/test_contract_copies.py.
4. Runtime state that aliases the pools ([R60]); the refusals themselves are rows of
   the bad-input catalogue (tests/test_bad_inputs.py, "ranges-...").
6. Complex runtime state (rows there too); a copy failed inside its own run.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cache import (
    BlockTrie,
    CacheError,
    CheckpointError,
    ConcurrentUse,
    CopyFailed,
    InvalidArgument,
    InvalidType,
)
from cache.checkpoints import CheckpointStore
from cache.node import NodeTable
from spec.model import ReferenceCache
from tests.helpers import empty_state, frozen, kv_trie, serve, ssm_trie, state
from tests.test_contract_copies import _FailsOnRun

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of 4, one token to compute


def _prefilled(trie: BlockTrie, tokens: list[int]) -> Any:
    """match + allocate + commit the whole prompt; the sequence stays live."""
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


# ------------------------------------------------- 1. user code after validation


class _CallsBack:
    """An identity whose hash and equality call back into the trie (re-entrancy)."""

    trie: BlockTrie | None = None

    def __hash__(self) -> int:
        if self.trie is not None:
            self.trie.evict(1)
        return 1

    def __eq__(self, other: object) -> bool:
        if self.trie is not None:
            self.trie.evict(1)
        return isinstance(other, _CallsBack)


class _Drifts:
    """An identity whose hash changes after it was cached."""

    def __init__(self) -> None:
        self.salt = 0

    def __hash__(self) -> int:
        return self.salt

    def __eq__(self, other: object) -> bool:
        return other is self


def _bad_identities() -> list[Any]:
    return [
        pytest.param((None, 1.5), InvalidType, id="float"),
        pytest.param(("img", "\ud800"), InvalidArgument, id="lone-surrogate"),
        pytest.param((torch.tensor([1, 2]),), InvalidType, id="multi-element-tensor"),
        pytest.param((torch.tensor(3),), InvalidType, id="0-d-tensor"),
        pytest.param((_CallsBack(),), InvalidType, id="calls-back-into-the-trie"),
        pytest.param((_Drifts(),), InvalidType, id="hash-drifts"),
        pytest.param((("mm", 0), float("nan")), InvalidType, id="nan"),
    ]


@pytest.mark.parametrize(("extra", "error"), _bad_identities())
def test_an_identity_the_cache_cannot_own_is_refused_before_anything_changes(
    extra: tuple[Any, ...], error: type[CacheError]
) -> None:
    """Before [R57] each of these was accepted by `match` and broke `commit` or
    `evict` half-way (a plain TypeError / ValueError / RuntimeError after the clock
    ticked and a block was deduplicated, a leaked node row, a node out of the
    eviction index, a KeyError): now `match` refuses it, naming it, and the cache,
    with events on, is exactly as before."""
    trie = kv_trie(num_blocks=8)
    serve(trie, PROMPT)  # something cached, so commit would deduplicate
    calls_back = [item for item in extra if isinstance(item, _CallsBack)]
    for item in calls_back:
        item.trie = trie
    try:
        before = frozen(trie.snapshot())
        clock = trie.clock
        with pytest.raises(error, match=r"extra\[[01]\]"):
            serve(trie, PROMPT, extra=extra)
        assert frozen(trie.snapshot()) == before
        assert trie.clock == clock
        trie.check()
        assert trie.evict(8) == 2  # the index still holds every cached block
        trie.check()
    finally:  # the parameter outlives the test: it must not keep the trie alive
        for item in calls_back:
            item.trie = None


def test_a_namespace_subclass_and_a_lone_surrogate_namespace_are_refused() -> None:
    """A `str` subclass hashes with its own code on every root lookup; a lone
    surrogate cannot be encoded into the root's event hash (it left a root behind
    a failed commit)."""

    class Tenant(str):
        def __hash__(self) -> int:
            return 0

    trie = kv_trie()
    before = frozen(trie.snapshot())
    with pytest.raises(InvalidType, match="namespace must be a str"):
        serve(trie, PROMPT, namespace=Tenant("a"))
    with pytest.raises(InvalidArgument, match="namespace is not valid Unicode"):
        serve(trie, PROMPT, namespace="t\ud83d")
    assert frozen(trie.snapshot()) == before
    assert trie.snapshot()["roots"] == {}
    trie.check()


def test_identities_the_cache_owns_still_hit_and_publish() -> None:
    """Every allowed form (None, bool, int, str with any valid Unicode, bytes,
    nested tuples) caches and hits; `True` and `1` stay one identity ([R5])."""
    extra = (("mm-hash-\u00e9\U0001f600", 3), (b"\x00raw", (None, (True, -(2**70)))))
    trie = kv_trie()
    serve(trie, PROMPT, extra=list(extra))
    seq = trie.match(PROMPT, extra=extra)
    assert seq.num_cached_tokens == 8
    assert seq.extra == extra
    trie.abort(seq)
    assert serve(trie, [1, 2, 3, 4, 9], extra=(True,)) == 0
    assert serve(trie, [1, 2, 3, 4, 9], extra=(1,)) == 4
    trie.check()


def test_extra_is_copied_at_match() -> None:
    """The list the caller passed is read once: changing it later changes nothing."""
    trie = kv_trie()
    extra: list[Any] = ["a", "b"]
    seq = trie.match(PROMPT, extra=extra)
    extra[0] = 1.5
    trie.allocate(seq, 9)
    trie.commit(seq, 9)
    trie.release(seq)
    assert seq.extra == ("a", "b")
    assert serve(trie, PROMPT, extra=("a", "b")) == 8
    trie.check()


def _model_and_cache_refuse_alike(call: Callable[[Any], object]) -> None:
    cache_trie = kv_trie()
    model = ReferenceCache(4, 16, 0)
    errors = []
    for impl in (cache_trie, model):
        with pytest.raises(CacheError) as info:
            call(impl)
        errors.append(type(info.value))
    assert errors[0] is errors[1], errors


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c: c.match(PROMPT, extra=(None, 1.5)), id="float"),
        pytest.param(lambda c: c.match(PROMPT, extra=("\udc00",)), id="surrogate"),
        pytest.param(lambda c: c.match(PROMPT, extra=(("a", [1]),)), id="nested-list"),
        pytest.param(lambda c: c.match(PROMPT, extra=("\udc00", 1.5)), id="value-then-type"),
        pytest.param(lambda c: c.match(PROMPT, extra=(1.5, "\udc00")), id="type-then-value"),
        pytest.param(lambda c: c.match(PROMPT, namespace="\ud800"), id="namespace"),
        pytest.param(
            lambda c: c.match([torch.tensor(2**63, dtype=torch.uint64)]), id="uint64-token"
        ),
    ],
)
def test_the_reference_model_applies_the_same_rule(call: Callable[[Any], object]) -> None:
    """[R57] is the model's rule too (the differential test compares error classes)."""
    _model_and_cache_refuse_alike(call)


# ------------------------------------------------ 2. completion from other threads


def _in_thread(call: Callable[[], object]) -> BaseException | None:
    """Run `call` on another thread, to its end; returns what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return raised[0] if raised else None


def _wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.0005)


def test_a_failure_reported_from_another_thread_inside_match_waits_for_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before [R58] the failure applied at once, between match finding the checkpoint
    matchable and pinning it: match raised `IllegalTransition` holding block
    references for good. Now it is recorded; match completes; poll applies it (the
    checkpoint is withdrawn, the restore refused) and every count adds up."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefilled(trie, [1, 1, 1, 1, 2])
    save = trie.save(seq, 4, state(1.0))
    assert save is not None
    trie.release(seq)
    find = CheckpointStore.deepest_match
    outcome: list[BaseException | None] = []

    def fail_meanwhile(*args: Any) -> Any:
        found = find(*args)
        outcome.append(_in_thread(lambda: copies.fail(save)))
        return found

    monkeypatch.setattr(CheckpointStore, "deepest_match", staticmethod(fail_meanwhile))
    hit = trie.match([1, 1, 1, 1, 3])
    monkeypatch.undo()
    assert outcome == [None]
    assert hit.restore is not None and save.state == "queued", "recorded, not applied"
    trie.check()
    assert trie.poll() == 1 and save.failed
    with pytest.raises(CheckpointError, match="withdrawn"):
        trie.restore(hit, empty_state())
    trie.abort(hit)
    trie.check()
    assert trie.evict(16) == 1 and trie.num_free_blocks == 16
    assert trie.num_free_checkpoint_slots == 4


def test_check_and_snapshot_from_a_monitor_thread_mid_operation_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, a monitor's `check()` in the middle of a commit saw half-attached nodes
    and reported a false `InvariantViolation` (or a `KeyError`); now both calls
    answer `ConcurrentUse` while an operation runs, and a consistent answer after."""
    trie = kv_trie()
    take = NodeTable._take  # mid-commit, rows for the new nodes taken: on either core
    seen: list[BaseException | None] = []

    def watch_meanwhile(table: NodeTable, count: int) -> list[int]:
        if not seen:  # the first time (a namespace's root takes a row too)
            seen.append(_in_thread(trie.check))
            seen.append(_in_thread(trie.snapshot))
        return take(table, count)

    monkeypatch.setattr(NodeTable, "_take", watch_meanwhile)
    serve(trie, PROMPT)
    monkeypatch.undo()
    assert [type(e) for e in seen] == [ConcurrentUse, ConcurrentUse]
    assert "check()" in str(seen[0]) and "snapshot()" in str(seen[1])
    assert _in_thread(trie.check) is None
    assert trie.num_cached_blocks == 2


def test_a_completion_from_the_owning_thread_applies_at_once_and_from_another_at_poll() -> None:
    """The owning thread keeps today's behaviour (the data moves when it says so);
    another thread's report waits for the owner's next `poll()`, which reaps it,
    or its next `Copy.wait()`."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefilled(trie, [1, 1, 1, 1, 2])
    first = trie.save(seq, 4, state(1.0))
    assert first is not None
    assert _in_thread(lambda: copies.complete(first)) is None
    assert first.state == "queued" and not first.done
    assert trie.poll() == 1 and first.state == "reaped"
    third = trie.save(seq, 3, state(3.0))
    assert third is not None
    assert _in_thread(lambda: copies.fail(third)) is None
    with pytest.raises(CopyFailed):  # the owner's wait applies the report first
        third.wait()
    assert trie.poll() == 1 and third.failed
    second = trie.save(seq, 5, state(2.0))
    assert second is not None
    copies.complete(second)
    assert second.state == "finished"
    assert _in_thread(lambda: copies.fail(second)) is None  # finished since: dropped
    assert trie.poll() == 1 and not second.failed
    trie.release(seq)
    trie.check()


def test_completions_and_failures_hammered_from_three_threads_keep_every_invariant() -> None:
    """The scheduler (this thread) serves requests with checkpoints and restores;
    two completion threads complete and fail whatever copies are pending; a
    monitor thread checks the invariants and takes snapshots. Every monitor call
    is consistent or `ConcurrentUse` (the scheduler retries a call the monitor
    refused: `ConcurrentUse` changes nothing); no thread sees any other error; at
    the end every pool is whole again."""
    trie, copies = ssm_trie(num_blocks=24, slots=4)
    assert copies is not None
    errors: list[BaseException] = []
    stop = threading.Event()
    reports = [0, 0]
    monitor_ok = [0]

    def retry(call: Callable[..., Any], *args: Any) -> Any:
        while True:
            try:
                return call(*args)
            except ConcurrentUse:  # the monitor holds the trie for a moment
                time.sleep(0)

    def completer(k: int) -> None:
        rng = random.Random(k)
        try:
            while not stop.is_set():
                pending = copies.pending()
                if pending:
                    copy = rng.choice(pending)
                    (copies.fail if rng.random() < 0.3 else copies.complete)(copy)
                    reports[k] += 1
                time.sleep(0.0002)
        except BaseException as exc:
            errors.append(exc)

    def monitor() -> None:
        try:
            while not stop.is_set():
                for look in (trie.check, trie.snapshot):
                    try:
                        look()
                        monitor_ok[0] += 1
                    except ConcurrentUse:
                        pass
                time.sleep(0.0002)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=completer, args=(k,)) for k in (0, 1)]
    threads.append(threading.Thread(target=monitor))
    rng = random.Random(44)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for thread in threads:
            thread.start()
        for step in range(300):
            if step % 10 == 0 and copies.pending():  # let the other threads in, whatever the load
                seen = sum(reports)
                _wait_until(lambda: sum(reports) > seen)  # noqa: B023 - read while it waits
            tokens = [rng.randrange(2) for _ in range(rng.randint(5, 11))]
            seq = retry(trie.match, tokens)
            if seq.restore is not None:
                try:
                    retry(trie.restore, seq, empty_state())
                except CheckpointError:  # withdrawn: its save failed ([R46])
                    retry(trie.abort, seq)
                    continue
            retry(trie.allocate, seq, len(tokens))
            retry(trie.commit, seq, len(tokens))
            retry(trie.save, seq, len(tokens) - 1, state(float(len(tokens))))
            retry(trie.release, seq)
            retry(trie.poll)
        _wait_until(lambda: monitor_ok[0] >= 2)  # the scheduler is idle: the looks succeed
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        sys.setswitchinterval(old)
    assert errors == []
    assert sum(reports) > 0 and monitor_ok[0] >= 2
    trie.poll()  # the reports still recorded
    copies.complete_all()
    trie.poll()
    trie.check()
    trie.evict(24)
    trie.evict_checkpoints(4)
    assert trie.num_free_blocks == 24 and trie.num_free_checkpoint_slots == 4
    assert trie.stats.copies_failed > 0 and trie.stats.copies_reaped > trie.stats.copies_failed


# ------------------------------------------------ 4. runtime state aliasing the pools


def test_a_restore_into_another_checkpoints_slot_is_refused_and_that_checkpoint_kept() -> None:
    """Before [R60] the restore was accepted and wrote one checkpoint's state over
    another's slot: the next request restoring that one got the wrong state."""
    trie, copies = ssm_trie()
    assert copies is not None
    for prompt, value in (([1, 1, 1, 1, 2], 7.0), ([3, 3, 3, 3, 4], 9.0)):
        seq = _prefilled(trie, prompt)
        trie.save(seq, 4, state(value))
        copies.complete_all()
        trie.poll()
        trie.release(seq)
    hit = trie.match([1, 1, 1, 1, 5])
    assert hit.restore is not None
    mine = hit.restore.checkpoint.serial
    (slot_of_nine,) = [
        c["slot"] for serial, c in trie.snapshot()["checkpoints"].items() if serial != mine
    ]
    views = {n: t[slot_of_nine] for n, t in trie.checkpoint_states.items()}
    with pytest.raises(InvalidArgument, match="overlaps the storage of the cache's checkpoint"):
        trie.restore(hit, views)
    out = empty_state()
    trie.restore(hit, out)
    copies.complete_all()
    trie.poll()
    trie.release(hit)
    assert torch.equal(out["conv"], state(7.0)["conv"])
    again = trie.match([3, 3, 3, 3, 5])
    out = empty_state()
    trie.restore(again, out)
    copies.complete_all()
    trie.poll()
    trie.release(again)
    assert torch.equal(out["ssm"], state(9.0)["ssm"])  # the other checkpoint is intact
    trie.check()


def test_disjoint_views_of_one_engine_buffer_are_fine_targets() -> None:
    """[R60] compares the bytes each tensor spans, not whole storages: an engine
    that keeps every state of a request in one buffer restores into its views."""
    trie, _ = ssm_trie(manual=False)
    seq = _prefilled(trie, [1, 1, 1, 1, 2])
    trie.save(seq, 4, state(3.0))
    trie.release(seq)
    buffer = torch.zeros(9, dtype=torch.float64)
    views = {"conv": buffer[:6].view(2, 3), "ssm": buffer[6:]}
    hit = trie.match([1, 1, 1, 1, 5])
    trie.restore(hit, views)
    trie.release(hit)
    assert torch.equal(views["conv"], state(3.0)["conv"])
    assert torch.equal(views["ssm"], state(3.0)["ssm"])
    trie.check()


# ------------------------------------------------ 6. a copy failed inside its own run


def test_complete_of_a_copy_failed_inside_its_own_run_raises_copy_failed() -> None:
    """It raised `IllegalTransition` (finish from `failed`) before: now `CopyFailed`,
    the copy is failed, its checkpoint withdrawn, and poll reaps it as failed."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefilled(trie, [1, 1, 1, 1, 2])
    copy = trie.save(seq, 4, state(1.0))
    assert copy is not None
    move = _FailsOnRun(copies)  # declares `copy` itself failed while it runs
    move.victim = copy
    copy.moves.append(move)
    with pytest.raises(CopyFailed, match="failed while it ran"):
        copies.complete(copy)
    assert copy.failed and copy.state == "failed"
    assert trie.poll() == 1
    assert trie.stats.copies_failed == 1
    trie.release(seq)
    again = trie.match([1, 1, 1, 1, 9])
    assert again.restore is None  # withdrawn, then released
    trie.release(again)
    trie.check()
