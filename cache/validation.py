"""Input validation shared by every public operation: clear errors, no changes."""

from __future__ import annotations

import collections.abc
import functools
import operator
from array import array
from typing import Any, NoReturn, TypeAlias

from spec.errors import InvalidArgument, InvalidType

TokenIds: TypeAlias = collections.abc.Sequence[int] | Any
"""Token ids as the API takes them: a list or tuple of integers, or a one-dimensional
integer array (`array.array`, a numpy array, a CPU torch tensor; see `token_list`)."""

_ARRAY_INT_CODES = frozenset("bBhHiIlLqQ")
_EXPECTED = "a list or tuple of ints, or a 1-D integer array"

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

    A one-dimensional integer array an engine already holds is taken too,
    with one vectorized range check and one conversion instead of a check per
    token: an `array.array` of an integer typecode, a numpy integer array, or
    a torch integer tensor on the CPU (`_array_tokens`). It pays off from a
    few hundred tokens (2-6 ns per token from 4,096 tokens, against 8-14 for a
    list and 24-47 for `.tolist()` first); below that numpy's fixed costs make
    it about even.
    """
    if not isinstance(tokens, (list, tuple)):
        return _array_tokens(tokens, what)
    try:
        return array(U32, tokens)
    except OverflowError:  # an id past 2**32 (or out of range: the next pass says)
        try:
            return array(U64, tokens)
        except Exception:  # an element's own conversion may raise anything ([R57])
            _explain_bad_tokens(tokens, what)
    except Exception:
        _explain_bad_tokens(tokens, what)


def _array_tokens(tokens: object, what: str) -> array[int]:
    """`token_list` for a one-dimensional integer array (anything else: `InvalidType`).

    The array is read once, in C: a numpy array's range and width come from
    one `max` (`_numpy_tokens`) and its ids are copied out as native uint32
    (uint64 when one needs it); a CPU tensor is read through numpy without a copy (through its
    list of ids where numpy is absent); an `array.array` converts as a list
    does. A tensor on another device is refused: reading it would synchronize
    that device behind the engine's back. Bool arrays are refused (a mask is
    not token ids).
    """
    if isinstance(tokens, array):
        if tokens.typecode not in _ARRAY_INT_CODES:
            raise InvalidType(
                f"{what} must be {_EXPECTED}; got an array of typecode {tokens.typecode!r}"
            )
        try:
            return array(U32, tokens)
        except OverflowError:
            try:
                return array(U64, tokens)
            except OverflowError:
                _explain_bad_tokens(tuple(tokens), what)
    package = type(tokens).__module__.partition(".")[0]
    if package == "torch":
        import torch

        if isinstance(tokens, torch.Tensor):
            if not tokens.is_cpu:
                raise InvalidType(
                    f"{what} is a tensor on {tokens.device}: pass token ids on the CPU "
                    "(reading them would synchronize the device)"
                )
            if tokens.dtype not in _torch_int_dtypes(torch):
                raise InvalidType(f"{what} must be {_EXPECTED}; got a tensor of {tokens.dtype}")
            if tokens.dim() != 1:
                raise InvalidType(
                    f"{what} must be {_EXPECTED}; got a tensor of shape {tuple(tokens.shape)}"
                )
            try:
                tokens = tokens.numpy()  # a view: integer tensors never require grad
            except (RuntimeError, TypeError):  # no numpy, or a dtype numpy lacks
                return token_list(tokens.tolist(), what)
            package = "numpy"
    if package == "numpy":
        import numpy as np

        if isinstance(tokens, np.ndarray):
            return _numpy_tokens(tokens, what, np)
    raise InvalidType(f"{what} must be {_EXPECTED}, got {type(tokens).__name__}")


@functools.cache
def _torch_int_dtypes(torch: Any) -> frozenset[Any]:
    """torch's integer dtypes (bool excluded), looked up once."""
    names = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


def _numpy_tokens(tokens: Any, what: str, np: Any) -> array[int]:
    """`_array_tokens` for a numpy array: dtype and shape, then range and width from
    one reduction, then one copy.

    Read as unsigned ints of the same width, a negative id becomes the largest
    values, so the maximum alone says whether every id is in range and whether
    it fits 32 bits.
    """
    dtype = tokens.dtype
    if dtype.kind not in "iu":
        raise InvalidType(f"{what} must be {_EXPECTED}; got a numpy array of {dtype}")
    if tokens.ndim != 1:
        raise InvalidType(f"{what} must be {_EXPECTED}; got a numpy array of shape {tokens.shape}")
    out = array(U32)
    if not tokens.size:
        return out
    if not dtype.isnative:
        tokens = tokens.astype(dtype.newbyteorder("="))
    bits = 8 * dtype.itemsize
    top = int(tokens.view(f"u{dtype.itemsize}").max())
    if dtype.kind == "i" and top >> (bits - 1):
        raise InvalidArgument(f"{what} must be in [0, 2**64); found {int(tokens.min())}")
    if top >> 32:
        out = array(U64)
        out.frombytes(tokens.astype(np.uint64, copy=False).tobytes())
        return out
    out.frombytes(tokens.astype(np.uint32, copy=False).tobytes())
    return out


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
    """Name the first element that is not an integer id, else the first out of range.

    An element whose conversion (`operator.index`) raises anything, not only
    `TypeError` (a 0-d uint64 tensor holding 2**63 raises torch's
    `RuntimeError`), is not an integer token id: `InvalidType` ([R57]).
    """
    ids: list[int] = []
    for t in tokens:
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise InvalidType(f"{what} must contain only integers; found {t!r}") from None
        except Exception as exc:
            raise InvalidType(
                f"{what} must contain only integers; found {_safe_repr(t)}, whose conversion "
                f"to int raised {type(exc).__name__}: {exc}"
            ) from None
    for t in ids:
        if not 0 <= t < 2**64:
            raise InvalidArgument(f"{what} must be in [0, 2**64); found {t}")
    raise InvalidType(f"{what} must hold integer token ids (an element failed to convert)")


