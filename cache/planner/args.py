"""The ``blocktrie`` command line's arguments: the parser, value types and limits.

Values are checked as they are parsed (counts with k/m suffixes and bounds,
policies); combinations are checked by `cache.planner.cli` before any work.
Usage errors are one line on stderr. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NoReturn

from cache.integrations.transformers.tiny import TINY_CONFIGS
from cache.planner.execute import EXECUTORS
from cache.planner.policy import DEFAULT_POLICY, POLICY_NAMES, CheckpointPolicy
from cache.planner.traces import FORMATS
from cache.planner.workload import SyntheticParams

__all__ = [
    "DEFAULT_BLOCKS_PER_SLOT",
    "DEFAULT_CHUNK",
    "DEFAULT_PUBLISH_WAIT",
    "FLEET_FLAGS",
    "MAX_BLOCKS",
    "MAX_REPLICAS",
    "PROG",
    "SSM_FLAGS",
    "STANDARD_POLICIES",
    "SYNTHETIC_FLAGS",
    "attach_values",
    "build_parser",
]

PROG = "blocktrie"
MAX_BLOCKS = 100_000_000
"""Most KV blocks (and checkpoint slots) a replay's pool may have: above it the
planner's pools would not fit in memory (a million blocks take ~100 MB)."""
MAX_CONCURRENCY = 1_000_000
STANDARD_POLICIES: tuple[str, ...] = (
    "prompt-end",
    "branch-points",
    "branch-points+prompt-end",
    "chunk-boundaries",
    "every-block",
    "every-n",
    "branch-points+prompt-end+decode-end",
    DEFAULT_POLICY,
    DEFAULT_POLICY + "+spare-slots",
)
"""What ``--ckpt-policy all`` compares."""

SYNTHETIC_FLAGS = {
    "users": "--users",
    "turns": "--turns",
    "system_prompts": "--system-prompts",
    "system_tokens": "--system-tokens",
    "user_tokens": "--user-tokens",
    "output_tokens": "--output-tokens",
    "agentic": "--agentic",
    "tool_calls": "--tool-calls",
    "tool_result_tokens": "--tool-result-tokens",
    "seed": "--seed",
}
SSM_FLAGS = {
    "ckpt_policy": "--ckpt-policy",
    "blocks_per_slot": "--blocks-per-slot",
    "sweep_blocks_per_slot": "--sweep-blocks-per-slot",
    "state_slots": "--state-slots",
    "ckpt_interval": "--ckpt-interval",
    "chunk_size": "--chunk-size",
    "state_bytes_per_slot": "--state-bytes-per-slot",
}
DEFAULT_BLOCKS_PER_SLOT = 8
DEFAULT_CHUNK = 2048
MAX_REPLICAS = 1024
DEFAULT_PUBLISH_WAIT = 1.0
ROUTER_NAMES = ("round-robin", "least-loaded", "prefix")
"""`cache.planner.fleet.ROUTERS` (not imported here: the fleet module needs msgspec)."""
FLEET_FLAGS = {
    "router": "--router",
    "prefix_max_load": "--prefix-max-load",
    "block_hash": "--block-hash",
    "hash_seed": "--hash-seed",
    "publish_wait": "--publish-wait",
}
"""Flags that need --replicas or --publish (--router needs --replicas itself)."""


# --------------------------------------------------------------------------
# Argument types


def _number(text: str, *, minimum: int, maximum: int) -> int:
    """An integer, optionally with a k (1000) or m (1,000,000) suffix: 4k, 1.5m, 2_000."""
    raw = text
    text = text.strip().lower().replace("_", "")
    scale = 1
    if text[-1:] in ("k", "m"):
        scale = 1000 if text[-1] == "k" else 1_000_000
        text = text[:-1]
    try:
        if not text or not all(c.isdigit() or c in ".-+" for c in text):
            raise ValueError
        value = Fraction(text) * scale
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 1000, 4k or 1.5m, got {raw!r}"
        ) from None
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {raw!r}")
    if not minimum <= value <= maximum:
        raise argparse.ArgumentTypeError(
            f"expected a value in [{minimum:,}, {maximum:,}], got {raw!r}"
        )
    return int(value)


