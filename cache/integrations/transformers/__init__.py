"""Serve Hugging Face ``transformers`` hybrid attention + SSM models through blocktrie.

Needs the ``hf`` extra (``pip install 'blocktrie[hf]'``). The worked example
is docs/transformers.md.

- `HFModel` (`adapter`): the model's KV and recurrent-state layout, discovered
  from a probe forward and its cache object; the numerical traps, found by
  probes; moving KV and state between the cache object and blocktrie's
  layout. Every use of ``transformers`` internals is there.
- `HFEngine` (`engine`): a reference engine on the public `cache.BlockTrie`
  API: ``HFEngine(model, block_size=, num_blocks=, num_checkpoint_slots=)``,
  ``.generate(prompt_ids, max_new_tokens=)`` -> `GenerateOutput`
  (``.tokens``, ``.logits``, ``.num_cached_tokens``), ``.trie``.
- `tiny_model` (`tiny`): tiny random-weight models of seven architectures
  for tests and ``blocktrie demo --model``.
"""

from cache.integrations.transformers.adapter import (
    AttentionSlot,
    HFModel,
    ModelLayout,
    StateSlot,
    Traps,
    UnsupportedModel,
)
from cache.integrations.transformers.engine import GenerateOutput, HFEngine, plan_pieces
from cache.integrations.transformers.tiny import TINY_CONFIGS, tiny_model

__all__ = [
    "TINY_CONFIGS",
    "AttentionSlot",
    "GenerateOutput",
    "HFEngine",
    "HFModel",
    "ModelLayout",
    "StateSlot",
    "Traps",
    "UnsupportedModel",
    "plan_pieces",
    "tiny_model",
]
