"""The bad-input catalogue (issue 12, "What to build" 2): one row per bad input.

Every row calls one public entry point (`BlockTrie`, `CacheConfig`,
`ManualCopies`, pin receipts) with one bad argument against a populated cache
(cached prefixes, a published partial checkpoint, live sequences with and
without a restore point, a pending save and restore copy, an outstanding pin).
Each row asserts:

- the error class (a `CacheError` subclass, or `ValueError` / `TypeError`);
- that the message names the argument or object at fault (a regex);
- that `snapshot()` of every trie in the world, statistics included, and the
  logical clock are exactly as before;
- that `check()` still passes.

Categories (documented in docs/invariants.md): **types** (wrong Python type),
**ranges** (right type, value outside its rule), **lifecycle misuse** (a call
the object's current state does not allow), **foreign / dead objects** (a
sequence, receipt or copy of another cache, released, or not made by the cache
at all), **config** (`CacheConfig` / `BlockTrie` construction), and **partial
failure** (an error raised midway must leave nothing half-applied).

Rows for the holes issue 12 found (items 1, 6-10) failed before their fixes.
"""

from __future__ import annotations

import copy as copy_module
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cache import (
    AllocationFailed,
    BlockTrie,
    CacheConfig,
    CacheError,
    CheckpointError,
    ConfigError,
    Copy,
    InvalidArgument,
    InvalidType,
    ManualCopies,
    PinError,
    PinReceipt,
    Sequence,
    SequenceNotLive,
)
from tests.helpers import empty_state, kv_trie, ssm_trie, state

B = 4
SAVED = [1, 1, 1, 1, 2, 2, 2, 2, 3]  # cached; partial checkpoints at 2 (root) and 6


def _prefill(trie: BlockTrie, tokens: list[int], namespace: str = "") -> Sequence:
    seq = trie.match(tokens, namespace=namespace)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def _refuse_marked_keys(key: Hashable) -> int:
    """A key_hash that raises on any block containing token 13 (a faulty user hook)."""
    tokens = key[0] if isinstance(key, tuple) and key and isinstance(key[0], tuple) else key
    if isinstance(tokens, tuple) and 13 in tokens:
        raise ValueError("key_hash refuses blocks with token 13")
    return hash(key)


@dataclass
class World:
    """A populated SSM cache and the objects the rows misuse."""

    trie: BlockTrie
    copies: ManualCopies
    live: Sequence  # hit 6 (partial checkpoint), not restored, nothing allocated past the hit
    plain: Sequence  # committed [5, 5, 5, 5, 6], no restore point
    roomy: Sequence  # committed two blocks with no checkpoint on them
    restored: Sequence  # restored once (its restore copy is pending)
    fresh_ns: Sequence  # namespace "fresh" (no root yet), one private block, nothing committed
    dead: Sequence
    receipt: PinReceipt
    used: PinReceipt
    pending: Copy  # a pending save copy
    other: BlockTrie  # another SSM cache
    foreign: Sequence
    foreign_receipt: PinReceipt
    foreign_copy: Copy
    kv: BlockTrie  # attention-only
    kv_seq: Sequence
    hashy: BlockTrie  # key_hash raises on token 13
    hashy_seq: Sequence
    tries: list[BlockTrie] = field(default_factory=list)


