"""The memory and time a replay will take, estimated before anything runs, and the
memory the machine has for it.

A workload with too many sessions, turns or tokens used to run for minutes and
then be killed by the kernel's OOM killer, with no message. `blocktrie replay`
now estimates the peak resident memory and the wall time of the whole command
from a `WorkloadShape` (what the built-in workload's parameters imply, before a
token is drawn: `synthetic_shape`; or a loaded trace's request lengths and file size:
`trace_shape`) and the planned runs, and refuses what will not fit in
`available_memory` (``--max-memory`` overrides it).

The model, phase by phase (each constant measured on the 2-core shared
development machine, CPython 3.11, block size 16; ``bench/planner_estimate.py``
compares the whole model with measured commands):

- start-up: 16 MiB (the interpreter and the planner's modules); the replay
  imports torch, 220 MiB, once per process that replays.
- the workload: 40 bytes per token the built-in generator draws (a 32-byte int
  object and the pointer to it), 8 bytes per token a session copies from its
  shared system prompt, lists 12.5 % over-allocated, 170 bytes per request
  (its record and lengths); a trace: 10 bytes per byte of the file.
  Measured: 116 MiB for ``--users 1000`` (4.24M tokens), estimated 135 MiB.
- the independent count: 70 bytes per distinct block (`count_prefix_hits`'s
  columns) plus 26 bytes per token of the longest request (its token list,
  packed copy and block keys), given back before the replay.
- each replay (each worker process with ``--jobs``): 116 bytes per KV block of
  its capacity and 56 per checkpoint slot (an empty ids-only cache: measured
  113.7-115.9 bytes per block at 1M and 4M blocks, +55 per slot), plus 18 bytes
  per token of the longest request for each of the ``--concurrency`` + 1 live
  requests; a forked worker also ends up with its own copy of the workload
  (reference counts touch every page).
- time: 0.2 us per drawn token to generate, 0.04 us per prompt or decoded
  token to count (25-28M tokens/s measured), 0.08 us per token to replay
  attention-only and 0.16 us with SSM checkpoints (12-15M tokens/s measured
  attention-only; SSM runs replayed half as many requests a second), 2 s to
  start each process that imports torch.

Distinct blocks are estimated from above (every token drawn or read, over the
block size, plus one partial block per request), so the estimate errs on the
large side: 1.01-1.50x the measured peak on the calibration runs of
``bench/planner_estimate.py`` (``--users 1000``: 393 MiB estimated, 363 MiB
measured; ``--turns 40``: 357 / 353; ``--jobs 2``: 875 / 624; the Mooncake
conversation trace: 1,398 / 934). It is a guard against orders of magnitude,
not a forecast to the megabyte. Time is rougher: the constants above were
measured at a load average of about 4 on 2 cores; at 10 every command took
2.5-6x the estimate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cache.planner.plan import Run
from cache.planner.policy import KV
from cache.planner.workload import SyntheticParams, Workload

__all__ = [
    "Estimate",
    "WorkloadShape",
    "available_memory",
    "estimate",
    "file_shape",
    "synthetic_shape",
    "trace_shape",
]

MiB = 2**20
START_BYTES = 16 * MiB
TORCH_BYTES = 220 * MiB
DRAWN_TOKEN_BYTES = 40
SHARED_TOKEN_BYTES = 8
LIST_SLACK = 1.125
REQUEST_BYTES = 170
TRACE_FILE_FACTOR = 10
COUNT_BLOCK_BYTES = 70
COUNT_TOKEN_BYTES = 26
CACHE_BLOCK_BYTES = 116
CACHE_SLOT_BYTES = 56
LIVE_TOKEN_BYTES = 18
GENERATE_S_PER_TOKEN = 0.2e-6
COUNT_S_PER_TOKEN = 0.04e-6
REPLAY_S_PER_TOKEN = 0.08e-6
SSM_REPLAY_S_PER_TOKEN = 0.16e-6
PROCESS_START_S = 2.0


@dataclass(frozen=True)
class WorkloadShape:
    """What the memory and time of a replay depend on (token counts may be estimates)."""

    requests: int
    prompt_tokens: int
    decode_tokens: int
    """Output tokens decoded (after ``--max-decode-tokens``)."""
    longest_tokens: int
    """Prompt plus decoded tokens of the longest request."""
    distinct_blocks: int
    """Distinct full blocks, estimated from above."""
    workload_bytes: int
    """Memory the loaded workload holds."""
    drawn_tokens: int = 0
    """Tokens the built-in generator draws (0 for a loaded workload)."""


def _capped(mean: int, cap: int | None) -> int:
    return mean if cap is None else min(mean, cap)


def synthetic_shape(
    p: SyntheticParams, block_size: int, max_decode_tokens: int | None = None
) -> WorkloadShape:
    """The shape `synthetic_workload(p)` will have, from its parameters alone (means:
    each length is drawn uniformly in [mean/2, 3 mean/2]; the longest request takes
    the longest system prompt, 3/2 of the mean). Arithmetic only: instant at any size."""
    a, c, turns, users = p.agentic, p.tool_calls, p.turns, p.users
    step = p.tool_call_tokens + p.tool_result_tokens
    chat_turn = p.user_tokens + p.output_tokens
    agent_turn = p.user_tokens + c * step + p.output_tokens
    mean_turn = (1 - a) * chat_turn + a * agent_turn
    per_session = turns * mean_turn
    tri = turns * (turns - 1) / 2
    chat_prompts = turns * (p.system_tokens + p.user_tokens) + chat_turn * tri
    agent_prompts = (c + 1) * (turns * (p.system_tokens + p.user_tokens) + agent_turn * tri)
    agent_prompts += turns * step * c * (c + 1) / 2
    requests = math.ceil(users * turns * (1 + a * c))
    prompt_tokens = users * ((1 - a) * chat_prompts + a * agent_prompts)
    out = _capped(p.output_tokens, max_decode_tokens)
    call = _capped(p.tool_call_tokens, max_decode_tokens)
    decode_tokens = users * turns * (out + a * c * call)
    drawn = p.system_prompts * p.system_tokens + users * per_session
    longest = 1.5 * p.system_tokens + turns * (agent_turn if a > 0 else chat_turn)
    memory = (drawn * DRAWN_TOKEN_BYTES + users * p.system_tokens * SHARED_TOKEN_BYTES) * LIST_SLACK
    return WorkloadShape(
        requests=requests,
        prompt_tokens=math.ceil(prompt_tokens),
        decode_tokens=math.ceil(decode_tokens),
        longest_tokens=math.ceil(longest),
        distinct_blocks=math.ceil(drawn / block_size) + requests,
        workload_bytes=math.ceil(memory) + requests * REQUEST_BYTES,
        drawn_tokens=math.ceil(drawn),
    )


def file_shape(file_bytes: int) -> WorkloadShape:
    """What is known of a trace before it is read: its file's size (a lower bound on
    the rest, to refuse a file too big to load before loading it)."""
    return WorkloadShape(0, 0, 0, 0, 0, file_bytes * TRACE_FILE_FACTOR)


def trace_shape(
    workload: Workload[object],
    block_size: int,
    max_decode_tokens: int | None = None,
    file_bytes: int = 0,
) -> WorkloadShape:
    """The shape of a loaded trace, from its request lengths (exact token counts;
    distinct blocks bounded by every token over the block size, plus a partial block
    per request) and the size of its file (`file_bytes`)."""
    decoded = [_capped(n, max_decode_tokens) for n in workload.output_lengths]
    longest = max((p + d for p, d in zip(workload.prompt_lengths, decoded, strict=True)), default=0)
    tokens = workload.prompt_tokens + sum(decoded)
    return WorkloadShape(
        requests=len(workload),
        prompt_tokens=workload.prompt_tokens,
        decode_tokens=sum(decoded),
        longest_tokens=longest,
        distinct_blocks=-(-tokens // block_size) + len(workload),
        workload_bytes=file_bytes * TRACE_FILE_FACTOR + len(workload) * REQUEST_BYTES,
    )


@dataclass(frozen=True)
class Estimate:
    """Memory and wall time of a whole ``blocktrie replay`` command, by phase."""

    held_bytes: int
    """Start-up plus the workload, held from generation or loading to the end."""
    count_bytes: int
    """What the independent count adds (given back before the replay)."""
    replay_bytes: int
    """What the replays add: torch and the caches of the runs replaying at once."""
    seconds: float
    """Wall time of the whole command."""
    replay_s: float
    """CPU seconds of all the replays together (one core)."""

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + max(self.count_bytes, self.replay_bytes)

    def parts(self) -> str:
        """Where the peak comes from, e.g. ``the workload 1.10 TiB + the replay 80 MiB``."""
        from cache.planner.report import fmt_bytes

        phase, extra = (
            ("count", self.count_bytes)
            if self.count_bytes > self.replay_bytes
            else ("replay", self.replay_bytes)
        )
        return f"the workload {fmt_bytes(self.held_bytes)} + the {phase} {fmt_bytes(extra)}"


def estimate(
    shape: WorkloadShape,
    runs: Sequence[Run],
    *,
    concurrency: int,
    jobs: int,
    cores: int,
) -> Estimate:
    """The memory and time of generating or loading, counting, then replaying `runs` in
    `jobs` processes on `cores` cores (see the module docstring for the model)."""
    tokens = shape.prompt_tokens + shape.decode_tokens
    counting = COUNT_BLOCK_BYTES * shape.distinct_blocks + COUNT_TOKEN_BYTES * shape.longest_tokens
    live = (concurrency + 1) * shape.longest_tokens * LIVE_TOKEN_BYTES

    def run_bytes(run: Run) -> int:
        return CACHE_BLOCK_BYTES * run.capacity + CACHE_SLOT_BYTES * run.slots + live

    workers = max(1, min(jobs, len(runs)))
    biggest = sorted((run_bytes(r) for r in runs), reverse=True)[:workers]
    if workers == 1:
        replaying = TORCH_BYTES + sum(biggest)
    else:  # each forked worker: torch, its cache, and (in time) its own copy of the workload
        replaying = sum(biggest) + workers * (TORCH_BYTES + shape.workload_bytes)
    replay_s = sum(
        tokens * (REPLAY_S_PER_TOKEN if r.policy == KV else SSM_REPLAY_S_PER_TOKEN) for r in runs
    )
    seconds = GENERATE_S_PER_TOKEN * shape.drawn_tokens + COUNT_S_PER_TOKEN * tokens
    seconds += replay_s / max(1, min(workers, cores)) + PROCESS_START_S * workers
    return Estimate(START_BYTES + shape.workload_bytes, counting, replaying, seconds, replay_s)


def available_memory() -> tuple[int, str] | None:
    """(bytes, where the figure comes from) of memory this process can still take: the
    smaller of the kernel's MemAvailable (/proc/meminfo) and what is left under the
    cgroup's memory.max; elsewhere the free physical pages (os.sysconf), else the
    physical memory; None when nothing says."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(0, int(limit) - used), "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    if not found:
        for name, what in (("SC_AVPHYS_PAGES", "free pages"), ("SC_PHYS_PAGES", "physical")):
            try:
                pages = os.sysconf(name)
                size = os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                continue
            if pages > 0 and size > 0:
                found.append((pages * size, f"{what} memory"))
                break
    return min(found) if found else None