Identity: TypeAlias = "bool | int | str | bytes | tuple[Identity, ...] | None"
"""An extra identity in the form the cache keeps ([R57]): exact builtin values only."""

IDENTITY_DEPTH = 32
"""How deep identity tuples may nest ([R57]): deeper is refused, before the
recursive hashers and encoders could overflow the stack."""

_IDENTITY_ATOMS = frozenset((type(None), bool, int, bytes))
_IDENTITY_TYPES = "None, bool, int, str, bytes or a tuple of those"


def namespace_arg(namespace: object) -> str:
    """`namespace` if it is exactly a `str` holding valid Unicode ([R57]).

    A `str` subclass is refused (`InvalidType`): its `__hash__` / `__eq__`
    would run inside the operation, after validation. A string with a lone
    surrogate is refused (`InvalidArgument`): events encode the namespace as
    UTF-8, which cannot hold it.
    """
    if type(namespace) is not str:
        exactly = " (exactly, not a subclass)" if isinstance(namespace, str) else ""
        raise InvalidType(f"namespace must be a str{exactly}, got {type(namespace).__name__}")
    if not namespace.isascii():
        _check_unicode(namespace, "namespace")
    return namespace


def cache_salt_arg(salt: object) -> str | None:
    """`match`'s `cache_salt` ([R70]): None, or exactly a `str` holding valid Unicode
    ([R57]: it becomes part of block 0's identity); "" is no salt (None), as in vLLM."""
    if salt is None:
        return None
    if type(salt) is not str:
        exactly = " (exactly, not a subclass)" if isinstance(salt, str) else ""
        raise InvalidType(f"cache_salt must be a str{exactly} or None, got {type(salt).__name__}")
    if not salt.isascii():
        _check_unicode(salt, "cache_salt")
    return salt or None


def extra_tuple(extra: object) -> tuple[Identity, ...] | None:
    """Per-block extra identities as a tuple the cache owns (None stays None) ([R57]).

    Each identity must be exactly None, bool, int, str, bytes or a tuple of
    those (nested at most `IDENTITY_DEPTH` deep): values whose hashing and
    comparison are Python's own, so no user code (a custom `__hash__` or
    `__eq__`, a tensor's `__bool__`) runs once the operation has started
    changing the cache, and every identity can be encoded on the wire. Any
    other type (a float, a tensor, a subclass of an allowed type) raises
    `InvalidType` naming the value; a str with a lone surrogate (not valid
    Unicode) raises `InvalidArgument`. Identities are checked in order, each
    one's type before its value. A list is read once, into a tuple: what the
    caller does with it later changes nothing here (a tuple of these values is
    immutable already, and kept as it is).
    """
    if extra is None:
        return None
    if not isinstance(extra, (list, tuple)):
        raise InvalidType(
            "extra must be None or a list/tuple of per-block identities, "
            f"got {type(extra).__name__}"
        )
    items = tuple(extra)
    _check_identities(items, "extra", 1)
    return items


def _check_identities(items: tuple[object, ...], where: str, depth: int) -> None:
    """`extra_tuple`'s check of identities `where[0]`, `where[1]`, ... (nested
    `depth` deep): each an atom, a valid str, or a tuple of identities."""
    atoms = _IDENTITY_ATOMS
    for i, item in enumerate(items):
        kind = type(item)
        if kind in atoms:
            continue
        if kind is str:
            if not item.isascii():  # type: ignore[attr-defined]
                _check_unicode(item, f"{where}[{i}]")  # type: ignore[arg-type]
        elif kind is tuple:
            if depth > IDENTITY_DEPTH:
                raise InvalidArgument(
                    f"{where}[{i}]: identity tuples nest more than {IDENTITY_DEPTH} deep"
                )
            _check_identities(item, f"{where}[{i}]", depth + 1)  # type: ignore[arg-type]
        else:
            raise InvalidType(
                f"{where}[{i}] must be {_IDENTITY_TYPES} (exactly, not a subclass), "
                f"got {type(item).__name__}: {_safe_repr(item)}"
            )


def _check_unicode(text: str, where: str) -> None:
    """Refuse a str that UTF-8 cannot encode (a lone surrogate) ([R57])."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{where} is not valid Unicode (a lone surrogate at position {exc.start}): {text!r}"
        ) from None


def _safe_repr(value: object) -> str:
    """`repr(value)` for an error message, short, and never raising."""
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the error being reported
        text = object.__repr__(value)
    return text if len(text) <= 80 else text[:77] + "..."
