"""Issue 44: the ways out of the documented model an audit found, each pinned by a
test that failed before its fix.

1. User code after validation ([R60]): identities and namespaces the cache cannot
   own are refused by `match`, before anything changes.
4. Runtime state that aliases the pools ([R63]); the refusals themselves are rows of
   the bad-input catalogue (tests/test_bad_inputs.py, "ranges-...").
6. Complex runtime state (rows there too); a copy failed inside its own run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cache import BlockTrie, CacheError, CopyFailed, InvalidArgument, InvalidType, ManualCopies
from cache.copies import Copy
from spec.model import ReferenceCache
from tests.helpers import empty_state, frozen, kv_trie, serve, ssm_trie, state

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of 4, one token to compute


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
    """Before [R60] each of these was accepted by `match` and broke `commit` or
    `evict` half-way (a plain TypeError / ValueError / RuntimeError after the clock
    ticked and a block was deduplicated, a leaked node row, a node out of the
    eviction index, a KeyError): now `match` refuses it, naming it, and the cache,
    with events on, is exactly as before."""
    trie = kv_trie(num_blocks=8)
    serve(trie, PROMPT)  # something cached, so commit would deduplicate
    for item in extra:
        if isinstance(item, _CallsBack):
            item.trie = trie
    before = frozen(trie.snapshot())
    clock = trie.clock
    with pytest.raises(error, match=r"extra\[[01]\]"):
        serve(trie, PROMPT, extra=extra)
    assert frozen(trie.snapshot()) == before
    assert trie.clock == clock
    trie.check()
    assert trie.evict(8) == 2  # the index still holds every cached block
    trie.check()


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
    """[R60] is the model's rule too (the differential test compares error classes)."""
    _model_and_cache_refuse_alike(call)


# ------------------------------------------------ 4. runtime state aliasing the pools


def test_a_restore_into_another_checkpoints_slot_is_refused_and_that_checkpoint_kept() -> None:
    """Before [R63] the restore was accepted and wrote one checkpoint's state over
    another's slot: the next request restoring that one got the wrong state."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = trie.match([1, 1, 1, 1, 2])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.save(seq, 4, state(7.0))
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    other = trie.match([3, 3, 3, 3, 4])
    trie.allocate(other, 5)
    trie.commit(other, 5)
    trie.save(other, 4, state(9.0))
    copies.complete_all()
    trie.poll()
    trie.release(other)
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
    """[R63] compares the bytes each tensor spans, not whole storages: an engine
    that keeps every state of a request in one buffer restores into its views."""
    trie, _ = ssm_trie(manual=False)
    seq = trie.match([1, 1, 1, 1, 2])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
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


class _FailsItself:
    """A move that, while it runs, has the engine declare its copy failed (as an
    engine does when it sees the transfer go wrong before it returns)."""

    def __init__(self, copies: ManualCopies) -> None:
        self.copies = copies
        self.copy: Copy | None = None

    def run(self) -> None:
        assert self.copy is not None
        self.copies.fail(self.copy)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def release(self) -> None:
        pass


def test_complete_of_a_copy_failed_inside_its_own_run_raises_copy_failed() -> None:
    """It raised `IllegalTransition` (finish from `failed`) before: now `CopyFailed`,
    the copy is failed, its checkpoint withdrawn, and poll reaps it as failed."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = trie.match([1, 1, 1, 1, 2])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    copy = trie.save(seq, 4, state(1.0))
    assert copy is not None
    move = _FailsItself(copies)
    move.copy = copy
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
