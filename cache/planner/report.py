"""The replay report as data (the ``--json`` schema), and its text and CSV renderings.

`build_report` makes the one document every output is drawn from, so the
table, the JSON, the CSV and the plot cannot disagree. Its schema (version
`SCHEMA`, documented in docs/replay.md) has every key present in every
document: a value that does not apply is ``null``.

Vocabulary (the same words in every rendering):

- *hit rate*: prompt tokens served from cache / all prompt tokens.
- *ceiling*: the hit rate of an unbounded attention-only cache (counted
  directly, `count_prefix_hits`); *distinct blocks*: what that cache ends up
  holding.
- *capacity*: KV blocks in the pool. *never-evict capacity*: distinct blocks
  plus the live requests' private blocks (plus one frozen tail block per
  checkpoint slot with SSM): a run at or above it never evicts.
- *peak pins*: the most KV blocks live requests held at once in a run (they
  cannot be evicted).
- *host tier* (``--host-capacity``): hit rate splits into *device* hits (on the
  device at match time) and *host* hits (loaded back from the host tier);
  *loaded bytes per second*: loaded blocks x KV bytes per block / the trace
  time the requests span (the host-to-device traffic the host tier costs).
"""

from __future__ import annotations

import csv
import io
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from cache.planner.plan import Recommendation, Run
from cache.planner.policy import CODES, KV, abbreviate
from cache.planner.replay import ReplayResult
from cache.planner.table import Column, render_table
from cache.planner.workload import PrefixCount, Workload

__all__ = [
    "FLEET_KEYS",
    "FLEET_RESULT_KEYS",
    "REPLICA_KEYS",
    "RUN_KEYS",
    "SCHEMA",
    "WORKLOAD_KEYS",
    "build_fleet",
    "build_report",
    "fmt_bytes",
    "fmt_count",
    "render_csv",
    "render_fleet_text",
    "render_text",
]

SCHEMA = 1

