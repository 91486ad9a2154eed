"""blocktrie's cache: a prefix cache of KV blocks and SSM checkpoints.

Public API (DESIGN.md): `BlockTrie`, `CacheConfig`, `ManualCopies`,
`DeviceCopies`, the error classes, events and `Sequence`.
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
