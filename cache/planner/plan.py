"""The planning decisions, as pure functions of the workload count and the options.

- `never_evict_capacity`: the pool size at which a replay never evicts.
- `plan_runs`: which (capacity, checkpoint policy, state budget) replays to run.
- `recommend`: the cheapest runs within 1 point / 99 % of the unbounded hit rate, or
  that no run reaches the ceiling.

Nothing here touches a cache, a terminal or a file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.planner.policy import KV
from cache.planner.replay import ReplayResult
from cache.planner.workload import PrefixCount

__all__ = ["Recommendation", "Run", "never_evict_capacity", "plan_runs", "recommend"]


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


@dataclass(frozen=True)
class Recommendation:
    """The cheapest runs near the ceiling (indices into the results; None when none is).

    - `within_1_point`: hit rate >= ceiling - 1 percentage point.
    - `within_99_percent`: hit rate >= 99 % of the ceiling.
    - `among`: the runs considered: ``"ssm"`` (every checkpoint-policy run) when the
      replay has any, since a hybrid model gets only those hit rates, else ``"kv"``.
    - `ceiling`: what "near" is measured against: the unbounded attention-only hit
      rate for ``"kv"``; for ``"ssm"`` the best hit rate any SSM run reached (a hybrid
      model cannot reach the attention-only ceiling: hits end at checkpoints).
    - `reached`: whether some run reaches the ceiling, so that "near" means what it
      says. Attention-only: a run is within 1 point of the unbounded hit rate. SSM: an
      SSM run evicted no KV block (a larger pool cannot raise its hit rate), or is within
      1 point of the attention-only ceiling (which no SSM run passes). When none is, the
      best SSM hit rate is only where the sweep stopped: both picks are None.
    - `best`: the run with the highest hit rate among those considered (the cheapest of
      them on a tie); None when there is no run.
    """

    within_1_point: int | None
    within_99_percent: int | None
    among: str
    ceiling: float
    reached: bool = True
    best: int | None = None


def recommend(
    results: Sequence[tuple[Run, ReplayResult]],
    ceiling: float,
    cost: Callable[[Run], float] | None = None,
) -> Recommendation:
    """The cheapest run within 1 point, and within 99 %, of the ceiling, over every run
    of its kind, or none when no run reaches the ceiling (see `Recommendation`).
    `ceiling` is the unbounded attention-only hit rate; with SSM runs the ceiling is the
    best SSM hit rate instead.

    `cost` orders runs (e.g. KV plus state bytes); by default capacity, then state slots.
    Ties go to the earlier run.
    """
    ssm = any(run.policy != KV for run, _ in results)
    among = [i for i, (run, _) in enumerate(results) if (run.policy != KV) == ssm]

    def key(i: int) -> tuple[float, int, int, int]:
        run = results[i][0]
        return (cost(run) if cost is not None else 0.0, run.capacity, run.slots, i)

    def cheapest(threshold: float) -> int | None:
        ok = [i for i in among if results[i][1].hit_rate >= threshold - 1e-12]
        return min(ok, key=key) if ok else None

    kind = "ssm" if ssm else KV
    best = min(among, key=lambda i: (-results[i][1].hit_rate, key(i)), default=None)
    reached = cheapest(ceiling - 0.01) is not None
    if ssm:
        reached = reached or any(results[i][1].evicted_blocks == 0 for i in among)
        ceiling = results[best][1].hit_rate if best is not None else 0.0
    if not reached:
        return Recommendation(None, None, kind, ceiling, False, best)
    return Recommendation(
        cheapest(ceiling - 0.01), cheapest(ceiling * 0.99), kind, ceiling, True, best
    )
