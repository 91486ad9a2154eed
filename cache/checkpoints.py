"""The checkpoint store: every live SSM checkpoint, its pins, and the LRU of unpinned ones."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from cache.kv_pool import KVBlockPool
from cache.lru import LRUIndex
from cache.node import Checkpoint, Node
from cache.sequence import PinReceipt
from cache.state_pool import CheckpointSlotPool
from cache.stats import CacheStats
from spec.lifecycle import CHECKPOINT, CheckpointState

_PUBLISHED = CheckpointState.PUBLISHED.value


class CheckpointStore:
    """Owns checkpoints: lifecycle states, pin counts, slots, frozen tails, LRU order.

    Contract: a checkpoint's state changes only through `move`, i.e. the
    `spec.lifecycle.CHECKPOINT` table, so releasing, replacing or evicting a
    pinned one raises `IllegalTransition`; entering `published` (unpinned) adds
    it to `lru`, leaving it removes it. Every pin is a `PinReceipt`, counted
    on its checkpoint. `on_pins_changed(anchor)` lets the trie settle the
    anchor node, whose lifecycle state depends on the pin count.
    """

    __slots__ = ("_kv", "_on_pins_changed", "_owner", "_serial", "_stats", "lru", "slots")

    def __init__(
        self,
        slots: CheckpointSlotPool,
        kv: KVBlockPool,
        stats: CacheStats,
        on_pins_changed: Callable[[Node], None],
        owner: object,
    ) -> None:
        self.slots = slots
        self._kv = kv
        self._stats = stats
        self._on_pins_changed = on_pins_changed
        self._owner = owner
        self._serial = 0
        self.lru: LRUIndex[Checkpoint] = LRUIndex()

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
            anchor, step, tail, tail_extra, slot, frozen_block, self._serial, tick,
            CheckpointState.ABSENT.value,
        )  # fmt: skip
        self.move(ck, "reserve")
        anchor.checkpoint = ck
        return ck

    def move(self, ck: Checkpoint, trigger: str) -> None:
        """Fire `trigger` on `ck` through the spec's table; keeps `lru` in step."""
        new = CHECKPOINT.step(trigger, ck.state, ck)
        if ck.state == _PUBLISHED:
            self.lru.remove(ck)
        ck.state = new
        if new == _PUBLISHED:
            self.lru.add(ck)

    def pin(self, ck: Checkpoint) -> PinReceipt:
        """One more pin on a matchable checkpoint; returns its receipt."""
        self.move(ck, "pin")
        ck.pins += 1
        stats = self._stats
        stats.pins += 1
        if stats.pins > stats.peak_pins:
            stats.peak_pins = stats.pins
        self._on_pins_changed(ck.anchor)
        return PinReceipt(self._owner, ck)

    def unpin(self, receipt: PinReceipt) -> None:
        """Consume `receipt` (the caller checked it is unused and ours)."""
        ck = receipt.checkpoint
        self.move(ck, "unpin_last" if ck.pins == 1 else "unpin")
        ck.pins -= 1
        receipt.used = True
        self._stats.pins -= 1
        self._on_pins_changed(ck.anchor)

    def drop(self, ck: Checkpoint, trigger: str) -> int:
        """Release / evict / replace an unpinned checkpoint; returns KV blocks freed."""
        self.move(ck, trigger)
        ck.anchor.checkpoint = None
        self.slots.give(ck.slot)
        if ck.frozen_block is not None and self._kv.decref(ck.frozen_block):
            return 1
        return 0

    def evict_frozen_tails(self, blocks: int) -> int:
        """Evict unpinned checkpoints that hold a frozen tail, least recent first,
        until `blocks` KV blocks are freed (or none is left); returns blocks freed."""
        freed = 0
        released = 0
        for ck in list(self.lru):
            if freed >= blocks:
                break
            if ck.frozen_block is not None:
                freed += self.drop(ck, "evict")
                released += 1
        self._stats.evicted_checkpoints += released
        return freed

    def frozen_tails(self) -> list[Checkpoint]:
        """Unpinned checkpoints holding a frozen tail block, in no particular order."""
        return [ck for ck in self.lru.unordered() if ck.frozen_block is not None]

    def evict_lru(self, count: int) -> int:
        """Evict up to `count` unpinned checkpoints, least recent first; returns how many."""
        done = 0
        lru = self.lru
        while done < count and lru:
            self.drop(lru.oldest(), "evict")
            done += 1
        self._stats.evicted_checkpoints += done
        return done
