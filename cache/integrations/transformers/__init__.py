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
- `compare_with_cold` (`cold`): a served request against ``model.generate``
  and a cold forward.
- `tiny_model` (`tiny`): tiny random-weight models of seven architectures
  for tests and ``blocktrie demo --model``.

Names load on first use, so importing `tiny` (for its config table) costs
neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cache.integrations.transformers.adapter import (
        AttentionSlot,
        HFModel,
        ModelLayout,
        StateSlot,
        Traps,
        UnsupportedModel,
    )
    from cache.integrations.transformers.cold import ColdComparison, compare_with_cold
    from cache.integrations.transformers.engine import GenerateOutput, HFEngine, plan_pieces
    from cache.integrations.transformers.tiny import TINY_CONFIGS, random_model, tiny_model

_HOME: dict[str, str] = {
    **dict.fromkeys(
        ("AttentionSlot", "HFModel", "ModelLayout", "StateSlot", "Traps", "UnsupportedModel"),
        "adapter",
    ),
    **dict.fromkeys(("ColdComparison", "compare_with_cold"), "cold"),
    **dict.fromkeys(("GenerateOutput", "HFEngine", "plan_pieces"), "engine"),
    **dict.fromkeys(("TINY_CONFIGS", "random_model", "tiny_model"), "tiny"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "TINY_CONFIGS",
    "AttentionSlot",
    "ColdComparison",
    "GenerateOutput",
    "HFEngine",
    "HFModel",
    "ModelLayout",
    "StateSlot",
    "Traps",
    "UnsupportedModel",
    "compare_with_cold",
    "plan_pieces",
    "random_model",
    "tiny_model",
]
