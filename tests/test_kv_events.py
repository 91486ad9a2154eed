"""`encode_batch` against decoders declared from vLLM's published schema (no vllm import)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("xxhash")

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from cache.block_hash import MASK64, BlockHasher, extra_keys, to_wire
from cache.events import (
    CHECKPOINT_GROUP,
    KIND_MAMBA,
    KV_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    checkpoint_removed,
    checkpoint_stored,
    replay,
)
from cache.kv_events import encode_batch

# ---- vLLM main (2026), vllm/distributed/kv_events.py: map events, array batch ----


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


# ---- pre-2026 vLLM: positional (array_like) events, two generations ----


class LEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LBlockStored(LEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class LBlockRemoved(LEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class LAllBlocksCleared(LEvent, tag="AllBlocksCleared"):
    pass


class LBatch(EventBatch):
    events: list[LBlockStored | LBlockRemoved | LAllBlocksCleared]


class OBlockStored(LEvent, tag="BlockStored"):  # vLLM 0.9: no medium / lora_name yet
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OBlockRemoved(LEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OAllBlocksCleared(LEvent, tag="AllBlocksCleared"):
    pass


class OBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OBlockStored | OBlockRemoved | OAllBlocksCleared]


def _sample() -> list[Event]:
    h = BlockHasher("vllm", 3)  # 256-bit chain values: the encoder must publish the low 64 bits
    r = h.root("")
    a = h.chain(r, [1, 2], None)
    b = h.chain(a, [3, 4], ("img", 0))
    c = h.chain(r, [9, 9], None, "tenant")
    return [
        BlockStored((a, b), (5, 6), None, (1, 2, 3, 4), 2, "", extra_keys=(None, ("img", 0))),
        BlockStored(
            (c,), (7,), None, (9, 9), 2, "tenant", extra_keys=(extra_keys(None, "tenant"),)
        ),
        checkpoint_stored(b, 0, a, (3, 4), 2, "", extra_keys=("img", 0)),
        BlockRemoved((b,), (6,), ""),
        checkpoint_removed((b,), (0,), ""),
        AllBlocksCleared(),
    ]


def test_batch_decodes_with_vllm_schema() -> None:
    events = _sample()
    payload = encode_batch(events, ts=12.5, data_parallel_rank=3)
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    s0, s1, ck, rm, ckrm, clr = batch.events
    e0 = events[0]
    assert isinstance(e0, BlockStored)
    assert s0.block_hashes == [to_wire(h) for h in e0.block_hashes]
    assert all(isinstance(x, int) and 0 <= x <= MASK64 for x in s0.block_hashes)
    assert s0.parent_block_hash is None
    assert s0.token_ids == [1, 2, 3, 4] and s0.block_size == 2
    assert s0.lora_id is None and s0.lora_name is None and s0.medium == "GPU"
    assert s0.extra_keys == [None, ("img", 0)]
    assert s0.group_idx == KV_GROUP and s0.kv_cache_spec_kind == "full_attention"
    assert s1.lora_name == "tenant" and s1.extra_keys == [("tenant",)]
    assert ck.group_idx == CHECKPOINT_GROUP and ck.kv_cache_spec_kind == KIND_MAMBA
    assert ck.block_hashes == [s0.block_hashes[1]] and ck.parent_block_hash == s0.block_hashes[0]
    assert ck.token_ids == [3, 4] and ck.extra_keys == [("img", 0)]
    assert isinstance(rm, VBlockRemoved) and rm.block_hashes == [s0.block_hashes[1]]
    assert rm.group_idx == KV_GROUP and rm.medium == "GPU"
    assert isinstance(ckrm, VBlockRemoved) and ckrm.group_idx == CHECKPOINT_GROUP
    assert isinstance(clr, VAllBlocksCleared)


def test_wire_layout_is_array_batch_of_tagged_maps() -> None:
    raw = msgspec.msgpack.decode(encode_batch(_sample()[:1], ts=1.0))
    assert isinstance(raw, list) and raw[0] == 1.0 and raw[2] is None
    ev = raw[1][0]
    assert list(ev)[:8] == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert ev["type"] == "BlockStored"
    # unset defaulted fields are left off (omit_defaults), required ones written as nil
    plain = BlockStored((1,), (1,), None, (1,), 1, "")
    ev = msgspec.msgpack.decode(encode_batch([plain], ts=0.0))[1][0]
    assert "extra_keys" not in ev and ev["lora_id"] is None and ev["parent_block_hash"] is None


def test_legacy_encoding_decodes_with_positional_schemas() -> None:
    events = _sample()
    payload = encode_batch(events, ts=2.0, legacy=True)
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored" and isinstance(raw[1][0], list)
    new = msgspec.msgpack.Decoder(LBatch).decode(payload)
    assert new.events[0].extra_keys == [None, ("img", 0)]
    assert new.events[2].group_idx == CHECKPOINT_GROUP
    old = msgspec.msgpack.Decoder(OBatch).decode(payload)
    assert [type(e).__name__ for e in old.events] == [
        "OBlockStored",
        "OBlockStored",
        "OBlockStored",
        "OBlockRemoved",
        "OBlockRemoved",
        "OAllBlocksCleared",
    ]
    assert old.events[0].token_ids == [1, 2, 3, 4]
    # the map form is not positional: a legacy decoder rejects it, and vice versa
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(LBatch).decode(encode_batch(events, ts=2.0))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(KVEventBatch).decode(payload)


def test_replaying_decoded_events_gives_the_published_hash_set() -> None:
    """Invariant 10 over the wire, by hash, per group: what a router reconstructs."""
    events = _sample()[:5]
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(encode_batch(events))
    by_group: dict[int | None, set[int | bytes]] = {}
    for e in batch.events:
        s = by_group.setdefault(e.group_idx, set())
        if isinstance(e, VBlockStored):
            s.update(e.block_hashes)
        else:
            s.difference_update(e.block_hashes)
    kv = events[0]
    assert isinstance(kv, BlockStored)
    assert by_group[KV_GROUP] == {to_wire(kv.block_hashes[0]), to_wire(events[1].block_hashes[0])}
    assert by_group[CHECKPOINT_GROUP] == set()
    assert replay(events) == {5, 7}
    assert replay(events[:3], group_idx=CHECKPOINT_GROUP) == {0}


def test_defaults_and_bad_input() -> None:
    payload = encode_batch([])
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert batch.events == [] and batch.ts > 0
    with pytest.raises(TypeError, match="not a KV cache event"):
        encode_batch([("BlockStored",)])  # type: ignore[list-item]
    bad = BlockStored((1,), (1,), None, (1,), 1, "", extra_keys=((object(),),))
    with pytest.raises(TypeError, match="cannot encode"):
        encode_batch([bad])


UINT32_EDGES = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1]


@pytest.mark.parametrize("top", UINT32_EDGES)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65_535, 65_536])
def test_uint_array_from_packed_bytes_decodes_to_the_ids(top: int, n: int) -> None:
    """`msgpack_uint_array` writes the ids straight from their packed bytes; any
    msgpack decoder reads back exactly the ids (every width, every header)."""
    from array import array

    from cache.kv_events import msgpack_uint_array

    ids = [(i * 7919) % (top + 1) for i in range(n)]
    if n:
        ids[n // 2] = top  # the largest id decides the width
    code = next(c for c in "ILH" if array(c).itemsize == 4)
    raw = msgpack_uint_array(array(code, ids).tobytes())
    assert msgspec.msgpack.decode(raw) == ids
    minimal = msgspec.msgpack.encode(ids)
    assert len(raw) <= len(minimal) + 4 * n  # at most the width's extra bytes per id


def test_trie_events_encode_the_same_ids_as_tuples_would() -> None:
    """A trie's `BlockStored` carries packed ids (no int per token); on the wire they
    decode exactly as the tuple form does, narrow and wide (>= 2**32) blocks alike."""
    from cache import BlockTrie, CacheConfig
    from cache.keys import PackedTokens

    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=8, enable_events=True))
    for tokens in ([1, 70_000, 3, 4], [9, 2**40, 5, 6]):
        seq = trie.match(tokens)
        trie.allocate(seq, len(tokens))
        trie.commit(seq, len(tokens))
        trie.release(seq)
    stored = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    assert [type(e.token_ids) for e in stored] == [PackedTokens, tuple]
    assert [tuple(e.token_ids) for e in stored] == [(1, 70_000, 3, 4), (9, 2**40, 5, 6)]
    as_tuples = [e._replace(token_ids=tuple(e.token_ids)) for e in stored]
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    got, want = decode(encode_batch(stored, ts=1.0)), decode(encode_batch(as_tuples, ts=1.0))
    assert got == want
    assert [e.token_ids for e in got.events] == [[1, 70_000, 3, 4], [9, 2**40, 5, 6]]


@pytest.mark.parametrize("tops", [(5, 100), (5, 200), (300, 7), (2**32 - 1, 0), (70_000, 90)])
def test_uint_arrays_of_a_batch_share_one_width_and_decode_each(tops: tuple[int, int]) -> None:
    """One numpy pass encodes every payload of a batch: each array decodes to its own
    ids (empty ones and 16+ element headers included) whatever the batch's width."""
    from array import array

    from cache.kv_events import msgpack_uint_arrays

    code = next(c for c in "ILH" if array(c).itemsize == 4)
    lists = [[tops[0]] * 3, [], [tops[1], 1, 2] * 7, [tops[0], tops[1]]]
    raws = msgpack_uint_arrays([array(code, ids).tobytes() for ids in lists])
    assert [msgspec.msgpack.decode(raw) for raw in raws] == lists
    assert msgpack_uint_arrays([]) == []


