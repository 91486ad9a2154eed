"""blocktrie's cache: a prefix cache of KV blocks and SSM checkpoints.

Public API (the docs site's contract page, docs/contract.md): `BlockTrie`,
`CacheConfig`, `ManualCopies`, `DeviceCopies`, the error classes, events and
`Sequence`; every name in `__all__` is documented in the API reference.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cache.block_pins import BlockPinReceipt
    from cache.config import CacheConfig, HostTierUnusedWarning
    from cache.copies import Copy, CopyEngine, DeviceCopies, ManualCopies
    from cache.errors import (
        AllocationFailed,
        CacheError,
        CheckpointError,
        ConcurrentUse,
        ConfigError,
        CopyFailed,
        HostTierError,
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
    from cache.keys import PackedTokens
    from cache.sequence import PinReceipt, RestorePoint, Sequence
    from cache.stats import CacheStats
    from cache.trie import BlockTrie

_HOME: dict[str, str] = {
    "BlockPinReceipt": "cache.block_pins",
    **dict.fromkeys(("CacheConfig", "HostTierUnusedWarning"), "cache.config"),
    **dict.fromkeys(("Copy", "CopyEngine", "DeviceCopies", "ManualCopies"), "cache.copies"),
    **dict.fromkeys(
        (
            "AllocationFailed",
            "CacheError",
            "CheckpointError",
            "ConcurrentUse",
            "ConfigError",
            "CopyFailed",
            "HostTierError",
            "IllegalTransition",
            "InvalidArgument",
            "InvalidType",
            "InvariantViolation",
            "OutOfBlocks",
            "OutOfStateSlots",
            "PinError",
            "SequenceNotLive",
        ),
        "cache.errors",
    ),
    **dict.fromkeys(("AllBlocksCleared", "BlockRemoved", "BlockStored", "Event"), "cache.events"),
    "PackedTokens": "cache.keys",
    **dict.fromkeys(("PinReceipt", "RestorePoint", "Sequence"), "cache.sequence"),
    "CacheStats": "cache.stats",
    "BlockTrie": "cache.trie",
}
"""Where each public name lives. Names are imported on first use (PEP 562), so that
``import cache.planner.cli`` (``blocktrie --help``) does not load torch."""


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AllBlocksCleared",
    "AllocationFailed",
    "BlockPinReceipt",
    "BlockRemoved",
    "BlockStored",
    "BlockTrie",
    "CacheConfig",
    "CacheError",
    "CacheStats",
    "CheckpointError",
    "ConcurrentUse",
    "ConfigError",
    "Copy",
    "CopyEngine",
    "CopyFailed",
    "DeviceCopies",
    "Event",
    "HostTierError",
    "HostTierUnusedWarning",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidType",
    "InvariantViolation",
    "ManualCopies",
    "OutOfBlocks",
    "OutOfStateSlots",
    "PackedTokens",
    "PinError",
    "PinReceipt",
    "RestorePoint",
    "Sequence",
    "SequenceNotLive",
]
