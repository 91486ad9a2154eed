"""`blocktrie demo`: a tiny hybrid model serves a short multi-turn chat through the cache.

`run_demo` builds the tiny deterministic hybrid model of `cache.testing`
(attention + SSM layers, float64 on CPU), serves a few multi-turn
conversations that share a system prompt through `cache.testing.Engine` on a
`cache.BlockTrie`, then replays every request cold (no cache) and compares
logits and generated tokens bit for bit. `run_hf_demo` serves the same chat
with a tiny random-weight Hugging Face model (``blocktrie demo --model``,
the ``hf`` extra) through `cache.integrations.transformers.HFEngine`.
`format_demo` renders either result as the lines the CLI prints.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cache import BlockTrie, CacheConfig
from cache.testing import (
    Engine,
    TinyHybridConfig,
    TinyHybridModel,
    Turn,
    compare_with_cold,
    run_chat,
)

__all__ = ["HF_TOLERANCE", "DemoResult", "format_demo", "run_demo", "run_hf_demo"]

_VOCAB = 64
_BLOCK_SIZE = 4
_SYSTEM_TOKENS = 24
_CONVERSATIONS = 3
_TURNS = 3
HF_TOLERANCE = 1e-6
"""Largest logit difference from a cold float64 run that `run_hf_demo` calls identical
(HF's kernels differ by chunking in the last bits; see docs/transformers.md)."""


@dataclass(frozen=True)
class DemoResult:
    """What `run_demo` measured.

    - ``hit_rate``: cached prompt tokens / prompt tokens over every request
      (``trie.stats.hit_rate``).
    - ``tokens_computed``: positions the engine ran through the model.
    - ``tokens_saved``: prompt tokens served from the cache instead
      (``trie.stats.hit_tokens``).
    - ``identical``: every request's logits and generated tokens equal those
      of a cold run of the same prompt without any cache.
    """

    hit_rate: float
    tokens_computed: int
    tokens_saved: int
    identical: bool
    requests: int = 0
    conversations: int = 0
    turns: int = 0
    checkpoint_hits: int = 0
    problems: tuple[str, ...] = ()
    prompt_tokens: int = 0
    """Prompt tokens of every request (``trie.stats.query_tokens``): hit_rate =
    tokens_saved / prompt_tokens."""
    model: str = "tiny hybrid model (attention + SSM)"
    """What served the chat, as the report's first line names it."""
    tolerance: float = 0.0
    """0: logits compared bit for bit; else the largest difference called identical."""
    max_logit_diff: float = 0.0
    """The largest logit difference from a cold run over every request."""
    notes: tuple[str, ...] = ()
    """The numerical traps the engine found in the model and adapted to."""


def _chat(seed: int) -> list[list[Turn]]:
    """Conversations sharing a system prompt; each turn adds a few user tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(_VOCAB) for _ in range(_SYSTEM_TOKENS)]
    conversations: list[list[Turn]] = []
    for _ in range(_CONVERSATIONS):
        turns: list[Turn] = []
        for turn in range(_TURNS):
            user = [rng.randrange(_VOCAB) for _ in range(rng.randint(3, 8))]
            turns.append(((system + user) if turn == 0 else user, rng.randint(4, 8)))
        conversations.append(turns)
    return conversations


def run_demo(seed: int = 0) -> DemoResult:
    """Serve the demo chat (deterministic in ``seed``) and compare with cold runs.

    Takes well under a second on a CPU. Never raises on a mismatch: it is
    reported as ``identical=False`` with the differences in ``problems``.
    """
    model = TinyHybridModel(TinyHybridConfig(vocab_size=_VOCAB, seed=seed))
    config: CacheConfig = model.cache_config(
        block_size=_BLOCK_SIZE, num_blocks=96, num_checkpoint_slots=16
    )
    trie = BlockTrie(config)
    engine = Engine(model, trie, max_running=2, chunk_size=6, save_on_finish=True, seed=seed)
    results = run_chat(engine, _chat(seed))
    engine.drain()
    problems = tuple(p for conv in results for r in conv for p in compare_with_cold(model, r))
    stats = trie.stats
    return DemoResult(
        hit_rate=stats.hit_rate,
        tokens_computed=engine.tokens_computed,
        tokens_saved=stats.hit_tokens,
        identical=not problems,
        requests=sum(len(conv) for conv in results),
        conversations=len(results),
        turns=_TURNS,
        checkpoint_hits=stats.checkpoint_hits,
        problems=problems,
        prompt_tokens=stats.query_tokens,
    )


def run_hf_demo(model: str, seed: int = 0) -> DemoResult:
    """Serve the demo chat with the tiny random-weight Hugging Face model ``model`` (a
    key of `cache.integrations.transformers.TINY_CONFIGS`) through `HFEngine`.

    Every request is compared with a cold run: its tokens with
    ``model.generate(..., do_sample=False)``, its logits with one float64 forward
    over the whole sequence, within `HF_TOLERANCE`. Needs the ``hf`` extra.
    """
    import transformers

    from cache.integrations.transformers import HFEngine, compare_with_cold, tiny_model

    hf_model = tiny_model(model, seed=seed)
    engine = HFEngine(
        hf_model,
        block_size=_BLOCK_SIZE,
        num_blocks=96,
        num_checkpoint_slots=16,
        checkpoint_interval=2,
        check=True,
    )
    conversations = _chat(seed)
    histories: list[list[int]] = [[] for _ in conversations]
    problems: list[str] = []
    max_diff = 0.0
    requests = 0
    for turn in range(_TURNS):  # the conversations' turns interleave
        for ci, conv in enumerate(conversations):
            user, max_new = conv[turn]
            prompt = histories[ci] + list(user)
            out = engine.generate(prompt, max_new_tokens=max_new)
            cold = compare_with_cold(hf_model, prompt, out, max_new)
            max_diff = max(max_diff, cold.max_logit_diff)
            if not cold.identical(HF_TOLERANCE):
                problems.append(
                    f"request {requests}: tokens {out.tokens}, cold {cold.cold_tokens}; max "
                    f"logit diff {cold.max_logit_diff:.3g} (cache hit {out.num_cached_tokens})"
                )
            histories[ci] = prompt + out.tokens
            requests += 1
    stats = engine.trie.stats
    return DemoResult(
        hit_rate=stats.hit_rate,
        tokens_computed=engine.tokens_computed,
        tokens_saved=stats.hit_tokens,
        identical=not problems,
        requests=requests,
        conversations=len(conversations),
        turns=_TURNS,
        checkpoint_hits=stats.checkpoint_hits,
        problems=tuple(problems),
        prompt_tokens=stats.query_tokens,
        model=(
            f"tiny random {model} ({type(hf_model).__name__}, float64, transformers "
            f"{transformers.__version__})"
        ),
        tolerance=HF_TOLERANCE,
        max_logit_diff=max_diff,
        notes=tuple(engine.traps.notes()),
    )


def format_demo(result: DemoResult) -> str:
    """The demo's report, one fact per line (no trailing newline)."""
    if result.tolerance:
        how = (
            f" (tokens equal model.generate's; logits within {result.tolerance:g} of a cold "
            f"float64 forward, max diff {result.max_logit_diff:.2g})"
        )
    else:
        how = ""
    lines = [
        f"{result.model}, {result.conversations} chats x "
        f"{result.turns} turns = {result.requests} requests",
        *(f"trap found and avoided: {note}" for note in result.notes),
        f"hit rate: {result.hit_rate:.1%} of prompt tokens served from cache "
        f"({result.tokens_saved} / {result.prompt_tokens}; "
        f"{result.checkpoint_hits} checkpoint hits)",
        f"tokens saved: {result.tokens_saved} (prompt tokens not recomputed)",
        f"tokens computed: {result.tokens_computed} (prefill and decode positions run "
        "through the model)",
        f"outputs identical to cold runs: {'yes' if result.identical else 'no'}{how}",
    ]
    lines.extend(f"  {p}" for p in result.problems[:10])
    return "\n".join(lines)
