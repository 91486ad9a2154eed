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


def int_arg(name: str, value: object) -> int:
    """`value` if it is an int (bool is not); else `InvalidType` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidType(f"{name} must be an int, got {type(value).__name__}")
    return value


def token_list(tokens: object, what: str = "tokens") -> list[int]:
    """Validate token ids; returns a private list.

    Token ids are integers (anything `operator.index` accepts: int, bool,
    numpy integers, 0-d integer tensors) in [0, 2**64), in a list or tuple,
    and are stored as plain Python ints ([R5]): a numpy integer or a tensor
    element becomes its int, so equal prompts share nodes whatever type the
    engine passed. One C-speed pass (`array("Q", ...)`) converts valid input;
    only a failure takes the slow path that names the first offending element,
    types before ranges ([R1], [R2]).
    """
    if not isinstance(tokens, (list, tuple)):
        raise InvalidType(f"{what} must be a list or tuple of ints, got {type(tokens).__name__}")
    try:
        return array("Q", tokens).tolist()
    except (TypeError, OverflowError, ValueError, RuntimeError):
        _explain_bad_tokens(tokens, what)


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
