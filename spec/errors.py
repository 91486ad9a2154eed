"""The one error hierarchy shared by the reference model (`spec`) and the cache.

Both raise the same classes for the same bad input, so the differential tests
can compare failures as well as results. Every class is a `CacheError`;
errors about malformed arguments also derive from `ValueError` or `TypeError`
so callers that only know the builtins still catch them.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error blocktrie raises on purpose."""


class InvalidArgument(CacheError, ValueError):
    """An argument has the right type but a value outside its rule."""


class InvalidType(CacheError, TypeError):
    """An argument has the wrong type (tokens that are not ints, a list that is a str...)."""


class ConfigError(InvalidArgument):
    """A `CacheConfig` field breaks its rule (block_size <= 0, ...)."""


class SequenceNotLive(CacheError):
    """The sequence was released, aborted, or belongs to another cache."""


class OutOfBlocks(CacheError):
    """Not enough KV blocks even after evicting every evictable leaf; nothing changed."""


class OutOfStateSlots(CacheError):
    """No checkpoint slot is free and no checkpoint can be evicted; nothing changed."""


class CheckpointError(CacheError):
    """A checkpoint operation does not apply (SSM disabled, nothing to restore, ...)."""


class PinError(CacheError):
    """A pin receipt is used twice, or belongs to another cache."""


class IllegalTransition(CacheError):
    """A lifecycle transition that the spec does not allow from the current state."""

    def __init__(self, machine: str, trigger: str, state: str, subject: str = "") -> None:
        self.machine = machine
        self.trigger = trigger
        self.state = state
        self.subject = subject
        where = f" on {subject}" if subject else ""
        super().__init__(
            f"{machine} lifecycle: trigger {trigger!r} is not allowed from state {state!r}{where}"
        )


class InvariantViolation(CacheError):
    """`check()` found a broken invariant; names the invariant and the object."""

    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        self.detail = detail
        super().__init__(f"invariant {invariant!r} violated: {detail}")


class AllocationFailed(CacheError):
    """An injected (or real) allocation failure inside a pool; the operation is undone."""


class ConcurrentUse(CacheError):
    """A cache was entered from a second thread while an operation was running.

    A cache is single-threaded (an engine's scheduler owns it); the second
    caller is refused before it changes anything.
    """


class CopyFailed(CacheError):
    """A save or restore copy did not deliver its data (it failed, or read data
    whose own copy failed). Its pins are released when it is reaped."""


class HostTierError(CacheError):
    """An operation needs a request's whole hit on the device, but part of it is still
    in the host tier (call `load` first) or its load failed (abort the request)."""
