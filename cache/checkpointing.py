"""`Checkpointing`: what `save` and `restore` decide and queue ([R25]-[R34]), and which
checkpoint `drop_checkpoint` releases ([R68]).

`BlockTrie.save` and `BlockTrie.restore` take their operation lock and check
the sequence is live, then call these. `save` validates its step and decides
rules [R25]-[R31] on the unchanged state (a duplicate or pinned anchor is
skipped, a missing slot or frozen-tail block is made room for only when it can
be) before it takes anything; `restore` ([R32]-[R34]) moves the match's pin
onto its copy. Each queues its copy through `cache.transfers.Transfers`, with
the undo that puts everything back if queuing fails ([R38]). The checkpoint
lifecycle, pins and slots are `cache.checkpoints.CheckpointStore`'s; the trie
keeps the logical clock and the namespace roots, which these read and tick.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from cache.checkpoints import CheckpointStore
from cache.copies import Copy
from cache.eviction import Evictor
from cache.keys import block_identity
from cache.kv_pool import KVBlockPool
from cache.node import NO_SLOT, Node, NodeTable
from cache.offload import Offload, refuse_unloaded
from cache.sequence import Sequence
from cache.state_pool import CheckpointSlotPool
from cache.stats import CacheStats
from cache.transfers import Transfers
from cache.validation import int_arg
from spec.errors import CacheError, CheckpointError, InvalidArgument
from spec.lifecycle import CHECKPOINT, CheckpointTrigger

if TYPE_CHECKING:
    from cache.trie import BlockTrie


class Checkpointing:
    """The save and restore plans of one `BlockTrie` (its parts, shared, not copied)."""

    def __init__(
        self,
        trie: BlockTrie,
        nodes: NodeTable,
        kv: KVBlockPool,
        slots: CheckpointSlotPool,
        checkpoints: CheckpointStore,
        evictor: Evictor,
        transfers: Transfers,
        offload: Offload,
        roots: dict[str, Node],
        stats: CacheStats,
    ) -> None:
        self._trie = trie  # its logical clock and `_attach.namespace_root`
        self._ssm = trie.config.ssm
        self._block_size = trie.config.block_size
        self._nodes = nodes
        self._kv = kv
        self._slots = slots
        self._checkpoints = checkpoints
        self._evictor = evictor
        self._transfers = transfers
        self._offload = offload
        self._roots = roots
        self.stats = stats

    def save(
        self, seq: Sequence, step: int, runtime_state: Mapping[str, torch.Tensor] | None
    ) -> Copy | None:
        """`BlockTrie.save` past its checks (`seq` is live)."""
        step = int_arg("step", step)
        if not self._ssm:
            raise CheckpointError("save: SSM checkpoints are disabled (num_checkpoint_slots=0)")
        if not 1 <= step <= len(seq.token_list):
            raise InvalidArgument(f"save: step={step} outside 1..{len(seq.token_list)} for {seq!r}")
        size = self._block_size
        depth, rem = divmod(step, size)
        if depth > seq.num_committed_tokens // size:
            raise CheckpointError(
                f"save: step={step} anchors at block {depth}, but {seq!r} has committed only "
                f"{seq.num_committed_tokens // size} blocks"
            )
        if rem and len(seq.blocks) <= depth:
            raise CheckpointError(
                f"save: step={step} needs the partial block {depth} allocated in {seq!r}"
            )
        runtime = self._slots.check_runtime(runtime_state)
        if seq.host_path or seq.load_failed:
            refuse_unloaded("save", seq)

        root = self._roots.get(seq.namespace)
        anchor = seq.path[depth - 1] if depth else root
        tail = tuple(seq.token_list[depth * size : step])
        tail_extra = block_identity(seq.extra, depth) if rem else None
        old = self._nodes.checkpoint.get(anchor) if anchor is not None else None
        stats = self.stats
        if old is not None:
            same = old.step == step and old.tail == tail and old.tail_extra == tail_extra
            if same and CHECKPOINT.can(CheckpointTrigger.PIN, old.state):
                stats.checkpoints_deduplicated += 1  # [R25]
                return None
            if not CHECKPOINT.can(CheckpointTrigger.REPLACE, old.state):
                stats.checkpoints_skipped += 1  # [R26]
                return None
        reuse_frozen = old is not None and old.frozen_block is not None and rem > 0  # [R27]
        need_block = rem > 0 and not reuse_frozen
        need_slot = old is None or old.slot == NO_SLOT  # none, or a host-only one ([R54])
        evictor = self._evictor
        # [R30]: feasibility first, on the unchanged state.
        if need_slot and self._slots.num_free == 0 and not self._checkpoints.lru:
            stats.checkpoints_skipped += 1  # [R28]
            return None
        if need_block and self._kv.num_free == 0 and not evictor.room_possible(1):
            stats.checkpoints_skipped += 1  # [R29]
            return None

        if need_slot and self._slots.num_free == 0:
            self._checkpoints.evict_lru(1)  # [R28]
        if need_block:
            evictor.make_room(1)  # [R29]
        slot = self._slots.take() if need_slot or old is None else old.slot
        frozen: int | None = old.frozen_block if reuse_frozen and old is not None else None
        if need_block:
            try:
                frozen = self._kv.take(1)[0]
            except CacheError:
                if need_slot:
                    self._slots.give(slot)
                raise

        new_root = anchor is None
        if anchor is None:  # created only now that nothing can fail ([R6], [R11])
            anchor = self._trie._attach.namespace_root(seq.namespace)
        if old is not None:
            self._checkpoints.replace(old, reuse_frozen)
        self._trie._clock += 1  # [R31]
        ck = self._checkpoints.reserve(
            anchor, step, tail, tail_extra, slot, frozen, self._trie._clock
        )
        seq_block = seq.blocks[depth] if rem else -1
        copy = self._transfers.build(
            "save", step, slot, runtime, into_checkpoint=True, frozen_block=frozen,
            seq_block=seq_block,
        )  # fmt: skip
        self._checkpoints.publish(ck)
        copy.receipts.append(self._checkpoints.pin(ck))
        stats.checkpoints_saved += 1

        def undo() -> None:
            # Its data never arrived: take the checkpoint out again. A replaced
            # one cannot come back: its slot was being overwritten.
            self._checkpoints.unpin(copy.receipts[0])
            self._checkpoints.drop(ck, CheckpointTrigger.RELEASE)
            if new_root:
                self._nodes.release(self._roots.pop(seq.namespace))
            if old is not None:  # [R38]: lost with its slot's data, so counted
                stats.evicted_checkpoints += 1
            self._trie._clock -= 1
            stats.checkpoints_saved -= 1

        self._transfers.launch(copy, undo)
        if not tail and self._checkpoints.host_slots is not None:
            self._offload.store_checkpoint(ck)
        return copy

    def drop(self, seq: Sequence, step: int) -> bool:
        """`BlockTrie.drop_checkpoint` past its checks (`seq` is live) ([R68]): validates
        `step` as `save` does, finds the anchor on `seq`'s path and has the store
        release the checkpoint of `seq`'s prefix there, if any."""
        step = int_arg("step", step)
        if not self._ssm:
            raise CheckpointError(
                "drop_checkpoint: SSM checkpoints are disabled (num_checkpoint_slots=0)"
            )
        if not 1 <= step <= len(seq.token_list):
            raise InvalidArgument(
                f"drop_checkpoint: step={step} outside 1..{len(seq.token_list)} for {seq!r}"
            )
        depth, rem = divmod(step, self._block_size)
        if depth > len(seq.path):  # its anchor is not on the sequence's path
            return False
        anchor = seq.path[depth - 1] if depth else self._roots.get(seq.namespace)
        if anchor is None:
            return False
        tail = tuple(seq.token_list[step - rem : step])
        tail_extra = block_identity(seq.extra, depth) if rem else None
        return self._checkpoints.drop_chosen(anchor, step, tail, tail_extra)

    def restore(self, seq: Sequence, runtime_state: Mapping[str, torch.Tensor] | None) -> Copy:
        """`BlockTrie.restore` past its checks (`seq` is live)."""
        point = seq.restore
        if point is None:
            raise CheckpointError(f"restore: {seq!r} matched no checkpoint")
        receipt = seq.match_receipt
        if receipt is None:
            raise CheckpointError(f"restore: {seq!r} was already restored")
        ck = point.checkpoint
        if not CHECKPOINT.can(CheckpointTrigger.PIN, ck.state):  # matchable no more
            raise CheckpointError(  # [R46]
                f"restore: {ck!r} was withdrawn (its save copy failed); abort {seq!r}"
            )
        runtime = self._slots.check_runtime(runtime_state, written=True)
        depth = ck.step // self._block_size
        if ck.frozen_block is not None and len(seq.path) > depth:
            raise CheckpointError(  # [R32]
                f"restore: {seq!r} already committed block {depth}, where the frozen tail "
                "would be written; restore before prefill"
            )
        allocated = ck.frozen_block is not None and len(seq.blocks) == depth
        if allocated:  # [R33]
            self._evictor.make_room(1)
            seq.blocks.extend(self._kv.take(1))
        old_tick = ck.tick
        self._trie._clock += 1  # [R34]
        ck.tick = self._trie._clock  # [R9]; pinned, so in no index while it changes
        seq_block = seq.blocks[depth] if ck.frozen_block is not None else -1
        from_host = ck.slot == NO_SLOT  # [R56]: host-only, read straight from its host slot
        copy = self._transfers.build(
            "restore", ck.step, ck.host_slot if from_host else ck.slot, runtime,
            into_checkpoint=False, frozen_block=ck.frozen_block, seq_block=seq_block,
            from_host=from_host,
        )  # fmt: skip
        copy.receipts.append(receipt)
        seq.match_receipt = None
        seq.restored = True
        self.stats.restores += 1

        def undo() -> None:
            seq.match_receipt = receipt
            seq.restored = False
            if allocated:
                self._kv.decref(seq.blocks.pop())
            ck.tick = old_tick
            self._trie._clock -= 1
            self.stats.restores -= 1

        self._transfers.launch(copy, undo)
        return copy
