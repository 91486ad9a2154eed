"""KV cache events, for engines that mirror the cache elsewhere (routers, KV stores).

Replaying every event in order over an empty set yields exactly the set of
cached blocks (invariant 10); `replay` does that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

# NamedTuples: immutable, and cheap enough to build on the commit / evict hot paths.


class BlockStored(NamedTuple):
    """Blocks attached by one commit, parent first. `parent_block_hash` is None at a root."""

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    namespace: str


class BlockRemoved(NamedTuple):
    """Blocks detached by eviction."""

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    namespace: str


class AllBlocksCleared(NamedTuple):
    """Every cached block was dropped (`BlockTrie.clear`)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


def replay(events: Iterable[Event], blocks: set[int] | None = None) -> set[int]:
    """Apply `events` in order to `blocks` (a new empty set by default); returns it."""
    out = set() if blocks is None else blocks
    for event in events:
        if isinstance(event, BlockStored):
            out.update(event.block_ids)
        elif isinstance(event, BlockRemoved):
            out.difference_update(event.block_ids)
        else:
            out.clear()
    return out
