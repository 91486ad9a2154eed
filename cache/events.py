"""KV cache events, for engines that mirror the cache elsewhere (routers, KV stores).

Replaying every event in order over an empty set yields exactly the set of
cached blocks (invariant 10); `replay` does that, per group.

The fields past the original ones carry what vLLM's wire schema needs
(`cache.kv_events.encode_batch` turns these tuples into vLLM's msgpack
`KVEventBatch`); their defaults describe a KV block in the engine's primary
(GPU) tier, so older constructions keep their meaning. Groups: KV blocks are
`KV_GROUP` (kind "full_attention"); SSM checkpoints are published as blocks of
`CHECKPOINT_GROUP` (kind "mamba"), whose `block_ids` are checkpoint slots (see
`checkpoint_stored` / `checkpoint_removed` and docs/events.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

__all__ = [
    "CHECKPOINT_GROUP",
    "KIND_FULL_ATTENTION",
    "KIND_MAMBA",
    "KV_GROUP",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockIds",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "checkpoint_removed",
    "checkpoint_stored",
    "replay",
    "replay_views",
]

MEDIUM_GPU = "GPU"
"""`medium` of blocks in the engine's primary (device) tier: vLLM's value."""
MEDIUM_CPU = "CPU"
"""`medium` of blocks in a host-memory tier."""
KV_GROUP = 0
"""`group_idx` of KV blocks."""
CHECKPOINT_GROUP = 1
"""`group_idx` of SSM checkpoints published as blocks (hybrid models)."""
KIND_FULL_ATTENTION = "full_attention"
"""`kv_cache_spec_kind` of KV blocks (vLLM's name for full-attention groups)."""
KIND_MAMBA = "mamba"
"""`kv_cache_spec_kind` of SSM checkpoints (vLLM's name for Mamba state groups)."""

# NamedTuples: immutable, and cheap enough to build on the commit / evict hot paths.


class BlockStored(NamedTuple):
    """Blocks attached by one commit, parent first. `parent_block_hash` is None at a root.

    `token_ids` are the blocks' tokens concatenated (`block_size` each, except
    a checkpoint's partial tail): a tuple, or for blocks whose ids all fit in
    32 bits the trie's `cache.keys.PackedTokens` (the keys' bytes, read as
    ints on demand; it equals and hashes like the tuple). `extra_keys`, when
    not None, holds one entry per block: vLLM's extra keys of that block (a tuple, or None), as
    `cache.block_hash.extra_keys` builds them. `lora_id` is vLLM's deprecated
    integer adapter id: None unless `BlockTrie.bind_lora` bound the namespace to one.
    """

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    namespace: str
    medium: str = MEDIUM_GPU
    group_idx: int = KV_GROUP
    kv_cache_spec_kind: str = KIND_FULL_ATTENTION
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    lora_id: int | None = None


class BlockRemoved(NamedTuple):
    """Blocks detached by eviction (or checkpoints released / evicted, in their group)."""

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    namespace: str
    medium: str = MEDIUM_GPU
    group_idx: int = KV_GROUP


class AllBlocksCleared(NamedTuple):
    """Every cached block was dropped (`BlockTrie.clear`)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


def replay(
    events: Iterable[Event],
    blocks: set[int] | None = None,
    *,
    group_idx: int = KV_GROUP,
    medium: str = MEDIUM_GPU,
) -> set[int]:
    """Apply `events` in order to `blocks` (a new empty set by default); returns it.

    Only events of `group_idx` and `medium` apply (device KV blocks by default;
    `CHECKPOINT_GROUP` gives the published checkpoint slots, `MEDIUM_CPU` the
    host tier's blocks); `AllBlocksCleared` clears every group and medium.
    """
    out = set() if blocks is None else blocks
    replay_views(events, {(group_idx, medium): out})
    return out


class BlockIds(Protocol):
    """What `replay_views` applies events to: a `set[int]`, or anything with its
    `update` / `difference_update` / `clear` (`cache.event_log.BlockBitmap`)."""

    def update(self, ids: Sequence[int], /) -> None: ...

    def difference_update(self, ids: Sequence[int], /) -> None: ...

    def clear(self) -> None: ...


def replay_views(events: Iterable[Event], views: Mapping[tuple[int, str], BlockIds]) -> None:
    """`replay` into several block sets in one pass: `views` maps (group_idx, medium)
    to the set that events of that group and medium apply to; events of any other
    pair are skipped, and `AllBlocksCleared` clears every set."""
    for event in events:
        if isinstance(event, BlockStored):
            view = views.get((event.group_idx, event.medium))
            if view is not None:
                view.update(event.block_ids)
        elif isinstance(event, BlockRemoved):
            view = views.get((event.group_idx, event.medium))
            if view is not None:
                view.difference_update(event.block_ids)
        else:
            for view in views.values():
                view.clear()


def checkpoint_stored(
    checkpoint_hash: int,
    slot: int,
    parent_block_hash: int | None,
    token_ids: tuple[int, ...],
    block_size: int,
    namespace: str,
    *,
    extra_keys: tuple[object, ...] | None = None,
    medium: str = MEDIUM_GPU,
    lora_id: int | None = None,
) -> BlockStored:
    """The event for a checkpoint published in `slot` (hybrid models); `lora_id` as
    `BlockTrie.bind_lora` bound the namespace.

    As for every stored block, `checkpoint_hash` is the chain hash of
    `token_ids` (with `extra_keys`) under `parent_block_hash` (the namespace
    root when None), so a router can recompute it:

    - a checkpoint at a block boundary is the KV block it ends at: its hash,
      its parent's hash, its tokens. A router thus finds the same hash in
      `KV_GROUP` and `CHECKPOINT_GROUP` exactly where an SSM hit can end, as
      with vLLM's Mamba groups;
    - a checkpoint with a partial tail past block `node` hashes the tail under
      it: `chain(node_hash, tail, tail_extra)`, parent `node_hash` (None when
      `node` is the root), `token_ids` the tail.
    """
    return BlockStored(
        (checkpoint_hash,),
        (slot,),
        parent_block_hash,
        token_ids,
        block_size,
        namespace,
        medium,
        CHECKPOINT_GROUP,
        KIND_MAMBA,
        None if extra_keys is None else (extra_keys,),
        lora_id,
    )


def checkpoint_removed(
    checkpoint_hashes: tuple[int, ...],
    slots: tuple[int, ...],
    namespace: str,
    *,
    medium: str = MEDIUM_GPU,
) -> BlockRemoved:
    """The event for checkpoints released or evicted from `slots` (hybrid models)."""
    return BlockRemoved(checkpoint_hashes, slots, namespace, medium, CHECKPOINT_GROUP)
