"""Input validation shared by every public operation: clear errors, no changes."""

from __future__ import annotations

import collections.abc
import operator
from array import array
from collections.abc import Hashable
from typing import Any, NoReturn, TypeAlias

from spec.errors import InvalidArgument, InvalidType

TokenIds: TypeAlias = collections.abc.Sequence[int]
"""Token ids as the API takes them: a list or tuple of integers."""

U32 = next(code for code in "ILH" if array(code).itemsize == 4)
"""The `array` typecode of a native uint32 (token storage, block keys, wire encoding)."""
U64 = "Q"
"""The `array` typecode of a native uint64."""


def int_arg(name: str, value: object) -> int:
    """`value` if it is an int (bool is not); else `InvalidType` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidType(f"{name} must be an int, got {type(value).__name__}")
    return value


def token_list(tokens: object, what: str = "tokens") -> array[int]:
    """Validate token ids; returns them as a private `array` of native uints.

    Token ids are integers (anything `operator.index` accepts: int, bool,
    numpy integers, 0-d integer tensors) in [0, 2**64), in a list or tuple.
    They are stored by value ([R5]): a numpy integer or a tensor element
    becomes its number, so equal prompts share nodes whatever type the engine
    passed. The array is uint32 (`U32`) when every id fits, else uint64
    (`U64`); either way one C-speed pass reads the input, no `int` object is
    made, and a uint32 array's bytes are already the blocks' keys
    (`cache.keys.request_keys`). Only a failure takes the slow path that
    names the first offending element, types before ranges ([R1], [R2]).
    """
    if not isinstance(tokens, (list, tuple)):
        raise InvalidType(f"{what} must be a list or tuple of ints, got {type(tokens).__name__}")
    try:
        return array(U32, tokens)
    except OverflowError:  # an id past 2**32 (or out of range: the next pass says)
        try:
            return array(U64, tokens)
        except (TypeError, OverflowError, ValueError, RuntimeError):
            _explain_bad_tokens(tokens, what)
    except (TypeError, ValueError, RuntimeError):
        _explain_bad_tokens(tokens, what)


def extend_tokens(stored: array[int], more: array[int]) -> array[int]:
    """`stored` with `more` appended (both from `token_list`); widened to uint64 when
    `more` needs it (a new array; `stored` is then left as it was)."""
    if more.typecode != stored.typecode:
        if stored.typecode == U32:
            stored = array(U64, stored)
        else:
            more = array(U64, more)
    stored.extend(more)
    return stored


def _explain_bad_tokens(tokens: list[Any] | tuple[Any, ...], what: str) -> NoReturn:
    for t in tokens:
        try:
            operator.index(t)
        except TypeError:
            raise InvalidType(f"{what} must contain only integers; found {t!r}") from None
    for t in tokens:
        if not 0 <= operator.index(t) < 2**64:
            raise InvalidArgument(f"{what} must be in [0, 2**64); found {t}")
    raise InvalidType(f"{what} are not integer token ids")


def extra_tuple(extra: object) -> tuple[Hashable, ...] | None:
    """Per-block extra identities as a tuple (None stays None); each must be hashable."""
    if extra is None:
        return None
    if not isinstance(extra, (list, tuple)):
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