def _bounded(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        return _number(text, minimum=minimum, maximum=maximum)

    parse.__name__ = "number"
    return parse


_blocks = _bounded(1, MAX_BLOCKS)
_positive = _bounded(1, 2**40)
_non_negative = _bounded(0, 2**40)


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 60], got {text!r}") from None
    if not 0.0 <= value <= 60.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 60], got {text!r}")
    return value


def _load_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not 1.0 <= value <= 1e6:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number in [1, 1e6], got {text!r}")
    return value


_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _size(text: str) -> int:
    """Bytes, with an optional binary unit: 512M, 1.5G, 2T, 64GiB (K/M/G/T are powers of
    1024 whether written G, GB or GiB)."""
    raw = text
    text = text.strip().lower().replace("_", "")
    for suffix in ("ib", "b"):
        if text.endswith(suffix) and text[: -len(suffix)][-1:] in "kmgt":
            text = text[: -len(suffix)]
            break
    unit = text[-1:] if text[-1:] in "kmgt" else ""
    number = text[: len(text) - len(unit)]
    try:
        if not number or not all(c.isdigit() or c == "." for c in number):
            raise ValueError
        value = Fraction(number) * _SIZE_UNITS[unit]
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512M, 8G or 1.5T, got {raw!r}"
        ) from None
    if not 1 <= value <= 2**60:
        raise argparse.ArgumentTypeError(f"expected a size in [1 byte, 1024P], got {raw!r}")
    return int(value)


