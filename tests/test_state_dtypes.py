"""Per-state dtypes (`CacheConfig.state_dtypes`): conv state in the model dtype, the
recurrent state in float32, as real hybrids keep them (issue 45, item 7)."""

from __future__ import annotations

import pytest
import torch

from cache import BlockTrie, CacheConfig, ConfigError, ManualCopies

SHAPES = {"conv": (3, 4), "ssm": (2, 5)}


def _config(**overrides: object) -> CacheConfig:
    fields: dict[str, object] = dict(
        block_size=2,
        num_blocks=8,
        kv_block_shape=(2,),
        num_checkpoint_slots=2,
        num_host_checkpoint_slots=2,
        state_shapes=SHAPES,
        state_dtypes={"conv": torch.bfloat16},
        state_dtype=torch.float32,
    )
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


def test_each_state_pool_has_its_own_dtype_and_the_rest_the_default() -> None:
    config = _config()
    assert config.state_dtype_of("conv") == torch.bfloat16
    assert config.state_dtype_of("ssm") == torch.float32
    trie = BlockTrie(config)
    for pools in (trie.checkpoint_states, trie.host_checkpoint_states):
        assert pools["conv"].dtype == torch.bfloat16
        assert pools["ssm"].dtype == torch.float32
    assert config.state_bytes_per_slot() == 12 * 2 + 10 * 4


@pytest.mark.parametrize(
    ("dtypes", "message"),
    [
        ({"mamba": torch.float32}, "not a state of state_shapes"),
        ({"conv": "bfloat16"}, r"state_dtypes\['conv'\] must be a torch.dtype"),
        ([("conv", torch.bfloat16)], "must be a mapping"),
    ],
)
def test_bad_state_dtypes_are_refused(dtypes: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(state_dtypes=dtypes)


def test_save_and_restore_keep_each_state_in_its_dtype() -> None:
    """A float32 runtime state round-trips through a bfloat16 conv slot (rounded to
    bfloat16) and a float32 ssm slot (exact), from the device slot and, once the
    device slot is evicted, from the host slot."""
    trie = BlockTrie(_config(), copies=ManualCopies())
    conv = torch.linspace(0.1, 1.3, 12).reshape(3, 4)
    ssm = torch.linspace(-1.0, 1.0, 10, dtype=torch.float64).reshape(2, 5) / 3
    seq = trie.match([1, 2, 3, 4, 5])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.save(seq, 4, {"conv": conv, "ssm": ssm})
    trie.copies.complete_all()  # type: ignore[attr-defined]
    trie.poll()
    trie.release(seq)
    slot = trie.checkpoint_states
    assert slot["conv"].dtype == torch.bfloat16 and slot["ssm"].dtype == torch.float32

    for evict_device_slot in (False, True):
        if evict_device_slot:
            assert trie.evict_checkpoints(1) == 1  # kept in its host slot ([R54])
        again = trie.match([1, 2, 3, 4, 5])
        assert again.num_cached_tokens == 4
        out = {"conv": torch.zeros(3, 4), "ssm": torch.zeros(2, 5, dtype=torch.float64)}
        trie.restore(again, out)
        trie.copies.complete_all()  # type: ignore[attr-defined]
        trie.poll()
        assert torch.equal(out["conv"], conv.to(torch.bfloat16).to(torch.float32))
        assert not torch.equal(out["conv"], conv)  # it was stored in bfloat16
        assert torch.equal(out["ssm"], ssm.to(torch.float32).to(torch.float64))
        trie.release(again)
    trie.check()