@given(
    st.lists(
        st.one_of(
            st.integers(0, 127),
            st.integers(0, 255),
            st.integers(0, 2**16),
            st.integers(0, 2**32 - 1),
        ),
        max_size=40,
    )
)
def test_numpy_and_bytes_bodies_are_the_same_bytes(ids: list[int]) -> None:
    """The two ways `msgpack_uint_arrays` builds elements (numpy for large calls, strided
    bytes copies for small ones) write identical bytes for every width."""
    from array import array

    from cache.kv_events import _body_bytes, _body_numpy

    code = next(c for c in "ILH" if array(c).itemsize == 4)
    joined = array(code, ids).tobytes()
    assert _body_bytes(joined, len(ids)) == _body_numpy(joined, len(ids))


def _reference_encode(
    events: list[Event], ts: float, data_parallel_rank: int | None, legacy: bool
) -> bytes:
    """The batch as `to_wire_event` writes each event (the token arrays of the batch
    sharing one width, as `encode_batch` writes them): what the fast path must equal."""
    from cache.keys import PackedTokens
    from cache.kv_events import _Batch, _encoder, msgpack_uint_arrays, to_wire_event

    packed = [
        e.token_ids.packed  # type: ignore[union-attr]
        for e in events
        if type(e) is BlockStored and type(e.token_ids) is PackedTokens
    ]
    raw = iter(msgpack_uint_arrays(packed))
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
        for e in events
    ]
    return _encoder.encode(_Batch(ts, wire, data_parallel_rank))


