"""The planner's up-front estimate (`cache.planner.resources`) against measurement:
each command runs in a child process (its peak resident set from ``wait4``, its
wall time), beside the estimate ``blocktrie replay`` makes for it before running.

    python -m bench.planner_estimate [--traces-dir DIR]

The figures quoted in `cache.planner.resources` come from this script. Keep the
machine quiet: wall times change with the load (it is printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import default_traces_dir
from cache.planner.args import attach_values, build_parser
from cache.planner.cli import _synthetic_params, estimate_replay
from cache.planner.resources import synthetic_shape, trace_shape
from cache.planner.traces import load_trace

CASES: list[list[str]] = [
    [],
    ["--users", "1000"],
    ["--turns", "40"],
    ["--users", "8", "--turns", "2", "--system-tokens", "100k"],
    ["--ssm", "--sweep", "1k,2k,4k", "--jobs", "1"],
    ["--users", "1000", "--sweep", "50k,100k", "--jobs", "2"],
]


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(k) for k in kids)
    return out


def _pss(pids: list[int]) -> int:
    """Proportional set size of `pids` together (shared pages counted once), in bytes."""
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def measure(argv: list[str]) -> tuple[int, float]:
    """(peak memory, wall seconds) of ``blocktrie replay ARGV``: the peak is the larger of
    the process's own peak resident set (``wait4``) and the most its process tree held
    at once (summed PSS, sampled every 50 ms: the workers of ``--jobs``)."""
    cmd = [sys.executable, "-m", "cache.planner", "replay", *argv, "--csv", "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    tree_peak = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        tree_peak = max(tree_peak, _pss(_tree(proc.pid)))
        time.sleep(0.05)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}")
    return max(usage.ru_maxrss * 1024, tree_peak), wall


def predict(argv: list[str]) -> tuple[int, float]:
    parser = build_parser()
    args = parser.parse_args(attach_values(parser, ["replay", *argv]))
    if args.trace is None:
        shape = synthetic_shape(_synthetic_params(args), args.block_size, args.max_decode_tokens)
    else:
        workload = load_trace(args.trace)
        shape = trace_shape(
            workload, args.block_size, args.max_decode_tokens, os.path.getsize(args.trace)
        )
    guess, _jobs = estimate_replay(args, shape)
    return guess.peak_bytes, guess.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--traces-dir", dest="traces", type=Path, default=default_traces_dir(),
        help="where conversation_trace.jsonl is (default: bench.default_traces_dir)",
    )  # fmt: skip
    opts = ap.parse_args()
    cases = list(CASES)
    trace = opts.traces / "conversation_trace.jsonl"
    if trace.is_file():
        cases.append(["--trace", str(trace)])
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'command':<58} {'est MB':>7} {'meas MB':>7} {'ratio':>5} {'est s':>6} {'meas s':>6}")
    for argv in cases:
        est_b, est_s = predict(argv)
        got_b, got_s = measure(argv)
        name = " ".join(argv).replace(str(opts.traces) + "/", "") or "(defaults)"
        print(
            f"{name:<58} {est_b / 2**20:7.0f} {got_b / 2**20:7.0f} {est_b / got_b:5.2f} "
            f"{est_s:6.1f} {got_s:6.1f}"
        )


if __name__ == "__main__":
    main()
