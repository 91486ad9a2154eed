"""LoRA ids and cache salts as vLLM emits them ([R70]): `bind_lora` and
`match(..., cache_salt=)`, with block hashes checked against vLLM's scheme."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from cache import BlockStored, BlockTrie, CacheConfig, InvalidArgument, InvalidType
from cache.block_hash import vllm_expressible

cbor2 = pytest.importorskip("cbor2")
pytest.importorskip("xxhash")

B = 4


def _trie(**overrides: Any) -> BlockTrie:
    fields: dict[str, Any] = dict(
        block_size=B, num_blocks=16, enable_events=True, block_hash="vllm", hash_seed=5
    )
    fields.update(overrides)
    return BlockTrie(CacheConfig(**fields))


def _serve(trie: BlockTrie, tokens: list[int], **match: Any) -> int:
    seq = trie.match(tokens, **match)
    hit = seq.num_cached_tokens
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    trie.release(seq)
    return hit


def _vllm_hashes(
    seed: str, tokens: list[int], lora_name: str | None, mm: list[tuple[Any, ...]], salt: str | None
) -> list[int]:
    """vLLM's `hash_request_tokens`, written out: per full block, extra keys =
    LoRA name + the block's multimodal keys + (block 0 only) the cache salt
    (`generate_block_hash_extra_keys`), None when empty; `sha256_cbor` chained
    from `NONE_HASH`; the low 64 bits published."""

    def sha256_cbor(x: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    parent = sha256_cbor(seed)
    out = []
    for i in range(len(tokens) // B):
        keys: list[Any] = [lora_name] if lora_name else []
        keys += list(mm[i]) if i < len(mm) else []
        if i == 0 and salt:
            keys.append(salt)
        parent = sha256_cbor((parent, tuple(tokens[i * B : (i + 1) * B]), tuple(keys) or None))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def _stored_hashes(trie: BlockTrie) -> list[int]:
    return [
        h & (2**64 - 1)
        for e in trie.drain_events()
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    ]


TOKENS = list(range(10, 23))  # three full blocks and one token


@pytest.mark.parametrize("namespace", ["", "adapter-a"])
@pytest.mark.parametrize(
    "extra", [None, [(("mm-1", 0),)], [(("mm-1", 0),), None, (("mm-2", 2),)], ["img"]]
)
def test_a_salted_requests_hashes_are_vllms(namespace: str, extra: Any) -> None:
    """vLLM's hashes wherever vLLM's own layout names the block apart ([R61]). In the
    default namespace, a block 0 whose extra keys start with a str (the salt alone,
    or a str multimodal key) has vLLM's keys of a block of the LoRA named by that
    str: it is published in blocktrie's layout instead, so no two cached blocks
    ever share a hash (blocks 1 and later, chained from it, differ too)."""
    trie = _trie()
    _serve(trie, TOKENS, namespace=namespace, extra=extra, cache_salt="tenant-7")
    mm = [() if e is None else e if isinstance(e, tuple) else (e,) for e in (extra or [])]
    vllm = _vllm_hashes("5", TOKENS, namespace, mm, "tenant-7")
    block0 = (*(mm[0] if mm else ()), "tenant-7")
    if vllm_expressible(block0, namespace):
        assert _stored_hashes(trie) == vllm
    else:
        lora = _trie()
        _serve(lora, TOKENS, namespace=block0[0], extra=[block0[1:] or None])
        assert _stored_hashes(trie)[0] != vllm[0]
        assert _stored_hashes(lora)[0] == vllm[0]  # the LoRA's block keeps vLLM's hash


def test_the_salt_equals_folding_it_into_block_0_by_hand() -> None:
    by_salt, by_hand = _trie(), _trie()
    _serve(by_salt, TOKENS, cache_salt="s")
    _serve(by_hand, TOKENS, extra=[("s",)])
    assert _stored_hashes(by_salt) == _stored_hashes(by_hand)


def test_salted_requests_share_only_with_the_same_salt() -> None:
    trie = _trie()
    assert _serve(trie, TOKENS, cache_salt="a") == 0
    assert _serve(trie, TOKENS) == 0
    assert _serve(trie, TOKENS, cache_salt="b") == 0
    assert _serve(trie, TOKENS, cache_salt="a") == 12
    assert _serve(trie, TOKENS, cache_salt="") == 12  # "" is no salt, as in vLLM
    assert _serve(trie, TOKENS, cache_salt=None) == 12
    trie.check()


def test_a_bad_salt_is_refused_before_anything_changes() -> None:
    trie = _trie()
    before = trie.snapshot()
    with pytest.raises(InvalidType, match="cache_salt"):
        trie.match(TOKENS, cache_salt=b"x")  # type: ignore[arg-type]
    assert trie.snapshot() == before

    class Salt(str):
        pass

    with pytest.raises(InvalidType, match="exactly"):  # [R57]: its __hash__ would run
        trie.match(TOKENS, cache_salt=Salt("x"))
    with pytest.raises(InvalidArgument, match="cache_salt"):  # events encode it as UTF-8
        trie.match(TOKENS, cache_salt="\ud800")
    assert trie.snapshot() == before
    with pytest.raises(TypeError):
        trie.match(TOKENS, "", None, "salt")  # type: ignore[misc]  # keyword-only


def test_bind_lora_puts_the_id_on_every_event_of_its_namespace() -> None:
    trie = _trie(num_checkpoint_slots=2, state_shapes={"s": (2,)})
    trie.bind_lora("adapter-a", 7)
    seq = trie.match(TOKENS, namespace="adapter-a")
    trie.allocate(seq, len(TOKENS))
    trie.commit(seq, len(TOKENS))
    trie.save(seq, 8, {"s": torch.zeros(2)})
    trie.release(seq)
    other = trie.match(TOKENS)
    trie.allocate(other, len(TOKENS))
    trie.commit(other, len(TOKENS))
    trie.release(other)
    events = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    assert {(e.namespace, e.lora_id) for e in events} == {("adapter-a", 7), ("", None)}
    assert any(e.group_idx == 1 and e.lora_id == 7 for e in events)  # the checkpoint's
    trie.bind_lora("adapter-a", None)
    seq = trie.match([*TOKENS, 1, 2, 3], namespace="adapter-a")
    trie.allocate(seq, 16)
    trie.commit(seq, 16)
    trie.release(seq)
    assert [e.lora_id for e in trie.drain_events() if isinstance(e, BlockStored)] == [None]


def test_bind_lora_id_reaches_the_wire() -> None:
    pytest.importorskip("msgspec")
    import msgspec

    from cache.kv_events import encode_batch

    trie = _trie(block_hash="xxh3")
    trie.bind_lora("adapter-a", 3)
    _serve(trie, TOKENS, namespace="adapter-a")
    for records in (trie.drain_event_records(),):  # the unbuilt path a publisher takes
        batch = msgspec.msgpack.decode(encode_batch(records, ts=0.0))
        stored = batch[1][0]
        assert stored["type"] == "BlockStored"
        assert (stored["lora_id"], stored["lora_name"]) == (3, "adapter-a")


@pytest.mark.parametrize(
    ("namespace", "lora_id", "error"),
    [(1, 1, InvalidType), ("a", "1", InvalidType), ("a", True, InvalidType),
     ("a", 0, InvalidArgument), ("a", -2, InvalidArgument), ("a", 2**63, InvalidArgument)],
)  # fmt: skip
def test_bind_lora_refuses_bad_arguments(namespace: Any, lora_id: Any, error: type) -> None:
    trie = _trie()
    with pytest.raises(error):
        trie.bind_lora(namespace, lora_id)
