"""Contract details of `cache.config.CacheConfig` (mutation survivors).

Pool byte sizes count every element of the configured shapes at the configured
dtype (the trie's out-of-memory message and the capacity planner use them).
Every refused field raises `ConfigError` with a message that names the field
and the value ([R1]); every limit is inclusive of the largest legal value; the
shapes kept are tuples, whatever sequence was given.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from cache.config import MAX_POOL_ENTRIES, CacheConfig, HostTierUnusedWarning
from spec.errors import ConfigError


def test_kv_bytes_per_block_is_elements_times_the_kv_dtype_size() -> None:
    assert CacheConfig(block_size=4, num_blocks=2).kv_bytes_per_block() == 0
    config = CacheConfig(block_size=4, num_blocks=2, kv_block_shape=(2, 3))
    assert config.kv_bytes_per_block() == 2 * 3 * 2  # float16 by default
    wide = CacheConfig(block_size=4, num_blocks=2, kv_block_shape=(5,), kv_dtype=torch.float64)
    assert wide.kv_bytes_per_block() == 40


def test_state_bytes_per_slot_sums_every_named_state() -> None:
    assert CacheConfig(block_size=4, num_blocks=2).state_bytes_per_slot() == 0
    config = CacheConfig(
        block_size=4,
        num_blocks=2,
        num_checkpoint_slots=1,
        state_shapes={"conv": (2,), "ssm": (3, 4)},
        state_dtype=torch.float64,
    )
    assert config.state_bytes_per_slot() == (2 + 12) * 8
    narrow = CacheConfig(
        block_size=4,
        num_blocks=2,
        num_checkpoint_slots=1,
        state_shapes={"ssm": (3,)},
        state_dtype=torch.int8,
    )
    assert narrow.state_bytes_per_slot() == 3


def _config(**overrides: Any) -> CacheConfig:
    fields: dict[str, Any] = {"block_size": 4, "num_blocks": 8}
    fields.update(overrides)
    return CacheConfig(**fields)


BAD = [
    ({"block_size": 4.0}, "CacheConfig.block_size must be an int, got float"),
    ({"block_size": True}, "CacheConfig.block_size must be an int, got bool"),
    ({"block_size": 0}, "CacheConfig.block_size must be > 0, got 0"),
    ({"block_size": -3}, "CacheConfig.block_size must be > 0, got -3"),
    ({"num_blocks": "8"}, "CacheConfig.num_blocks must be an int, got str"),
    ({"num_blocks": 0}, "CacheConfig.num_blocks must be > 0, got 0"),
    (
        {"num_blocks": MAX_POOL_ENTRIES + 1},
        f"CacheConfig.num_blocks must be <= {MAX_POOL_ENTRIES}, got {MAX_POOL_ENTRIES + 1}",
    ),
    (
        {"num_checkpoint_slots": None},
        "CacheConfig.num_checkpoint_slots must be an int, got NoneType",
    ),
    ({"num_checkpoint_slots": -1}, "CacheConfig.num_checkpoint_slots must be >= 0, got -1"),
    (
        {"num_checkpoint_slots": MAX_POOL_ENTRIES + 1},
        f"CacheConfig.num_checkpoint_slots must be <= {MAX_POOL_ENTRIES}, "
        f"got {MAX_POOL_ENTRIES + 1}",
    ),
    (
        {"num_host_blocks": MAX_POOL_ENTRIES + 1},
        f"CacheConfig.num_host_blocks must be <= {MAX_POOL_ENTRIES}, got {MAX_POOL_ENTRIES + 1}",
    ),
    (
        {"kv_block_shape": (2, 0)},
        "CacheConfig.kv_block_shape must be a tuple of positive ints, got (2, 0)",
    ),
    (
        {"kv_block_shape": "22"},
        "CacheConfig.kv_block_shape must be a tuple of positive ints, got '22'",
    ),
    (
        {"kv_block_shape": (2.0,)},
        "CacheConfig.kv_block_shape must be a tuple of positive ints, got (2.0,)",
    ),
    (
        {"state_shapes": [("ssm", (1,))]},
        "CacheConfig.state_shapes must be a mapping of name -> shape",
    ),
    ({"state_shapes": {"": (1,)}}, "CacheConfig.state_shapes: state name '' is not a str"),
    ({"state_shapes": {1: (1,)}}, "CacheConfig.state_shapes: state name 1 is not a str"),
    (
        {"state_shapes": {"ssm": (1, -1)}},
        "CacheConfig.state_shapes['ssm'] must be a tuple of positive ints, got (1, -1)",
    ),
    (
        {"num_blocks": 2, "kv_block_shape": (2**62,)},
        f"CacheConfig.kv_block_shape: 2 x ({2**62},) elements do not fit in one tensor",
    ),
    (
        {"num_host_blocks": MAX_POOL_ENTRIES, "kv_block_shape": (2**33,)},
        f"CacheConfig.kv_block_shape: {MAX_POOL_ENTRIES} x ({2**33},) elements do not fit "
        "in one tensor",
    ),
    (
        {"num_checkpoint_slots": 4, "state_shapes": {"conv": (1,), "ssm": (2**61, 1)}},
        f"CacheConfig.state_shapes['ssm']: 4 x ({2**61}, 1) elements do not fit in one tensor",
    ),
    ({"kv_dtype": "float16"}, "CacheConfig.kv_dtype must be a torch.dtype"),
    ({"state_dtype": None}, "CacheConfig.state_dtype must be a torch.dtype"),
    ({"key_hash": 5}, "CacheConfig.key_hash must be callable or None"),
    ({"enable_events": "no"}, "CacheConfig.enable_events must be a bool, got 'no'"),
    ({"enable_events": 1}, "CacheConfig.enable_events must be a bool, got 1"),
    ({"hash_seed": -1}, "CacheConfig.hash_seed must be an int in [0, 2**64), got -1"),
    ({"hash_seed": 2**64}, f"CacheConfig.hash_seed must be an int in [0, 2**64), got {2**64}"),
    ({"hash_seed": 1.0}, "CacheConfig.hash_seed must be an int in [0, 2**64), got 1.0"),
    ({"hash_seed": True}, "CacheConfig.hash_seed must be an int in [0, 2**64), got True"),
    (
        {"num_host_checkpoint_slots": 2},
        "CacheConfig.num_host_checkpoint_slots needs num_checkpoint_slots > 0: host "
        "checkpoints are stored from device checkpoints",
    ),
    (
        {"host_write": "around"},
        "CacheConfig.host_write must be one of ('through', 'back'), got 'around'",
    ),
    (
        {"num_host_blocks": 4, "host_write": "back", "num_checkpoint_slots": 1},
        "CacheConfig.host_write='back' needs num_checkpoint_slots=0: a checkpoint's "
        "frozen tail needs a block at once, and write-back frees blocks only when "
        "their stores finish (use 'through' with SSM checkpoints)",
    ),
    (
        {"block_hash": "md5"},
        "CacheConfig.block_hash must be one of ('xxh3', 'vllm'), got 'md5'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[m for _, m in BAD])
def test_a_bad_field_is_refused_with_a_message_naming_it(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _config(**overrides)


def test_a_device_that_is_not_one_is_refused_with_torchs_reason() -> None:
    with pytest.raises(ConfigError) as info:
        _config(device="nonsense")
    message = str(info.value)
    assert message.startswith("CacheConfig.device 'nonsense' is not a device: ")
    assert "at start of device string: nonsense" in message  # torch's own reason
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(ConfigError, match=r"^CacheConfig\.device None is not a device: "):
        _config(device=None)  # torch raises TypeError here


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_on_a_host_without_it_is_refused_at_once() -> None:
    for device in ("cuda", torch.device("cuda", 1)):
        with pytest.raises(ConfigError, match=r"^CacheConfig\.device .*: CUDA is not available$"):
            _config(device=device)


def test_values_at_every_limit_are_accepted() -> None:
    top = _config(num_blocks=MAX_POOL_ENTRIES, num_checkpoint_slots=MAX_POOL_ENTRIES)
    assert (top.num_blocks, top.num_checkpoint_slots) == (MAX_POOL_ENTRIES, MAX_POOL_ENTRIES)
    assert _config(block_size=1, num_blocks=1).num_blocks == 1
    assert not _config(num_checkpoint_slots=0).ssm
    assert _config(num_checkpoint_slots=1).ssm
    assert _config(hash_seed=0).hash_seed == 0
    assert _config(hash_seed=2**64 - 1).hash_seed == 2**64 - 1
    assert _config(block_hash="vllm").block_hash == "vllm"
    assert _config(enable_events=True).enable_events is True
    assert _config(device=torch.device("cpu")).device == torch.device("cpu")
    # The largest pool that fits one tensor: entries x elements == 2**63 - 1.
    assert _config(num_blocks=1, kv_block_shape=(2**63 - 1,)).kv_block_shape == (2**63 - 1,)
    big = _config(num_checkpoint_slots=7, state_shapes={"ssm": (7, 73, 127, 337, 92737, 649657)})
    assert big.state_shapes == {"ssm": (7, 73, 127, 337, 92737, 649657)}


def test_shapes_are_normalised_to_tuples_in_a_plain_dict() -> None:
    states = {"conv": [2, 3], "ssm": (4,)}
    config = _config(kv_block_shape=[4, 2], num_checkpoint_slots=1, state_shapes=states)
    assert config.kv_block_shape == (4, 2)
    assert type(config.kv_block_shape) is tuple
    assert config.state_shapes == {"conv": (2, 3), "ssm": (4,)}
    assert all(type(shape) is tuple for shape in config.state_shapes.values())
    assert type(config.state_shapes) is dict
    assert states == {"conv": [2, 3], "ssm": (4,)}, "the caller's mapping is left alone"


def test_a_cuda_index_must_name_an_existing_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a (simulated) host with 2 GPUs: "cuda", "cuda:0" and "cuda:1" pass, "cuda:2"
    does not. The config builds no tensor, so no GPU is needed to check this."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("cuda", "cuda:0", "cuda:1", torch.device("cuda", 1)):
        assert _config(device=device).device == device
    message = "CacheConfig.device 'cuda:2': only 2 CUDA device(s)"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _config(device="cuda:2")


HOST_TIER_UNUSED = (
    "CacheConfig: num_host_blocks > 0 with SSM checkpoints "
    "(num_checkpoint_slots > 0) stores KV to the host but never serves it: an SSM "
    "hit ends at a checkpoint, and a block offloaded to the host loses its "
    "checkpoint. Set num_host_blocks=0; num_host_checkpoint_slots keeps "
    "checkpoints in host memory"
)


def test_one_host_block_with_one_checkpoint_slot_warns_the_host_tier_is_unused() -> None:
    """The warning's whole text, from the smallest configuration that earns it."""
    with pytest.warns(HostTierUnusedWarning) as caught:
        _config(num_host_blocks=1, num_checkpoint_slots=1)
    assert [str(w.message) for w in caught] == [HOST_TIER_UNUSED]
