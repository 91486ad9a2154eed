"""The --plot figure, drawn from the report document: hit rate against KV capacity
(in GiB with --kv-bytes-per-token, else blocks), one line per policy and state
budget, the ceiling and the recommended points. matplotlib is imported when called."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from cache.planner.policy import KV

__all__ = ["PLOT_FORMATS", "check_plot_path", "write_plot"]

PLOT_FORMATS = ("png", "svg", "pdf")
"""What --plot writes, chosen by the file's suffix (matplotlib's own vector and raster
back-ends; no other image library needed)."""


def plot_format(path: str) -> str | None:
    """The format `path`'s suffix names (None when it names none of `PLOT_FORMATS`)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    return suffix if suffix in PLOT_FORMATS else None


def check_plot_path(path: str) -> str | None:
    """Why the plot cannot be written at `path` (None when it can), found before any
    replay runs: empty, no suffix or one that names no format of `PLOT_FORMATS`, a
    directory, a missing or unwritable folder. It creates and removes a probe file
    beside the target, so a read-only file system is caught too."""
    if not path.strip():
        return "empty file name"
    target = Path(path)
    if plot_format(path) is None:
        names = ", ".join(f".{f}" for f in PLOT_FORMATS[:-1]) + f" or .{PLOT_FORMATS[-1]}"
        if not target.suffix:
            return f"{path} has no suffix to name the format: end it in {names}"
        return f"{path}: cannot write {target.suffix} images; end the name in {names}"
    if target.is_dir():
        return f"{path} is a directory"
    parent = target.resolve().parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{path} is not writable"
    try:
        fd, probe = tempfile.mkstemp(prefix=".blocktrie-probe-", dir=parent)
    except OSError as exc:
        return f"cannot write in {parent}: {exc.strerror or exc}"
    os.close(fd)
    Path(probe).unlink(missing_ok=True)
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_plot(path: str, doc: dict[str, Any]) -> None:
    """Write the figure in the format `path`'s suffix names (`PLOT_FORMATS`), atomically
    (temp file + rename), with the mode the umask gives new files (mkstemp alone would
    leave it 0600)."""
    fmt = plot_format(path)
    if fmt is None:
        raise ValueError(f"--plot: {check_plot_path(path)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = doc["workload"]
    runs = doc["runs"]
    gib = w["kv_bytes_per_token"] is not None

    def x(run: dict[str, Any]) -> float:
        return float(run["kv_bytes"] / 2**30 if gib else run["capacity"])

    several_budgets = len(
        {(r["blocks_per_slot"], r["state_slots"]) for r in runs if r["policy"] != KV}
    ) > len({r["capacity"] for r in runs})
    series: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        label = "attention-only (KV)" if run["policy"] == KV else run["policy"]
        if run["policy"] != KV and several_budgets:
            r = run["blocks_per_slot"]
            label += f", 1 slot/{r} blocks" if r is not None else f", {run['state_slots']} slots"
        series.setdefault(label, []).append((x(run), run["hit_rate"] * 100))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    try:
        for label, points in series.items():
            points.sort()
            kv = label.startswith("attention")
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "-o" if kv else "--.",
                label=label,
                linewidth=2 if kv else 1.2,
            )
        ceiling = w["unbounded_hit_rate"] * 100
        ax.axhline(ceiling, color="grey", linestyle=":", label=f"ceiling {ceiling:.2f}%")
        rec = doc["recommended"]
        goal = "the best SSM hit rate" if rec["among"] != KV else "the ceiling"
        for key, marker, text in (
            ("within_99_percent", "s", f"cheapest within 99% of {goal}"),
            ("within_1_point", "*", f"cheapest within 1 point of {goal}"),
        ):
            pick = rec[key]
            if pick is not None:
                run = runs[pick["run"]]
                ax.plot([x(run)], [run["hit_rate"] * 100], marker, markersize=11, label=text)
        if not rec["reached"] and rec["best"] is not None:
            run = runs[rec["best"]["run"]]
            text = "best run: no run reaches the ceiling, none recommended"
            ax.plot([x(run)], [run["hit_rate"] * 100], "X", markersize=11, label=text)
        xs = sorted({x(r) for r in runs})
        if len(xs) > 1 and xs[0] > 0 and xs[-1] / xs[0] >= 20:
            ax.set_xscale("log")
        ax.set_xlabel(
            f"KV memory (GiB; {w['kv_bytes_per_token']:,} bytes per token)"
            if gib
            else f"KV capacity (blocks of {w['block_size']} tokens)"
        )
        ax.set_ylabel("prompt-token hit rate (%)")
        ax.set_title(f"blocktrie replay: {w['name']}, {w['requests']:,} requests", fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")  # away from the points (lower right hid the best)
        fig.tight_layout()
        target = Path(path)
        fd, tmp = tempfile.mkstemp(
            prefix=".blocktrie-plot-", suffix=f".{fmt}", dir=target.resolve().parent
        )
        os.close(fd)
        try:
            fig.savefig(tmp, format=fmt)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    finally:
        plt.close(fig)
