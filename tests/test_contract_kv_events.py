"""Contract details of `cache.kv_events` (mutation survivors).

`to_wire_event` writes vLLM's 2026 map form unless asked for the legacy one,
and encodes a `PackedTokens` event's ids itself when it is given none; block
hashes that are already 64-bit values (every ``xxh3`` chain value, and every
hash of an empty event) are published as they are, without a copy.
`encode_batch` takes any iterable of events, not only a list.
"""

from __future__ import annotations

from array import array

import pytest

pytest.importorskip("msgspec")

import msgspec

from cache.block_hash import MASK64
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from cache.keys import PackedTokens
from cache.kv_events import encode_batch, msgpack_uint_array, to_wire_event

_CODE = next(c for c in "ILH" if array(c).itemsize == 4)


def _packed(ids: list[int]) -> PackedTokens:
    return PackedTokens(array(_CODE, ids).tobytes())


def _wire(struct: object) -> object:
    """The plain msgpack value of one wire struct."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(struct))


def test_to_wire_event_defaults_to_the_map_form() -> None:
    """Without `legacy`, an event is vLLM's 2026 map (``"type"`` first), not an array."""
    removed = BlockRemoved((1, 2), (3, 4), "")
    assert _wire(to_wire_event(removed)) == {
        "type": "BlockRemoved",
        "block_hashes": [1, 2],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert _wire(to_wire_event(removed, legacy=True)) == ["BlockRemoved", [1, 2], "GPU", 0]
    assert _wire(to_wire_event(AllBlocksCleared())) == {"type": "AllBlocksCleared"}
    stored = BlockStored((5,), (1,), None, (7, 8), 2, "")
    assert _wire(to_wire_event(stored))["type"] == "BlockStored"  # type: ignore[index]


@pytest.mark.parametrize("ids", [[1, 2], [300, 7], [2**32 - 1, 0, 5]])
def test_to_wire_event_encodes_packed_ids_itself(ids: list[int]) -> None:
    """A `PackedTokens` event given no pre-encoded `token_ids` writes its ids as
    `msgpack_uint_array` does (read from the packed bytes): it decodes as its tuple
    form does."""
    tokens = _packed(ids)
    packed = BlockStored((5,), (1,), 4, tokens, len(ids), "ns")
    got = msgspec.msgpack.encode(to_wire_event(packed))
    assert msgpack_uint_array(tokens.packed) in got
    as_tuple = packed._replace(token_ids=tuple(ids))
    assert _wire(to_wire_event(packed)) == _wire(to_wire_event(as_tuple))
    assert msgspec.msgpack.decode(got)["token_ids"] == ids


@pytest.mark.parametrize("hashes", [(), (0, MASK64), (MASK64,), (2**63, 1)])
def test_64_bit_hashes_are_published_as_they_are(hashes: tuple[int, ...]) -> None:
    """Hashes within 64 bits (``xxh3`` chain values) go out as the event's own tuple:
    no masking pass, no copy; `MASK64` itself is such a value."""
    removed = BlockRemoved(hashes, tuple(range(len(hashes))), "")
    assert to_wire_event(removed).block_hashes is hashes  # type: ignore[attr-defined]
    stored = BlockStored(hashes, tuple(range(len(hashes))), None, (), 1, "")
    assert to_wire_event(stored).block_hashes is hashes  # type: ignore[attr-defined]


def test_wider_hashes_are_published_as_their_low_64_bits() -> None:
    """A 256-bit (``vllm``) hash goes out as its low 64 bits, the others unchanged."""
    wide = (1 << 200) | 9
    removed = BlockRemoved((wide, MASK64, 3), (0, 1, 2), "")
    assert list(to_wire_event(removed).block_hashes) == [9, MASK64, 3]  # type: ignore[attr-defined]


def test_encode_batch_takes_any_iterable_of_events() -> None:
    """A generator (or tuple) of events encodes to the bytes of the same list."""
    events: list[Event] = [
        BlockStored((1, 2), (1, 2), None, _packed([1, 2, 3, 4]), 2, ""),
        BlockRemoved((2,), (2,), ""),
        AllBlocksCleared(),
    ]
    want = encode_batch(events, ts=1.0)
    assert encode_batch((e for e in events), ts=1.0) == want
    assert encode_batch(tuple(events), ts=1.0) == want
    wide = [BlockRemoved((1 << 100,), (1,), ""), *events]
    assert encode_batch(iter(wide), ts=1.0) == encode_batch(wide, ts=1.0)


def _masked(event: Event) -> Event:
    """`event` with its hashes replaced by their published (low 64-bit) values."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return event._replace(
            block_hashes=tuple(h & MASK64 for h in event.block_hashes),
            parent_block_hash=None if parent is None else parent & MASK64,
        )
    if isinstance(event, BlockRemoved):
        return event._replace(block_hashes=tuple(h & MASK64 for h in event.block_hashes))
    return event


@pytest.mark.parametrize("legacy", [False, True])
def test_a_batch_of_wide_hashes_encodes_as_its_published_values_do(legacy: bool) -> None:
    """A batch holding 256-bit (``vllm``) hashes is byte-identical to the same batch
    with every hash already masked to 64 bits: each event as `to_wire_event` writes
    it, the packed token ids of the whole batch in their one common width."""
    wide = 1 << 200
    events: list[Event] = [
        BlockStored((wide | 1,), (1,), None, _packed([1, 2]), 2, "", lora_id=3),
        BlockRemoved((wide | 2,), (2,), "tenant", "CPU", 1),
        BlockStored((wide | 3, 4), (3, 4), wide | 5, (9, 8, 7, 6), 2, "t", extra_keys=(None, (1,))),
        BlockStored((6,), (5,), 7, _packed([300, 70_000]), 2, "", "CPU", 1, "mamba"),
        AllBlocksCleared(),
    ]
    masked = [_masked(e) for e in events]
    want = encode_batch(masked, ts=2.0, data_parallel_rank=4, legacy=legacy)
    assert encode_batch(events, ts=2.0, data_parallel_rank=4, legacy=legacy) == want


def test_a_64_bit_batch_builds_its_stored_events_inline_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As `encode_batch` documents: a batch whose hashes fit in 64 bits is encoded in
    one pass, each `BlockStored` built inline (`to_wire_event` only for the other
    events, once each); a batch msgpack refuses (a stored 256-bit hash) is encoded
    again, every event through `to_wire_event`. Both write the same bytes."""
    import cache.kv_events as kv_events

    calls: list[str] = []
    real = kv_events.to_wire_event

    def spy(event: Event, **kwargs: object) -> object:
        calls.append(type(event).__name__)
        return real(event, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_events, "to_wire_event", spy)
    events: list[Event] = [
        BlockStored((1, 2), (1, 2), None, _packed([1, 2, 300, 4]), 2, "", extra_keys=(None, (1,))),
        BlockStored((3,), (3,), 2, (5, 6), 2, "tenant"),
        BlockRemoved((2,), (2,), ""),
        AllBlocksCleared(),
    ]
    for legacy in (False, True):
        calls.clear()
        fast = encode_batch(events, ts=1.0, legacy=legacy)
        assert calls == ["BlockRemoved", "AllBlocksCleared"]
        calls.clear()
        assert encode_batch([_masked(e) for e in events], ts=1.0, legacy=legacy) == fast
    wide = [*events, BlockStored((1 << 100,), (4,), None, (7, 8), 2, "")]
    calls.clear()
    encode_batch(wide, ts=1.0)
    assert calls == ["BlockRemoved", "AllBlocksCleared"] + [type(e).__name__ for e in wide]


@pytest.mark.parametrize("ids", [[2**24], [2**24 + 5, 3], [0xFF00FFFF], [0x7F000000, 1]])
def test_ids_with_a_zero_second_byte_take_the_full_width(ids: list[int]) -> None:
    """An id of 2**16 or more needs all four bytes even when its second-highest byte is
    zero (0x01000000): the strided-bytes path picks uint 32 for it too."""
    from cache.kv_events import _body_bytes, _body_numpy

    raw = msgpack_uint_array(_packed(ids).packed)
    assert msgspec.msgpack.decode(raw) == ids
    assert raw[1] == 0xCE  # the uint 32 tag
    joined = _packed(ids).packed
    assert _body_bytes(joined, len(ids)) == _body_numpy(joined, len(ids))


def test_a_non_event_is_refused_by_its_type_name() -> None:
    """`to_wire_event` (and so `encode_batch`) names the type of what it refuses."""
    with pytest.raises(TypeError, match=r"^not a KV cache event: tuple$"):
        to_wire_event(("BlockStored",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^not a KV cache event: int$"):
        encode_batch([7])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^not a KV cache event: tuple$"):  # a run's shape
        encode_batch([(None, [1], b"\0\0\0\0", [0], 1, "")])  # type: ignore[list-item]


def test_drained_records_are_encoded_without_building_an_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`encode_batch(trie.drain_event_records())` writes each commit from its record:
    the path that builds events first (taken only for a hash past 64 bits or a bad
    event) is never reached for `xxh3` records, and the bytes are the built events'.
    The batch has commits under a root and under a block, in two namespaces, one
    with an extra identity (recorded built), and an eviction."""
    pytest.importorskip("xxhash")
    import cache.kv_events as kv_events
    from cache import BlockTrie, CacheConfig

    trie = BlockTrie(
        CacheConfig(block_size=2, num_blocks=16, kv_block_shape=None, enable_events=True)
    )
    for tokens, namespace, extra in [
        ([1, 2, 3, 4], "", None),
        ([1, 2, 3, 4, 5, 6], "", None),  # under block [3, 4]
        ([1, 2, 7, 8], "lora-a", None),
        ([9, 9, 9, 9], "", ("img",)),
    ]:
        seq = trie.match(tokens, namespace, extra)
        trie.allocate(seq, len(tokens))
        trie.commit(seq, len(tokens))
        trie.release(seq)
    trie.evict(1)
    records = trie.drain_event_records()
    runs = [item for item in records.items if type(item) is tuple]
    assert {run[0] is None for run in runs} == {True, False}  # root and block parents
    assert {run[5] for run in runs} == {"", "lora-a"}
    events = records.events()

    def refuse(items: object) -> list[Event]:
        raise AssertionError("encode_batch built the events of a records batch")

    monkeypatch.setattr(kv_events, "built_events", refuse)
    for legacy in (False, True):
        assert encode_batch(records, ts=1.0, legacy=legacy) == encode_batch(
            events, ts=1.0, legacy=legacy
        )