def build_world() -> World:
    trie, copies = ssm_trie(num_blocks=24, slots=4)
    assert copies is not None
    seq = _prefill(trie, SAVED)
    trie.save(seq, 2, state(1.0))  # on the root
    trie.save(seq, 6, state(2.0))  # on the depth-1 node, frozen tail [2, 2]
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    live = trie.match([1, 1, 1, 1, 2, 2, 9, 9, 5])
    assert live.restore is not None and live.restore.step == 6
    restored = trie.match([1, 1, 1, 1, 2, 2, 8])
    trie.restore(restored, empty_state())
    plain = _prefill(trie, [5, 5, 5, 5, 6])
    pending = trie.save(plain, 4, state(3.0))
    assert pending is not None
    roomy = _prefill(trie, [6, 6, 6, 6, 6, 6, 6, 6, 7])
    fresh_ns = trie.match([3, 3], namespace="fresh")
    trie.allocate(fresh_ns, 2)
    dead = trie.match([7, 7])
    trie.release(dead)
    receipt = trie.pin(live)
    used = trie.pin(live)
    trie.unpin(used)

    other, other_copies = ssm_trie(num_blocks=8, slots=2)
    assert other_copies is not None
    oseq = _prefill(other, SAVED)
    foreign_copy = other.save(oseq, 4, state(4.0))
    assert foreign_copy is not None
    other_copies.complete_all()
    other.poll()
    foreign = other.match([1, 1, 1, 1, 2])
    foreign_receipt = other.pin(foreign)
    foreign_copy = other.save(oseq, 8, state(5.0))
    assert foreign_copy is not None

    kv = kv_trie()
    kv_seq = _prefill(kv, [1, 2, 3, 4, 5])

    hashy = BlockTrie(CacheConfig(block_size=2, num_blocks=8, key_hash=_refuse_marked_keys))
    hashy_seq = hashy.match([1, 2])
    hashy.append(hashy_seq, [13, 14, 5])  # match builds its keys; commit builds these
    hashy.allocate(hashy_seq, 5)

    world = World(
        trie, copies, live, plain, roomy, restored, fresh_ns, dead, receipt, used, pending,
        other, foreign, foreign_receipt, foreign_copy, kv, kv_seq, hashy, hashy_seq,
    )  # fmt: skip
    world.tries = [trie, other, kv, hashy]
    for t in world.tries:
        t.check()
    return world


class _OwnHash:
    """An identity with its own hash and equality (user code the cache must not run)."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _OwnHash)


class _Str(str):
    """A str subclass whose hash is its own."""

    def __hash__(self) -> int:
        return 7


def _nested(depth: int) -> tuple[Any, ...]:
    value: tuple[Any, ...] = ()
    for _ in range(depth - 1):
        value = (value,)
    return value


def _grad_state() -> dict[str, torch.Tensor]:
    return {k: v.clone().requires_grad_(True) for k, v in empty_state().items()}


def _with(name: str, tensor: torch.Tensor, base: dict[str, torch.Tensor] | None = None) -> Any:
    out = dict(state(1.0) if base is None else base)
    out[name] = tensor
    return out


def _slot_views(trie: BlockTrie, slot: int) -> dict[str, torch.Tensor]:
    """Views of one checkpoint slot, from the public `checkpoint_states`."""
    return {name: pool[slot] for name, pool in trie.checkpoint_states.items()}


def _kv_view(trie: BlockTrie) -> torch.Tensor:
    """A (2, 3) view into the KV pool's last block."""
    kv = trie.kv_cache
    assert kv is not None
    return kv[-1].reshape(-1)[:6].view(2, 3)


def _aliased() -> dict[str, torch.Tensor]:
    """Restore targets that share memory: "ssm" is the second row of "conv"."""
    conv = torch.zeros(2, 3, dtype=torch.float64)
    return {"conv": conv, "ssm": conv[1]}


def _expanded() -> torch.Tensor:
    return torch.zeros(1, 3, dtype=torch.float64).expand(2, 3)  # overlapping memory


def _sparse() -> torch.Tensor:
    return torch.zeros(3, dtype=torch.float64).to_sparse()


def _config(**kw: Any) -> Callable[[World], object]:
    base: dict[str, Any] = {"block_size": 4, "num_blocks": 8}
    base.update(kw)
    return lambda w: CacheConfig(**base)


def _config_and_trie(**kw: Any) -> Callable[[World], object]:
    """Construction must refuse: in `CacheConfig` or, at the latest, in `BlockTrie`."""
    base: dict[str, Any] = {"block_size": 4, "num_blocks": 8}
    base.update(kw)
    return lambda w: BlockTrie(CacheConfig(**base))


def _arm_then(call: Callable[[World], object]) -> Callable[[World], object]:
    def run(w: World) -> object:
        w.trie.faults.arm(after=0)
        try:
            return call(w)
        finally:
            w.trie.faults.disarm()

    return run


NO_CUDA = not torch.cuda.is_available()