def _hash_seed(text: str) -> int:
    value = _seed(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return value


def _list(item: Callable[[str], int]) -> Callable[[str], list[int]]:
    """Comma-separated values, returned sorted; an empty value or one given twice is an
    error (``1k,,2k``, ``1k,1000``), not silently dropped."""

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(
                f"empty value in {text!r} (expected values separated by single commas)"
            )
        seen: dict[int, str] = {}
        for part in parts:
            value = item(part)
            if value in seen:
                raise argparse.ArgumentTypeError(
                    f"{seen[value].strip()!r} and {part.strip()!r} in {text!r} are the same "
                    f"value ({value:,}); give each once"
                )
            seen[value] = part
        return sorted(seen)

    parse.__name__ = "list"
    return parse


def _policy_list(text: str) -> list[str]:
    out: list[str] = []
    for spec in text.split(","):
        spec = spec.strip()
        if not spec:
            continue
        if spec == "all":
            out.extend(STANDARD_POLICIES)
            continue
        try:
            out.append(CheckpointPolicy.parse(spec).name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one checkpoint policy")
    return list(dict.fromkeys(out))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (the usage block is what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Help with the default of each valued option, written as it would be typed
    (switches and unset options say nothing; their help says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or action.nargs == 0
            or "default:" in text
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown})"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("blocktrie")
    except Exception:  # not installed (run from a checkout)
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (importlib.metadata is slow to load)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{PROG} {_version()}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="blocktrie: a prefix cache for hybrid attention + SSM models."
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    rp = sub.add_parser(
        "replay",
        help="capacity planner: replay a workload, report hit rate and memory",
        description=(
            "Replay a workload through the cache and report how much KV (and SSM state) "
            "memory it needs and the hit rate it gets. Without --trace, a built-in "
            "synthetic chat + agentic workload is used. Counts take k and m suffixes "
            "(4k = 4,000)."
        ),
        formatter_class=_Formatter,
    )
    wl = rp.add_argument_group("workload")
    wl.add_argument(
        "--trace",
        metavar="FILE",
        help="a JSON-lines trace: Mooncake, Bailian (Qwen) or token ids (docs/replay.md); "
        "CSV traces such as Azure's carry no token or hash ids and are not read",
    )
    wl.add_argument(
        "--trace-format",
        choices=("auto", *FORMATS),
        default="auto",
        help="trace format (auto: from the first line)",
    )
    wl.add_argument(
        "--trace-block-tokens",
        type=_positive,
        metavar="N",
        help="tokens per hash id of a Mooncake or Bailian trace (default: 512 Mooncake, 16 "
        "Bailian)",
    )
    wl.add_argument("--limit", type=_positive, metavar="N", help="replay only the first N requests")
    d = SyntheticParams()
    for dest, help_text, kind in (
        ("users", "sessions", _positive),
        ("turns", "turns per session", _positive),
        ("system_prompts", "distinct shared system prompts", _positive),
        ("system_tokens", "mean system prompt length", _non_negative),
        ("user_tokens", "mean user message length", _positive),
        ("output_tokens", "mean answer length", _non_negative),
        ("agentic", "fraction of agentic (tool-call) sessions", _fraction),
        ("tool_calls", "tool calls per agentic turn", _non_negative),
        ("tool_result_tokens", "mean tool result length", _non_negative),
        ("seed", "random seed", _seed),
    ):
        wl.add_argument(
            SYNTHETIC_FLAGS[dest],
            dest=dest,
            type=kind,
            metavar="N" if kind is not _fraction else "F",
            help=f"built-in: {help_text} (default: {getattr(d, dest)})",
        )

    ca = rp.add_argument_group("cache")
    ca.add_argument(
        "--capacity",
        type=_blocks,
        metavar="BLOCKS",
        help="KV blocks in the pool (default: the never-evict capacity)",
    )
    ca.add_argument(
        "--host-capacity",
        type=_bounded(0, MAX_BLOCKS),
        metavar="BLOCKS",
        help="KV blocks in a host-memory tier behind every run's pool (evicted blocks are "
        "kept there and loaded back on a hit; attention-only; default: 0, no host tier)",
    )
    ca.add_argument(
        "--block-size", type=_bounded(1, 1 << 20), default=16, help="tokens per KV block"
    )
    ca.add_argument(
        "--concurrency",
        type=_bounded(1, MAX_CONCURRENCY),
        default=32,
        help="requests live at once (their blocks cannot be evicted)",
    )
    ca.add_argument(
        "--max-decode-tokens",
        type=_non_negative,
        metavar="N",
        help="decode at most N output tokens per request (default: all)",
    )
    ca.add_argument(
        "--sweep",
        type=_list(_blocks),
        metavar="CAPACITIES",
        help="replay at each of these capacities (comma-separated blocks, e.g. 2k,8k,32k)",
    )

    ss = rp.add_argument_group("SSM state (hybrid models; these need --ssm)")
    ss.add_argument(
        "--ssm",
        action="store_true",
        help="hybrid model: hits end at SSM checkpoints; compare to attention-only",
    )
    ss.add_argument(
        "--ckpt-policy",
        type=_policy_list,
        metavar="POLICIES",
        help=(
            "comma-separated checkpoint placements to compare, each a '+' combination of "
            f"{', '.join(POLICY_NAMES)}; 'all' compares the standard set "
            f"(default: {DEFAULT_POLICY})"
        ),
    )
    ss.add_argument(
        "--blocks-per-slot",
        type=_blocks,
        metavar="R",
        help="state budget: one checkpoint slot per R KV blocks "
        f"(default: {DEFAULT_BLOCKS_PER_SLOT})",
    )
    ss.add_argument(
        "--sweep-blocks-per-slot",
        type=_list(_blocks),
        metavar="LIST",
        help="replay at each of these state budgets (comma-separated R values)",
    )
    ss.add_argument(
        "--state-slots",
        type=_blocks,
        metavar="N",
        help="state budget in slots (instead of --blocks-per-slot)",
    )
    ss.add_argument(
        "--ckpt-interval",
        type=_positive,
        metavar="TOKENS",
        help="every-n: tokens between checkpoints (default: 2 x R x block size)",
    )
    ss.add_argument(
        "--chunk-size",
        type=_positive,
        metavar="TOKENS",
        help=f"chunk-boundaries: prefill chunk size (default: {DEFAULT_CHUNK})",
    )
    ss.add_argument(
        "--state-bytes-per-slot",
        type=_positive,
        metavar="BYTES",
        help="SSM state bytes per checkpoint (all layers), to report state memory",
    )

    me = rp.add_argument_group("memory")
    me.add_argument(
        "--kv-bytes-per-token",
        type=_positive,
        metavar="BYTES",
        help="KV bytes per token of your model (all layers, K and V): report capacity in GiB",
    )

    fl = rp.add_argument_group(
        "fleet (multi-replica planning and KV events; need the events extra)"
    )
    fl.add_argument(
        "--replicas",
        type=_bounded(1, MAX_REPLICAS),
        metavar="N",
        help="replay across N replicas behind a router, each with --capacity blocks",
    )
    fl.add_argument(
        "--router",
        choices=ROUTER_NAMES,
        help="how requests are spread over the replicas (default: prefix); prefix scores "
        "replicas from their decoded KV-event bytes; each is compared with round-robin",
    )
    fl.add_argument(
        "--prefix-max-load",
        type=_load_factor,
        metavar="F",
        help="prefix router: skip replicas with more than F x the mean in-flight requests "
        "(default: no bound; ties alone are broken by load)",
    )
    fl.add_argument(
        "--publish",
        metavar="ENDPOINT",
        help="stream each replica's KV events (vLLM's ZMQ format) to ENDPOINT, e.g. "
        "tcp://*:5557; replica i publishes on port + i",
    )
    fl.add_argument(
        "--publish-wait",
        type=_seconds,
        metavar="SECONDS",
        help="with --publish: wait this long for subscribers to connect before the replay, "
        f"and for the last batches to leave after it (default: {DEFAULT_PUBLISH_WAIT:g})",
    )
    fl.add_argument(
        "--block-hash",
        choices=("xxh3", "vllm"),
        help="block hash scheme of the replicas and the router (default: xxh3)",
    )
    fl.add_argument(
        "--hash-seed",
        type=_hash_seed,
        metavar="N",
        help="block hash seed (vLLM's PYTHONHASHSEED for --block-hash vllm; default: 0)",
    )

    ex = rp.add_argument_group("execution")
    ex.add_argument(
        "--jobs",
        type=_bounded(1, 4096),
        metavar="N",
        help="replay sweep points in N worker processes (default: one per run on the idle "
        "cores (cores minus the load average), when the runs are long enough to repay a "
        "worker's 2 s start-up and their memory fits; else 1)",
    )
    ex.add_argument(
        "--max-memory",
        type=_size,
        metavar="SIZE",
        help="memory the command may use, e.g. 8G: a workload estimated to need more is "
        "refused before anything runs (default: the memory available, MemAvailable or the "
        "cgroup limit); give a larger SIZE to run it anyway",
    )
    ex.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="process",
        help="where sweep points run: local worker processes, or a Ray cluster (needs ray)",
    )
    ex.add_argument(
        "--check", action="store_true", help="verify every cache invariant after each replay (slow)"
    )

    out = rp.add_argument_group("output")
    fmt = out.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json", action="store_true", help="print one JSON document (docs/replay.md), nothing else"
    )
    fmt.add_argument("--csv", action="store_true", help="print one CSV row per run, nothing else")
    out.add_argument(
        "--plot",
        metavar="FILE",
        help="draw hit rate against capacity (needs --sweep) as FILE.png, .svg or .pdf",
    )
    prog = out.add_mutually_exclusive_group()
    prog.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show progress on stderr (default: when stderr is a terminal)",
    )
    prog.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show progress"
    )

    dm = sub.add_parser(
        "demo",
        help="serve a tiny hybrid model over a short chat; check outputs equal cold runs",
        formatter_class=_Formatter,
    )
    dm.add_argument("--seed", type=_seed, default=0, help="model weights and chat seed")
    dm.add_argument(
        "--model",
        choices=sorted(TINY_CONFIGS),
        default=None,
        help="serve a tiny random-weight Hugging Face model of this architecture instead "
        "(needs the hf extra: pip install 'blocktrie[hf]')",
    )
    return parser


def attach_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--sweep -1k`` -> ``--sweep=-1k``, so that a value starting with '-' reaches the
    option's own check (and its clear message) instead of "expected one argument"."""
    valued: set[str] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if action.nargs is None and action.option_strings:
                valued.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in valued and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            nxt = argv[i + 1]
            if nxt not in valued and not nxt.startswith("--"):
                out.append(f"{arg}={nxt}")
                i += 2
                continue
        out.append(arg)
        i += 1
    return out
