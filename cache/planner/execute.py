"""Running the planned replays: in this process, in worker processes, or on Ray.

Every run is independent (its own cache), so a sweep parallelises by run.
Results come back in run order and are identical whatever the executor,
except the wall-clock fields (``wall_s`` and the rates derived from it).
Worker processes are forked, so they share the loaded workload without
pickling it (the parent has not loaded torch: each worker imports it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cache.planner.plan import Run
from cache.planner.policy import KV, CheckpointPolicy, abbreviate
from cache.planner.replay import ReplayResult, run_replay
from cache.planner.workload import Workload

__all__ = [
    "EXECUTORS",
    "WORKER_START_S",
    "ReplaySettings",
    "available_cores",
    "default_jobs",
    "policy_for",
    "run_all",
]

EXECUTORS = ("process", "ray")


@dataclass(frozen=True)
class ReplaySettings:
    """What every run of a plan shares."""

    block_size: int
    concurrency: int
    max_decode_tokens: int | None = None
    ckpt_interval: int | None = None
    """every-n interval in tokens; None: 2 x R x block size (R = the run's blocks per slot)."""
    chunk_size: int = 2048
    default_blocks_per_slot: int = 8
    check: bool = False
    host_capacity: int = 0
    """Host-tier blocks of every run (0: no host tier)."""


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


WORKER_START_S = 2.0
"""What a worker process costs before its first request: the fork, and importing torch
(1.5-2.5 s measured on the 2-core development machine)."""


def idle_cores() -> int:
    """Cores no other process is using: the cores available minus the 1-minute load
    average (rounded to the nearest core), at least 1."""
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not Unix
        return cores
    return max(1, min(cores, round(cores - load)))


def default_jobs(runs: int, seconds_per_run: float, cores: int | None = None) -> int:
    """`--jobs` when not given: one worker per run on the idle cores (`idle_cores`), when a
    run is long enough to repay a worker's start-up (`seconds_per_run` at least
    2 x `WORKER_START_S`); else 1, replaying here without forking.

    Measured on the 2-core development machine while other jobs ran (load average
    4.6-10.4), interleaved: a 4-run sweep of ``--users 1000`` took 30.9 / 42.7 / 52.1 s
    with ``--jobs 1`` and 44.6 / 36.9 / 58.6 s with ``--jobs 2``; a 6-run ``--ssm`` sweep
    of the built-in workload 11.4 / 13.3 s and 15.5 / 14.7 s (docs/replay.md). Workers
    pay off only with idle cores and runs of several seconds."""
    if runs <= 1 or seconds_per_run < 2 * WORKER_START_S:
        return 1
    return max(1, min(runs, idle_cores() if cores is None else cores))


def policy_for(run: Run, settings: ReplaySettings) -> CheckpointPolicy | None:
    """The checkpoint policy of `run` (None for attention-only). Periodic checkpoints take
    at most half the budget: one per 2R blocks unless --ckpt-interval says otherwise."""
    if run.policy == KV:
        return None
    ratio = run.blocks_per_slot or settings.default_blocks_per_slot
    interval = settings.ckpt_interval or 2 * ratio * settings.block_size
    return CheckpointPolicy.parse(run.policy, interval, settings.chunk_size)


def run_one(
    workload: Workload[Any],
    run: Run,
    settings: ReplaySettings,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `workload` once, as `run` says."""
    return run_replay(
        workload,
        block_size=settings.block_size,
        capacity=run.capacity,
        concurrency=settings.concurrency,
        max_decode_tokens=settings.max_decode_tokens,
        policy=policy_for(run, settings),
        state_slots=run.slots,
        host_capacity=settings.host_capacity,
        progress=progress,
        check=settings.check,
    )


_SHARED: dict[str, Any] = {}  # the workload and progress counters, set before forking workers


def _worker(index: int, run: Run, settings: ReplaySettings) -> ReplayResult:
    progress = None
    if "done" in _SHARED:
        done = _SHARED["done"]

        def progress(n: int) -> None:
            done[index] = n  # this run's slot: one writer, the parent only reads

    return run_one(_SHARED["workload"], run, settings, progress)


def run_all(
    workload: Workload[Any],
    runs: Sequence[Run],
    settings: ReplaySettings,
    *,
    jobs: int = 1,
    executor: str = "process",
    progress: Callable[[int, str], None] | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[ReplayResult]:
    """Every run's result, in run order.

    `jobs` 1 replays here, run after run, calling ``progress(requests done in this run,
    label)``; more replays in `jobs` forked worker processes (``executor="process"``),
    calling ``progress(requests done in all runs together, label)`` four times a second
    (each worker counts its requests in shared memory), or as Ray tasks
    (``executor="ray"``; the ray cluster of ``ray.init()``). Every executor calls
    ``on_done(run index)`` as each run finishes.

    Fork only from a process with no other thread (the `blocktrie` command keeps
    it so): a fork copies the locks other threads hold at that instant into the
    worker still locked, and the worker can hang on one. A caller with threads
    of its own (an engine, a notebook's kernel) should pass ``jobs=1`` or use Ray.
    """
    if jobs < 1:
        raise ValueError("jobs must be >= 1")
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r} (choose from {', '.join(EXECUTORS)})")
    if executor == "ray":
        return _run_ray(workload, runs, settings, on_done)
    import multiprocessing

    forkable = "fork" in multiprocessing.get_all_start_methods()
    if jobs == 1 or len(runs) == 1 or not forkable:  # no fork (Windows): one at a time
        results = []
        for i, run in enumerate(runs):
            label = f"{run.capacity:,} blocks {abbreviate(run.policy)}"
            cb = None if progress is None else (lambda n, label=label: progress(n, label))
            results.append(run_one(workload, run, settings, cb))
            if on_done is not None:
                on_done(i)
        return results
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("fork")
    _SHARED["workload"] = workload
    if progress is not None:
        _SHARED["done"] = context.RawArray("q", len(runs))  # shared with the forks
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context) as pool:
            futures = {pool.submit(_worker, i, run, settings): i for i, run in enumerate(runs)}
            out: dict[int, ReplayResult] = {}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=futures.__getitem__):
                    out[futures[future]] = future.result()
                    if on_done is not None:
                        on_done(futures[future])
                if progress is not None:
                    label = f"{len(out)}/{len(runs)} runs done"
                    progress(sum(_SHARED["done"]), label)
            return [out[i] for i in range(len(runs))]
    finally:
        _SHARED.clear()


def _run_ray(
    workload: Workload[Any],
    runs: Sequence[Run],
    settings: ReplaySettings,
    on_done: Callable[[int], None] | None,
) -> list[ReplayResult]:
    import ray

    if not ray.is_initialized():
        ray.init()
    remote = ray.remote(run_one)
    ref = ray.put(workload)
    pending = [remote.remote(ref, run, settings) for run in runs]
    out: list[ReplayResult] = []
    for i, task in enumerate(pending):
        out.append(ray.get(task))
        if on_done is not None:
            on_done(i)
    return out