def _rows() -> list[Any]:
    # fmt: off
    rows: list[Any] = []

    def add(
        category: str,
        name: str,
        call: Callable[[World], object],
        error: type[BaseException] | tuple[type[BaseException], ...],
        names: str,
        *marks: Any,
    ) -> None:
        rows.append(pytest.param(call, error, names, id=f"{category}-{name}", marks=marks))

    # ------------------------------------------------------------------ types
    t = "types"
    add(t, "match-str", lambda w: w.trie.match("1234"), InvalidType, "tokens")
    add(t, "match-float", lambda w: w.trie.match([1, 2.0]), InvalidType, "tokens")
    add(t, "match-none-token", lambda w: w.trie.match([1, None]), InvalidType, "tokens")
    add(t, "match-set", lambda w: w.trie.match({1, 2}), InvalidType, "tokens")
    add(t, "match-bytes-token", lambda w: w.trie.match([b"a"]), InvalidType, "tokens")
    add(t, "match-str-before-range", lambda w: w.trie.match(["1", -1]), InvalidType, "tokens")
    add(t, "match-float-tensor-as-tokens", lambda w: w.trie.match(torch.tensor([1.0, 2.0])),
        InvalidType, "tokens")
    add(t, "match-2d-tensor-as-tokens",
        lambda w: w.trie.match(torch.ones((2, 2), dtype=torch.int64)), InvalidType, "tokens")
    add(t, "match-namespace-int", lambda w: w.trie.match([1], namespace=3),
        InvalidType, "namespace")
    add(t, "match-namespace-none", lambda w: w.trie.match([1], namespace=None),
        InvalidType, "namespace")
    add(t, "match-extra-str", lambda w: w.trie.match([1], extra="ab"), InvalidType, "extra")
    add(t, "match-extra-unhashable", lambda w: w.trie.match([1], extra=[[1]]),
        InvalidType, r"extra\[0\]")
    add(t, "match-extra-dict", lambda w: w.trie.match([1], extra={1: 2}), InvalidType, "extra")
    # [R57] (issue 44 item 1): identities the cache could not own, refused at the boundary
    add(t, "match-extra-float", lambda w: w.trie.match([1], extra=(None, 1.5)),
        InvalidType, r"extra\[1\] .*float: 1\.5")
    add(t, "match-extra-tensor", lambda w: w.trie.match([1], extra=(torch.tensor([1, 2]),)),
        InvalidType, r"extra\[0\] .*Tensor")
    add(t, "match-extra-custom-hash", lambda w: w.trie.match([1], extra=(_OwnHash(),)),
        InvalidType, r"extra\[0\] .*_OwnHash")
    add(t, "match-extra-str-subclass", lambda w: w.trie.match([1], extra=(_Str("a"),)),
        InvalidType, r"extra\[0\] .*_Str")
    add(t, "match-extra-nested-float", lambda w: w.trie.match([1], extra=(("img", 0.5),)),
        InvalidType, r"extra\[0\]\[1\] .*float")
    add(t, "match-namespace-str-subclass", lambda w: w.trie.match([1], namespace=_Str("t")),
        InvalidType, "namespace")
    add(t, "match-token-uint64-tensor-2**63",
        lambda w: w.trie.match([torch.tensor(2**63, dtype=torch.uint64), 1]),
        InvalidType, "tokens must contain only integers; found tensor")
    add(t, "append-int", lambda w: w.trie.append(w.plain, 5), InvalidType, "tokens")
    add(t, "append-float", lambda w: w.trie.append(w.plain, [1.5]), InvalidType, "tokens")
    add(t, "allocate-float", lambda w: w.trie.allocate(w.plain, 2.5), InvalidType, "num_tokens")
    add(t, "allocate-bool", lambda w: w.trie.allocate(w.plain, True), InvalidType, "num_tokens")
    add(t, "allocate-str", lambda w: w.trie.allocate(w.plain, "4"), InvalidType, "num_tokens")
    add(t, "commit-none", lambda w: w.trie.commit(w.plain, None), InvalidType, "num_tokens")
    add(t, "commit-float", lambda w: w.trie.commit(w.plain, 5.0), InvalidType, "num_tokens")
    add(t, "save-step-str", lambda w: w.trie.save(w.plain, "3", state(1.0)), InvalidType, "step")
    add(t, "save-step-bool", lambda w: w.trie.save(w.plain, True, state(1.0)), InvalidType, "step")
    add(t, "save-state-list", lambda w: w.trie.save(w.plain, 5, [1, 2]),
        InvalidType, "runtime_state")
    add(t, "save-state-value-list", lambda w: w.trie.save(w.plain, 5, _with("ssm", [0, 0, 0])),
        InvalidType, r"runtime_state\['ssm'\]")
    add(t, "restore-state-str", lambda w: w.trie.restore(w.live, "state"),
        InvalidType, "runtime_state")
    add(t, "evict-str", lambda w: w.trie.evict("1"), InvalidType, "num_blocks")
    add(t, "evict-none", lambda w: w.trie.evict(None), InvalidType, "num_blocks")
    add(t, "evict-checkpoints-float", lambda w: w.trie.evict_checkpoints(1.0), InvalidType, "n")
    add(t, "unpin-str", lambda w: w.trie.unpin("receipt"), InvalidType, "PinReceipt")
    add(t, "unpin-none", lambda w: w.trie.unpin(None), InvalidType, "PinReceipt")
    add(t, "release-str", lambda w: w.trie.release("seq"), InvalidType, "Sequence")
    add(t, "abort-none", lambda w: w.trie.abort(None), InvalidType, "Sequence")
    add(t, "pin-int", lambda w: w.trie.pin(42), InvalidType, "Sequence")
    add(t, "commit-list-as-seq", lambda w: w.trie.commit([1], 4), InvalidType, "Sequence")
    add(t, "restore-tokens-as-seq", lambda w: w.trie.restore([1, 2], empty_state()),
        InvalidType, "Sequence")
    add(t, "complete-str", lambda w: w.copies.complete("copy"), InvalidType, "Copy")
    add(t, "trie-config-str", lambda w: BlockTrie("config"), InvalidType, "config")
    add(t, "trie-copies-object", lambda w: BlockTrie(w.trie.config, copies=object()),
        InvalidType, "copies")

    # ----------------------------------------------------------------- ranges
    r = "ranges"
    add(r, "match-empty", lambda w: w.trie.match([]), InvalidArgument, "token")
    add(r, "match-negative", lambda w: w.trie.match([1, -2]), InvalidArgument, "tokens")
    add(r, "match-2**64", lambda w: w.trie.match([2**64]), InvalidArgument, "tokens")
    add(r, "match-extra-lone-surrogate", lambda w: w.trie.match([1], extra=("a", "\ud800")),
        InvalidArgument, r"extra\[1\] is not valid Unicode")
    add(r, "match-namespace-lone-surrogate", lambda w: w.trie.match([1], namespace="t\udfff"),
        InvalidArgument, "namespace is not valid Unicode")
    add(r, "match-extra-nested-too-deep", lambda w: w.trie.match([1], extra=(_nested(33),)),
        InvalidArgument, "nest more than 32 deep")
    add(r, "append-negative", lambda w: w.trie.append(w.plain, [-1]), InvalidArgument, "tokens")
    add(r, "allocate-negative", lambda w: w.trie.allocate(w.plain, -1),
        InvalidArgument, "num_tokens")
    add(r, "allocate-past-end", lambda w: w.trie.allocate(w.plain, 6),
        InvalidArgument, "num_tokens")
    add(r, "commit-backwards", lambda w: w.trie.commit(w.plain, 4), InvalidArgument, "num_tokens")
    add(r, "commit-past-end", lambda w: w.trie.commit(w.plain, 99), InvalidArgument, "num_tokens")
    add(r, "commit-unallocated", lambda w: w.trie.commit(w.live, 9),
        InvalidArgument, "num_tokens")
    add(r, "evict-negative", lambda w: w.trie.evict(-1), InvalidArgument, "num_blocks")
    add(r, "evict-checkpoints-negative", lambda w: w.trie.evict_checkpoints(-1),
        InvalidArgument, "n")
    add(r, "save-step-0", lambda w: w.trie.save(w.plain, 0, state(1.0)), InvalidArgument, "step")
    add(r, "save-step-past-end", lambda w: w.trie.save(w.plain, 6, state(1.0)),
        InvalidArgument, "step")
    add(r, "save-state-missing", lambda w: w.trie.save(w.plain, 5, {"conv": torch.zeros(2, 3)}),
        InvalidArgument, "runtime_state")
    add(r, "save-state-unknown", lambda w: w.trie.save(w.plain, 5, _with("extra", torch.zeros(1))),
        InvalidArgument, "unknown")
    add(r, "save-state-shape", lambda w: w.trie.save(w.plain, 5, _with("ssm", torch.zeros(4))),
        InvalidArgument, r"runtime_state\['ssm'\]")
    add(r, "save-state-meta", lambda w: w.trie.save(
        w.plain, 5, _with("ssm", torch.empty(3, device="meta"))),
        InvalidArgument, "meta")
    add(r, "restore-state-grad", lambda w: w.trie.restore(w.live, _grad_state()),
        InvalidArgument, "requires grad")
    add(r, "restore-state-expanded", lambda w: w.trie.restore(
        w.live, _with("conv", _expanded(), empty_state())),
        InvalidArgument, r"runtime_state\['conv'\]")
    add(r, "restore-state-sparse", lambda w: w.trie.restore(
        w.live, _with("ssm", _sparse(), empty_state())),
        InvalidArgument, r"runtime_state\['ssm'\]")
    add(r, "save-state-sparse", lambda w: w.trie.save(w.plain, 5, _with("ssm", _sparse())),
        InvalidArgument, r"runtime_state\['ssm'\]")
    # [R60] (issue 44 items 4 and 6): runtime state that aliases the pools, or complex
    add(r, "restore-into-another-checkpoint's-slot", lambda w: w.trie.restore(
        w.live, _slot_views(w.trie, 0)),
        InvalidArgument, r"runtime_state\['conv'\] overlaps the storage of the cache's "
        r"checkpoint pool 'conv'")
    add(r, "save-from-a-checkpoint's-slot",
        lambda w: w.trie.save(w.plain, 5, _slot_views(w.trie, 1)),
        InvalidArgument, "overlaps the storage of the cache's checkpoint pool")
    add(r, "restore-into-the-kv-pool", lambda w: w.trie.restore(
        w.live, _with("conv", _kv_view(w.trie), empty_state())),
        InvalidArgument, "overlaps the storage of the cache's KV pool")
    add(r, "restore-targets-alias-each-other", lambda w: w.trie.restore(w.live, _aliased()),
        InvalidArgument, r"runtime_state\['ssm'\] and runtime_state\['conv'\] overlap")
    add(r, "save-complex-state", lambda w: w.trie.save(
        w.plain, 5, _with("ssm", torch.zeros(3, dtype=torch.complex128))),
        InvalidArgument, "imaginary part")
    add(r, "restore-into-complex-state", lambda w: w.trie.restore(
        w.live, _with("ssm", torch.zeros(3, dtype=torch.complex128), empty_state())),
        InvalidArgument, "imaginary part")
    add(r, "faults-arm-negative", lambda w: w.trie.faults.arm(after=-1), ValueError, "after")

    # ------------------------------------------------------- lifecycle misuse
    m = "lifecycle"
    add(m, "save-attention-only", lambda w: w.kv.save(w.kv_seq, 4, None),
        CheckpointError, "num_checkpoint_slots")
    add(m, "save-anchor-uncommitted", lambda w: w.trie.save(w.live, 8, state(1.0)),
        CheckpointError, "committed")
    add(m, "save-partial-unallocated", lambda w: w.trie.save(w.live, 6, state(1.0)),
        CheckpointError, "partial block")
    add(m, "restore-without-checkpoint", lambda w: w.trie.restore(w.plain, empty_state()),
        CheckpointError, "Sequence")
    add(m, "restore-twice", lambda w: w.trie.restore(w.restored, empty_state()),
        CheckpointError, "already restored")
    add(m, "pin-without-checkpoint", lambda w: w.trie.pin(w.plain), CheckpointError, "Sequence")
    add(m, "unpin-twice", lambda w: w.trie.unpin(w.used), PinError, "PinReceipt")
    add(m, "clear-with-live-sequences", lambda w: w.trie.clear(), CacheError, "live sequences")
    add(m, "engine-bound-twice", lambda w: BlockTrie(w.trie.config, copies=w.copies),
        CacheError, "ManualCopies")
    add(m, "save-after-injected-failure", _arm_then(lambda w: w.trie.save(w.roomy, 8, state(1.0))),
        AllocationFailed, "slots.take")
    add(m, "allocate-after-injected-failure", _arm_then(lambda w: w.trie.allocate(w.live, 9)),
        AllocationFailed, "kv.take")
    add(m, "restore-after-injected-failure",
        _arm_then(lambda w: w.trie.restore(w.live, empty_state())),
        AllocationFailed, "kv.take")

    # ---------------------------------------------------- foreign / dead objects
    f = "foreign"
    add(f, "release-dead", lambda w: w.trie.release(w.dead), SequenceNotLive, "Sequence #")
    add(f, "abort-dead", lambda w: w.trie.abort(w.dead), SequenceNotLive, "Sequence #")
    add(f, "allocate-dead", lambda w: w.trie.allocate(w.dead, 1), SequenceNotLive, "Sequence #")
    add(f, "commit-dead", lambda w: w.trie.commit(w.dead, 0), SequenceNotLive, "Sequence #")
    add(f, "append-dead", lambda w: w.trie.append(w.dead, [1]), SequenceNotLive, "Sequence #")
    add(f, "save-dead", lambda w: w.trie.save(w.dead, 1, state(1.0)), SequenceNotLive, "Sequence #")
    add(f, "restore-dead", lambda w: w.trie.restore(w.dead, empty_state()),
        SequenceNotLive, "Sequence #")
    add(f, "pin-dead", lambda w: w.trie.pin(w.dead), SequenceNotLive, "Sequence #")
    add(f, "release-foreign", lambda w: w.trie.release(w.foreign), SequenceNotLive, "another cache")
    add(f, "abort-foreign", lambda w: w.trie.abort(w.foreign), SequenceNotLive, "another cache")
    add(f, "pin-foreign", lambda w: w.trie.pin(w.foreign), SequenceNotLive, "another cache")
    add(f, "restore-foreign", lambda w: w.trie.restore(w.foreign, empty_state()),
        SequenceNotLive, "another cache")
    add(f, "unpin-foreign-receipt", lambda w: w.trie.unpin(w.foreign_receipt),
        PinError, "PinReceipt")
    add(f, "unpin-copied-receipt", lambda w: w.trie.unpin(copy_module.copy(w.receipt)),
        PinError, "PinReceipt")
    add(f, "complete-foreign-copy", lambda w: w.copies.complete(w.foreign_copy),
        InvalidArgument, "Copy #")
    add(f, "abort-copied-sequence", lambda w: w.trie.abort(copy_module.copy(w.live)),
        SequenceNotLive, "Sequence #")
    add(f, "release-copied-sequence", lambda w: w.trie.release(copy_module.copy(w.plain)),
        SequenceNotLive, "Sequence #")
    add(f, "release-hand-built-sequence",
        lambda w: w.trie.release(Sequence(w.trie, 999, [1, 2], "", None)),
        SequenceNotLive, "Sequence #999")
    add(f, "release-hand-built-reused-serial",
        lambda w: w.trie.release(Sequence(w.trie, w.plain.serial, [5, 5, 5, 5, 6], "", None)),
        SequenceNotLive, "Sequence #")

    # ---------------------------------------------------------------- config
    c = "config"
    add(c, "block_size-0", _config(block_size=0), ConfigError, "block_size")
    add(c, "block_size-negative", _config(block_size=-1), ConfigError, "block_size")
    add(c, "block_size-float", _config(block_size=4.0), ConfigError, "block_size")
    add(c, "block_size-bool", _config(block_size=True), ConfigError, "block_size")
    add(c, "num_blocks-0", _config(num_blocks=0), ConfigError, "num_blocks")
    add(c, "num_blocks-str", _config(num_blocks="8"), ConfigError, "num_blocks")
    add(c, "slots-negative", _config(num_checkpoint_slots=-1), ConfigError, "num_checkpoint_slots")
    add(c, "kv_block_shape-zero", _config(kv_block_shape=(0, 2)), ConfigError, "kv_block_shape")
    add(c, "kv_block_shape-float", _config(kv_block_shape=(2.0,)), ConfigError, "kv_block_shape")
    add(c, "kv_block_shape-str", _config(kv_block_shape="22"), ConfigError, "kv_block_shape")
    add(c, "state_shapes-negative", _config(state_shapes={"ssm": (-1,)}),
        ConfigError, "state_shapes")
    add(c, "state_shapes-list", _config(state_shapes=[("ssm", (1,))]), ConfigError, "state_shapes")
    add(c, "state_shapes-empty-name", _config(state_shapes={"": (1,)}),
        ConfigError, "state_shapes")
    add(c, "state_shapes-int-name", _config(state_shapes={1: (1,)}), ConfigError, "state_shapes")
    add(c, "kv_dtype-str", _config(kv_dtype="float16"), ConfigError, "kv_dtype")
    add(c, "state_dtype-none", _config(state_dtype=None), ConfigError, "state_dtype")
    add(c, "device-nonsense", _config(device="nonsense"), ConfigError, "device")
    add(c, "key_hash-int", _config(key_hash=5), ConfigError, "key_hash")
    add(c, "device-cuda-without-cuda", _config_and_trie(device="cuda"),
        (ValueError, TypeError), "device",
        *(() if NO_CUDA else (pytest.mark.skip(reason="CUDA is present"),)))
    add(c, "num_blocks-2**62", _config_and_trie(num_blocks=2**62),
        (ValueError, TypeError), "num_blocks")
    add(c, "kv_block_shape-huge", _config_and_trie(kv_block_shape=(2**40, 2**40)),
        (ValueError, TypeError), "kv_block_shape")
    add(c, "state_shapes-huge",
        _config_and_trie(num_checkpoint_slots=4, state_shapes={"ssm": (2**31, 2**31)}),
        (ValueError, TypeError), "state_shapes")
    add(c, "enable_events-str", _config(enable_events="no"),
        (ValueError, TypeError), "enable_events")

    # ------------------------------------------------------- partial failure
    p = "partial"
    add(p, "key_hash-raises-mid-commit", lambda w: w.hashy.commit(w.hashy_seq, 5),
        ValueError, "key_hash")
    add(p, "failed-save-leaves-no-namespace-root",
        _arm_then(lambda w: w.trie.save(w.fresh_ns, 1, state(1.0))),
        AllocationFailed, "slots.take")
    # fmt: on
    return rows


