"""The planning decisions, as pure functions of the workload count and the options.

- `never_evict_capacity`: the pool size at which a replay never evicts.
- `plan_runs`: which (capacity, checkpoint policy, state budget) replays to run.
- `recommend`: the capacity to buy, from the results of a sweep.

Nothing here touches a cache, a terminal or a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.planner.policy import KV
from cache.planner.replay import ReplayResult
from cache.planner.workload import PrefixCount

__all__ = ["KV", "Run", "never_evict_capacity", "plan_runs", "recommend"]


@dataclass(frozen=True)
class Run:
    """One replay to run: KV capacity in blocks, policy (`KV` or a checkpoint policy name),
    the state budget as blocks per slot (None when given in slots) and the slot count."""

    capacity: int
    policy: str
    blocks_per_slot: int | None
    slots: int


def never_evict_capacity(
    count: PrefixCount,
    concurrency: int,
    *,
    ssm: bool = False,
    state_slots: int | None = None,
    min_blocks_per_slot: int = 8,
) -> int:
    """KV blocks at which a replay never evicts.

    Every distinct block the workload commits, plus what the live window holds
    privately (``concurrency + 1`` requests of at most ``max_request_blocks + 1``
    blocks). With SSM checkpoints, partial checkpoints freeze a tail block each:
    add one block per state slot (`state_slots`, or one slot per
    `min_blocks_per_slot` blocks).
    """
    blocks = count.unique_blocks + (concurrency + 1) * (count.max_request_blocks + 1)
    if ssm:
        blocks += state_slots or blocks // min_blocks_per_slot
    return blocks


def plan_runs(
    capacities: Sequence[int],
    *,
    ssm: bool = False,
    policies: Sequence[str] = (),
    blocks_per_slot: Sequence[int] = (8,),
    state_slots: int | None = None,
) -> list[Run]:
    """The replays to run, in report order.

    For each capacity: an attention-only run, then (with `ssm`) one run per
    policy and state budget: `state_slots` slots when given, else one slot
    per R blocks for each R in `blocks_per_slot` (at least one slot).
    """
    runs: list[Run] = []
    for cap in capacities:
        runs.append(Run(cap, KV, None, 0))
        if not ssm:
            continue
        budgets: list[tuple[int | None, int]] = (
            [(None, state_slots)]
            if state_slots is not None
            else [(r, max(1, cap // r)) for r in blocks_per_slot]
        )
        for policy in policies:
            for r, slots in budgets:
                runs.append(Run(cap, policy, r, slots))
    return runs


def recommend(results: Sequence[tuple[Run, ReplayResult]], ceiling: float) -> int | None:
    """Smallest swept capacity whose attention-only hit rate is within 1 point of `ceiling`."""
    caps = sorted(
        r.capacity for run, r in results if run.policy == KV and r.hit_rate >= ceiling - 0.01
    )
    return caps[0] if caps else None
