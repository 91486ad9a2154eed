"""Was the machine quiet while a benchmark ran? The CPU other processes used meanwhile.

A ratio measured while another job shares the cores is noise: on the project's
2-core machines a mutation run halved copy bandwidth and moved the events cost
from +0.3x to +0.9x. `bench.run` therefore samples the machine before and after
each section and flags a section during which other processes kept more than
`DEFAULT_MAX_OTHER_CORES` cores busy on average, or the hypervisor took more
than `DEFAULT_MAX_STEAL` of the CPU time (steal).

Linux only: the figures come from ``/proc/stat`` (all CPU time, every process)
minus this process's own CPU time and that of its reaped children
(`resource.getrusage`). Elsewhere `sample` has no machine figures and
`measure` reports none (never noisy).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MAX_OTHER_CORES",
    "DEFAULT_MAX_STEAL",
    "CpuSample",
    "Load",
    "measure",
    "parse_proc_stat",
    "sample",
]

DEFAULT_MAX_OTHER_CORES = 0.25
"""Average cores other processes may keep busy before a section is flagged."""
DEFAULT_MAX_STEAL = 0.05
"""Share of the CPU time the hypervisor may take (steal) before a section is flagged."""

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuSample:
    """CPU counters at one instant, in seconds.

    `busy` is non-idle CPU time over every core since boot (user, nice,
    system, irq, softirq; guest time is inside user), `steal` the time the
    hypervisor ran other guests, `total` all of it including idle and iowait:
    None where ``/proc/stat`` cannot be read. `own` is this process's CPU time
    plus that of its children that have been waited for.
    """

    wall: float
    own: float
    busy: float | None = None
    steal: float | None = None
    total: float | None = None


def parse_proc_stat(text: str, ticks_per_second: float) -> tuple[float, float, float]:
    """(busy, steal, total) seconds from the aggregate ``cpu`` line of ``/proc/stat``.

    Raises `ValueError` when the text has no aggregate line with the four
    fields every kernel writes (user, nice, system, idle).
    """
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            if len(values) < 4:
                break
            values += [0] * (8 - len(values))  # iowait, irq, softirq, steal on old kernels
            user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
            busy = user + nice + system + irq + softirq
            total = busy + idle + iowait + steal
            return busy / ticks_per_second, steal / ticks_per_second, total / ticks_per_second
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def _own_cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def sample(stat: Path = PROC_STAT) -> CpuSample:
    """The counters now (machine figures None where `stat` cannot be read or parsed)."""
    wall = time.monotonic()
    own = _own_cpu_seconds()
    try:
        busy, steal, total = parse_proc_stat(stat.read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return CpuSample(wall, own)
    return CpuSample(wall, own, busy, steal, total)


@dataclass(frozen=True)
class Load:
    """What the machine did between two samples.

    `other_cores`: cores kept busy on average by other processes (None
    without machine figures); `steal`: the hypervisor's share of all CPU time
    (None without figures); `noisy`: either past its limit, so the figures
    measured meanwhile should not be quoted.
    """

    seconds: float
    other_cores: float | None
    steal: float | None
    noisy: bool

    def describe(self) -> str:
        """One line for a report, e.g. ``other processes 0.02 cores, steal 0%``."""
        if self.other_cores is None or self.steal is None:
            return "machine load unknown (no /proc/stat)"
        text = f"other processes {self.other_cores:.2f} cores, steal {self.steal:.0%}"
        return text + ("; NOISY: do not quote these figures" if self.noisy else "")


def measure(
    before: CpuSample,
    after: CpuSample,
    max_other_cores: float = DEFAULT_MAX_OTHER_CORES,
    max_steal: float = DEFAULT_MAX_STEAL,
) -> Load:
    """The `Load` between `before` and `after` (taken in that order, same process).

    Raises `ValueError` for negative limits.
    """
    if max_other_cores < 0 or max_steal < 0:
        raise ValueError(
            f"load limits must be >= 0, got max_other_cores={max_other_cores}, "
            f"max_steal={max_steal}"
        )
    seconds = after.wall - before.wall
    if (
        seconds <= 0
        or before.busy is None
        or after.busy is None
        or before.steal is None
        or after.steal is None
        or before.total is None
        or after.total is None
    ):  # spelled out, not `None in (...)`: mypy narrows each one
        return Load(max(seconds, 0.0), None, None, False)
    others = (after.busy - before.busy) - (after.own - before.own)
    other_cores = max(others, 0.0) / seconds  # clock ticks are coarser than rusage
    total = after.total - before.total
    steal = (after.steal - before.steal) / total if total > 0 else 0.0
    noisy = other_cores > max_other_cores or steal > max_steal
    return Load(seconds, other_cores, steal, noisy)