ROWS = _rows()


def test_the_catalogue_has_at_least_60_rows() -> None:
    assert len(ROWS) >= 60


@pytest.mark.parametrize(("call", "error", "names"), ROWS)
def test_bad_input_is_refused_and_changes_nothing(
    call: Callable[[World], object],
    error: type[BaseException] | tuple[type[BaseException], ...],
    names: str,
) -> None:
    w = build_world()
    before = [t.snapshot() for t in w.tries]
    clocks = [t.clock for t in w.tries]
    with pytest.raises(error, match=names) as info:
        call(w)
    assert not isinstance(info.value, AssertionError)
    assert isinstance(info.value, (CacheError, ValueError, TypeError)), type(info.value)
    assert [t.snapshot() for t in w.tries] == before
    assert [t.clock for t in w.tries] == clocks
    for t in w.tries:
        t.check()


@pytest.mark.parametrize(
    "token",
    [
        pytest.param(lambda v: torch.tensor(v), id="0-d"),
        pytest.param(lambda v: torch.tensor([v]), id="1-element"),
    ],
)
def test_integer_tensors_as_tokens_are_refused_or_share_nodes(
    token: Callable[[int], torch.Tensor],
) -> None:
    """Tensors hash by identity: either refuse them (InvalidType naming the tokens),
    or store them so that equal prompts share nodes."""
    trie = kv_trie()
    before = trie.snapshot()
    try:
        seq = trie.match([token(1) for _ in range(5)])  # type: ignore[misc]
    except InvalidType as exc:
        assert "tokens" in str(exc)
        assert trie.snapshot() == before
        trie.check()
        return
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.release(seq)
    for _ in range(2):
        again = trie.match([token(1) for _ in range(5)])  # type: ignore[misc]
        assert again.num_cached_tokens == 4, "an equal prompt hits"
        trie.allocate(again, 5)
        trie.commit(again, 5)
        trie.release(again)
    assert trie.num_cached_blocks == 1, "equal prompts share one node"
    trie.check()
