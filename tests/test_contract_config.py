"""Contract details of `cache.config.CacheConfig` (mutation survivors): pool byte sizes.

The sizes count every element of the configured shapes at the configured dtype
(the trie's out-of-memory message and the capacity planner use them).
"""

from __future__ import annotations

import torch

from cache.config import CacheConfig


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
