"""vLLM's KV-event wire format: `encode_batch(events) -> bytes` (msgspec msgpack).

What `msgspec.msgpack.Decoder(KVEventBatch)` in vLLM's
``vllm/distributed/kv_events.py`` (main, 2026) decodes:

- the batch is a msgpack **array** ``[ts, events, data_parallel_rank]``
  (``data_parallel_rank`` nil when None: msgspec's ``omit_defaults`` does not
  apply to array-like structs, so vLLM's own encoder writes the nil too);
- each event is a msgpack **map** whose first key ``"type"`` names the event
  (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``), then its
  fields in declaration order. Fields without a default are always present
  (None as nil); defaulted ones are left off when None:

  - BlockStored: ``block_hashes``, ``parent_block_hash``, ``token_ids``,
    ``block_size``, ``lora_id``, ``medium``, ``lora_name`` always; then
    ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` when set;
  - BlockRemoved: ``block_hashes``, ``medium`` always; ``group_idx`` when set;
  - AllBlocksCleared: no fields.

``legacy=True`` gives the pre-2026 form still decoded in the field: each event
a positional array ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
kv_cache_spec_kind]`` (every position written, nil when unset; older
decoders ignore the trailing fields they do not declare).

Mapping from `cache.events`: hashes go out as unsigned 64-bit ints (their low
64 bits: `cache.block_hash.to_wire`); the namespace becomes ``lora_name``
(None for the default namespace ""), as vLLM keys a LoRA adapter's blocks by
its name; ``block_ids`` stay in process (a router has no use for them).
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from cache.block_hash import MASK64
from cache.event_log import EventRecords, StoredRun, built_events, plain_extra_keys, run_hashes
from cache.events import (
    KIND_FULL_ATTENTION,
    KV_GROUP,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)
from cache.extras import requires_extra
from cache.keys import PackedTokens
from cache.validation import U32

with requires_extra("events", "cache.kv_events"):
    import msgspec
    import numpy as np

__all__ = ["encode_batch", "msgpack_uint_array", "to_wire_event"]


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: Sequence[int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class _LegacyStored(
    msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _LegacyRemoved(
    msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: Sequence[int]
    medium: str | None
    group_idx: int | None = None


class _LegacyCleared(
    msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True, gc=False
):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[object]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_CLEARED = _Cleared()
_LEGACY_CLEARED = _LegacyCleared()


def _hashes(hashes: tuple[int, ...]) -> Sequence[int]:
    """The published (low 64-bit) values; `xxh3` chain values already are."""
    if not hashes or max(hashes) <= MASK64:
        return hashes
    return [h & MASK64 for h in hashes]


_U32_NATIVE = np.dtype(np.uint32)  # the byte order `PackedTokens` (array "I") holds
_NATIVE_LITTLE = sys.byteorder == "little"
_ELEMENTS = [
    (1 << bits, (tag, np.dtype([("tag", "u1"), ("value", f">u{bits // 8}")])))
    for bits, tag in ((8, 0xCC), (16, 0xCD), (32, 0xCE))
]
"""(exclusive limit, (msgpack tag, record dtype)) of the uint 8 / 16 / 32 element forms."""


def _array_head(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def msgpack_uint_arrays(payloads: Sequence[bytes]) -> list[bytes]:
    """One msgpack array per payload of native-uint32 ids, built from the bytes.

    Every element is written in one width for the whole call, the smallest
    that holds its largest id: positive fixint (< 128), uint 8, uint 16 or
    uint 32. Decoders read every width as an int, so each decoded list equals
    that of encoding its ints one by one; only ids below the width may take a
    byte or two more than their own minimal form. No `int` is made per id:
    `encode_batch` encodes all of a batch's packed token ids in one call, with
    numpy for a large batch and strided `bytes` copies for a small one (where
    numpy's fixed cost per call dominates); both write the same bytes.
    """
    counts = [len(p) >> 2 for p in payloads]
    joined = b"".join(payloads)
    total = len(joined) >> 2
    body, width = (_body_numpy if total >= _NUMPY_FROM else _body_bytes)(joined, total)
    arrays = []
    start = 0
    for n in counts:
        stop = start + n * width
        arrays.append(_array_head(n) + body[start:stop])
        start = stop
    return arrays


_NUMPY_FROM = 256
"""Ids per call from which numpy (~5 us fixed, then ~1 ns per id) beats strided
`bytes` copies (cheap to start, then ~25 ns per id)."""


def _body_numpy(joined: bytes, total: int) -> tuple[bytes, int]:
    """The elements of `joined`'s ids in their common width; (bytes, width)."""
    ids = np.frombuffer(joined, dtype=_U32_NATIVE)
    top = int(ids.max()) if total else 0
    if top < 0x80:
        return ids.astype(np.uint8).tobytes(), 1
    tag, element = _element(top)
    out = np.empty(total, dtype=element)  # (tag byte, big-endian value) records
    out["tag"] = tag
    out["value"] = ids
    return out.tobytes(), element.itemsize


def _body_bytes(joined: bytes, total: int) -> tuple[bytes, int]:
    """`_body_numpy`'s bytes, by strided copies of the big-endian ids (no numpy)."""
    ids = array(U32, joined)
    if _NATIVE_LITTLE:
        ids.byteswap()
    big = ids.tobytes()  # byte k of each id is big[k::4]
    zeros = bytes(total)
    if big[0::4] != zeros or big[1::4] != zeros:
        width, tag, first = 5, 0xCE, 0  # some id >= 2**16: all four bytes
    elif big[2::4] != zeros:
        width, tag, first = 3, 0xCD, 2  # some id >= 2**8: the low two
    elif big[3::4].isascii():
        return big[3::4], 1  # every id < 128: positive fixints
    else:
        width, tag, first = 2, 0xCC, 3
    out = bytearray(width * total)
    out[0::width] = bytes((tag,)) * total
    for k in range(first, 4):
        out[1 + k - first :: width] = big[k::4]
    return bytes(out), width


def _element(top: int) -> tuple[int, np.dtype[Any]]:
    """(msgpack tag, record dtype) of the narrowest uint form holding `top` (>= 128)."""
    return next(pair for limit, pair in _ELEMENTS if top < limit)


def msgpack_uint_array(packed: bytes) -> bytes:
    """The msgpack array of the native-uint32 ids in `packed` (`msgpack_uint_arrays`)."""
    return msgpack_uint_arrays([packed])[0]


def to_wire_event(
    event: Event, *, legacy: bool = False, token_ids: msgspec.Raw | None = None
) -> object:
    """The msgspec struct `encode_batch` writes for one event (`TypeError` on others).

    `token_ids`, for a `BlockStored`, is its ids already encoded (as
    `encode_batch` does for a whole batch at once); by default they are
    encoded here.
    """
    if isinstance(event, BlockStored):
        stored = _LegacyStored if legacy else _Stored
        parent = event.parent_block_hash
        extra = event.extra_keys
        tokens: object = token_ids
        if tokens is None:
            ids = event.token_ids
            is_packed = type(ids) is PackedTokens
            tokens = msgspec.Raw(msgpack_uint_array(ids.packed)) if is_packed else ids  # type: ignore[attr-defined]
        return stored(
            _hashes(event.block_hashes),
            None if parent is None else parent & MASK64,
            tokens,  # type: ignore[arg-type]  # Raw or a tuple: an array either way
            event.block_size,
            event.lora_id,
            event.medium,
            event.namespace or None,
            None if extra is None else list(extra),
            event.group_idx,
            event.kv_cache_spec_kind,
        )
    if isinstance(event, BlockRemoved):
        removed = _LegacyRemoved if legacy else _Removed
        return removed(_hashes(event.block_hashes), event.medium, event.group_idx)
    if isinstance(event, AllBlocksCleared):
        return _LEGACY_CLEARED if legacy else _CLEARED
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


def encode_batch(
    events: Iterable[Event] | EventRecords,
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    legacy: bool = False,
) -> bytes:
    """msgpack bytes of vLLM's `KVEventBatch` holding `events` in order.

    `events` is a list (or any iterable) of events, or what
    `BlockTrie.drain_event_records()` returns: the same events unbuilt, which
    are encoded straight from the commits' records (no event object is made
    for them) to the same bytes as their built events. `ts` defaults to
    `time.time()`. Raises `TypeError` for an object that is not a
    `cache.events` event or an extra key msgpack cannot encode.

    The bytes are those of `to_wire_event` for each event. A batch is first
    encoded with its block hashes as they are (what `xxh3` chain values need:
    they are 64-bit already), building each `BlockStored`'s struct inline;
    only when msgpack refuses an int (a `vllm` 256-bit digest) is it encoded
    again through `to_wire_event`, which publishes their low 64 bits.
    """
    if isinstance(events, EventRecords):
        items: list[Event | StoredRun] = events.items
    else:
        items = events if isinstance(events, list) else list(events)
        if tuple in map(type, items):  # only a record's own runs are plain tuples
            raise TypeError("not a KV cache event: tuple")
    # Every packed token id array of the batch in one numpy pass.
    packed = [
        e[2] if type(e) is tuple else e.token_ids.packed  # type: ignore[union-attr,attr-defined]
        for e in items
        if type(e) is tuple or (type(e) is BlockStored and type(e.token_ids) is PackedTokens)
    ]
    arrays = msgpack_uint_arrays(packed) if packed else []
    stamp = time.time() if ts is None else float(ts)
    try:
        wire = _fast_wire(items, arrays, legacy)
        return _encoder.encode(_Batch(stamp, wire, data_parallel_rank))
    except (TypeError, OverflowError):
        pass  # a hash past 64 bits, or a bad event: the exact path masks or reports it
    built = built_events(items)
    raw = iter(arrays)
    wire = [
        to_wire_event(
            e,
            legacy=legacy,
            token_ids=(
                msgspec.Raw(next(raw))
                if type(e) is BlockStored and type(e.token_ids) is PackedTokens
                else None
            ),
        )
        for e in built
    ]
    try:
        return _encoder.encode(_Batch(stamp, wire, data_parallel_rank))
    except (TypeError, OverflowError) as exc:
        raise TypeError(f"cannot encode KV event batch: {exc}") from None


def _fast_wire(items: list[Event | StoredRun], arrays: list[bytes], legacy: bool) -> list[object]:
    """`to_wire_event` of each event (a stored run: of the event it builds), with
    `BlockStored` built inline and its block hashes unmasked (msgpack raises
    `OverflowError` for one past 64 bits)."""
    stored = _LegacyStored if legacy else _Stored
    raw = iter(arrays)
    wire: list[object] = []
    append = wire.append
    for e in items:
        if type(e) is tuple:  # a stored run: the fields of the event it builds
            parent, packed, _, blocks, size, namespace = e
            hashes: Sequence[int] = run_hashes(packed)
            tokens: object = msgspec.Raw(next(raw))
            extra = plain_extra_keys(namespace, len(blocks))
            medium, group, kind, lora = MEDIUM_GPU, KV_GROUP, KIND_FULL_ATTENTION, None
        elif type(e) is BlockStored:
            hashes, _, parent, ids, size, namespace, medium, group, kind, extra, lora = e
            tokens = msgspec.Raw(next(raw)) if type(ids) is PackedTokens else ids
        else:
            append(to_wire_event(e, legacy=legacy))  # type: ignore[arg-type]
            continue
        append(
            stored(
                hashes,
                None if parent is None else parent & MASK64,
                tokens,  # type: ignore[arg-type]  # Raw or a tuple: an array either way
                size,
                lora,
                medium,
                namespace or None,
                None if extra is None else list(extra),
                group,
                kind,
            )
        )
    return wire
