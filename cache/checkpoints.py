"""The checkpoint store: every live SSM checkpoint, its pins, and the LRU of unpinned ones."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable

from cache.bounds import NO_SPANS, Spans, span_start
from cache.event_log import EventLog
from cache.keys import block_identity
from cache.kv_pool import KVBlockPool
from cache.lru import LRUIndex
from cache.node import NO_SLOT, Checkpoint, Node, NodeTable
from cache.sequence import PinReceipt
from cache.state_pool import CheckpointSlotPool
from cache.stats import CacheStats
from spec.errors import CacheError, InvariantViolation, PinError
from spec.lifecycle import (
    CHECKPOINT,
    RECEIPT,
    RESIDENCY,
    CheckpointState,
    CheckpointTrigger,
    ReceiptTrigger,
    Residency,
    ResidencyTrigger,
    implied_checkpoint_state,
)

_PUBLISHED = CheckpointState.PUBLISHED.value
_RESERVED = CheckpointState.RESERVED.value
_WITHDRAWN = CheckpointState.WITHDRAWN.value
_ABSENT = CheckpointState.ABSENT.value
_MIRRORED = Residency.MIRRORED.value
_ON_HOST = frozenset({Residency.MIRRORED.value, Residency.HOST.value})  # announced on host


def _no_settle(node: Node) -> None:
    pass


class CheckpointStore:
    """Owns checkpoints: lifecycle states, pin counts, receipts, slots, frozen tails, LRU.

    Contract:
    - A checkpoint's state changes only through the `spec.lifecycle.CHECKPOINT`
      table: commands (`reserve`, `publish`, `pin`, `release`, `replace`,
      `evict`) fire their trigger, so releasing, replacing or evicting a pinned
      one raises `IllegalTransition`; a pin count that drops is routed to the
      state `implied_checkpoint_state` gives.
    - Entering `published` (unpinned) adds it to `lru`; leaving it removes it.
    - Every pin is a `PinReceipt` (`spec.lifecycle.RECEIPT`: issued, then
      redeemed exactly once), counted on its checkpoint (invariant 2).
    - `on_pins_changed(anchor)` lets the evictor settle the anchor node, whose
      lifecycle state depends on the pin count.
    - With a host tier (`host_slots`, [R53]-[R56]): a checkpoint's residency
      changes only through the `spec.lifecycle.RESIDENCY` table; `lru` holds the
      unpinned published checkpoints that own a device slot, `host_lru` the
      unpinned published host-only ones. Evicting a `mirrored` checkpoint from
      the device only gives its device slot back (`offload`); dropping one
      gives back every slot it holds, on both tiers.
    It must not evict nodes or take KV blocks; it frees a frozen tail's block
    reference only when it drops that tail's checkpoint.
    """

    __slots__ = (
        "_block_size",
        "_events",
        "_kv",
        "_owner",
        "_serial",
        "_stats",
        "host_lru",
        "host_slots",
        "lru",
        "nodes",
        "on_pins_changed",
        "slots",
    )

    def __init__(
        self,
        nodes: NodeTable,
        slots: CheckpointSlotPool,
        kv: KVBlockPool,
        stats: CacheStats,
        events: EventLog,
        block_size: int,
        owner: object,
    ) -> None:
        self.nodes = nodes
        """The trie's nodes: `nodes.checkpoint` maps each anchor to its checkpoint."""
        self.slots = slots
        self._kv = kv
        self._stats = stats
        self._events = events
        self._block_size = block_size
        self._owner = owner
        self._serial = 0
        self.lru: LRUIndex[Checkpoint] = LRUIndex()
        self.host_slots: CheckpointSlotPool | None = None
        """The host checkpoint slots (None without a checkpoint host tier)."""
        self.host_lru: LRUIndex[Checkpoint] = LRUIndex()
        self.on_pins_changed: Callable[[Node], None] = _no_settle

    # ------------------------------------------------------------ lookups

    @staticmethod
    def deepest_match(
        anchored: dict[Node, Checkpoint],
        root: Node,
        path: list[Node],
        tokens: array[int],
        extra: tuple[Hashable, ...] | None,
        max_depth: int,
        block_size: int,
        cap: int | None = None,
        spans: Spans = NO_SPANS,
    ) -> Checkpoint | None:
        """The deepest matchable checkpoint on `path[:max_depth]` (or the root)
        whose prefix equals `tokens`' and that leaves a token to compute ([R13]),
        at most `cap` tokens ([R64]) and ending inside none of `spans` ([R65]).
        `anchored` is the table's node -> checkpoint map."""
        last = len(tokens) - 1
        if cap is not None and cap < last:
            last = cap
        for depth in range(max_depth, -1, -1):
            anchor = path[depth - 1] if depth else root
            ck = anchored.get(anchor)
            if ck is None or ck.step > last:
                continue
            if spans and span_start(spans, ck.step) >= 0:
                continue
            if not CHECKPOINT.can(CheckpointTrigger.PIN, ck.state):  # matchable
                continue
            if ck.tail:
                start = depth * block_size
                if tuple(tokens[start : ck.step]) != ck.tail:
                    continue
                if ck.tail_extra != block_identity(extra, depth):
                    continue
            return ck
        return None

    # ---------------------------------------------------------- lifecycle

    def reserve(
        self,
        anchor: Node,
        step: int,
        tail: tuple[int, ...],
        tail_extra: Hashable,
        slot: int,
        frozen_block: int | None,
        tick: int,
    ) -> Checkpoint:
        """A new `reserved` checkpoint on `anchor` (which must have none)."""
        self._serial += 1
        ck = Checkpoint(
            anchor=anchor,
            step=step,
            tail=tail,
            tail_extra=tail_extra,
            slot=slot,
            frozen_block=frozen_block,
            serial=self._serial,
            tick=tick,
            state=CheckpointState.ABSENT.value,
        )
        self.move(ck, CheckpointTrigger.RESERVE)
        self.nodes.checkpoint[anchor] = ck
        return ck

    def _index_of(self, ck: Checkpoint) -> LRUIndex[Checkpoint]:
        """The eviction index `ck` belongs in while unpinned and published."""
        return self.lru if ck.slot != NO_SLOT else self.host_lru

    def move(self, ck: Checkpoint, trigger: CheckpointTrigger) -> None:
        """Fire `trigger` on `ck` through the spec's table; keeps the indexes in step."""
        new = CHECKPOINT.step(trigger, ck.state, ck)
        if ck.state == _PUBLISHED:
            self._index_of(ck).remove(ck)
        ck.state = new
        if new == _PUBLISHED:
            self._index_of(ck).add(ck)

    def publish(self, ck: Checkpoint) -> None:
        """A reserved checkpoint becomes matchable (and is announced, with events on)."""
        self.move(ck, CheckpointTrigger.PUBLISH)
        self._events.checkpoint_published(ck, self._block_size)

    def _settle(self, ck: Checkpoint) -> None:
        """Route `ck` to the state its pin count implies; one the spec implies
        `absent` (withdrawn, last pin gone: [R46]) is released."""
        implied = implied_checkpoint_state(
            present=True,
            published=ck.state != _RESERVED,
            pins=ck.pins,
            withdrawn=ck.state == _WITHDRAWN,
        )
        if implied == _ABSENT:
            self.drop(ck, CheckpointTrigger.RELEASE)
            return
        for trigger in CHECKPOINT.route(ck.state, implied, ck):
            self.move(ck, CheckpointTrigger(trigger))

    def withdraw(self, ck: Checkpoint) -> None:
        """Its save failed ([R46]): `ck` stops being matchable (and is announced
        removed); it is released when its last pin goes."""
        announced = CHECKPOINT.can(CheckpointTrigger.PIN, ck.state)
        self.move(ck, CheckpointTrigger.WITHDRAW)
        if announced:
            self._events.checkpoint_dropped(ck)
        self._settle(ck)

    def pin(self, ck: Checkpoint) -> PinReceipt:
        """One more pin on a matchable checkpoint; returns its receipt ([R39])."""
        self.move(ck, CheckpointTrigger.PIN)
        ck.pins += 1
        stats = self._stats
        stats.pins += 1
        if stats.pins > stats.peak_pins:
            stats.peak_pins = stats.pins
        self.on_pins_changed(ck.anchor)
        return PinReceipt(self._owner, ck)

    def unpin(self, receipt: PinReceipt) -> None:
        """Redeem `receipt` and drop its pin ([R40]); a redeemed receipt raises."""
        ck = receipt.checkpoint
        if ck.pins <= 0:
            raise PinError(f"unpin: {ck!r} has no pin for {receipt!r}")
        receipt.state = RECEIPT.step(ReceiptTrigger.REDEEM, receipt.state, receipt)
        ck.pins -= 1
        self._stats.pins -= 1
        anchor = ck.anchor
        self._settle(ck)
        self.on_pins_changed(anchor)

    def drop(self, ck: Checkpoint, trigger: CheckpointTrigger) -> int:
        """Release / evict / replace an unpinned checkpoint, on both tiers; returns
        KV blocks freed."""
        announced = ck.state == _PUBLISHED
        self.move(ck, trigger)
        if announced and ck.slot != NO_SLOT:
            self._events.checkpoint_dropped(ck)
        del self.nodes.checkpoint[ck.anchor]
        if ck.slot != NO_SLOT:
            self.slots.give(ck.slot)
        self._give_host_slot(ck, announced)
        if ck.frozen_block is not None and self._kv.decref(ck.frozen_block):
            return 1
        return 0

    def replace(self, old: Checkpoint, keep_frozen: bool) -> None:
        """A save replaces unpinned `old` on its anchor ([R25]-[R27]): the new one
        takes over its device slot (if it has one) and, with `keep_frozen`, its
        frozen tail; its host slot is given back."""
        announced = old.state == _PUBLISHED
        self.move(old, CheckpointTrigger.REPLACE)
        del self.nodes.checkpoint[old.anchor]
        if old.frozen_block is not None and not keep_frozen:
            self._kv.decref(old.frozen_block)
        self._give_host_slot(old, announced)

    def _give_host_slot(self, ck: Checkpoint, announced: bool) -> None:
        """Give back `ck`'s host slot, if it holds one, with a `CPU` removal when its
        host copy was announced (`announced`: it was published, and its store had
        finished)."""
        if ck.host_slot == NO_SLOT:
            return
        if announced and ck.residency in _ON_HOST:
            self._events.checkpoint_dropped(ck, host=True)
        self._host_pool().give(ck.host_slot)
        ck.host_slot = NO_SLOT

    # ------------------------------------------------------------ host tier

    def _host_pool(self) -> CheckpointSlotPool:
        pool = self.host_slots
        if pool is None:
            raise InvariantViolation("host tier", "a host checkpoint slot without a host tier")
        return pool

    def reserve_host_slot(self) -> int | None:
        """A host slot for a new store, evicting the LRU host-only checkpoint if none
        is free ([R55]); None when there is no host tier, every host slot is held by
        a checkpoint it may not evict, or taking one fails (a store is best effort)."""
        pool = self.host_slots
        if pool is None:
            return None
        if pool.num_free == 0:
            if not self.host_lru:
                return None
            self.evict_host_lru(1)
        try:
            return pool.take()
        except CacheError:
            return None

    def begin_store(self, ck: Checkpoint, host_slot: int) -> None:
        """`ck` (device-only) will be copied into `host_slot` ([R53]); the caller's
        store copy pins it until reaped."""
        ck.residency = RESIDENCY.step(ResidencyTrigger.STORE, ck.residency, ck)
        ck.host_slot = host_slot

    def stored(self, ck: Checkpoint, failed: bool) -> None:
        """Its store copy was reaped (before its pin goes): `mirrored`, or `device`
        again with the host slot given back if the copy failed."""
        if failed:
            ck.residency = RESIDENCY.step(ResidencyTrigger.STORE_FAILED, ck.residency, ck)
            self._give_host_slot(ck, announced=False)  # never announced: `device` now
            return
        ck.residency = RESIDENCY.step(ResidencyTrigger.STORED, ck.residency, ck)
        self._stats.checkpoints_stored += 1
        if CHECKPOINT.can(CheckpointTrigger.PIN, ck.state):  # still matchable
            self._events.checkpoint_published(ck, self._block_size, host=True)

    def offload(self, ck: Checkpoint) -> None:
        """Give back the device slot of an unpinned published `mirrored` checkpoint
        ([R54]): it stays matchable, host-only."""
        residency = RESIDENCY.step(ResidencyTrigger.OFFLOAD, ck.residency, ck)
        # Leaving the device is an eviction there: the checkpoint lifecycle allows it
        # only from `published` (unpinned); the state itself stays.
        CHECKPOINT.step(CheckpointTrigger.EVICT, ck.state, ck)
        self.lru.remove(ck)
        self._events.checkpoint_dropped(ck)
        self.slots.give(ck.slot)
        ck.slot = NO_SLOT
        ck.residency = residency
        self.host_lru.add(ck)
        self._stats.checkpoints_offloaded += 1

    def evict_host_lru(self, count: int) -> int:
        """Drop up to `count` unpinned host-only checkpoints, least recent first ([R55])."""
        done = 0
        lru = self.host_lru
        while done < count and lru:
            self.drop(lru.oldest(), CheckpointTrigger.EVICT)
            done += 1
        self._stats.host_evicted_checkpoints += done
        return done

    # ------------------------------------------------------------ eviction

    def evict_frozen_tails(self, blocks: int) -> int:
        """Evict unpinned checkpoints that hold a frozen tail, least recent first,
        until `blocks` KV blocks are freed (or none is left); returns blocks freed."""
        freed = 0
        released = 0
        for ck in list(self.lru):
            if freed >= blocks:
                break
            if ck.frozen_block is not None:
                freed += self.drop(ck, CheckpointTrigger.EVICT)
                released += 1
        self._stats.evicted_checkpoints += released
        return freed

    def drop_chosen(
        self, anchor: Node, step: int, tail: tuple[int, ...], tail_extra: Hashable
    ) -> bool:
        """Release the checkpoint on `anchor` after exactly `step` tokens, if it has this
        tail and tail identity, because the engine asked for it ([R68]): its slots on
        both tiers and its frozen tail go back, as an eviction's would
        (`evicted_checkpoints`, the same events). Raises `PinError` when it is pinned
        (changing nothing); False when there is no such checkpoint, or it is not
        matchable (withdrawn: it goes with its last pin)."""
        ck = self.nodes.checkpoint.get(anchor)
        if ck is None or (ck.step, ck.tail, ck.tail_extra) != (step, tail, tail_extra):
            return False  # none, or another prefix's
        if not CHECKPOINT.can(CheckpointTrigger.PIN, ck.state):  # not matchable
            return False
        if ck.pins:
            raise PinError(
                f"drop_checkpoint: {ck!r} holds {ck.pins} pin(s); a pinned checkpoint is "
                "never released"
            )
        self.drop(ck, CheckpointTrigger.EVICT)
        self._stats.evicted_checkpoints += 1
        return True

    def frozen_tails(self) -> list[Checkpoint]:
        """Unpinned checkpoints holding a frozen tail block, in no particular order."""
        return [ck for ck in self.lru.unordered() if ck.frozen_block is not None]

    def evict_lru(self, count: int) -> int:
        """Free up to `count` device slots of unpinned checkpoints, least recent
        first ([R24]): a `mirrored` one is offloaded (it stays, host-only: [R54]),
        any other is evicted. Returns the device slots freed."""
        done = 0
        evicted = 0
        lru = self.lru
        while done < count and lru:
            ck = lru.oldest()
            if ck.residency == _MIRRORED:
                self.offload(ck)
            else:
                self.drop(ck, CheckpointTrigger.EVICT)
                evicted += 1
            done += 1
        self._stats.evicted_checkpoints += evicted
        return done