WORKLOAD_KEYS = (
    "name",
    "description",
    "format",
    "requests",
    "prompt_tokens",
    "block_size",
    "concurrency",
    "max_decode_tokens",
    "kv_bytes_per_token",
    "state_bytes_per_slot",
    "unbounded_hit_rate",
    "distinct_blocks",
    "distinct_bytes",
    "never_evict_blocks",
    "never_evict_bytes",
    "duration_s",
)
RUN_KEYS = (
    "capacity",
    "kv_bytes",
    "policy",
    "blocks_per_slot",
    "state_slots",
    "state_bytes",
    "total_bytes",
    "never_evicts",
    "requests",
    "rejected",
    "prompt_tokens",
    "hit_tokens",
    "hit_rate",
    "kv_hit_rate",
    "hit_rate_vs_kv",
    "tokens_saved",
    "decode_tokens",
    "evicted_blocks",
    "evicted_checkpoints",
    "checkpoint_hits",
    "checkpoints_saved",
    "checkpoints_skipped",
    "peak_pinned_blocks",
    "peak_checkpoint_pins",
    "peak_cached_blocks",
    "peak_used_blocks",
    "wall_s",
    "requests_per_s",
    "tokens_per_s",
    "us_per_block",
    "host_capacity",
    "host_kv_bytes",
    "device_hit_tokens",
    "host_hit_tokens",
    "device_hit_rate",
    "host_hit_rate",
    "loaded_blocks",
    "stored_blocks",
    "host_evicted_blocks",
    "loaded_bytes",
    "loaded_bytes_per_s",
)
"""Keys after ``us_per_block`` were added with the host tier (schema 1 is extended, never
changed: a key keeps its meaning and position)."""
FLEET_KEYS = (
    "replicas",
    "capacity",
    "router",
    "block_hash",
    "hash_seed",
    "result",
    "round_robin",
    "gain_vs_round_robin",
    "publish",
)
FLEET_RESULT_KEYS = (
    "router",
    "requests",
    "rejected",
    "prompt_tokens",
    "hit_tokens",
    "hit_rate",
    "load_balance",
    "evicted_blocks",
    "wall_s",
    "per_replica",
)
REPLICA_KEYS = (
    "replica",
    "requests",
    "rejected",
    "prompt_tokens",
    "hit_tokens",
    "hit_rate",
    "evicted_blocks",
    "peak_cached_blocks",
)
PICK_KEYS = ("run", "capacity", "policy", "state_slots", "kv_bytes", "state_bytes", "hit_rate")
TIMING_KEYS = ("wall_s", "requests_per_s", "tokens_per_s", "us_per_block")
"""Run keys that measure this machine (they differ between two identical replays)."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e4:
        return f"{n / 1e3:.1f}k"
    return f"{n:,.0f}"


def _bytes(n: int | None, per: int | None) -> int | None:
    return None if n is None or per is None else n * per


def build_report(
    workload: Workload[Any],
    fmt: str,
    count: PrefixCount,
    never_evict: int,
    runs: Sequence[Run],
    results: Sequence[ReplayResult],
    recommendation: Recommendation,
    *,
    fleet: dict[str, Any] | None = None,
    block_size: int,
    concurrency: int,
    max_decode_tokens: int | None,
    kv_bytes_per_token: int | None,
    state_bytes_per_slot: int | None,
    host_capacity: int = 0,
) -> dict[str, Any]:
    """The report document (schema `SCHEMA`): ``{"schema", "workload", "runs",
    "recommended", "fleet"}``, every key always present (``fleet`` is `build_fleet`'s
    document with ``--replicas`` / ``--publish``, else None). `host_capacity`: the
    host-tier blocks every run had (0: none)."""
    per_block = None if kv_bytes_per_token is None else kv_bytes_per_token * block_size
    duration = workload.duration_s
    kv_at = {run.capacity: r for run, r in zip(runs, results, strict=True) if run.policy == KV}
    out_runs: list[dict[str, Any]] = []
    for run, r in zip(runs, results, strict=True):
        kv = kv_at.get(run.capacity) if run.policy != KV else None
        kv_bytes = _bytes(run.capacity, per_block)
        state_bytes = _bytes(r.state_slots, state_bytes_per_slot) if run.policy != KV else None
        total = None
        if kv_bytes is not None and (run.policy == KV or state_bytes is not None):
            total = kv_bytes + (state_bytes or 0)
        row = {
            "capacity": run.capacity,
            "kv_bytes": kv_bytes,
            "policy": run.policy,
            "blocks_per_slot": run.blocks_per_slot,
            "state_slots": r.state_slots,
            "state_bytes": state_bytes,
            "total_bytes": total,
            "never_evicts": run.capacity >= never_evict,
            "requests": r.requests,
            "rejected": r.rejected,
            "prompt_tokens": r.prompt_tokens,
            "hit_tokens": r.hit_tokens,
            "hit_rate": r.hit_rate,
            "kv_hit_rate": None if kv is None else kv.hit_rate,
            "hit_rate_vs_kv": None if kv is None else r.hit_rate - kv.hit_rate,
            "tokens_saved": r.tokens_saved,
            "decode_tokens": r.decode_tokens,
            "evicted_blocks": r.evicted_blocks,
            "evicted_checkpoints": r.evicted_checkpoints,
            "checkpoint_hits": r.checkpoint_hits,
            "checkpoints_saved": r.checkpoints_saved,
            "checkpoints_skipped": r.checkpoints_skipped,
            "peak_pinned_blocks": r.peak_pinned_blocks,
            "peak_checkpoint_pins": r.peak_pins,
            "peak_cached_blocks": r.peak_cached_blocks,
            "peak_used_blocks": r.peak_used_blocks,
            "wall_s": r.wall_s,
            "requests_per_s": r.requests_per_s,
            "tokens_per_s": r.tokens_per_s,
            "us_per_block": r.us_per_block,
            **_host_keys(r, host_capacity, per_block, duration),
        }
        out_runs.append(row)

    def pick(index: int | None) -> dict[str, Any] | None:
        if index is None:
            return None
        row = out_runs[index]
        return {"run": index, **{k: row[k] for k in PICK_KEYS[1:]}}

    return {
        "schema": SCHEMA,
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "format": fmt,
            "requests": count.requests,
            "prompt_tokens": count.prompt_tokens,
            "block_size": block_size,
            "concurrency": concurrency,
            "max_decode_tokens": max_decode_tokens,
            "kv_bytes_per_token": kv_bytes_per_token,
            "state_bytes_per_slot": state_bytes_per_slot,
            "unbounded_hit_rate": count.hit_rate,
            "distinct_blocks": count.unique_blocks,
            "distinct_bytes": _bytes(count.unique_blocks, per_block),
            "never_evict_blocks": never_evict,
            "never_evict_bytes": _bytes(never_evict, per_block),
            "duration_s": duration,
        },
        "runs": out_runs,
        "recommended": {
            "ceiling": recommendation.ceiling,
            "among": recommendation.among,
            "within_1_point": pick(recommendation.within_1_point),
            "within_99_percent": pick(recommendation.within_99_percent),
            "reached": recommendation.reached,
            "best": pick(recommendation.best),
        },
        "fleet": fleet,
    }


def _host_keys(
    r: ReplayResult, host_capacity: int, per_block: int | None, duration: float | None
) -> dict[str, Any]:
    """A run's host-tier keys (the last of `RUN_KEYS`): zero hits and copies without one."""
    loaded_bytes = _bytes(r.loaded_blocks, per_block)
    return {
        "host_capacity": host_capacity,
        "host_kv_bytes": _bytes(host_capacity, per_block),
        "device_hit_tokens": r.device_hit_tokens,
        "host_hit_tokens": r.host_hit_tokens,
        "device_hit_rate": r.device_hit_rate,
        "host_hit_rate": r.host_hit_rate,
        "loaded_blocks": r.loaded_blocks,
        "stored_blocks": r.stored_blocks,
        "host_evicted_blocks": r.host_evicted_blocks,
        "loaded_bytes": loaded_bytes,
        "loaded_bytes_per_s": (
            None if loaded_bytes is None or duration is None else loaded_bytes / duration
        ),
    }


