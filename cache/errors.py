"""The error hierarchy (defined in `spec.errors`, shared with the reference model)."""

from spec.errors import (
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

__all__ = [
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
]
