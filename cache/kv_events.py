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

import time
from collections.abc import Iterable

import msgspec

from cache.block_hash import MASK64
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["encode_batch", "to_wire_event"]


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
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
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class _LegacyStored(
    msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: list[int]
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
    block_hashes: list[int]
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


def _hashes(hashes: Iterable[int]) -> list[int]:
    return [h & MASK64 for h in hashes]


def to_wire_event(event: Event, *, legacy: bool = False) -> object:
    """The msgspec struct `encode_batch` writes for one event (`TypeError` on others)."""
    if isinstance(event, BlockStored):
        stored = _LegacyStored if legacy else _Stored
        parent = event.parent_block_hash
        extra = event.extra_keys
        return stored(
            _hashes(event.block_hashes),
            None if parent is None else parent & MASK64,
            event.token_ids,  # type: ignore[arg-type]  # a tuple encodes as an array
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
