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

import msgspec

from cache.block_hash import MASK64
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from cache.keys import PackedTokens

_U32 = next(code for code in "ILH" if array(code).itemsize == 4)

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


_NATIVE_LITTLE = sys.byteorder == "little"


def msgpack_uint_array(packed: bytes) -> bytes:
    """The msgpack array of the native-uint32 ids in `packed`, built from the bytes.

    One width for the whole array, the smallest that holds its largest id:
    positive fixint (< 128), uint 8, uint 16 or uint 32. Decoders read every
    width as an int, so the decoded list equals that of encoding the ints one
    by one; only ids below the array's width may take a byte or two more than
    their own minimal form. No `int` is made per id.
    """
    ids = array(_U32, packed)
    n = len(ids)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 0x10000:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    if _NATIVE_LITTLE:
        ids.byteswap()
    big = ids.tobytes()  # big-endian u32 per id; byte k of each id is big[k::4]
    # Strided slices and compares run in C: no per-id Python object.
    zeros = bytes(n)
    if big[0::4] != zeros or big[1::4] != zeros:  # some id >= 2**16
        out = bytearray(5 * n)
        out[0::5] = b"\xce" * n
        for k in range(4):
            out[1 + k :: 5] = big[k::4]
        return head + out
    low = big[3::4]
    mid = big[2::4]
    if mid != zeros:  # some id >= 2**8
        out = bytearray(3 * n)
        out[0::3] = b"\xcd" * n
        out[1::3] = mid
        out[2::3] = low
        return head + out
    if low.isascii():  # every id < 128: positive fixints, one byte each
        return head + low
    out = bytearray(2 * n)
    out[0::2] = b"\xcc" * n
    out[1::2] = low
    return head + out


def _token_ids(tokens: Sequence[int]) -> object:
    if isinstance(tokens, PackedTokens):
        return msgspec.Raw(msgpack_uint_array(tokens.packed))
    return tokens


def to_wire_event(event: Event, *, legacy: bool = False) -> object:
    """The msgspec struct `encode_batch` writes for one event (`TypeError` on others)."""
    if isinstance(event, BlockStored):
        stored = _LegacyStored if legacy else _Stored
        parent = event.parent_block_hash
        extra = event.extra_keys
        return stored(
            _hashes(event.block_hashes),
            None if parent is None else parent & MASK64,
            _token_ids(event.token_ids),  # type: ignore[arg-type]  # Raw or a tuple: an array
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
    events: Iterable[Event],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    legacy: bool = False,
) -> bytes:
    """msgpack bytes of vLLM's `KVEventBatch` holding `events` in order.

    `ts` defaults to `time.time()`. Raises `TypeError` for an object that is
    not a `cache.events` event or an extra key msgpack cannot encode.
    """
    wire = [to_wire_event(e, legacy=legacy) for e in events]
    batch = _Batch(time.time() if ts is None else float(ts), wire, data_parallel_rank)
    try:
        return _encoder.encode(batch)
    except (TypeError, OverflowError) as exc:
        raise TypeError(f"cannot encode KV event batch: {exc}") from None
