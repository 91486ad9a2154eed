"""The core test: one state machine drives `cache.BlockTrie` and `spec.model.ReferenceCache`
with the same operations and compares what they observe after every step.

- Tiny token alphabet ({0, 1}), block sizes 2-3, a handful of blocks and slots:
  prefixes collide, nodes are shared, eviction and skipping happen constantly.
- `Bundle`s hold live sequences, in-flight copies and pin receipts;
  `consumes()` retires them on release / abort / complete / unpin.
- Errors are part of the contract: both implementations must raise the same
  class, and a failing operation must leave the cache's observable state as it was.
- `check()` (every spec invariant) runs as an `@invariant` on the cache, and
  the same predicates run on the model's snapshot.
- With a host tier (drawn for some runs): stores and loads are queued on the
  same `ManualCopies`, completed or failed in any order by index, and `load`,
  `evict_host` are rules ([R47]-[R51]).
- Data: every save writes a unique pattern into a fresh runtime state (and
  prefix-derived values into the partial tail's KV); every restore must read
  back exactly what was saved for that prefix, which catches a slot or frozen
  block reused while a copy was in flight. SSM runs keep a float64 and a
  float32 state (`state_dtypes`).
- Events and metrics: `bind_lora` is a rule, and after every step each stored
  block's event carries the `lora_id` the model has bound its namespace to
  ([R70]); `cache.metrics` is scraped and must give what `spec.metrics` states.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from cache import BlockPinReceipt, BlockTrie, CacheConfig, Copy, ManualCopies, PinReceipt, Sequence
from cache.block_hash import chain, root_hash, to_wire
from cache.events import BlockStored
from spec import invariants
from spec.errors import AllocationFailed, CopyFailed
from spec.lifecycle import CopyState, ReceiptState
from spec.metrics import UNMODELLED, ExportedMetrics
from spec.model import ReferenceCache
from spec.snapshot import observe

# The `metrics` extra (in the README's install): without it, the cache's exported
# metrics are not compared.
HAVE_METRICS = importlib.util.find_spec("prometheus_client") is not None

T = TypeVar("T")

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=8)
NAMESPACES = st.sampled_from(["", "ns"])
EXTRAS = st.one_of(st.none(), st.lists(st.sampled_from([None, "img"]), max_size=3))
FRACTION = st.floats(0.0, 1.0)
SALTS = st.sampled_from([None, None, None, "", "s", "t"])
MAX_HIT = st.one_of(st.none(), st.integers(-1, 8))
SPANS = st.lists(st.tuples(st.integers(-1, 8), st.integers(0, 9)), max_size=3)
LORA_IDS = st.sampled_from([None, 1, 7, 2**63 - 1, 0, -3, 2**63, True, "1"])


def _published_hash(namespace: str, keys: tuple[tuple[tuple[int, ...], Any], ...]) -> int:
    """The hash events publish for the block at the end of `keys` (the model's view of
    a path: (block tokens, block identity) from the root), scheme "xxh3", seed 0."""
    h = root_hash(namespace)
    for tokens, identity in keys:
        h = chain(h, tokens, identity, namespace=namespace)
    return to_wire(h)


def _code(namespace: str, prefix: tuple[int, ...]) -> float:
    """The KV value an engine would write at the last position of `prefix`."""
    return float(hash((namespace, prefix)) % 100_003)


@dataclass
class Pair:
    """The same object in both implementations."""

    real: Any
    model: Any


@dataclass
class PendingRestore:
    """What a restore copy must have written once it completes."""

    copy: Copy
    runtime: dict[str, torch.Tensor]
    expected_pattern: float
    block: int
    expected_tail: list[float] = field(default_factory=list)


class CacheVersusModel(RuleBasedStateMachine):
    device = "cpu"
    live = Bundle("live")
    copies = Bundle("copies")
    receipts = Bundle("receipts")
    block_receipts = Bundle("block_receipts")

    @initialize(
        block_size=st.integers(2, 3),
        num_blocks=st.integers(4, 10),
        slots=st.sampled_from([0, 1, 2, 3]),
        collide=st.booleans(),
        host=st.sampled_from([0, 0, 2, 6]),
        write_back=st.booleans(),
        host_slots=st.sampled_from([0, 0, 1, 3]),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        slots: int,
        collide: bool,
        host: int,
        write_back: bool,
        host_slots: int,
    ) -> None:
        """`collide`: the cache hashes every block key to 0, so exact comparison alone
        decides. `write_back` applies to attention-only runs with a host tier ([R52]);
        `host_slots` (host checkpoint slots, [R53]) to SSM runs. SSM runs keep two
        states, of two dtypes (`state_dtypes`): the model has no tensors, so the
        restored bytes of both are checked against what was saved."""
        self.block_size = block_size
        self.ssm = slots > 0
        self.host = host > 0
        host_write = "back" if write_back and host and not slots else "through"
        host_slots = host_slots if slots else 0
        self.manual = ManualCopies()
        self.cache = BlockTrie(
            CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                kv_block_shape=(block_size,),
                kv_dtype=torch.float64,
                num_checkpoint_slots=slots,
                state_shapes={"s": (2,), "c": (3,)} if slots else {},
                state_dtype=torch.float64,
                state_dtypes={"c": torch.float32} if slots else {},
                device=self.device,
                key_hash=(lambda key: 0) if collide else None,
                enable_events=True,  # so check() also replays them (invariant 10)
                num_host_blocks=host,
                host_write=host_write,
                num_host_checkpoint_slots=host_slots,
                stats_window=num_blocks - 2,  # small: matches fall out of it ([R69])
            ),
            copies=self.manual,
        )
        self.model = ReferenceCache(
            block_size,
            num_blocks,
            slots,
            manual_copies=True,
            num_host_blocks=host,
            host_write=host_write,
            num_host_checkpoint_slots=host_slots,
            stats_window=num_blocks - 2,
            block_hash=_published_hash,
        )
        self.patterns = 0
        self.saved: dict[tuple[Any, ...], float] = {}
        self.pending_restores: list[PendingRestore] = []
        self.open_sequences: dict[int, Pair] = {}  # for teardown's drain
        self.open_receipts: dict[int, Pair] = {}
        self.open_block_receipts: dict[int, Pair] = {}
        self.registry: Any = None  # the cache's exported metrics, against spec.metrics
        if HAVE_METRICS:
            from prometheus_client import CollectorRegistry

            from cache.metrics import register

            self.registry = CollectorRegistry()
            register(self.cache, self.registry)
        self.exported = ExportedMetrics(self.model)
        self.most_pins = 0  # since the last reset: a floor for the exported peak_pins
        self.seen_resets = 0  # the model's `resets` when `most_pins` last restarted

    # ------------------------------------------------------------ helpers

    def both(
        self, real: Callable[[], T], model: Callable[[], Any], *, evictions_stay: bool = False
    ) -> tuple[T, Any] | None:
        """Run the operation on both; same error class, or both succeed.

        Returns None when both raised. A raising operation must not change
        what the cache's observable state was; with `evictions_stay`, one that
        failed at an allocation point may leave its make-room evictions done
        ([R6]), which the model makes too (the comparison after each step checks them).
        """
        before = observe(self.cache.snapshot())
        real_error: Exception | None = None
        model_error: Exception | None = None
        real_result: Any = None
        model_result: Any = None
        try:
            real_result = real()
        except Exception as exc:  # compared below
            real_error = exc
        try:
            model_result = model()
        except Exception as exc:
            model_error = exc
        assert type(real_error) is type(model_error), (
            f"cache raised {real_error!r}, model raised {model_error!r}"
        )
        if real_error is not None:
            assert not isinstance(real_error, AssertionError)
            if "write-back stores in flight" in str(real_error):  # [R52]'s one exception
                return None
            if not (evictions_stay and isinstance(real_error, AllocationFailed)):
                assert observe(self.cache.snapshot()) == before, f"{real_error!r} changed state"
            return None
        return real_result, model_result

    def _identity(self, seq: Sequence, step: int) -> tuple[Any, ...]:
        """What a checkpoint after `step` tokens of `seq` is for: namespace, tokens, extras."""
        blocks = -(-step // self.block_size)
        extra = seq.extra or ()
        extras = tuple(extra[i] if i < len(extra) else None for i in range(blocks))
        return (seq.namespace, seq.tokens[:step], extras)

    def _runtime(self, value: float) -> dict[str, torch.Tensor]:
        if not self.ssm:
            return {}
        return {
            "s": torch.tensor([value, -value], dtype=torch.float64, device=self.device),
            "c": torch.tensor([value, 0.5, -value], dtype=torch.float32, device=self.device),
        }

    # -------------------------------------------------------------- rules

    def _match(self, tokens: list[int], namespace: str, extra: Any, **bounds: Any) -> Pair | None:
        """`match` on both (with `bounds`: max_hit_tokens, atomic_spans); the pair of
        sequences, or None when both refused it."""
        out = self.both(
            lambda: self.cache.match(tokens, namespace=namespace, extra=extra, **bounds),
            lambda: self.model.match(tokens, namespace=namespace, extra=extra, **bounds),
        )
        if out is None:
            return None
        real, model = out
        assert real.num_cached_tokens == model.num_cached_tokens
        assert real.num_host_tokens == model.num_host_tokens
        assert real.branch_step == model.branch_step
        assert len(real.block_ids) == len(model.block_ids)
        assert (real.restore is None) == (model.restore is None)
        if real.restore is not None:
            assert real.restore.step == model.restore.step == real.num_cached_tokens
        pair = Pair(real, model)
        self.open_sequences[id(real)] = pair
        return pair

    @rule(target=live, tokens=TOKENS, namespace=NAMESPACES, extra=EXTRAS, salt=SALTS)
    def match(
        self,
        tokens: list[int],
        namespace: str,
        extra: list[str | None] | None,
        salt: str | None = None,
    ) -> Any:
        """`salt`: vLLM's cache_salt ([R70]), folded into block 0's identity."""
        pair = self._match(tokens, namespace, extra, cache_salt=salt)
        assert pair is not None
        return pair

    @rule(
        target=live,
        tokens=TOKENS,
        namespace=NAMESPACES,
        extra=EXTRAS,
        max_hit=MAX_HIT,
        spans=SPANS,
        prefill=st.booleans(),
    )
    def bounded_match(
        self,
        tokens: list[int],
        namespace: str,
        extra: list[str | None] | None,
        max_hit: int | None,
        spans: list[tuple[int, int]],
        prefill: bool,
    ) -> Any:
        """[R64], [R65]: a capped match and atomic spans (malformed ones too: both raise);
        with `prefill`, the prompt is then computed and committed whatever the hit
        (max_hit=0: vLLM's prompt-logprobs request, deduplicated into the cache)."""
        pair = self._match(tokens, namespace, extra, max_hit_tokens=max_hit, atomic_spans=spans)
        if pair is None:
            return multiple()
        hit = pair.real.num_cached_tokens
        assert max_hit is None or hit <= max_hit
        assert not any(start < hit < end for start, end in spans)
        if prefill:
            if self.host:
                self.load(pair)
            self.allocate_and_commit_all(pair)
        return pair

    @rule(target=live, tokens=TOKENS, namespace=NAMESPACES, extra=EXTRAS)
    def prefill(self, tokens: list[int], namespace: str, extra: list[str | None] | None) -> Any:
        """match (+ load) + allocate + commit the whole prompt: what most requests do."""
        pair = self.match(tokens, namespace, extra)
        if self.host:
            self.load(pair)
        n = len(tokens)
        if self.both(
            lambda: self.cache.allocate(pair.real, n), lambda: self.model.allocate(pair.model, n)
        ):
            self.both(
                lambda: self.cache.commit(pair.real, n), lambda: self.model.commit(pair.model, n)
            )
        return pair

    @rule(seq=live, tokens=TOKENS)
    def append(self, seq: Pair, tokens: list[int]) -> None:
        self.both(
            lambda: self.cache.append(seq.real, tokens),
            lambda: self.model.append(seq.model, tokens),
        )

    @rule(seq=live, fraction=FRACTION, overshoot=st.integers(0, 1))
    def allocate(self, seq: Pair, fraction: float, overshoot: int) -> None:
        n = int(len(seq.real.tokens) * fraction) + overshoot
        self.both(
            lambda: self.cache.allocate(seq.real, n), lambda: self.model.allocate(seq.model, n)
        )

    @rule(seq=live, fraction=FRACTION, overshoot=st.integers(0, 1))
    def can_allocate_then_allocate(self, seq: Pair, fraction: float, overshoot: int) -> None:
        """[R62], [R63]: the admission queries change nothing, agree with the model and
        with each other, and `allocate` succeeds exactly when `can_allocate` said so
        (but for [R52]'s write-back stores that `ManualCopies` never finishes)."""
        reclaimable = self.cache.num_reclaimable_blocks
        assert reclaimable == self.model.num_reclaimable_blocks
        n = int(len(seq.real.tokens) * fraction) + overshoot
        before = observe(self.cache.snapshot())
        out = self.both(
            lambda: self.cache.can_allocate(seq.real, n),
            lambda: self.model.can_allocate(seq.model, n),
        )
        assert observe(self.cache.snapshot()) == before
        if out is None:  # a malformed call: both raised what allocate raises
            return
        can, model_can = out
        assert can is model_can
        need = -(-n // self.block_size) - len(seq.real.block_ids)
        if not (seq.real.host_path or seq.real.load_failed) and need > 0:
            assert can == (need <= reclaimable)
        errors: list[Exception] = []

        def allocate() -> None:
            try:
                self.cache.allocate(seq.real, n)
            except Exception as exc:
                errors.append(exc)
                raise

        self.both(allocate, lambda: self.model.allocate(seq.model, n))
        if errors and "complete them, poll, retry" in str(errors[0]):  # [R52]
            assert can
        else:
            assert can == (not errors), errors

    @rule(seq=live, fraction=FRACTION)
    def commit(self, seq: Pair, fraction: float) -> None:
        covered = min(len(seq.real.tokens), len(seq.real.block_ids) * self.block_size)
        n = int(covered * fraction) if fraction < 0.9 else covered
        self.both(lambda: self.cache.commit(seq.real, n), lambda: self.model.commit(seq.model, n))

    @rule(seq=live)
    def allocate_and_commit_all(self, seq: Pair) -> None:
        n = len(seq.real.tokens)
        if self.both(
            lambda: self.cache.allocate(seq.real, n), lambda: self.model.allocate(seq.model, n)
        ):
            self.both(
                lambda: self.cache.commit(seq.real, n), lambda: self.model.commit(seq.model, n)
            )

    @rule(seq=consumes(live))
    def release(self, seq: Pair) -> None:
        self.both(lambda: self.cache.release(seq.real), lambda: self.model.release(seq.model))
        self.open_sequences.pop(id(seq.real), None)

    @rule(seq=consumes(live))
    def abort(self, seq: Pair) -> None:
        self.both(lambda: self.cache.abort(seq.real), lambda: self.model.abort(seq.model))
        self.open_sequences.pop(id(seq.real), None)

    @precondition(lambda self: self.host)
    @rule(seq=live)
    def load(self, seq: Pair) -> None:
        out = self.both(lambda: self.cache.load(seq.real), lambda: self.model.load(seq.model))
        if out is not None:
            real, model = out
            assert (real is None) == (model is None)
            if real is not None:
                assert (real.kind, real.state) == (model.kind, model.state)
            assert seq.real.block_ids == tuple(seq.real.block_ids)
            assert len(seq.real.block_ids) == len(seq.model.block_ids)

    @precondition(lambda self: self.host)
    @rule(n=st.integers(0, 3))
    def evict_host(self, n: int) -> None:
        out = self.both(lambda: self.cache.evict_host(n), lambda: self.model.evict_host(n))
        assert out is not None and out[0] == out[1]

    @precondition(lambda self: self.host and bool(self.manual.pending()))
    @rule(pick=st.integers(0, 7), fail=st.booleans())
    def finish_a_pending_copy(self, pick: int, fail: bool) -> None:
        """Any pending copy (stores and loads included) completes or fails, by index."""
        real_pending, model_pending = self.manual.pending(), self.model.pending()
        assert len(real_pending) == len(model_pending)
        real, model = (
            real_pending[pick % len(real_pending)],
            model_pending[pick % len(real_pending)],
        )
        assert real.kind == model.kind
        if fail:
            self.both(lambda: self.manual.fail(real), lambda: self.model.fail(model))
        else:
            self.both(lambda: self.manual.complete(real), lambda: self.model.complete(model))
        assert real.state == model.state
        self._check_restored_data()

    @rule(tokens=TOKENS, namespace=NAMESPACES)
    def match_then_abort_is_an_exact_undo(self, tokens: list[int], namespace: str) -> None:
        """Invariant 8 (rollback), on both implementations."""
        for impl in (self.cache, self.model):
            before = impl.snapshot()
            impl.abort(impl.match(tokens, namespace=namespace))
            assert invariants.rollback(before, impl.snapshot()) == []

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        out = self.both(lambda: self.cache.evict(n), lambda: self.model.evict(n))
        assert out is not None and out[0] == out[1]

    @precondition(lambda self: self.ssm)
    @rule(n=st.integers(0, 3))
    def evict_checkpoints(self, n: int) -> None:
        out = self.both(
            lambda: self.cache.evict_checkpoints(n), lambda: self.model.evict_checkpoints(n)
        )
        assert out is not None and out[0] == out[1]

    @precondition(lambda self: self.ssm)
    @rule(
        target=copies,
        seq=live,
        where=st.sampled_from(["committed", "block", "branch", "any"]),
        fraction=FRACTION,
    )
    def save(self, seq: Pair, where: str, fraction: float) -> Any:
        """Save where an engine would: the committed end, its last block boundary (a
        chunked prefill's; block-aligned checkpoints go to the host tier), the branch
        point, or anywhere."""
        real_seq: Sequence = seq.real
        step = self._step(real_seq, where, fraction)
        self.patterns += 1
        pattern = float(self.patterns)
        runtime = self._runtime(pattern)
        depth, rem = divmod(step, self.block_size)
        kv = self.cache.kv_cache
        if rem and len(real_seq.block_ids) > depth and kv is not None:
            # The engine has computed the partial block's KV: prefix-derived values.
            for pos in range(rem):
                prefix = real_seq.tokens[: depth * self.block_size + pos + 1]
                kv[real_seq.block_ids[depth], pos] = _code(real_seq.namespace, prefix)
        out = self.both(
            lambda: self.cache.save(real_seq, step, runtime),
            lambda: self.model.save(seq.model, step),
        )
        if out is None:
            return multiple()
        real, model = out
        assert (real is None) == (model is None)
        if real is None:
            return multiple()
        self.saved[self._identity(real_seq, step)] = pattern
        return Pair(real, model)

    def _step(self, seq: Sequence, where: str, fraction: float) -> int:
        """A step where an engine would save (or drop) a checkpoint: the committed end,
        its last block boundary, the branch point, or anywhere."""
        if where == "committed":
            return max(1, seq.num_committed_tokens)
        if where == "block":
            return max(1, seq.num_committed_tokens // self.block_size * self.block_size)
        if where == "branch":
            return max(1, min(seq.branch_step, seq.num_committed_tokens))
        return max(1, round(len(seq.tokens) * fraction))

    @rule(
        seq=live,
        where=st.sampled_from(["committed", "block", "branch", "any"]),
        fraction=FRACTION,
    )
    def drop_checkpoint(self, seq: Pair, where: str, fraction: float) -> None:
        """[R68]: the engine releases a checkpoint of its sequence's prefix (lmdeploy's
        rolling decode checkpoint); attention-only, both refuse."""
        step = self._step(seq.real, where, fraction)
        out = self.both(
            lambda: self.cache.drop_checkpoint(seq.real, step),
            lambda: self.model.drop_checkpoint(seq.model, step),
        )
        if out is not None:
            assert out[0] is out[1]

    @precondition(lambda self: self.ssm)
    @rule(target=copies, seq=live)
    def restore(self, seq: Pair) -> Any:
        real_seq: Sequence = seq.real
        runtime = self._runtime(-1.0)
        out = self.both(
            lambda: self.cache.restore(real_seq, runtime),
            lambda: self.model.restore(seq.model),
        )
        if out is None:
            return multiple()
        real, model = out
        assert real_seq.restore is not None
        step = real_seq.restore.step
        depth, rem = divmod(step, self.block_size)
        self.pending_restores.append(
            PendingRestore(
                copy=real,
                runtime=runtime,
                expected_pattern=self.saved[self._identity(real_seq, step)],
                block=real_seq.block_ids[depth] if rem else -1,
                expected_tail=[
                    _code(real_seq.namespace, real_seq.tokens[: depth * self.block_size + p + 1])
                    for p in range(rem)
                ],
            )
        )
        return Pair(real, model)

    @precondition(lambda self: self.ssm)
    @rule(target=receipts, seq=live)
    def pin(self, seq: Pair) -> Any:
        out = self.both(lambda: self.cache.pin(seq.real), lambda: self.model.pin(seq.model))
        if out is None:
            return multiple()
        pair = Pair(*out)
        assert pair.real.state == pair.model.state == ReceiptState.ISSUED
        self.open_receipts[id(pair.real)] = pair
        return pair

    @rule(receipt=consumes(receipts))
    def unpin(self, receipt: Pair) -> None:
        assert isinstance(receipt.real, PinReceipt)
        self.both(lambda: self.cache.unpin(receipt.real), lambda: self.model.unpin(receipt.model))
        self.open_receipts.pop(id(receipt.real), None)
        # The receipt lifecycle: whatever happened, both agree, and a used one is redeemed.
        assert receipt.real.state == receipt.model.state
        assert receipt.real.state == ReceiptState.REDEEMED

    @rule(
        target=block_receipts,
        tokens=TOKENS,
        namespace=NAMESPACES,
        extra=EXTRAS,
        keep=st.lists(st.booleans(), min_size=4, max_size=4),
        unknown=st.booleans(),
    )
    def pin_blocks(
        self,
        tokens: list[int],
        namespace: str,
        extra: list[str | None] | None,
        keep: list[bool],
        unknown: bool,
    ) -> Any:
        """[R66]: a router pins blocks by the hashes events published for a prompt's
        blocks (some of them, maybe one no block has, maybe a repeat)."""
        size = self.block_size
        keys: list[tuple[tuple[int, ...], Any]] = []
        hashes: list[int] = []
        for i in range(len(tokens) // size):
            identity = extra[i] if extra is not None and i < len(extra) else None
            keys.append((tuple(tokens[i * size : (i + 1) * size]), identity))
            if keep[i % 4]:
                hashes.append(_published_hash(namespace, tuple(keys)))
        if unknown:
            hashes += [12345, *hashes[:1]]
        out = self.both(
            lambda: self.cache.pin_blocks(hashes, namespace=namespace),
            lambda: self.model.pin_blocks(hashes, namespace=namespace),
        )
        assert out is not None
        pair = Pair(*out)
        assert pair.real.pinned == pair.model.pinned
        assert pair.real.state == pair.model.state == ReceiptState.ISSUED
        self.open_block_receipts[id(pair.real)] = pair
        return pair

    @rule(receipt=consumes(block_receipts))
    def unpin_blocks(self, receipt: Pair) -> None:
        """[R67]: the pins go; what only they held is evictable again."""
        assert isinstance(receipt.real, BlockPinReceipt)
        self.both(
            lambda: self.cache.unpin_blocks(receipt.real),
            lambda: self.model.unpin_blocks(receipt.model),
        )
        self.open_block_receipts.pop(id(receipt.real), None)
        assert receipt.real.state == receipt.model.state == ReceiptState.REDEEMED
        self.both(  # single use: a second one raises PinError in both
            lambda: self.cache.unpin_blocks(receipt.real),
            lambda: self.model.unpin_blocks(receipt.model),
        )

    @rule(receipt=receipts)
    def unpin_twice_is_refused(self, receipt: Pair) -> None:
        if receipt.real.used:
            self.both(
                lambda: self.cache.unpin(receipt.real), lambda: self.model.unpin(receipt.model)
            )

    @rule(copy=consumes(copies))
    def complete_one_copy(self, copy: Pair) -> None:
        self.both(lambda: self.manual.complete(copy.real), lambda: self.model.complete(copy.model))
        # The copy lifecycle: finished (or failed earlier, or reaped), the same in both.
        assert copy.real.state == copy.model.state
        assert copy.real.state in (CopyState.FINISHED, CopyState.FAILED, CopyState.REAPED)
        self._check_restored_data()

    @rule(copy=consumes(copies))
    def fail_one_copy(self, copy: Pair) -> None:
        """A copy that never delivers ([R46]): a CUDA error, a cancelled request."""
        self.both(lambda: self.manual.fail(copy.real), lambda: self.model.fail(copy.model))
        assert copy.real.state == copy.model.state
        self._check_restored_data()

    @rule(copy=consumes(copies), interrupt=st.booleans())
    def a_copy_raises_while_it_runs(self, copy: Pair, interrupt: bool) -> None:
        """`complete` of a copy whose data movement raises (a CUDA error, or Ctrl-C in
        the middle): the error propagates, the copy is failed ([R46]) and nothing
        half-done is published; the model completes what it waited for, then fails it."""
        error: BaseException = (
            KeyboardInterrupt() if interrupt else RuntimeError("CUDA error: injected")
        )
        runs = not copy.model.done and not copy.model.failed
        raised: BaseException | None = None
        original = Copy.run

        def run(self_: Copy) -> None:
            if self_ is copy.real:
                raise error
            original(self_)

        Copy.run = run  # type: ignore[method-assign,assignment]
        try:
            self.manual.complete(copy.real)
        except BaseException as exc:  # the injected error, or CopyFailed
            raised = exc
        finally:
            Copy.run = original  # type: ignore[method-assign]
        try:
            self.model.complete_failing(copy.model)
        except CopyFailed:
            assert isinstance(raised, CopyFailed)
        else:
            assert raised is (error if runs else None)
        assert copy.real.state == copy.model.state
        self._check_restored_data()

    @precondition(lambda self: not self.host)  # make-room then takes no host blocks
    @rule(seq=live, fraction=FRACTION, overshoot=st.integers(0, 1))
    def allocate_failing_at_its_take(self, seq: Pair, fraction: float, overshoot: int) -> None:
        """The pool take fails (an injected `AllocationFailed`): nothing changes but the
        make-room evictions before it, which stay done in both ([R6])."""
        n = int(len(seq.real.tokens) * fraction) + overshoot
        self.cache.faults.arm(0)
        self.model.fail_next_block_take = True
        try:
            self.both(
                lambda: self.cache.allocate(seq.real, n),
                lambda: self.model.allocate(seq.model, n),
                evictions_stay=True,
            )
        finally:
            self.cache.faults.disarm()
            self.model.fail_next_block_take = False

    @rule()
    def complete_all(self) -> None:
        self.both(self.manual.complete_all, self.model.complete_all)
        self._check_restored_data()

    @rule()
    def reset_stats(self) -> None:
        """`stats.reset()` ([R69]): counters restart; a later abort of an earlier
        match rolls nothing back."""
        self.cache.stats.reset()
        self.model.reset_stats()

    @rule(namespace=NAMESPACES, lora_id=LORA_IDS)
    def bind_lora(self, namespace: str, lora_id: Any) -> None:
        """[R70]: events of the namespace carry the id from now on (None unbinds);
        an id that is no int in 1..2**63-1 is refused by both."""
        self.both(
            lambda: self.cache.bind_lora(namespace, lora_id),
            lambda: self.model.bind_lora(namespace, lora_id),
        )

    @rule()
    def poll(self) -> None:
        out = self.both(self.cache.poll, self.model.poll)
        assert out is not None and out[0] == out[1]

    def _check_restored_data(self) -> None:
        kv = self.cache.kv_cache
        still: list[PendingRestore] = []
        for pending in self.pending_restores:
            if pending.copy.failed:
                continue  # its data never arrived: the engine aborts that request
            if not pending.copy.done:
                still.append(pending)
                continue
            assert pending.runtime["s"].tolist() == [
                pending.expected_pattern,
                -pending.expected_pattern,
            ], "restore read a state other than the one saved for this prefix"
            assert pending.runtime["c"].dtype == torch.float32
            assert pending.runtime["c"].tolist() == [
                pending.expected_pattern,
                0.5,
                -pending.expected_pattern,
            ], "restore read a float32 state other than the one saved for this prefix"
            if pending.block >= 0 and kv is not None:
                got = kv[pending.block, : len(pending.expected_tail)].tolist()
                assert got == pending.expected_tail, "frozen tail differs from the saved tail"
        self.pending_restores = still

    def teardown(self) -> None:
        """Invariant 9: with nothing live and nothing pinned, evicting everything
        returns every pool to full, in both implementations."""
        if not hasattr(self, "cache"):
            return
        for pair in self.open_sequences.values():
            self.cache.release(pair.real)
            self.model.release(pair.model)
        for pair in self.open_receipts.values():
            if not pair.real.used:
                self.cache.unpin(pair.real)
                self.model.unpin(pair.model)
        for pair in self.open_block_receipts.values():
            self.cache.unpin_blocks(pair.real)
            self.model.unpin_blocks(pair.model)
        self.manual.complete_all()
        self.model.complete_all()
        assert self.cache.poll() == self.model.poll()
        self._check_restored_data()
        capacity = self.cache.config.num_blocks
        while True:  # write-back ([R52]): evicting queues stores that free blocks later
            freed = self.cache.evict(capacity)
            assert freed == self.model.evict(capacity)
            self.manual.complete_all()
            self.model.complete_all()
            reaped = self.cache.poll()
            assert reaped == self.model.poll()
            if not freed and not reaped:
                break
        host = self.cache.config.num_host_blocks
        assert self.cache.evict_host(host) == self.model.evict_host(host)
        slots = self.cache.config.num_checkpoint_slots
        assert self.cache.evict_checkpoints(slots) == self.model.evict_checkpoints(slots)
        for impl in (self.cache, self.model):
            assert impl.num_free_blocks == capacity
            assert impl.num_cached_blocks == 0
            assert impl.num_free_checkpoint_slots == slots
            assert impl.num_free_host_blocks == host
            assert (
                impl.num_free_host_checkpoint_slots == self.cache.config.num_host_checkpoint_slots
            )
        self.cache.check()

    # --------------------------------------------------------- invariants

    @invariant()
    def cache_invariants_hold(self) -> None:
        self.cache.check()

    @invariant()
    def model_invariants_hold(self) -> None:
        invariants.check_all(self.model.snapshot())

    @invariant()
    def both_observe_the_same(self) -> None:
        real, model = observe(self.cache.snapshot()), observe(self.model.snapshot())
        for key in real:
            assert real[key] == model[key], f"{key}: cache {real[key]!r} != model {model[key]!r}"
        assert self.cache.stats.recent_hit_rate == self.model.recent_hit_rate
        assert self.cache.num_free_blocks == self.model.num_free_blocks
        assert self.cache.num_cached_blocks == self.model.num_cached_blocks
        assert self.cache.num_free_checkpoint_slots == self.model.num_free_checkpoint_slots
        assert self.cache.num_free_host_blocks == self.model.num_free_host_blocks
        assert self.cache.num_host_cached_blocks == self.model.num_host_cached_blocks
        assert (
            self.cache.num_free_host_checkpoint_slots == self.model.num_free_host_checkpoint_slots
        )

    @invariant()
    def stored_events_carry_the_bound_lora_id(self) -> None:
        """[R70]: every block an operation stored was published with the lora_id its
        namespace was bound to then (drained after every step, so "then" is now)."""
        for event in self.cache.drain_events():
            if isinstance(event, BlockStored):
                assert event.lora_id == self.model.lora_id(event.namespace), event

    @invariant()
    def exported_metrics_are_the_models(self) -> None:
        """`cache.metrics` scraped now gives the values `spec.metrics` states: every
        counter at its high-water mark since the last reset, every gauge as it is."""
        expected = self.exported.scrape()
        if self.model.resets != self.seen_resets:
            self.seen_resets = self.model.resets
            self.most_pins = 0
        self.most_pins = max(self.most_pins, self.model.num_pins)
        if self.registry is None:
            return
        got = {
            sample.name: sample.value
            for family in self.registry.collect()
            for sample in family.samples
        }
        assert {name: value for name, value in got.items() if name not in UNMODELLED} == expected
        assert got["blocktrie:peak_pins"] >= self.most_pins

    @invariant()
    def pinned_checkpoints_are_never_released_nor_their_slots_reused(self) -> None:
        snap = self.cache.snapshot()
        owners: dict[tuple[str, int | None], int] = {}
        for cid, ck in snap["checkpoints"].items():
            owners[("slot", ck["slot"])] = cid
            owners[("host_slot", ck["host_slot"])] = cid
        for copy in snap["copies"].values():
            for cid in copy["pins"]:
                assert cid in snap["checkpoints"], "a copy's checkpoint was released"
                ck = snap["checkpoints"][cid]
                for tier in ("slot", "host_slot"):
                    if ck[tier] is not None:  # type: ignore[literal-required]
                        assert owners[(tier, ck[tier])] == cid, f"its {tier} was reused"  # type: ignore[literal-required]


TestCacheVersusModel = CacheVersusModel.TestCase
# At least 400 x 100 (CI's budget), except under `python -m tools.mutation`, which
# runs the covering tests once per mutant: there the short profile decides.
_FLOOR = (0, 0) if os.environ.get("HYPOTHESIS_PROFILE") == "mutation" else (400, 100)
TestCacheVersusModel.settings = settings(
    TestCacheVersusModel.settings,
    max_examples=max(TestCacheVersusModel.settings.max_examples, _FLOOR[0]),
    stateful_step_count=max(TestCacheVersusModel.settings.stateful_step_count, _FLOOR[1]),
)


class HostCheckpointsVersusModel(CacheVersusModel):
    """The same machine, always SSM with host checkpoint slots ([R53]-[R56]): stores,
    offloads, host evictions and restores from the host in any order."""

    @initialize(
        block_size=st.integers(2, 3),
        num_blocks=st.integers(8, 16),
        slots=st.sampled_from([1, 1, 2]),
        collide=st.booleans(),
        host=st.sampled_from([0, 2]),
        write_back=st.just(False),
        host_slots=st.sampled_from([1, 2, 3]),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        slots: int,
        collide: bool,
        host: int,
        write_back: bool,
        host_slots: int,
    ) -> None:
        super().setup(block_size, num_blocks, slots, collide, host, write_back, host_slots)

    @rule(target=CacheVersusModel.copies, tokens=TOKENS, namespace=NAMESPACES)
    def prefill_with_a_checkpoint(self, tokens: list[int], namespace: str) -> Any:
        """A chunked prefill: the whole prompt, a checkpoint at its last block
        boundary (so one the host tier keeps), then the request finishes."""
        pair = self.prefill(tokens, namespace, None)
        copy = self.save(pair, "block", 0.0)
        self.release(pair)
        return copy

    @rule(target=CacheVersusModel.copies, tokens=TOKENS, namespace=NAMESPACES)
    def match_and_restore(self, tokens: list[int], namespace: str) -> Any:
        """A request that hits a checkpoint restores it at once (from the host slot
        when it is host-only: [R56]) and stays live."""
        pair = self.match(tokens, namespace, None)
        if pair.real.restore is None:
            return multiple()
        return self.restore(pair)


TestHostCheckpointsVersusModel = HostCheckpointsVersusModel.TestCase
TestHostCheckpointsVersusModel.settings = settings(
    TestHostCheckpointsVersusModel.settings,
    max_examples=max(TestHostCheckpointsVersusModel.settings.max_examples, _FLOOR[0] // 2),
    stateful_step_count=max(TestHostCheckpointsVersusModel.settings.stateful_step_count, _FLOOR[1]),
)


class CacheVersusModelOnCuda(CacheVersusModel):
    """The same machine with the pools and runtime state on a CUDA device."""

    device = "cuda"


TestCacheVersusModelOnCuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"
)(CacheVersusModelOnCuda.TestCase)
