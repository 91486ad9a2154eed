"""The naive reference model of the whole cache: slow, tiny and obviously right.

`ReferenceCache` follows `docs/semantics.md` step for step, with plain Python
objects and linear scans everywhere. It never imports torch or `cache`; the
runtime state (tensors) is not modelled, only ids, counts, pins and order.

How it is kept obviously right:

* Nothing that can be derived is stored. A block's reference count is
  recomputed from its holders every time it is needed (attached node + block
  table entries of live sequences + frozen tail of a live checkpoint + block
  references of unreaped copies); the free list is "every block whose count is
  0", the free slots are "every slot no live checkpoint uses", a checkpoint's
  pin count is "match pins of live sequences + pins of unreaped copies +
  outstanding explicit receipts", and every lifecycle state is the one
  `spec.lifecycle` implies from those facts.
* The eviction index is "all evictable nodes sorted by (tick, serial)",
  rebuilt on every step of an eviction; the checkpoint index is "all
  published checkpoints sorted by (tick, serial)".
* `reclaimable` (for `OutOfBlocks` and save rule 5) is computed by running the
  real eviction loop to exhaustion on a deep copy of the model.
* Every public operation validates all of its input first and decides
  whether it can succeed before it changes anything.

Rules
-----
Every rule both implementations follow is numbered once, in
`docs/semantics.md`; this model cites them as `[R<n>]` where it implements
them (and so does `cache/`). It builds its own keys, validation and records on
purpose: the differential test is only worth something if the two sides share
no code.
"""

from __future__ import annotations

import copy as _copylib
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from spec.errors import (
    AllocationFailed,
    CheckpointError,
    ConfigError,
    CopyFailed,
    HostTierError,
    InvalidArgument,
    InvalidType,
    OutOfBlocks,
    PinError,
    SequenceNotLive,
)
from spec.lifecycle import (
    CHECKPOINT,
    NODE,
    RECEIPT,
    RESIDENCY,
    CheckpointState,
    CheckpointTrigger,
    NodeState,
    NodeTrigger,
    ReceiptState,
    ReceiptTrigger,
    Residency,
    ResidencyTrigger,
    implied_checkpoint_state,
    implied_copy_state,
    implied_node_state,
)
from spec.snapshot import (
    STAT_COUNTERS,
    CheckpointView,
    CopyView,
    NodeView,
    SequenceView,
    Snapshot,
)

Key = tuple[tuple[int, ...], Hashable]

__all__ = ["ModelCopy", "ModelReceipt", "ModelRestore", "ModelSequence", "ReferenceCache"]


# --------------------------------------------------------------------------- objects


class _Node:
    """One trie node (a root when `parent` is None)."""

    def __init__(
        self,
        serial: int,
        namespace: str,
        parent: _Node | None,
        key: Key | None,
        block: int | None,
        tick: int,
    ) -> None:
        self.serial = serial
        self.namespace = namespace
        self.parent = parent
        self.key = key
        self.block = block
        self.tick = tick
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.attached = True
        self.checkpoint: _Checkpoint | None = None
        self.host: int | None = None  # its host-tier block ([R47])
        self.residency = Residency.DEVICE.value  # fired by commands, like checkpoints


class _Checkpoint:
    """One checkpoint; live while `present` (it is then its anchor's checkpoint)."""

    def __init__(
        self,
        serial: int,
        anchor: _Node,
        step: int,
        tail: tuple[int, ...],
        tail_extra: Hashable,
        slot: int | None,
        frozen_block: int | None,
        tick: int,
    ) -> None:
        self.serial = serial
        self.anchor = anchor
        self.step = step
        self.tail = tail
        self.tail_extra = tail_extra
        self.slot = slot
        self.frozen_block = frozen_block
        self.tick = tick
        self.present = True
        self.published = False
        self.withdrawn = False  # [R46]: its save copy failed
        self.host_slot: int | None = None  # [R53]: its host slot, if it has one
        self.residency = Residency.DEVICE.value  # `slot` is None once `host` ([R54])


class ModelRestore:
    """`seq.restore`: the checkpoint a match hit."""

    def __init__(self, checkpoint: _Checkpoint) -> None:
        self.step = checkpoint.step
        self._checkpoint = checkpoint

    def __repr__(self) -> str:
        return f"ModelRestore(step={self.step})"


class ModelSequence:
    """One request's view of the reference cache."""

    def __init__(
        self,
        owner: ReferenceCache,
        ident: int,
        tokens: tuple[int, ...],
        namespace: str,
        extra: tuple[Hashable, ...] | None,
    ) -> None:
        self.tokens = tokens
        self.namespace = namespace
        self.extra = extra
        self.num_cached_tokens = 0
        self.num_committed_tokens = 0
        self.block_ids: list[int] = []
        self.restore: ModelRestore | None = None
        self.branch_step = 0
        self._owner = owner
        self._id = ident
        self._live = True
        self._path: list[_Node] = []
        self._holds_match_pin = False
        self._restored = False
        self._match_stats: dict[str, int] = {}
        self.num_host_tokens = 0
        self._host_path: list[_Node] = []  # [R50]: matched host-only nodes, not yet loaded
        self._loads: list[ModelCopy] = []  # load copies its hit waits on
        self._load_failed = False

    @property
    def live(self) -> bool:
        return self._live

    def __repr__(self) -> str:
        return (
            f"ModelSequence(#{self._id}, ns={self.namespace!r}, len={len(self.tokens)}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_ids})"
        )


class ModelCopy:
    """One queued copy (checkpoint save or restore)."""

    def __init__(
        self,
        owner: ReferenceCache,
        ident: int,
        kind: str,
        step: int,
        blocks: list[int],
        pins: list[_Checkpoint],
        touches: frozenset[tuple[str, int]],
    ) -> None:
        self.kind = kind
        self.step = step
        self.done = False  # its data moved
        self.failed = False  # [R46]: it never delivers
        self.reaped = False
        self._owner = owner
        self._id = ident
        self._blocks = blocks
        self._pins = pins
        self._touches = touches
        self._host_blocks: list[int] = []  # host-tier blocks a store / load holds
        self._nodes: list[_Node] = []  # nodes whose KV a store / load moves
        self._write_back = False  # a store an eviction queued ([R52])

    def __repr__(self) -> str:
        return f"ModelCopy(#{self._id}, {self.kind}, step={self.step}, {self.state})"

    @property
    def state(self) -> str:
        """The copy lifecycle state its facts imply (`spec.lifecycle.COPY`)."""
        return implied_copy_state(reaped=self.reaped, failed=self.failed, moved=self.done).value


class ModelReceipt:
    """An explicit pin receipt (single use)."""

    def __init__(self, owner: ReferenceCache, checkpoint: _Checkpoint) -> None:
        self._owner = owner
        self._checkpoint = checkpoint
        self._used = False

    @property
    def state(self) -> str:
        """The receipt lifecycle state (`spec.lifecycle.RECEIPT`): issued or redeemed."""
        state = ReceiptState.REDEEMED if self._used else ReceiptState.ISSUED
        return str(state.value)


class ModelBlockReceipt:
    """A `pin_blocks` receipt: one reference on each pinned block (single use)."""

    def __init__(self, owner: ReferenceCache, blocks: list[int]) -> None:
        self._owner = owner
        self._blocks = blocks
        self._used = False

    @property
    def pinned(self) -> int:
        return len(self._blocks)

    @property
    def state(self) -> str:
        state = ReceiptState.REDEEMED if self._used else ReceiptState.ISSUED
        return str(state.value)


