"""Multi-turn chat workloads through an `Engine`, and the comparison with cold runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.testing.engine import Engine, RequestResult
from cache.testing.model import ColdRun, TinyHybridModel

Turn = tuple[Sequence[int], int]
"""One chat turn: (new user tokens, max_new_tokens)."""


def run_chat(
    engine: Engine,
    conversations: Sequence[Sequence[Turn]],
    namespace: str | Sequence[str] = "",
    max_steps: int = 100_000,
) -> list[list[RequestResult]]:
    """Serve multi-turn conversations through ``engine``; returns each one's turn results.

    Turn ``k`` of a conversation is a request whose prompt is turn ``k - 1``'s
    ``prompt + generated`` followed by turn ``k``'s user tokens (turn 0: just
    its user tokens). Every conversation's first turn is submitted at once;
    each next turn is submitted when the previous one finishes, so turns of
    different conversations interleave in the engine. ``namespace`` is one
    cache namespace for all, or one per conversation.
    """
    if isinstance(namespace, str):
        namespaces = [namespace] * len(conversations)
    else:
        namespaces = list(namespace)
        if len(namespaces) != len(conversations):
            raise ValueError(
                f"run_chat: {len(namespaces)} namespaces for {len(conversations)} conversations"
            )
    for conv in conversations:
        if not conv:
            raise ValueError("run_chat: a conversation needs at least one turn")
        if not list(conv[0][0]):
            raise ValueError("run_chat: the first turn needs user tokens")
    out: list[list[RequestResult]] = [[] for _ in conversations]
    owner: dict[int, int] = {}

    def submit(ci: int) -> None:
        turn = len(out[ci])
        user, max_new = conversations[ci][turn]
        prev = out[ci][-1].tokens if out[ci] else []
        rid = engine.submit(prev + list(user), max_new, namespaces[ci])
        owner[rid] = ci

    for ci in range(len(conversations)):
        submit(ci)
    for _ in range(max_steps):
        if not engine.has_work:
            return out
        for result in engine.step():
            index = owner.get(result.request_id)
            if index is None:
                continue
            out[index].append(result)
            if len(out[index]) < len(conversations[index]):
                submit(index)
    raise RuntimeError(f"run_chat: still busy after {max_steps} steps")


def compare_with_cold(
    model: TinyHybridModel,
    result: RequestResult,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    cold: ColdRun | None = None,
) -> list[str]:
    """Differences between a served request and a cold run of its prompt; [] when identical.

    The cold run is ``model.cold_run(result.prompt, result.max_new_tokens)``
    (pass ``cold`` to reuse one). Checks that the generated tokens are equal
    and that every logits row the engine computed equals the cold run's row at
    the same position: exactly with the default ``atol = rtol = 0`` (float64
    on CPU), else within ``torch.allclose(atol, rtol)``. With a tolerance, a
    generated token may differ only where the cold run's top two logits are
    within tolerance of each other (a near tie); the comparison then stops at
    that position, since the two runs continue from different tokens.
    """
    if cold is None:
        cold = model.cold_run(result.prompt, result.max_new_tokens)
    problems: list[str] = []
    exact = atol == 0.0 and rtol == 0.0
    prompt_len = len(result.prompt)
    limit = prompt_len + len(result.generated) - 1  # comparable positions: < limit
    if not result.finished:
        problems.append(f"request {result.request_id} did not finish")
    for i, (got, want) in enumerate(zip(result.generated, cold.generated, strict=False)):
        if got == want:
            continue
        row = cold.generation_logits[i]
        top2 = torch.topk(row, 2).values if row.numel() >= 2 else row
        gap = float(top2[0] - top2[-1])
        bound = atol + rtol * float(top2[0].abs())
        if exact or gap > bound:
            problems.append(
                f"request {result.request_id}: generated token {i} is {got}, cold run gives "
                f"{want} (top-2 gap {gap:.3g})"
            )
        limit = prompt_len + i
        break
    if len(result.generated) != len(cold.generated) and result.finished:
        problems.append(
            f"request {result.request_id}: generated {len(result.generated)} tokens, "
            f"cold run {len(cold.generated)}"
        )
    for start, logits in result.chunks:
        stop = min(start + logits.shape[0], limit)
        if stop <= start:
            continue
        got_rows = logits[: stop - start].to(cold.logits.device)
        want_rows = cold.logits[start:stop]
        same = (
            torch.equal(got_rows, want_rows)
            if exact
            else torch.allclose(got_rows, want_rows, atol=atol, rtol=rtol)
        )
        if not same:
            diff = (got_rows - want_rows).abs().max().item()
            bad = int((got_rows != want_rows).any(dim=-1).nonzero()[0].item()) + start
            problems.append(
                f"request {result.request_id}: logits at positions {start}..{stop - 1} differ "
                f"from the cold run (first at position {bad}, max |diff| {diff:.3g}; "
                f"cache hit was {result.num_cached_tokens} tokens)"
            )
    return problems
