"""`TrieCounts`: what a `BlockTrie` reports about itself, read-only.

The counts of blocks and checkpoint slots in each pool and index, the pools'
tensors and the logical clock: each a property that reads the part that owns
it (`BlockTrie.__init__` builds the parts). A base class of `BlockTrie`, so
that `cache/trie.py` holds the operations; the properties are `BlockTrie`'s
own public API (the contract page, "Public API").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cache.eviction import Evictor
    from cache.host_tier import HostTier
    from cache.kv_pool import KVBlockPool
    from cache.state_pool import CheckpointSlotPool


class TrieCounts:
    """The counts, pool tensors and clock of a `BlockTrie` (its base class)."""

    _kv: KVBlockPool
    _slots: CheckpointSlotPool
    _host_pool: KVBlockPool
    _host_slots: CheckpointSlotPool
    _evictor: Evictor
    _host: HostTier | None
    _clock: int

    @property
    def num_free_blocks(self) -> int:
        """KV blocks in the free list ([R44])."""
        return self._kv.num_free

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks owned by attached trie nodes ([R44])."""
        return self._evictor.num_cached

    @property
    def num_free_checkpoint_slots(self) -> int:
        """Checkpoint slots in the free list."""
        return self._slots.num_free

    @property
    def num_free_host_checkpoint_slots(self) -> int:
        """Host checkpoint slots in the free list (0 without a checkpoint host tier)."""
        return self._host_slots.num_free

    @property
    def num_host_checkpoints(self) -> int:
        """Checkpoints holding a host slot: storing, mirrored or host-only ([R53])."""
        return self._host_slots.capacity - self._host_slots.num_free

    @property
    def num_evictable_blocks(self) -> int:
        """Nodes in the eviction index (evictable leaves right now)."""
        return len(self._evictor.index)

    @property
    def num_free_host_blocks(self) -> int:
        """Host-tier blocks in its free list (0 without a host tier)."""
        return self._host_pool.num_free

    @property
    def num_host_cached_blocks(self) -> int:
        """Host-tier blocks owned by attached nodes (0 without a host tier)."""
        return 0 if self._host is None else self._host.num_cached

    @property
    def num_evictable_host_blocks(self) -> int:
        """Nodes in the host eviction index (host-only leaves no request reads)."""
        return 0 if self._host is None else len(self._host.index)

    @property
    def host_cache(self) -> torch.Tensor | None:
        """The host-tier pool tensor `[num_host_blocks, *kv_block_shape]` (None for
        ids only or without a host tier)."""
        return self._host_pool.tensor

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """The KV pool tensor `[num_blocks, *kv_block_shape]` (None for ids only).

        Axis 0 is the block: `kv_cache[b]` is block id `b` of a `Sequence.block_ids`.
        The layout inside a block (layers, K/V, the offset of a token within its
        block) is the engine's choice: the trie only copies whole blocks (frozen
        tails, host-tier stores and loads). A token at position `p` of a request
        lives in block `block_ids[p // block_size]`, offset `p % block_size` on
        whichever axis the engine keeps tokens (`cache.testing`'s model: shape
        `(layers, 2, block_size, heads, head_dim)`, K at index 0 of axis 1, V at 1).
        """
        return self._kv.tensor

    @property
    def checkpoint_states(self) -> dict[str, torch.Tensor]:
        """Per state name, the checkpoint pool tensor `[num_checkpoint_slots, *shape]`."""
        return dict(self._slots.tensors)

    @property
    def host_checkpoint_states(self) -> dict[str, torch.Tensor]:
        """Per state name, the host checkpoint pool tensor
        `[num_host_checkpoint_slots, *shape]` (empty without one)."""
        return dict(self._host_slots.tensors)

    @property
    def clock(self) -> int:
        """The logical clock ([R7]: ticks on commit, release, and copy-queuing save/restore)."""
        return self._clock