# --------------------------------------------------------------------------- validation


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(x: object, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidType(f"{what} must be an int (not bool), got {type(x).__name__}")
    return x


def _check_tokens(tokens: object, what: str, *, nonempty: bool) -> tuple[int, ...]:
    # [R1], [R2]: container, then element types, then ranges, then non-empty.
    if not isinstance(tokens, (list, tuple)):
        raise InvalidType(
            f"{what}: tokens must be a list or tuple of int, got {type(tokens).__name__}"
        )
    for t in tokens:
        try:
            operator.index(t)
        except Exception:  # [R57]: whatever its conversion raises, it is no integer id
            raise InvalidType(f"{what}: every token must be an integer, got {t!r}") from None
    for t in tokens:
        if not 0 <= operator.index(t) < 2**64:
            raise InvalidArgument(f"{what}: token ids must be in [0, 2**64), got {t}")
    if nonempty and not tokens:
        raise InvalidArgument(f"{what}: tokens must be non-empty")
    return tuple(operator.index(t) for t in tokens)  # [R5]: stored as plain ints


def _valid_unicode(text: str) -> bool:
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _check_namespace(namespace: object) -> str:
    # [R57]: exactly a str (a subclass's __hash__ would run mid-operation), valid Unicode.
    if type(namespace) is not str:
        raise InvalidType(f"namespace must be exactly a str, got {type(namespace).__name__}")
    if not _valid_unicode(namespace):
        raise InvalidArgument(f"namespace {namespace!r} holds a lone surrogate")
    return namespace


def _check_identity(value: object, where: str, depth: int) -> None:
    # [R57]: None, bool, int, str, bytes or tuples of those, exactly; each
    # identity's type before its value, in order; tuples nest at most 32 deep.
    if value is None or type(value) in (bool, int, bytes):
        return
    if type(value) is str:
        if not _valid_unicode(value):
            raise InvalidArgument(f"{where} {value!r} holds a lone surrogate")
        return
    if type(value) is not tuple:
        raise InvalidType(f"{where} must be None/bool/int/str/bytes/tuple, got {type(value)}")
    if depth > 32:
        raise InvalidArgument(f"{where}: identity tuples nest more than 32 deep")
    for j, item in enumerate(value):
        _check_identity(item, f"{where}[{j}]", depth + 1)


def _check_extra(extra: object) -> tuple[Hashable, ...] | None:
    # [R1], [R5], [R57]: stored as a tuple; identities compared with ==.
    if extra is None:
        return None
    if not isinstance(extra, (list, tuple)):
        raise InvalidType(f"extra must be None or a list/tuple, got {type(extra).__name__}")
    for i, e in enumerate(extra):
        _check_identity(e, f"extra[{i}]", 1)
    return tuple(extra)


def _check_bounds(max_hit_tokens: object, atomic_spans: object) -> tuple[int | None, list[Any]]:
    # [R1], [R2], [R64], [R65]: the cap, then each span in order.
    if max_hit_tokens is not None:
        _check_int(max_hit_tokens, "match: max_hit_tokens")
        if max_hit_tokens < 0:  # type: ignore[operator]
            raise InvalidArgument(f"match: max_hit_tokens must be >= 0, got {max_hit_tokens}")
    if not isinstance(atomic_spans, (list, tuple)):
        raise InvalidType(f"match: atomic_spans must be a list or tuple, got {atomic_spans!r}")
    for span in atomic_spans:
        if not isinstance(span, (list, tuple)) or len(span) != 2:
            raise InvalidType(f"match: an atomic span must be a (start, end) pair, got {span!r}")
        for x in span:
            _check_int(x, "match: atomic span bounds")
        if not 0 <= span[0] < span[1]:
            raise InvalidArgument(f"match: an atomic span needs 0 <= start < end, got {span!r}")
    return max_hit_tokens, list(atomic_spans)  # type: ignore[return-value]


def _hit_allowed(end: int, cap: int | None, spans: list[Any]) -> bool:
    """[R64], [R65]: a hit of `end` tokens is at most `cap` and cuts no span."""
    return (cap is None or end <= cap) and not any(s < end < e for s, e in spans)


def _identity(extra: tuple[Hashable, ...] | None, i: int) -> Hashable:
    """Block `i`'s extra identity (None past the end of `extra`) ([R5])."""
    if extra is None or i >= len(extra):
        return None
    return extra[i]


# --------------------------------------------------------------------------- the model


class ReferenceCache:
    """The naive reference model (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_checkpoint_slots: int = 0,
        *,
        manual_copies: bool = True,
        num_host_blocks: int = 0,
        host_write: str = "through",
        num_host_checkpoint_slots: int = 0,
        stats_window: int = 1000,
        block_hash: Callable[[str, tuple[Key, ...]], int] | None = None,
    ) -> None:
        """`block_hash(namespace, keys)`: the published (64-bit) hash of the block at
        the end of the path `keys` from the namespace's root, as the cache's events
        name it; None models a cache without events ([R66])."""
        for name, value, low in (
            ("stats_window", stats_window, 1),
            ("block_size", block_size, 1),
            ("num_blocks", num_blocks, 1),
            ("num_checkpoint_slots", num_checkpoint_slots, 0),
            ("num_host_blocks", num_host_blocks, 0),
            ("num_host_checkpoint_slots", num_host_checkpoint_slots, 0),
        ):
            if not _is_int(value):
                raise ConfigError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}")
        if host_write not in ("through", "back"):
            raise ConfigError(f"host_write must be 'through' or 'back', got {host_write!r}")
        if host_write == "back" and num_checkpoint_slots:
            raise ConfigError("host_write='back' needs num_checkpoint_slots=0")
        if num_host_checkpoint_slots and not num_checkpoint_slots:
            raise ConfigError("num_host_checkpoint_slots needs num_checkpoint_slots > 0")
        if not isinstance(manual_copies, bool):
            raise ConfigError(f"manual_copies must be a bool, got {type(manual_copies).__name__}")
        self._B = block_size
        self._num_blocks = num_blocks
        self._num_slots = num_checkpoint_slots
        self._num_host = num_host_blocks
        self._num_host_slots = num_host_checkpoint_slots
        self._write_back = num_host_blocks > 0 and host_write == "back"
        self._round: ModelCopy | None = None  # the write-back store being filled ([R52])
        self._manual = manual_copies
        self._clock = 0
        self._node_serial = 0
        self._ckpt_serial = 0
        self._seq_counter = 0
        self._copy_counter = 0
        self._roots: dict[str, _Node] = {}
        self._nodes: list[_Node] = []  # attached non-root nodes, in creation order
        self._sequences: list[ModelSequence] = []  # live sequences, in creation order
        self._copies: list[ModelCopy] = []  # unreaped copies, oldest first
        self._receipts: list[ModelReceipt] = []  # outstanding explicit receipts
        self._block_receipts: list[ModelBlockReceipt] = []  # outstanding `pin_blocks` ([R66])
        self._block_hash = block_hash
        self._lora_ids: dict[str, int] = {}  # [R70]: namespace -> its events' lora_id
        self._stats: dict[str, int] = dict.fromkeys(STAT_COUNTERS, 0)
        self.resets = 0
        """How many times `reset_stats` ran ([R69])."""
        self._window = stats_window
        self._recent: list[tuple[int, int, int]] = []  # [R69]: (sequence, queried, hit)
        self.fail_next_block_take = False
        """Fault injection, as the cache's `faults.arm()` on a KV take: the next time
        blocks are taken (after make-room, [R17]), raise `AllocationFailed` instead;
        the make-room evictions stay done ([R6]). Cleared when it fires."""

    # ------------------------------------------------------------------ derived facts

    @property
    def block_size(self) -> int:
        return self._B

    @property
    def clock(self) -> int:
        return self._clock

    def _refcounts(self) -> dict[int, int]:
        rc = dict.fromkeys(range(self._num_blocks), 0)
        for node in self._nodes:
            if node.block is not None:  # an offloaded node owns none ([R48])
                rc[node.block] += 1
        for seq in self._sequences:
            for b in seq.block_ids:
                rc[b] += 1
        for c in self._live_checkpoints():
            if c.frozen_block is not None:
                rc[c.frozen_block] += 1
        for cp in self._copies:
            for b in cp._blocks:
                rc[b] += 1
        for r in self._block_receipts:  # [R66]: a block pin is a reference
            for b in r._blocks:
                rc[b] += 1
        return rc

    def _free_block_list(self) -> list[int]:
        return [b for b, n in self._refcounts().items() if n == 0]

    def _host_refcounts(self) -> dict[int, int]:
        """[R47]-[R50]: owning node + requests that matched it + copies holding it."""
        rc = dict.fromkeys(range(self._num_host), 0)
        for node in self._nodes:
            if node.host is not None:
                rc[node.host] += 1
        for seq in self._sequences:
            for node in seq._host_path:
                assert node.host is not None
                rc[node.host] += 1
        for cp in self._copies:
            for h in cp._host_blocks:
                rc[h] += 1
        return rc

    def _free_host_list(self) -> list[int]:
        return [h for h, n in self._host_refcounts().items() if n == 0]

    def _load_of(self, node: _Node) -> ModelCopy | None:
        """The unreaped load copy moving `node`'s KV, if it is `loading`."""
        for cp in self._copies:
            if cp.kind == "load" and node in cp._nodes:
                return cp
        return None

    def _live_checkpoints(self) -> list[_Checkpoint]:
        anchors = [*self._roots.values(), *self._nodes]
        found = [n.checkpoint for n in anchors if n.checkpoint is not None]
        return sorted(found, key=lambda c: c.serial)

    def _free_slot_list(self) -> list[int]:
        used = {c.slot for c in self._live_checkpoints()}
        return [s for s in range(self._num_slots) if s not in used]

    def _free_host_slot_list(self) -> list[int]:
        used = {c.host_slot for c in self._live_checkpoints()}
        return [s for s in range(self._num_host_slots) if s not in used]

    def _pin_count(self, c: _Checkpoint) -> int:
        n = sum(
            1
            for s in self._sequences
            if s._holds_match_pin and s.restore is not None and s.restore._checkpoint is c
        )
        n += sum(sum(1 for p in cp._pins if p is c) for cp in self._copies)
        n += sum(1 for r in self._receipts if r._checkpoint is c)
        return n

    def _children(self, node: _Node) -> list[_Node]:
        return [n for n in self._nodes if n.parent is node]

    def _child(self, node: _Node, key: Key) -> _Node | None:
        for n in self._nodes:
            if n.parent is node and n.key == key:
                return n
        return None

    def _node_state(self, node: _Node, rc: dict[int, int]) -> NodeState:
        pins = 0 if node.checkpoint is None else self._pin_count(node.checkpoint)
        return implied_node_state(
            attached=node.attached,
            leaf=all(c.block is None for c in self._children(node)),  # [R48]: device leaf
            block_refs=0 if node.block is None else rc[node.block],
            pins=pins,
            on_device=node.block is not None,
        )

    def _checkpoint_state(self, c: _Checkpoint) -> CheckpointState:
        return implied_checkpoint_state(
            present=c.present, published=c.published, pins=self._pin_count(c), withdrawn=c.withdrawn
        )

    def _release_withdrawn(self) -> None:
        """[R46]: a withdrawn checkpoint goes when its last pin goes."""
        for c in self._live_checkpoints():
            if c.withdrawn and self._checkpoint_state(c) is CheckpointState.ABSENT:
                # The spec implies it gone (its last pin went): released from `withdrawn`.
                CHECKPOINT.step(
                    CheckpointTrigger.RELEASE,
                    CheckpointState.WITHDRAWN.value,
                    f"checkpoint #{c.serial}",
                )
                c.present = False
                c.anchor.checkpoint = None

    def _evictable_index(self) -> list[_Node]:
        # [R10]: smallest (tick, serial) first.
        rc = self._refcounts()
        nodes = [n for n in self._nodes if self._node_state(n, rc) is NodeState.EVICTABLE]
        return sorted(nodes, key=lambda n: (n.tick, n.serial))

    def _host_index(self) -> list[_Node]:
        # [R51]: offloaded leaves whose host block only the node holds, by (tick, serial).
        rc, hrc = self._refcounts(), self._host_refcounts()
        nodes = [
            n
            for n in self._nodes
            if self._node_state(n, rc) is NodeState.OFFLOADED
            and not self._children(n)
            and n.host is not None
            and hrc[n.host] == 1
        ]
        return sorted(nodes, key=lambda n: (n.tick, n.serial))

    def _checkpoint_index(self, host_only: bool = False) -> list[_Checkpoint]:
        """[R24]: unpinned published checkpoints with a device slot (with
        `host_only`, [R55]: the host-only ones), by (tick, serial)."""
        found = [
            c
            for c in self._live_checkpoints()
            if self._checkpoint_state(c) is CheckpointState.PUBLISHED
            and (c.slot is None) == host_only
        ]
        return sorted(found, key=lambda c: (c.tick, c.serial))

    def _key(self, tokens: tuple[int, ...], extra: tuple[Hashable, ...] | None, i: int) -> Key:
        B = self._B
        return (tokens[i * B : (i + 1) * B], _identity(extra, i))

    # ------------------------------------------------------------------ primitive changes

    def _drop_checkpoint(self, c: _Checkpoint, trigger: CheckpointTrigger) -> None:
        """Release / replace / evict a live checkpoint (frees its slot and frozen block)."""
        CHECKPOINT.step(trigger, self._checkpoint_state(c).value, f"checkpoint #{c.serial}")
        c.present = False
        c.anchor.checkpoint = None

    def _evict_one_node(self) -> bool:
        """Evict the LRU evictable node (and its checkpoint); False when there is none."""
        index = self._evictable_index()
        if not index:
            return False
        node = index[0]
        if (
            self._write_back
            and node.residency == Residency.DEVICE.value
            and self._begin_write_back(node)
        ):
            return True
        if node.residency == Residency.MIRRORED.value:  # [R48]: offload, keep the node
            NODE.step(NodeTrigger.OFFLOAD, NodeState.EVICTABLE.value, f"node #{node.serial}")
        else:
            NODE.step(NodeTrigger.FREE, NodeState.EVICTABLE.value, f"node #{node.serial}")
        if node.checkpoint is not None:
            self._drop_checkpoint(node.checkpoint, CheckpointTrigger.EVICT)
            self._stats["evicted_checkpoints"] += 1
        if node.residency == Residency.MIRRORED.value:
            node.residency = RESIDENCY.step(ResidencyTrigger.OFFLOAD, node.residency)
            node.block = None
            return True
        below = self._descendants(node)  # [R48]: all host-only, freed with it
        rc = self._refcounts()
        for gone in below:
            NODE.step(NodeTrigger.FREE, self._node_state(gone, rc).value, f"node #{gone.serial}")
            self._nodes.remove(gone)
            gone.attached = False
        self._stats["host_evicted_blocks"] += len(below)
        self._nodes.remove(node)
        node.attached = False
        return True

    def _begin_write_back(self, node: _Node) -> bool:
        """[R52]: give an evictable `device` leaf a host block and add it to this
        eviction round's store; False when the host tier has no block for it."""
        if not self._free_host_list():
            self._evict_host(1)
        free = self._free_host_list()
        if not free:
            return False
        node.host = free[0]
        node.residency = RESIDENCY.step(ResidencyTrigger.STORE, node.residency)
        if self._round is None:
            self._round = self._new_copy("store", [], [], [], [])
            self._round._write_back = True
        assert node.block is not None
        self._round._blocks.append(node.block)
        self._round._host_blocks.append(node.host)
        self._round._nodes.append(node)
        return True

    def _offload(self, node: _Node) -> int:
        """[R48]: free the device block of an evictable mirrored leaf; blocks freed."""
        before = len(self._free_block_list())
        NODE.step(NodeTrigger.OFFLOAD, NodeState.EVICTABLE.value, f"node #{node.serial}")
        if node.checkpoint is not None:
            self._drop_checkpoint(node.checkpoint, CheckpointTrigger.EVICT)
            self._stats["evicted_checkpoints"] += 1
        node.residency = RESIDENCY.step(ResidencyTrigger.OFFLOAD, node.residency)
        node.block = None
        return len(self._free_block_list()) - before

    def _descendants(self, node: _Node) -> list[_Node]:
        out: list[_Node] = []
        for child in self._children(node):
            out += [child, *self._descendants(child)]
        return out

    def _evict_host(self, n: int) -> int:
        """Host eviction: with write-back, first the host copies of mirrored nodes no
        request or copy holds, newest-created first ([R71]); then LRU offloaded
        leaves no request or copy holds ([R51])."""
        hrc = self._host_refcounts()
        duplicates = sorted(
            (
                node
                for node in self._nodes
                if self._write_back
                and node.residency == Residency.MIRRORED.value
                and node.host is not None
                and hrc[node.host] == 1
            ),
            key=lambda node: -node.serial,
        )[:n]
        for node in duplicates:
            node.residency = RESIDENCY.step(ResidencyTrigger.DROP_COPY, node.residency)
            node.host = None
        freed = len(duplicates)  # counted with the leaves below
        while freed < n:
            index = self._host_index()
            if not index:
                break
            node = index[0]
            NODE.step(NodeTrigger.FREE, NodeState.OFFLOADED.value, f"node #{node.serial}")
            self._nodes.remove(node)
            node.attached = False
            freed += 1
        self._stats["host_evicted_blocks"] += freed
        return freed

    def _evict_blocks(self, n: int) -> int:
        """KV eviction as in `evict(n)` ([R23]); returns the number of blocks freed."""
        return self._evict_counting(n)[0]

    def _evict_counting(self, n: int) -> tuple[int, int]:
        """`evict(n)`; returns (blocks freed, blocks its write-back stores still in
        flight will free). Write-back ([R52]): the leaves of one round share one
        store, queued when the round ends; their parents may be evicted in the
        next round once those stores finished."""
        freed, written, pending = 0, 0, 0
        while True:
            self._round = None
            while True:
                chosen = 0 if self._round is None else len(self._round._nodes)
                if freed + written + pending + chosen >= n:
                    break
                before = len(self._free_block_list())
                if not self._evict_one_node():
                    break
                freed += len(self._free_block_list()) - before
            round_copy, self._round = self._round, None
            if round_copy is None:
                break
            round_copy._touches = frozenset(
                {("block", b) for b in round_copy._blocks}
                | {("host_block", h) for h in round_copy._host_blocks}
            )
            before = len(self._free_block_list())
            self._settle(round_copy)  # finished when queued: offloaded, freed now
            done = len(self._free_block_list()) - before
            written += done
            pending += len(round_copy._nodes) - done
        self._stats["evicted_blocks"] += freed
        return freed + written, pending

    def _evict_checkpoints(self, n: int) -> int:
        """[R24]: free up to `n` device slots, LRU first; a mirrored checkpoint is
        offloaded (kept, host-only: [R54]), any other evicted. Frozen blocks freed
        here are not counted in evicted_blocks."""
        released = 0
        while released < n:
            index = self._checkpoint_index()
            if not index:
                break
            c = index[0]
            if c.residency == Residency.MIRRORED.value:
                c.residency = RESIDENCY.step(ResidencyTrigger.OFFLOAD, c.residency)
                c.slot = None
                self._stats["checkpoints_offloaded"] += 1
            else:
                self._drop_checkpoint(c, CheckpointTrigger.EVICT)
                self._stats["evicted_checkpoints"] += 1
            released += 1
        return released

    def _store_checkpoint(self, c: _Checkpoint) -> None:
        """[R53]: write-through of a just-saved block-aligned checkpoint into a host
        slot (free, or the LRU host-only checkpoint's: [R55]); none to be had: it
        stays device-only."""
        if not self._num_host_slots:
            return
        if not self._free_host_slot_list():
            index = self._checkpoint_index(host_only=True)
            if not index:
                return
            self._drop_checkpoint(index[0], CheckpointTrigger.EVICT)
            self._stats["host_evicted_checkpoints"] += 1
        c.host_slot = self._free_host_slot_list()[0]
        c.residency = RESIDENCY.step(ResidencyTrigger.STORE, c.residency)
        assert c.slot is not None
        touches = {("slot", c.slot), ("host_slot", c.host_slot)}
        cp = self._add_copy("store", c.step, [], [c], touches)  # the store pins it
        self._settle(cp)

    def _make_room(self, short: int) -> int:
        """Free `short` blocks for an allocation: KV eviction first; when that runs
        out, the frozen tails of unpinned checkpoints, least recent first ([R17]).
        Returns the blocks freed (possibly fewer)."""
        freed, pending = self._evict_counting(short)
        while freed + pending < short:
            holders = [c for c in self._checkpoint_index() if c.frozen_block is not None]
            if not holders:
                break
            before = len(self._free_block_list())
            self._drop_checkpoint(holders[0], CheckpointTrigger.EVICT)
            self._stats["evicted_checkpoints"] += 1
            gained = len(self._free_block_list()) - before
            self._stats["evicted_blocks"] += gained
            freed += gained
        return freed

    def _reclaimable(self) -> int:
        """Blocks `_make_room` could free (simulated on a deep copy) ([R16]); a
        write-back store queued by the simulation counts as finished ([R52])."""
        sim = _copylib.deepcopy(self)
        sim._manual = False
        return sim._make_room(self._num_blocks + 1)

    def _can_get_blocks(self, need: int) -> bool:
        free = len(self._free_block_list())
        return free >= need or free + self._reclaimable() >= need

    def _get_blocks(self, need: int) -> list[int]:
        """Evict until `need` blocks are free and return the lowest free ids ([R10])
        (the caller checked feasibility)."""
        free = len(self._free_block_list())
        if free < need:
            self._make_room(need - free)
        if self.fail_next_block_take:  # [R6]: injected at the take, after make-room
            self.fail_next_block_take = False
            raise AllocationFailed(f"injected allocation failure taking {need} blocks")
        blocks = self._free_block_list()[:need]
        if len(blocks) < need:  # [R52]: freed only when the write-back stores finish
            raise OutOfBlocks(f"need {need} blocks; the rest wait for write-back stores")
        return blocks

    def _grow(self, seq: ModelSequence, need: int) -> None:
        if not self._can_get_blocks(need):  # [R16], [R6]: nothing changed
            raise OutOfBlocks(
                f"sequence #{seq._id} needs {need} blocks; {len(self._free_block_list())} free "
                f"and not enough evictable"
            )
        seq.block_ids.extend(self._get_blocks(need))

    def _queue_copy(self, kind: str, checkpoint: _Checkpoint, seq_block: int | None) -> ModelCopy:
        # [R35]: holds a reference on the sequence block d; [R36]: what it touches
        # (a host-only checkpoint's restore reads its host slot: [R56]).
        touches: set[tuple[str, int]]
        if checkpoint.slot is not None:
            touches = {("slot", checkpoint.slot)}
        else:
            assert checkpoint.host_slot is not None  # host-only: [R54]
            touches = {("host_slot", checkpoint.host_slot)}
        if checkpoint.frozen_block is not None:
            touches.add(("block", checkpoint.frozen_block))
        if seq_block is not None:
            touches.add(("block", seq_block))
        blocks = [] if seq_block is None else [seq_block]
        return self._add_copy(kind, checkpoint.step, blocks, [checkpoint], touches)

    def _add_copy(
        self,
        kind: str,
        step: int,
        blocks: list[int],
        pins: list[_Checkpoint],
        touches: set[tuple[str, int]],
    ) -> ModelCopy:
        """A new unreaped copy holding `blocks` and a pin on each of `pins` ([R35]),
        ordered by what it `touches` ([R36])."""
        self._copy_counter += 1
        cp = ModelCopy(self, self._copy_counter, kind, step, blocks, pins, frozenset(touches))
        self._copies.append(cp)
        return cp

    def _settle(self, cp: ModelCopy) -> None:
        """With `manual_copies=False` a copy is done when queued and reaped at once ([R37])."""
        if not self._manual:
            cp.done = True
            self._reap(cp)

    def _reap(self, cp: ModelCopy) -> None:
        self._copies.remove(cp)
        cp.reaped = True
        self._stats["copies_reaped"] += 1
        if cp.failed:
            self._stats["copies_failed"] += 1
        if cp.kind == "store" and cp._pins:  # [R53]: a checkpoint's store
            (c,) = cp._pins
            if cp.failed:
                c.residency = RESIDENCY.step(ResidencyTrigger.STORE_FAILED, c.residency)
                c.host_slot = None
            else:
                c.residency = RESIDENCY.step(ResidencyTrigger.STORED, c.residency)
                self._stats["checkpoints_stored"] += 1
        elif cp.kind == "store":  # [R47]
            for node in cp._nodes:
                if cp.failed:
                    node.residency = RESIDENCY.step(ResidencyTrigger.STORE_FAILED, node.residency)
                    node.host = None
                else:
                    node.residency = RESIDENCY.step(ResidencyTrigger.STORED, node.residency)
                    self._stats["stored_blocks"] += 1
            if cp._write_back:  # [R52]: offload what is still an evictable leaf
                for node in cp._nodes:
                    rc = self._refcounts()
                    if (
                        node.residency == Residency.MIRRORED.value
                        and self._node_state(node, rc) is NodeState.EVICTABLE
                    ):
                        self._stats["evicted_blocks"] += self._offload(node)
        elif cp.kind == "load":  # [R50]
            for node in cp._nodes:
                if cp.failed:
                    node.residency = RESIDENCY.step(ResidencyTrigger.LOAD_FAILED, node.residency)
                    node.block = None  # private to the requests that still hold it
                else:
                    node.residency = RESIDENCY.step(ResidencyTrigger.LOADED, node.residency)
                    self._stats["loaded_blocks"] += 1
            if cp.failed:
                for seq in self._sequences:  # cut every request that reads a failed block
                    for i, node in enumerate(seq._path):
                        if node in cp._nodes:
                            del seq._path[i:]
                            seq._load_failed = True
                            break

    # ------------------------------------------------------------------ argument checks

    def _check_seq(self, seq: object, op: str) -> ModelSequence:
        # [R3]: type, then owner, then liveness.
        if not isinstance(seq, ModelSequence):
            raise InvalidType(f"{op}: expected a sequence of this cache, got {type(seq).__name__}")
        if seq._owner is not self:
            raise SequenceNotLive(f"{op}: sequence #{seq._id} belongs to another cache")
        if not seq._live:
            raise SequenceNotLive(f"{op}: sequence #{seq._id} was released or aborted")
        return seq

    # ------------------------------------------------------------------ public API

    def match(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        extra: Sequence[Hashable] | None = None,
        *,
        cache_salt: str | None = None,
        max_hit_tokens: int | None = None,
        atomic_spans: Sequence[Sequence[int]] = (),
    ) -> ModelSequence:
        toks = _check_tokens(tokens, "match", nonempty=True)
        ns = _check_namespace(namespace)
        ext = _check_extra(extra)
        if cache_salt is not None:  # [R57]: exactly a str, valid Unicode
            if type(cache_salt) is not str:
                raise InvalidType(
                    f"cache_salt must be exactly a str, got {type(cache_salt).__name__}"
                )
            if not _valid_unicode(cache_salt):
                raise InvalidArgument(f"cache_salt {cache_salt!r} holds a lone surrogate")
        if cache_salt:  # [R70]: block 0's extra keys, then the salt, as vLLM folds it
            first = _identity(ext, 0)
            own = () if first is None else first if isinstance(first, tuple) else (first,)
            ext = ((*own, cache_salt), *(ext[1:] if ext else ()))
        cap, spans = _check_bounds(max_hit_tokens, atomic_spans)
        B = self._B
        root = self._roots.get(ns)
        if root is None:  # [R11]
            self._node_serial += 1
            root = _Node(self._node_serial, ns, None, None, None, 0)
            self._roots[ns] = root
        walked: list[_Node] = []  # [R12]
        node = root
        for i in range(len(toks) // B):
            child = self._child(node, self._key(toks, ext, i))
            if child is None:
                break
            walked.append(child)
            node = child
        kv_depth = len(walked)
        limit = min(kv_depth, (len(toks) - 1) // B)

        self._seq_counter += 1
        seq = ModelSequence(self, self._seq_counter, toks, ns, ext)
        seq.branch_step = kv_depth * B
        if self._num_slots == 0:  # [R13]
            if self._num_host:  # [R50]: nothing at or past a failed load is readable
                for i, node in enumerate(walked[:limit]):
                    load = self._load_of(node)
                    if load is not None and load.failed:
                        limit = i
                        break
            while limit > 0 and not _hit_allowed(limit * B, cap, spans):  # [R64], [R65]
                limit -= 1
            seq._path = walked[:limit]
            seq.num_cached_tokens = limit * B
            if self._num_host:  # [R50]: the device part, then the host part
                depth, waiting = 0, 0
                host_part = walked[:limit]
                for node in walked[:limit]:
                    if node.block is None:
                        host_part = walked[depth:limit]
                        break
                    load = self._load_of(node)
                    if load is not None and load.failed:  # unreadable, and all below it
                        host_part = []
                        break
                    if load is not None and not load.done:
                        waiting += 1
                        if load not in seq._loads:
                            seq._loads.append(load)
                    depth += 1
                else:
                    host_part = []
                seq._path = walked[:depth]
                seq._host_path = host_part
                seq.num_cached_tokens = (depth + len(host_part)) * B
                seq.num_host_tokens = (len(host_part) + waiting) * B
        else:
            for d in range(limit, -1, -1):
                anchor = root if d == 0 else walked[d - 1]
                c = anchor.checkpoint
                if c is None:
                    continue
                if self._checkpoint_state(c) not in (
                    CheckpointState.PUBLISHED,
                    CheckpointState.PINNED,
                ):
                    continue
                if c.step > len(toks) - 1 or not _hit_allowed(c.step, cap, spans):
                    continue
                if c.step % B != 0 and (
                    c.tail != toks[d * B : c.step] or c.tail_extra != _identity(ext, d)
                ):
                    continue
                CHECKPOINT.step(
                    CheckpointTrigger.PIN,
                    self._checkpoint_state(c).value,
                    f"checkpoint #{c.serial}",
                )
                seq._path = walked[:d]
                seq.num_cached_tokens = c.step
                seq.restore = ModelRestore(c)
                seq._holds_match_pin = True
                break
        seq.block_ids = [n.block for n in seq._path if n.block is not None]
        seq.num_committed_tokens = seq.num_cached_tokens
        seq._match_stats = {  # [R14]
            "queries": 1,
            "query_tokens": len(toks),
            "hit_tokens": seq.num_cached_tokens,
            "checkpoint_hits": 0 if seq.restore is None else 1,
            "host_hit_tokens": seq.num_host_tokens,
        }
        for name, value in seq._match_stats.items():
            self._stats[name] += value
        self._recent = [*self._recent, (seq._id, len(toks), seq.num_cached_tokens)][
            -self._window :
        ]  # [R69]: the last `stats_window` matches
        self._sequences.append(seq)
        return seq

    def append(self, seq: ModelSequence, tokens: Sequence[int]) -> None:
        s = self._check_seq(seq, "append")
        toks = _check_tokens(tokens, "append", nonempty=False)
        s.tokens = s.tokens + toks  # [R4]: an empty append changes nothing

    def _check_allocation(self, op: str, seq: ModelSequence, num_tokens: int) -> ModelSequence:
        s = self._check_seq(seq, op)
        n = _check_int(num_tokens, f"{op}: num_tokens")
        if not 0 <= n <= len(s.tokens):
            raise InvalidArgument(
                f"{op}: num_tokens must be in [0, {len(s.tokens)}] for sequence #{s._id}, got {n}"
            )
        return s

    def allocate(self, seq: ModelSequence, num_tokens: int) -> None:
        s = self._check_allocation("allocate", seq, num_tokens)
        self._refuse_unloaded("allocate", s)
        need = -(-num_tokens // self._B) - len(s.block_ids)  # [R15]
        if need <= 0:
            return
        self._grow(s, need)

    def can_allocate(self, seq: ModelSequence, num_tokens: int) -> bool:
        """[R63]: `allocate`'s validation, then whether it would get its blocks."""
        s = self._check_allocation("can_allocate", seq, num_tokens)
        if s._load_failed or s._host_path:  # allocate would refuse ([R50])
            return False
        need = -(-num_tokens // self._B) - len(s.block_ids)
        return need <= 0 or self._can_get_blocks(need)

    @property
    def num_reclaimable_blocks(self) -> int:
        """[R62]: free blocks + what making room could free ([R16])."""
        return len(self._free_block_list()) + self._reclaimable()

    def _refuse_unloaded(self, op: str, s: ModelSequence) -> None:
        """[R50]: the operation needs the whole hit on the device."""
        if s._load_failed:
            raise HostTierError(f"{op}: the load of sequence #{s._id} failed; abort it")
        if s._host_path:
            raise HostTierError(f"{op}: sequence #{s._id} must load its host part first")

    def commit(self, seq: ModelSequence, num_tokens: int) -> None:
        s = self._check_seq(seq, "commit")
        n = _check_int(num_tokens, "commit: num_tokens")
        self._refuse_unloaded("commit", s)
        covered = len(s.block_ids) * self._B
        high = min(len(s.tokens), covered)
        if not s.num_committed_tokens <= n <= high:
            raise InvalidArgument(
                f"commit: num_tokens must be in [{s.num_committed_tokens}, {high}] for "
                f"sequence #{s._id}, got {n}"
            )
        if self._num_host and len(s._path) < n // self._B:
            self._refuse_reading_unloaded(s, n // self._B)
        self._clock += 1  # [R7]
        tick = self._clock
        parent = s._path[-1] if s._path else self._roots[s.namespace]
        attached: list[_Node] = []
        for i in range(len(s._path), n // self._B):
            key = self._key(s.tokens, s.extra, i)
            child = self._child(parent, key)
            if child is not None and child.block is None:  # [R49]: adopt the computed block
                child.block = s.block_ids[i]
                child.residency = RESIDENCY.step(ResidencyTrigger.ADOPT, child.residency)
            elif child is not None:  # [R18]
                assert child.block is not None
                s.block_ids[i] = child.block  # drops the private block, takes the node's
            else:  # [R19]
                self._node_serial += 1
                child = _Node(self._node_serial, s.namespace, parent, key, s.block_ids[i], tick)
                self._nodes.append(child)
                attached.append(child)
            child.tick = tick  # [R8]
            s._path.append(child)
            parent = child
        s.num_committed_tokens = n
        if self._num_host and attached and not self._write_back:
            self._store(attached)

    def _refuse_reading_unloaded(self, s: ModelSequence, full: int) -> None:
        """[R50]: no commit reads a block whose load has not finished, its own or one
        it would share."""
        for cp in s._loads:
            if cp.failed or not cp.done:
                raise HostTierError(f"commit: sequence #{s._id} waits on load copy #{cp._id}")
        s._loads = []
        node = s._path[-1] if s._path else self._roots.get(s.namespace)
        for i in range(len(s._path), full):
            if node is None:
                return
            node = self._child(node, self._key(s.tokens, s.extra, i))
            load = None if node is None else self._load_of(node)
            if load is not None and (load.failed or not load.done):
                raise HostTierError(f"commit: block {i} of sequence #{s._id} is being loaded")

    def _store(self, nodes: list[_Node]) -> None:
        """[R47]: write-through, one copy for the blocks a commit attached, each into a
        free host block (host eviction makes one); the rest stay device-only."""
        storing: list[_Node] = []
        for node in nodes:
            if not self._free_host_list():
                self._evict_host(1)
            free = self._free_host_list()
            if not free:
                break
            node.host = free[0]
            node.residency = RESIDENCY.step(ResidencyTrigger.STORE, node.residency)
            storing.append(node)
        if not storing:
            return
        blocks = [n.block for n in storing if n.block is not None]
        hosts = [n.host for n in storing if n.host is not None]
        cp = self._new_copy("store", blocks, hosts, storing, [])
        self._settle(cp)

    def _new_copy(
        self,
        kind: str,
        blocks: list[int],
        hosts: list[int],
        nodes: list[_Node],
        waits_on: list[int],
    ) -> ModelCopy:
        """A store or load copy holding `blocks` and `hosts` ([R35], [R36])."""
        touches = {("block", b) for b in (*blocks, *waits_on)} | {("host_block", h) for h in hosts}
        cp = self._add_copy(kind, 0, list(blocks), [], touches)
        cp._host_blocks = list(hosts)
        cp._nodes = list(nodes)
        return cp

    def load(self, seq: ModelSequence) -> ModelCopy | None:
        """[R50]: device blocks for the host part, one copy for them, shared loads."""
        s = self._check_seq(seq, "load")
        if s._load_failed:
            raise HostTierError(f"load: the load of sequence #{s._id} failed; abort it")
        if any(cp.failed for cp in s._loads):
            raise HostTierError(f"load: a load sequence #{s._id} waits on failed")
        pending = [cp for cp in s._loads if not cp.done and not cp.failed]
        nodes = s._host_path
        own = [n for n in nodes if n.block is None]
        shared = [n for n in nodes if n.block is not None]
        for node in shared:
            load = self._load_of(node)
            if load is not None and load.failed:
                raise HostTierError(f"load: load copy #{load._id} failed; poll() and retry")
        s.block_ids += [n.block for n in shared if n.block is not None]  # held first
        if not self._can_get_blocks(len(own)):
            del s.block_ids[len(s.block_ids) - len(shared) :]
            raise OutOfBlocks(f"load: sequence #{s._id} needs {len(own)} blocks")
        blocks = self._get_blocks(len(own)) if own else []
        del s.block_ids[len(s.block_ids) - len(shared) :]
        for node in shared:
            load = self._load_of(node)
            if load is not None and not load.done and load not in pending:
                pending.append(load)
        for node, block in zip(own, blocks, strict=True):
            node.block = block
            node.residency = RESIDENCY.step(ResidencyTrigger.LOAD, node.residency)
        s._path += nodes
        s.block_ids += [n.block for n in nodes if n.block is not None]
        s._host_path = []
        if not own and len(pending) <= 1:
            s._loads = pending
            return pending[0] if pending else None
        waits_on = [b for cp in pending for kind, b in cp._touches if kind == "block"]
        hosts = [n.host for n in own if n.host is not None]
        cp = self._new_copy("load", blocks, hosts, own, waits_on)
        s._loads = [*pending, cp] if own else pending
        self._settle(cp)
        return cp

    def evict_host(self, n: int) -> int:
        k = _check_int(n, "evict_host: n")
        if k < 0:
            raise InvalidArgument(f"evict_host: n must be >= 0, got {k}")
        return self._evict_host(k)

    def release(self, seq: ModelSequence) -> None:
        s = self._check_seq(seq, "release")
        self._clock += 1  # [R20], [R8]
        for node in s._path:
            node.tick = self._clock
        self._end(s)

    def abort(self, seq: ModelSequence) -> None:
        s = self._check_seq(seq, "abort")
        for name, value in s._match_stats.items():  # [R21], [R42]
            self._stats[name] -= value
        self._recent = [r for r in self._recent if r[0] != s._id]  # [R69]
        self._end(s)

    def reset_stats(self) -> None:
        """`stats.reset()` ([R69]): every counter to 0, the recent window emptied; a
        live match has nothing left for its abort to roll back."""
        self._stats = dict.fromkeys(STAT_COUNTERS, 0)
        self._recent = []
        self.resets += 1
        for s in self._sequences:
            s._match_stats = {}

    @property
    def recent_hit_rate(self) -> float:
        """Hit tokens over queried tokens of the last `stats_window` matches ([R69])."""
        queried = sum(q for _, q, _ in self._recent)
        return sum(h for _, _, h in self._recent) / queried if queried else 0.0

    def _end(self, s: ModelSequence) -> None:
        s._holds_match_pin = False
        s._live = False
        self._sequences.remove(s)  # drops its references and its match pin
        self._release_withdrawn()

    def save(self, seq: ModelSequence, step: int) -> ModelCopy | None:
        s = self._check_seq(seq, "save")
        st = _check_int(step, "save: step")
        B = self._B
        if self._num_slots == 0:
            raise CheckpointError("save: SSM checkpoints are disabled (num_checkpoint_slots == 0)")
        if not 1 <= st <= len(s.tokens):
            raise InvalidArgument(
                f"save: step must be in [1, {len(s.tokens)}] for sequence #{s._id}, got {st}"
            )
        d = st // B
        if d > s.num_committed_tokens // B:
            raise CheckpointError(
                f"save: step {st} anchors at block {d}, but sequence #{s._id} has only "
                f"{s.num_committed_tokens // B} committed blocks"
            )
        partial = st % B != 0
        if partial and len(s.block_ids) <= d:
            raise CheckpointError(
                f"save: partial step {st} needs block {d} of sequence #{s._id} allocated"
            )
        anchor = self._roots[s.namespace] if d == 0 else s._path[d - 1]
        tail = s.tokens[d * B : st]
        tail_extra = _identity(s.extra, d) if partial else None
        old = anchor.checkpoint
        # [R25] the same checkpoint exists (a withdrawn one does not count: [R46])
        same = old is not None and (old.step, old.tail, old.tail_extra) == (st, tail, tail_extra)
        if same and old is not None and not old.withdrawn:
            self._stats["checkpoints_deduplicated"] += 1
            return None
        # [R26] a pinned checkpoint is never replaced
        if old is not None and self._pin_count(old) > 0:
            self._stats["checkpoints_skipped"] += 1
            return None
        reuse_frozen = old is not None and partial and old.frozen_block is not None
        need_slot = old is None or old.slot is None  # none, or a host-only one ([R54])
        # [R30] feasibility first. [R28] (check) a slot: free, or the LRU published one's
        if need_slot and not self._free_slot_list() and not self._checkpoint_index():
            self._stats["checkpoints_skipped"] += 1
            return None
        # [R29] (check, before [R28] evicts anything) a frozen block: free, or by making room
        if partial and not reuse_frozen and not self._can_get_blocks(1):
            self._stats["checkpoints_skipped"] += 1
            return None
        # [R27] / [R28] take the slot
        frozen: int | None = None
        slot: int | None = None
        if need_slot:
            free_slots = self._free_slot_list()
            if not free_slots:
                self._evict_checkpoints(1)
                free_slots = self._free_slot_list()
            slot = free_slots[0]
        if old is not None:
            if not need_slot:
                slot = old.slot
            if reuse_frozen:
                frozen = old.frozen_block
            self._drop_checkpoint(old, CheckpointTrigger.REPLACE)
        # [R29] take the frozen block
        if partial and frozen is None:
            frozen = self._get_blocks(1)[0]
        self._clock += 1  # [R31], [R9]
        self._ckpt_serial += 1
        c = _Checkpoint(self._ckpt_serial, anchor, st, tail, tail_extra, slot, frozen, self._clock)
        CHECKPOINT.step(CheckpointTrigger.RESERVE, CheckpointState.ABSENT.value)
        anchor.checkpoint = c
        cp = self._queue_copy("save", c, s.block_ids[d] if partial else None)
        CHECKPOINT.step(CheckpointTrigger.PUBLISH, CheckpointState.RESERVED.value)
        c.published = True
        self._stats["checkpoints_saved"] += 1
        self._settle(cp)
        if not partial:
            self._store_checkpoint(c)
        return cp

    def restore(self, seq: ModelSequence) -> ModelCopy:
        s = self._check_seq(seq, "restore")
        if s.restore is None:
            raise CheckpointError(f"restore: sequence #{s._id} did not hit a checkpoint")
        if s._restored:
            raise CheckpointError(f"restore: sequence #{s._id} was already restored")
        c = s.restore._checkpoint
        if c.withdrawn:  # [R46]
            raise CheckpointError(f"restore: checkpoint #{c.serial} was withdrawn")
        if not c.present:  # unreachable: the match pin keeps it
            CHECKPOINT.step(
                CheckpointTrigger.PIN, CheckpointState.ABSENT.value, f"checkpoint #{c.serial}"
            )
        d = c.step // self._B
        partial = c.step % self._B != 0
        if partial and s.num_committed_tokens >= (d + 1) * self._B:  # [R32]
            raise CheckpointError(
                f"restore: sequence #{s._id} already committed block {d}, the frozen tail's target"
            )
        if partial and len(s.block_ids) <= d:  # [R33]
            self._grow(s, d + 1 - len(s.block_ids))
        self._clock += 1  # [R34], [R9]
        c.tick = self._clock
        cp = self._queue_copy("restore", c, s.block_ids[d] if partial else None)
        s._holds_match_pin = False  # the match pin moves to the copy
        s._restored = True
        self._stats["restores"] += 1
        self._settle(cp)
        return cp

    def evict(self, num_blocks: int) -> int:
        n = _check_int(num_blocks, "evict: num_blocks")
        if n < 0:
            raise InvalidArgument(f"evict: num_blocks must be >= 0, got {n}")
        return self._evict_blocks(n)

    def evict_checkpoints(self, n: int) -> int:
        k = _check_int(n, "evict_checkpoints: n")
        if k < 0:
            raise InvalidArgument(f"evict_checkpoints: n must be >= 0, got {k}")
        return self._evict_checkpoints(k)

    def drop_checkpoint(self, seq: ModelSequence, step: int) -> bool:
        s = self._check_seq(seq, "drop_checkpoint")
        st = _check_int(step, "drop_checkpoint: step")
        if self._num_slots == 0:
            raise CheckpointError("drop_checkpoint: SSM checkpoints are disabled")
        if not 1 <= st <= len(s.tokens):
            raise InvalidArgument(
                f"drop_checkpoint: step must be in [1, {len(s.tokens)}] for sequence "
                f"#{s._id}, got {st}"
            )
        B = self._B
        d = st // B
        if d > len(s._path):  # [R68]: the anchor must be on the sequence's path
            return False
        anchor = self._roots.get(s.namespace) if d == 0 else s._path[d - 1]
        c = None if anchor is None else anchor.checkpoint
        tail_extra = _identity(s.extra, d) if st % B else None
        if c is None or (c.step, c.tail, c.tail_extra) != (st, s.tokens[d * B : st], tail_extra):
            return False
        state = self._checkpoint_state(c)
        if state is CheckpointState.PINNED:
            raise PinError(f"drop_checkpoint: checkpoint #{c.serial} is pinned")
        if state is not CheckpointState.PUBLISHED:  # withdrawn: goes with its last pin
            return False
        self._drop_checkpoint(c, CheckpointTrigger.EVICT)
        self._stats["evicted_checkpoints"] += 1
        return True

    def poll(self) -> int:
        # [R35]: reaping releases the copy's pins and references.
        finished = [cp for cp in self._copies if cp.done or cp.failed]
        for cp in finished:
            self._reap(cp)
        self._release_withdrawn()
        return len(finished)

    def pin(self, seq: ModelSequence) -> ModelReceipt:
        s = self._check_seq(seq, "pin")
        if s.restore is None:
            raise CheckpointError(f"pin: sequence #{s._id} has no restore checkpoint")
        c = s.restore._checkpoint
        state = self._checkpoint_state(c)
        # [R39]; [R41]: a released checkpoint cannot be pinned.
        CHECKPOINT.step(CheckpointTrigger.PIN, state.value, f"checkpoint #{c.serial}")
        receipt = ModelReceipt(self, c)
        self._receipts.append(receipt)
        return receipt

    def unpin(self, receipt: ModelReceipt) -> None:
        if not isinstance(receipt, ModelReceipt):
            raise InvalidType(f"unpin: expected a pin receipt, got {type(receipt).__name__}")
        if receipt._owner is not self:
            raise PinError("unpin: the receipt belongs to another cache")
        if receipt._used:
            raise PinError(
                f"unpin: the receipt on checkpoint #{receipt._checkpoint.serial} was already used"
            )
        RECEIPT.step(ReceiptTrigger.REDEEM, receipt.state, "pin receipt")  # [R40]
        receipt._used = True
        self._receipts.remove(receipt)
        self._release_withdrawn()

    def pin_blocks(self, block_hashes: Sequence[int], namespace: str = "") -> ModelBlockReceipt:
        # [R1]: the hashes (container, element types, ranges), then the namespace.
        if not isinstance(block_hashes, (list, tuple)):
            raise InvalidType(
                f"pin_blocks: block_hashes must be a list or tuple, got {block_hashes!r}"
            )
        for h in block_hashes:
            _check_int(h, "pin_blocks: a block hash")
        for h in block_hashes:
            if h < 0:
                raise InvalidArgument(f"pin_blocks: a block hash is never negative, got {h}")
        ns = _check_namespace(namespace)
        if self._block_hash is None:
            raise ConfigError("pin_blocks: blocks are named by event hashes; events are off")
        wanted = {h % 2**64 for h in block_hashes}  # a wide digest: its wire value
        blocks = [  # [R66]: every device block of the namespace published with a listed hash
            n.block
            for n in self._nodes
            if n.namespace == ns and n.block is not None and self._node_hash(n) in wanted
        ]
        receipt = ModelBlockReceipt(self, blocks)
        self._block_receipts.append(receipt)
        return receipt

    def _node_hash(self, node: _Node) -> int:
        keys: list[Key] = []
        at: _Node | None = node
        while at is not None and at.key is not None:
            keys.append(at.key)
            at = at.parent
        assert self._block_hash is not None
        return self._block_hash(node.namespace, tuple(reversed(keys)))

    def unpin_blocks(self, receipt: ModelBlockReceipt) -> None:
        if not isinstance(receipt, ModelBlockReceipt):
            raise InvalidType(f"unpin_blocks: expected a block pin receipt, got {receipt!r}")
        if receipt._owner is not self:
            raise PinError("unpin_blocks: the receipt belongs to another cache")
        if receipt._used:  # [R67]: single use
            raise PinError("unpin_blocks: the receipt was already used")
        RECEIPT.step(ReceiptTrigger.REDEEM, receipt.state, "block pin receipt")
        receipt._used = True
        self._block_receipts.remove(receipt)

    # ------------------------------------------------------------------ events

    def bind_lora(self, namespace: str, lora_id: int | None) -> None:
        """[R70]: the events of `namespace` recorded from now on carry `lora_id`
        (None: they carry none again). Changes nothing else."""
        ns = _check_namespace(namespace)
        if lora_id is None:
            self._lora_ids.pop(ns, None)
            return
        _check_int(lora_id, "bind_lora: lora_id")
        if not 0 < lora_id < 2**63:
            raise InvalidArgument(f"bind_lora: lora_id must be in 1..2**63-1, got {lora_id}")
        self._lora_ids[ns] = lora_id

    def lora_id(self, namespace: str) -> int | None:
        """The `lora_id` that an event of `namespace` recorded now carries ([R70])."""
        return self._lora_ids.get(namespace)

    def pending(self) -> list[ModelCopy]:
        return [cp for cp in self._copies if not cp.done and not cp.failed]

    def complete(self, copy: ModelCopy) -> None:
        if self._to_complete(copy):
            self._complete(copy)

    def complete_failing(self, copy: ModelCopy) -> None:
        """`complete(copy)` where the copy's own data movement raises ([R46]): the
        earlier copies it waits for complete first ([R36]), then it fails as
        `fail` says. (The cache raises the copy's error; the model raises nothing.)"""
        if self._to_complete(copy):
            self._complete_earlier(copy)
            self._fail(copy)

    def _to_complete(self, copy: ModelCopy) -> bool:
        """Whether `complete(copy)` has work to do: False for a finished copy; raises
        for a non-copy, another cache's copy, or a failed one ([R46])."""
        if not isinstance(copy, ModelCopy):
            raise InvalidType(f"complete: expected a copy, got {type(copy).__name__}")
        if copy._owner is not self:
            raise InvalidArgument("complete: the copy belongs to another cache")
        if copy.failed:
            raise CopyFailed(f"complete: copy #{copy._id} failed")
        return not copy.done

    def fail(self, copy: ModelCopy) -> None:
        """[R46]: the copy never delivers; a save's checkpoint is withdrawn and the
        pending restores that read it fail too."""
        if not isinstance(copy, ModelCopy):
            raise InvalidType(f"fail: expected a copy, got {type(copy).__name__}")
        if copy._owner is not self:
            raise InvalidArgument("fail: the copy belongs to another cache")
        if copy.failed:
            return
        if copy.done:
            raise InvalidArgument(f"fail: copy #{copy._id} already finished")
        self._fail(copy)

    def _fail(self, copy: ModelCopy) -> None:
        copy.failed = True
        if copy.kind == "load":  # [R50]: the loads ordered after it fail too
            for other in self.pending():
                if other.kind == "load" and other._touches & copy._touches:
                    self._fail(other)
        if copy.kind == "save":
            (c,) = copy._pins
            CHECKPOINT.step(
                CheckpointTrigger.WITHDRAW,
                self._checkpoint_state(c).value,
                f"checkpoint #{c.serial}",
            )
            c.withdrawn = True
            for other in self.pending():  # its restores, and its store ([R53]), read it
                if other.kind != "save" and c in other._pins:
                    other.failed = True

    def _complete(self, copy: ModelCopy) -> None:
        self._complete_earlier(copy)
        copy.done = True

    def _complete_earlier(self, copy: ModelCopy) -> None:
        """[R36]: earlier pending copies sharing a resource with `copy` complete first."""
        for earlier in self._copies:
            if earlier is copy:
                break
            if not earlier.done and not earlier.failed and earlier._touches & copy._touches:
                self._complete(earlier)

    def complete_all(self) -> None:
        for cp in self.pending():
            cp.done = True

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_list())

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for n in self._nodes if n.block is not None)  # [R44]; offloaded: none

    @property
    def num_free_checkpoint_slots(self) -> int:
        return len(self._free_slot_list())

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_list())

    @property
    def num_free_host_checkpoint_slots(self) -> int:
        return len(self._free_host_slot_list())

    @property
    def num_host_cached_blocks(self) -> int:
        return sum(1 for n in self._nodes if n.host is not None)

    @property
    def num_pins(self) -> int:
        """Checkpoint pins outstanding: live sequences' match pins, unreaped copies'
        pins and outstanding receipts ([R35], [R39])."""
        matches = sum(1 for s in self._sequences if s._holds_match_pin and s.restore is not None)
        return matches + sum(len(cp._pins) for cp in self._copies) + len(self._receipts)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def snapshot(self) -> Snapshot:
        # [R43] ids; [R44] counts are derived from holders.
        rc = self._refcounts()
        all_nodes = sorted([*self._roots.values(), *self._nodes], key=lambda n: n.serial)
        nodes: dict[int, NodeView] = {}
        for n in all_nodes:
            is_root = n.parent is None
            nodes[n.serial] = NodeView(
                namespace=n.namespace,
                parent=None if n.parent is None else n.parent.serial,
                depth=n.depth,
                key=n.key,
                block=n.block,
                children=sorted(c.serial for c in self._children(n)),
                state=NodeState.ROOT.value if is_root else self._node_state(n, rc).value,
                tick=n.tick,
                serial=n.serial,
                checkpoint=None if n.checkpoint is None else n.checkpoint.serial,
                block_host=n.host,
                residency=n.residency,
            )
        checkpoints: dict[int, CheckpointView] = {}
        for c in self._live_checkpoints():
            checkpoints[c.serial] = CheckpointView(
                anchor=c.anchor.serial,
                step=c.step,
                tail=c.tail,
                tail_extra=c.tail_extra,
                slot=c.slot,
                host_slot=c.host_slot,
                residency=c.residency,
                frozen_block=c.frozen_block,
                pins=self._pin_count(c),
                state=self._checkpoint_state(c).value,
                tick=c.tick,
                serial=c.serial,
            )
        sequences: dict[int, SequenceView] = {}
        for s in self._sequences:
            restore_c = None if s.restore is None else s.restore._checkpoint
            sequences[s._id] = SequenceView(
                namespace=s.namespace,
                tokens=s.tokens,
                extra=s.extra,
                blocks=list(s.block_ids),
                path=[n.serial for n in s._path],
                num_cached_tokens=s.num_cached_tokens,
                num_committed_tokens=s.num_committed_tokens,
                restore_checkpoint=None if restore_c is None else restore_c.serial,
                holds_match_pin=s._holds_match_pin,
                host_path=[n.serial for n in s._host_path],
                num_host_tokens=s.num_host_tokens,
            )
        copies: dict[int, CopyView] = {
            cp._id: CopyView(
                kind=cp.kind,
                blocks=list(cp._blocks),
                pins=[c.serial for c in cp._pins],
                done=cp.done or cp.failed,
                state=cp.state,
                host_blocks=list(cp._host_blocks),
                nodes=[n.serial for n in cp._nodes],
            )
            for cp in self._copies
        }
        stats: dict[str, Any] = dict(self._stats)
        return Snapshot(
            block_size=self._B,
            capacity=self._num_blocks,
            free_blocks=[b for b, n in rc.items() if n == 0],
            refcounts=rc,
            slot_capacity=self._num_slots,
            free_slots=self._free_slot_list(),
            roots={ns: r.serial for ns, r in self._roots.items()},
            nodes=nodes,
            checkpoints=checkpoints,
            sequences=sequences,
            copies=copies,
            explicit_pins=[r._checkpoint.serial for r in self._receipts],
            block_pins=[b for r in self._block_receipts for b in r._blocks],
            evictable_index=[n.serial for n in self._evictable_index()],
            checkpoint_index=[c.serial for c in self._checkpoint_index()],
            event_blocks=None,
            event_block_hashes=None,
            event_checkpoint_slots=None,
            stats=stats,
            host_capacity=self._num_host,
            free_host_blocks=self._free_host_list(),
            host_refcounts=self._host_refcounts(),
            host_index=[n.serial for n in self._host_index()],
            event_host_blocks=None,
            host_slot_capacity=self._num_host_slots,
            free_host_slots=self._free_host_slot_list(),
            host_checkpoint_index=[c.serial for c in self._checkpoint_index(host_only=True)],
            event_host_checkpoint_slots=None,
        )
