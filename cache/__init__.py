"""blocktrie's cache: a prefix cache of KV blocks and SSM checkpoints.

Public API (the docs site's contract page, docs/contract.md): `BlockTrie`,
`CacheConfig`, `ManualCopies`, `DeviceCopies`, the error classes, events and
`Sequence`; every name in `__all__` is documented in the API reference.
"""

from cache.config import CacheConfig
from cache.copies import Copy, CopyEngine, DeviceCopies, ManualCopies
from cache.errors import (
    AllocationFailed,
    CacheError,
    CheckpointError,
    ConfigError,
    IllegalTransition,
    InvalidArgument,
    InvalidType,
    InvariantViolation,
    OutOfBlocks,
    OutOfStateSlots,
    PinError,
    SequenceNotLive,
)
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from cache.sequence import PinReceipt, RestorePoint, Sequence
from cache.stats import CacheStats
from cache.trie import BlockTrie

__all__ = [
    "AllBlocksCleared",
    "AllocationFailed",
    "BlockRemoved",
    "BlockStored",
    "BlockTrie",
    "CacheConfig",
    "CacheError",
    "CacheStats",
    "CheckpointError",
    "ConfigError",
    "Copy",
    "CopyEngine",
    "DeviceCopies",
    "Event",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidType",
    "InvariantViolation",
    "ManualCopies",
    "OutOfBlocks",
    "OutOfStateSlots",
    "PinError",
    "PinReceipt",
    "RestorePoint",
    "Sequence",
    "SequenceNotLive",
]