def _fleet_result(result: Any) -> dict[str, Any]:
    """A `cache.planner.fleet.FleetResult` as ``FLEET_RESULT_KEYS``."""
    return {
        "router": result.router,
        "requests": result.requests,
        "rejected": sum(r.rejected for r in result.replicas),
        "prompt_tokens": result.prompt_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_rate": result.hit_rate,
        "load_balance": result.load_balance,
        "evicted_blocks": sum(r.evicted_blocks for r in result.replicas),
        "wall_s": result.wall_s,
        "per_replica": [
            {
                "replica": i,
                "requests": r.requests,
                "rejected": r.rejected,
                "prompt_tokens": r.prompt_tokens,
                "hit_tokens": r.hit_tokens,
                "hit_rate": r.hit_rate,
                "evicted_blocks": r.evicted_blocks,
                "peak_cached_blocks": r.peak_cached_blocks,
            }
            for i, r in enumerate(result.replicas)
        ],
    }


def build_fleet(
    result: Any,
    round_robin: Any,
    *,
    block_hash: str,
    hash_seed: int,
    publish: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The ``fleet`` document: the chosen router's `FleetResult` (`result`), the
    round-robin baseline (`round_robin`; the same result when the router is
    round-robin), the gain in hit rate over it, and the publishers' counters."""
    res = _fleet_result(result)
    rr = res if round_robin is result else _fleet_result(round_robin)
    return {
        "replicas": len(result.replicas),
        "capacity": result.capacity,
        "router": result.router,
        "block_hash": block_hash,
        "hash_seed": hash_seed,
        "result": res,
        "round_robin": rr,
        "gain_vs_round_robin": res["hit_rate"] - rr["hit_rate"],
        "publish": publish,
    }


def render_fleet_text(fleet: dict[str, Any], width: int) -> str:
    """The fleet section of the text report: the router against round-robin (hit rate,
    load balance), then one row per replica of the chosen router's replay."""
    res, rr = fleet["result"], fleet["round_robin"]
    n = fleet["replicas"]
    how = (
        " (scores replicas from their decoded vLLM KV-event bytes)"
        if fleet["router"] == "prefix"
        else ""
    )
    lines = [
        f"fleet: {n:,} replica{'s' if n != 1 else ''} x {fleet['capacity']:,} blocks, "
        f"{fleet['router']} router{how}"
    ]
    lines = [wrapped for line in lines for wrapped in _wrap(line, width)]
    results = [res] if rr is res or fleet["router"] == "round-robin" else [res, rr]
    cols = [
        Column("router", [r["router"] for r in results], "<"),
        Column("hit rate", [_pct(r["hit_rate"]) for r in results]),
        Column("tok saved", [fmt_count(r["hit_tokens"]) for r in results]),
        Column("max/mean req", [f"{r['load_balance']:.2f}" for r in results]),
        Column("evicted", [fmt_count(r["evicted_blocks"]) for r in results]),
        Column("rejected", [f"{r['rejected']:,}" for r in results]),
    ]
    lines += render_table(cols, width, 1)
    if len(results) == 2:
        lines.append(
            f"{fleet['router']} gains {fleet['gain_vs_round_robin'] * 100:+.2f} points of hit "
            "rate over round-robin"
        )
    per = res["per_replica"]
    cols = [
        Column("replica", [str(p["replica"]) for p in per]),
        Column("requests", [f"{p['requests']:,}" for p in per]),
        Column("hit rate", [_pct(p["hit_rate"]) for p in per]),
        Column("evicted", [fmt_count(p["evicted_blocks"]) for p in per]),
        Column("rejected", [f"{p['rejected']:,}" for p in per]),
    ]
    lines += ["", *render_table(cols, width, 1)]
    if fleet["publish"] is not None:
        for p in fleet["publish"]:
            dropped = f", {p['dropped_batches']:,} dropped" if p["dropped_batches"] else ""
            lines.append(
                f"replica {p['replica']} published {p['published_batches']:,} event batches on "
                f"{p['endpoint']}{dropped}"
            )
    lines.append(
        "max/mean req = requests on the busiest replica / the mean (1.00 is even); the "
        "fleet holds --concurrency live requests per replica, released oldest first."
    )
    tail = len(lines) - 1
    return "\n".join(lines[:tail] + _wrap(lines[tail], width))


def render_csv(doc: dict[str, Any]) -> str:
    """One row per run, the columns of `RUN_KEYS` (empty where the value is null)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(RUN_KEYS)
    for row in doc["runs"]:
        writer.writerow(["" if row[k] is None else row[k] for k in RUN_KEYS])
    return buf.getvalue()


def _pct(x: float) -> str:
    return f"{x:.2%}"


def _cap(blocks: int, nbytes: int | None) -> str:
    return f"{blocks:,} blocks" + (f" ({fmt_bytes(nbytes)})" if nbytes is not None else "")


def _pick_text(pick: dict[str, Any], ssm: bool) -> str:
    text = _cap(pick["capacity"], pick["kv_bytes"])
    if ssm:
        text += f" with {abbreviate(pick['policy'])} @ {pick['state_slots']:,} slots"
        if pick["state_bytes"] is not None:
            text += f" ({fmt_bytes(pick['state_bytes'])} of state)"
    return text + f" ({_pct(pick['hit_rate'])} hit rate)"


def render_text(doc: dict[str, Any], width: int) -> str:
    """The human report: workload and ceiling, the run table (fitted to `width`,
    policies abbreviated with a legend), the recommendation and the definitions."""
    w = doc["workload"]
    runs = doc["runs"]
    ssm = any(r["policy"] != KV for r in runs)
    bs = w["block_size"]
    lines = [
        f"workload: {w['description']}",
        f"  {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens, "
        f"blocks of {bs} tokens",
        f"  ceiling (unbounded cache): {_pct(w['unbounded_hit_rate'])} hit rate; it ends "
        f"holding {w['distinct_blocks']:,} distinct blocks"
        + (f" ({fmt_bytes(w['distinct_bytes'])})" if w["distinct_bytes"] is not None else ""),
        f"  never-evict capacity: {_cap(w['never_evict_blocks'], w['never_evict_bytes'])} "
        f"(distinct blocks + room for {w['concurrency']:,} live requests"
        + (" + a frozen tail block per checkpoint slot)" if ssm else ")"),
        "",
    ]
    host = runs[0]["host_capacity"] if runs else 0
    if host and len(runs) > 1:
        lines.insert(
            len(lines) - 1,
            f"  host tier: {_cap(host, runs[0]['host_kv_bytes'])} behind every run's pool",
        )
    lines = [wrapped for line in lines for wrapped in _wrap(line, width)]
    if len(runs) == 1:
        lines += _single(runs[0], ssm)
    else:
        lines += _table(runs, ssm, width)
    table_end = len(lines)
    if ssm:
        used = sorted({p for r in runs for p in r["policy"].split("+") if r["policy"] != KV})
        legend = ", ".join(f"{CODES.get(p, p)} = {p}" for p in used)
        lines.append(f"policies: KV = attention-only; {legend}")
    rec = doc["recommended"]
    one, near = rec["within_1_point"], rec["within_99_percent"]
    if rec["among"] != KV:
        kind, target = "SSM runs", f"the best SSM hit rate ({_pct(rec['ceiling'])})"
    else:
        kind, target = "runs", f"the ceiling ({_pct(rec['ceiling'])})"
    if one is not None:
        lines.append(
            f"recommended: {_pick_text(one, ssm)}, the cheapest of the {kind} within 1 point "
            f"of {target}"
        )
    else:
        lines.append(_unreached(doc, ssm))
    if near is not None:
        lines.append(
            f"  within 99% of it: {_pick_text(near, ssm)}"
            if near != one
            else "  (also the cheapest within 99% of it)"
        )
    lines.append(
        "hit rate = prompt tokens served from cache / all prompt tokens; capacity = KV "
        "blocks in the pool; peak pins = most KV blocks live requests held at once (not "
        "evictable). When a request does not fit, the replay releases live requests early; "
        "it rejects a request only when it alone does not fit."
    )
    if host:
        lines.append(
            "device / host = hit rate served from the device pool / loaded back from the "
            "host tier; load/s = bytes loaded from the host per second of trace time "
            f"({_no_rate_reason(w, runs[0]) or 'the host-to-device traffic it costs'})."
        )
    tail = [wrapped for line in lines[table_end:] for wrapped in _wrap(line, width)]
    return "\n".join(lines[:table_end] + tail)


def _unreached(doc: dict[str, Any], ssm: bool) -> str:
    """The recommendation line when no run reaches the ceiling: what the best run got,
    how far below the ceiling, and the capacity that reaches it."""
    w, rec = doc["workload"], doc["recommended"]
    ceiling = w["unbounded_hit_rate"]
    never = f"{w['never_evict_blocks']:,} blocks never evict"
    best = rec["best"]
    if best is None:
        return f"recommended: none: no run; {never}"
    gap = (ceiling - best["hit_rate"]) * 100
    if ssm:
        return (
            "recommended: none: no SSM run reaches its ceiling. The best, "
            f"{_pick_text(best, ssm)}, is {gap:.2f} points under the attention-only ceiling "
            f"({_pct(ceiling)}) and every SSM run evicted KV blocks, so more capacity may "
            f"raise it; sweep on to where one evicts none ({never})"
        )
    return (
        f"recommended: none: no run reaches the ceiling ({_pct(ceiling)}; within 1 point "
        f"counts). The best, {_pick_text(best, ssm)}, is {gap:.2f} points under it; "
        f"sweep on towards {never}"
    )


def _wrap(line: str, width: int) -> list[str]:
    """Prose wrapped at `width` between words (a number is never split); continuation
    lines indented two spaces more than the first."""
    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    return textwrap.wrap(
        line,
        width,
        subsequent_indent=" " * (lead + 2),
        break_long_words=False,
        break_on_hyphens=False,
    )


def _if(condition: object, text: str, otherwise: str = "") -> str:
    return text if condition else otherwise


def _or_dash(value: Any, fmt: Callable[[Any], str]) -> str:
    return "-" if value is None else fmt(value)


def _no_rate_reason(w: dict[str, Any], r: dict[str, Any]) -> str | None:
    """Why a run has no loaded bytes per second (None when it has one)."""
    if r["loaded_bytes"] is None:
        return "n/a: needs --kv-bytes-per-token"
    if w["duration_s"] is None:
        return "n/a: the trace has no timestamps"
    return None


def _load_rate(r: dict[str, Any]) -> str:
    rate = r["loaded_bytes_per_s"]
    return "n/a" if rate is None else f"{fmt_bytes(rate)}/s"


def _single(r: dict[str, Any], ssm: bool) -> list[str]:
    rows: list[tuple[str, str]] = [
        (
            "capacity",
            _cap(r["capacity"], r["kv_bytes"]) + (" (never evicts)" if r["never_evicts"] else ""),
        ),
        (
            "requests",
            f"{r['requests']:,}" + (f" ({r['rejected']:,} rejected)" if r["rejected"] else ""),
        ),
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        (
            "hit rate",
            _pct(r["hit_rate"])
            + _if(
                r["host_capacity"],
                f" ({_pct(r['device_hit_rate'])} on device, {_pct(r['host_hit_rate'])} "
                "loaded from host)",
            ),
        ),
        ("tokens saved", f"{r['tokens_saved']:,}"),
        ("evictions", f"{r['evicted_blocks']:,} blocks"),
        ("peak pins", f"{r['peak_pinned_blocks']:,} blocks"),
    ]
    if r["host_capacity"]:
        rows[1:1] = [("host tier", _cap(r["host_capacity"], r["host_kv_bytes"]))]
        rows += [
            (
                "host copies",
                f"{r['loaded_blocks']:,} blocks loaded, {r['stored_blocks']:,} stored, "
                f"{r['host_evicted_blocks']:,} evicted from host",
            ),
            ("load/s", _load_rate(r)),
        ]
    if ssm:
        rows += [
            ("checkpoint policy", f"{r['policy']} ({r['state_slots']:,} slots)"),
            ("checkpoint hits", f"{r['checkpoint_hits']:,}"),
            (
                "checkpoints saved",
                f"{r['checkpoints_saved']:,} ({r['checkpoints_skipped']:,} skipped, "
                f"{r['evicted_checkpoints']:,} evicted)",
            ),
            ("peak checkpoint pins", f"{r['peak_checkpoint_pins']:,}"),
        ]
        if r["state_bytes"] is not None:
            rows.append(("state memory", fmt_bytes(r["state_bytes"])))
    rows += [
        ("peak cached blocks", f"{r['peak_cached_blocks']:,}"),
        (
            "throughput",
            f"{r['requests_per_s']:,.0f} req/s, {fmt_count(r['tokens_per_s'])} tok/s, "
            f"{r['us_per_block']:.2f} us/block",
        ),
    ]
    name_width = max(len(n) for n, _ in rows)
    return [f"  {n:<{name_width}}  {v}" for n, v in rows]


def _table(runs: list[dict[str, Any]], ssm: bool, width: int) -> list[str]:
    cols = [Column("capacity", [f"{r['capacity']:,}" for r in runs])]
    if ssm:
        cols.append(Column("policy", [abbreviate(r["policy"]) for r in runs], "<"))
        cols.append(
            Column("slots", [f"{r['state_slots']:,}" if r["policy"] != KV else "-" for r in runs])
        )
    keys = len(cols)
    if any(r["kv_bytes"] is not None for r in runs):
        cols.append(Column("KV mem", [fmt_bytes(r["kv_bytes"]) for r in runs]))
    if ssm and any(r["state_bytes"] is not None for r in runs):
        cols.append(
            Column(
                "state mem",
                [
                    fmt_bytes(r["state_bytes"]) if r["state_bytes"] is not None else "-"
                    for r in runs
                ],
            )
        )
    cols.append(Column("hit rate", [_pct(r["hit_rate"]) for r in runs]))
    if any(r["host_capacity"] for r in runs):
        cols += [
            Column("device", [_pct(r["device_hit_rate"]) for r in runs]),
            Column("host", [_pct(r["host_hit_rate"]) for r in runs]),
            Column("loaded", [fmt_count(r["loaded_blocks"]) for r in runs]),
            Column("load/s", [_load_rate(r) for r in runs]),
        ]
    if ssm:
        cols.append(
            Column(
                "vs KV",
                [
                    f"{r['hit_rate_vs_kv'] * 100:+.2f} pt"
                    if r["hit_rate_vs_kv"] is not None
                    else "-"
                    for r in runs
                ],
            )
        )
        cols.append(
            Column(
                "ckpt hits",
                [f"{r['checkpoint_hits']:,}" if r["policy"] != KV else "-" for r in runs],
            )
        )
    cols += [
        Column("tok saved", [fmt_count(r["tokens_saved"]) for r in runs]),
        Column("evicted", [fmt_count(r["evicted_blocks"]) for r in runs]),
        Column("peak pins", [f"{r['peak_pinned_blocks']:,}" for r in runs]),
        Column("rejected", [f"{r['rejected']:,}" for r in runs]),
        Column("req/s", [f"{r['requests_per_s']:,.0f}" for r in runs]),
    ]
    return [*render_table(cols, width, keys)]
