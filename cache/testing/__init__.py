"""Test helpers for engines built on blocktrie: a tiny hybrid model and a minimal engine.

This module is shipped and documented (``docs/testing.md``) so that people who
write their own inference engine on top of `cache.BlockTrie` can test it the
same way blocktrie tests itself: run a real (tiny) model through the cache and
check that every output equals a cold run of the same prompt without any cache.

`TinyHybridModel`
    A deterministic hybrid attention + SSM language model. Attention layers
    read and write K/V through a *block table* into a paged KV tensor shaped
    ``[num_blocks, *model.kv_block_shape(block_size)]`` (the layout of
    ``BlockTrie.kv_cache``); SSM layers (a short causal convolution followed by
    a selective diagonal linear recurrence, Mamba style) keep their recurrent
    state in runtime tensors that `TinyHybridModel.forward` updates in place.
    The model depends on nothing but the tokens, their positions, the block
    table and the state: exactly what a paged-attention engine hands a model.

    Exactness contract: every position is computed with tensor operations
    whose shapes depend only on that position (never on how the tokens were
    split into chunks, on the block size, or on which physical blocks the
    block table names). On one device with one dtype, a chunked run therefore
    produces *bit-identical* logits, KV and state to a one-shot run. In
    float64 on CPU, any difference between a cached run and a cold run is a
    real bug, never rounding.

`Engine` (and `run_chat`)
    A minimal scheduler on the public `BlockTrie` API, written the way a real
    engine uses it: match -> restore -> allocate -> chunked prefill (saving
    checkpoints at chunk boundaries) -> commit -> decode with `append` and
    periodic block-aligned saves -> release, several requests interleaved, and
    copies waited on exactly where a real engine would make its compute
    stream wait on the copy event.
"""

from cache.testing.chat import Turn, compare_with_cold, run_chat
from cache.testing.engine import Engine, EngineCapacityError, RequestResult
from cache.testing.model import (
    ColdRun,
    LayerKind,
    TinyHybridConfig,
    TinyHybridModel,
    greedy,
)

__all__ = [
    "ColdRun",
    "Engine",
    "EngineCapacityError",
    "LayerKind",
    "RequestResult",
    "TinyHybridConfig",
    "TinyHybridModel",
    "Turn",
    "compare_with_cold",
    "greedy",
    "run_chat",
]
