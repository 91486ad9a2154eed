"""Input validation shared by every public operation: clear errors, no changes."""

from __future__ import annotations

from collections.abc import Hashable

from spec.errors import InvalidArgument, InvalidType


def int_arg(name: str, value: object) -> int:
    """`value` if it is an int (bool is not); else `InvalidType` naming `name`."""
    if type(value) is not int:
        raise InvalidType(f"{name} must be an int, got {type(value).__name__}")
    return value


def token_list(tokens: object, what: str = "tokens") -> list[int]:
    """Validate token ids: a list/tuple of non-negative ints. Returns a private list."""
    if type(tokens) is not list and type(tokens) is not tuple:
        raise InvalidType(f"{what} must be a list or tuple of ints, got {type(tokens).__name__}")
    if not tokens:
        return []
    kinds = {*map(type, tokens)}
    if kinds != {int}:
        bad = sorted(k.__name__ for k in kinds if k is not int)
        raise InvalidType(f"{what} must contain only ints; found {', '.join(bad)}")
    if min(tokens) < 0:
        raise InvalidArgument(f"{what} must be >= 0; found {min(tokens)}")
    return list(tokens)


def extra_tuple(extra: object) -> tuple[Hashable, ...] | None:
    """Per-block extra identities as a tuple (None stays None); each must be hashable."""
    if extra is None:
        return None
    if type(extra) is not list and type(extra) is not tuple:
        raise InvalidType(
            "extra must be None or a list/tuple of per-block identities, "
            f"got {type(extra).__name__}"
        )
    for i, item in enumerate(extra):
        try:
            hash(item)
        except TypeError:
            raise InvalidType(f"extra[{i}] is not hashable: {item!r}") from None
    return tuple(extra)