_HASHES = st.one_of(st.integers(0, MASK64), st.integers(0, 2**256 - 1))


@st.composite
def _events(draw: st.DrawFn) -> Event:
    from array import array

    from cache.keys import PackedTokens

    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
    n = draw(st.integers(1, 4))
    hashes = tuple(draw(st.lists(_HASHES, min_size=n, max_size=n)))
    ids = tuple(range(n))
    namespace = draw(st.sampled_from(["", "tenant"]))
    medium = draw(st.sampled_from(["GPU", "CPU"]))
    group = draw(st.sampled_from([KV_GROUP, CHECKPOINT_GROUP]))
    if kind == "removed":
        return BlockRemoved(hashes, ids, namespace, medium, group)
    if kind == "cleared":
        return AllBlocksCleared()
    size = draw(st.integers(1, 3))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * size, max_size=n * size))
    code = next(c for c in "ILH" if array(c).itemsize == 4)
    token_ids = (
        PackedTokens(array(code, tokens).tobytes()) if draw(st.booleans()) else tuple(tokens)
    )
    extras = draw(st.sampled_from([None, tuple((i, "x") if i % 2 else None for i in range(n))]))
    return BlockStored(
        hashes,
        ids,
        draw(st.one_of(st.none(), _HASHES)),
        token_ids,
        size,
        namespace,
        medium,
        group,
        draw(st.sampled_from(["full_attention", "mamba"])),
        extras,
        draw(st.one_of(st.none(), st.integers(0, 7))),
    )


@given(
    st.lists(_events(), max_size=12),
    st.one_of(st.none(), st.integers(0, 7)),
    st.booleans(),
)
def test_fast_encoding_is_byte_identical_to_the_per_event_structs(
    events: list[Event], rank: int | None, legacy: bool
) -> None:
    """`encode_batch` builds stored events inline and masks hashes only when msgpack
    refuses one: the bytes equal `to_wire_event`'s, event by event, for 64-bit and
    256-bit hashes, packed and tuple token ids, both encodings."""
    got = encode_batch(events, ts=1.5, data_parallel_rank=rank, legacy=legacy)
    assert got == _reference_encode(events, 1.5, rank, legacy)
