"""Compare an `HFEngine` result with a cold run of the same prompt, with no blocktrie."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cache.integrations.transformers.engine import GenerateOutput

__all__ = ["ColdComparison", "compare_with_cold"]


@dataclass(frozen=True)
class ColdComparison:
    """How one served request compares with a cold run.

    - ``cold_tokens``: ``model.generate(prompt, max_new_tokens, do_sample=False)``'s
      new tokens (greedy, the model's own cache, no blocktrie).
    - ``max_logit_diff``: the largest ``|served - cold|`` over every logit row,
      the cold rows from one forward over ``prompt + tokens[:-1]`` with no
      cache at all (in the model's dtype: float64 for the tiny models).
    """

    tokens: list[int]
    cold_tokens: list[int]
    max_logit_diff: float

    @property
    def tokens_equal(self) -> bool:
        """Whether the served tokens are exactly the cold run's."""
        return self.tokens == self.cold_tokens

    def identical(self, tolerance: float) -> bool:
        """Tokens equal and every logit within ``tolerance``."""
        return self.tokens_equal and self.max_logit_diff <= tolerance


def compare_with_cold(
    model: Any, prompt: Sequence[int], out: GenerateOutput, max_new_tokens: int
) -> ColdComparison:
    """Run ``prompt`` cold through ``model`` and compare with the served ``out``."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        cold_tokens = [int(t) for t in generated[0, len(prompt) :].tolist()]
        full = torch.tensor([list(prompt) + out.tokens[:-1]], dtype=torch.long, device=device)
        logits = model(input_ids=full, use_cache=False).logits[0, len(prompt) - 1 :]
    diff = float((out.logits.to(logits.device) - logits).abs().max())
    return ColdComparison(list(out.tokens), cold_tokens, diff)
