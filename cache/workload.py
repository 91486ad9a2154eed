"""Workloads for replaying through a prefix cache: the built-in synthetic
generator, trace loaders, and an independent infinite-capacity hit counter.

A workload is an ordered list of requests. Each `Request` carries its prompt
tokens and the output tokens its decode will append (so that a later turn of
the same conversation, whose prompt contains this output, can hit it).

Three sources:

- `synthetic_workload`: the built-in default, seeded. Sessions of multi-turn
  chat that share a few system prompts, and agentic sessions whose turns are
  a chain of short tool calls, each followed by a tool result that the next
  request's prompt contains.
- `load_mooncake`: Mooncake-format jsonl (``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids``), one hash id per ``block_tokens`` tokens.
  Hash id ``h`` becomes a block of synthetic tokens: a marker token
  ``block_tokens + h`` followed by position tokens ``1, 2, ...``; so two
  prompts share a token prefix exactly when they share the hash-id prefix
  (the last, partial block of a prompt is a prefix of its id's block).
- `load_token_jsonl`: one request per line, either a JSON list of token ids or
  an object ``{"tokens": [...], "output": [...] | "output_length": n,
  "namespace": "..."}``.

Loaders read and validate the whole file before anything is replayed; a
missing file or a malformed line raises `TraceError`, whose message names the
file and the line number.

Output tokens of trace requests are unknown; they are replaced by a filler
token unique to the request (larger than every prompt token), so decode
blocks take cache space but never produce a false hit.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "PrefixCount",
    "Request",
    "SyntheticParams",
    "TraceError",
    "Workload",
    "count_prefix_hits",
    "detect_trace_format",
    "load_mooncake",
    "load_token_jsonl",
    "load_trace",
    "synthetic_workload",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake traces."""


class TraceError(ValueError):
    """A trace file is missing or malformed. The message names the file and line."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class Request:
    """One request: prompt tokens, the output tokens decode appends, its namespace."""

    prompt: list[int]
    output: list[int]
    namespace: str = ""
    arrival_ms: float = 0.0


R = TypeVar("R")


class Workload(Generic[R]):
    """An ordered, re-iterable list of requests, built lazily from compact records.

    Iterating builds each `Request` on the fly (prompts of long traces are
    never all in memory at once). `prompt_tokens` and `output_tokens` are
    known without building anything.
    """

    def __init__(
        self,
        name: str,
        records: Sequence[R],
        build: Callable[[int, R], Request],
        prompt_lengths: Sequence[int],
        output_lengths: Sequence[int],
        description: str = "",
    ) -> None:
        if not (len(records) == len(prompt_lengths) == len(output_lengths)):
            raise ValueError("records, prompt_lengths and output_lengths differ in length")
        self.name = name
        self.description = description or name
        self._records = records
        self._build = build
        self.prompt_lengths: Sequence[int] = prompt_lengths
        self.output_lengths: Sequence[int] = output_lengths
        self.prompt_tokens = sum(prompt_lengths)
        self.output_tokens = sum(output_lengths)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Request]:
        build = self._build
        for i, rec in enumerate(self._records):
            yield build(i, rec)

    def __getitem__(self, index: int) -> Request:
        i = range(len(self._records))[index]
        return self._build(i, self._records[i])

    def head(self, n: int) -> Workload[R]:
        """The first `n` requests (all of them when `n` is larger)."""
        return Workload(
            self.name,
            self._records[:n],
            self._build,
            self.prompt_lengths[:n],
            self.output_lengths[:n],
            self.description,
        )


# --------------------------------------------------------------------------
# Built-in synthetic workload


@dataclass(frozen=True)
class SyntheticParams:
    """Parameters of the built-in workload (all lengths in tokens, means)."""

    users: int = 48
    """Sessions (one user each)."""
    turns: int = 4
    """User turns per session."""
    system_prompts: int = 4
    """Distinct shared system prompts; sessions pick one, the first ones more often."""
    system_tokens: int = 1536
    user_tokens: int = 192
    output_tokens: int = 160
    agentic: float = 0.25
    """Fraction of sessions that are agentic (tool-call chains)."""
    tool_calls: int = 3
    """Tool calls per agentic turn (each one a request)."""
    tool_call_tokens: int = 48
    tool_result_tokens: int = 384
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "users",
            "turns",
            "system_prompts",
            "system_tokens",
            "user_tokens",
            "output_tokens",
            "tool_calls",
            "tool_call_tokens",
            "tool_result_tokens",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"SyntheticParams.{name} must be an int >= 0, got {value!r}")
        for name in ("users", "turns", "system_prompts", "user_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SyntheticParams.{name} must be >= 1")
        if not 0.0 <= self.agentic <= 1.0:
            raise ValueError(f"SyntheticParams.agentic must be in [0, 1], got {self.agentic}")
        if self.vocab < 2:
            raise ValueError("SyntheticParams.vocab must be >= 2")


@dataclass(frozen=True, slots=True)
class _SynthRecord:
    buffer: list[int]  # the session's append-only token history
    prompt_end: int
    output_end: int
    arrival_ms: float


def _length(rng: random.Random, mean: int) -> int:
    """A length around `mean` (uniform in [mean/2, 3*mean/2]), at least 1 when mean > 0."""
    if mean <= 0:
        return 0
    return max(1, round(mean * rng.uniform(0.5, 1.5)))


def synthetic_workload(params: SyntheticParams | None = None) -> Workload[Any]:
    """The built-in workload: seeded multi-turn chat and agentic sessions.

    Every session starts with one of `system_prompts` shared system prompts
    (chosen with weights 1, 1/2, 1/3, ...). A chat turn's prompt is the whole
    history (system prompt, earlier messages and answers) plus a new user
    message; its output is the answer. An agentic turn is `tool_calls + 1`
    requests: after the user message the model emits a short tool call, the
    tool result is appended, and the next request's prompt is the grown
    history; the last request of the turn produces the answer. Sessions start
    at Poisson times and their requests interleave by arrival time.
    """
    p = params or SyntheticParams()
    rng = random.Random(p.seed)
    vocab = p.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [tokens(_length(rng, p.system_tokens)) for _ in range(p.system_prompts)]
    weights = [1.0 / (i + 1) for i in range(p.system_prompts)]
    records: list[_SynthRecord] = []
    start = 0.0
    for _user in range(p.users):
        start += rng.expovariate(1.0 / 2000.0)  # a session every ~2 s
        buffer = list(rng.choices(systems, weights)[0])
        agentic = rng.random() < p.agentic
        now = start
        for _turn in range(p.turns):
            buffer.extend(tokens(_length(rng, p.user_tokens)))
            steps = p.tool_calls if agentic else 0
            for _call in range(steps):
                prompt_end = len(buffer)
                buffer.extend(tokens(_length(rng, p.tool_call_tokens)))
                records.append(_SynthRecord(buffer, prompt_end, len(buffer), now))
                buffer.extend(tokens(_length(rng, p.tool_result_tokens)))
                now += rng.expovariate(1.0 / 1500.0)  # tool latency ~1.5 s
            prompt_end = len(buffer)
            buffer.extend(tokens(_length(rng, p.output_tokens)))
            records.append(_SynthRecord(buffer, prompt_end, len(buffer), now))
            now += rng.expovariate(1.0 / 20000.0)  # user think time ~20 s
    records.sort(key=lambda r: r.arrival_ms)  # stable: a session's requests keep their order

    def build(_index: int, rec: _SynthRecord) -> Request:
        return Request(
            rec.buffer[: rec.prompt_end],
            rec.buffer[rec.prompt_end : rec.output_end],
            "",
            rec.arrival_ms,
        )

    kind = f"{p.users} users x {p.turns} turns, {p.system_prompts} system prompts"
    if p.agentic > 0:
        kind += f", {p.agentic:.0%} agentic ({p.tool_calls} tool calls/turn)"
    return Workload(
        "synthetic",
        records,
        build,
        [r.prompt_end for r in records],
        [r.output_end - r.prompt_end for r in records],
        f"built-in synthetic chat (seed {p.seed}): {kind}",
    )


# --------------------------------------------------------------------------
# Trace loaders


def _read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of every non-blank line; TraceError if unreadable."""
    p = Path(path)
    try:
        handle = p.open("rb")
    except FileNotFoundError:
        raise TraceError(path, None, "no such trace file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise TraceError(path, lineno, f"not UTF-8 text: {exc.reason}") from None
            if text:
                yield lineno, text


def _parse_json(path: str | Path, lineno: int, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(
            path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None


def _int_field(path: str | Path, lineno: int, obj: dict[str, Any], key: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(path, lineno, f"missing field {key!r}")
    value = obj[key]
    if type(value) is not int:
        raise TraceError(path, lineno, f"field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, lineno, f"field {key!r} must be >= {minimum}, got {value}")
    return value


def _token_list(
    path: str | Path, lineno: int, value: Any, what: str, *, empty_ok: bool
) -> list[int]:
    if not isinstance(value, list):
        raise TraceError(
            path, lineno, f"{what} must be a list of token ids, got {type(value).__name__}"
        )
    if not value and not empty_ok:
        raise TraceError(path, lineno, f"{what} is empty")
    for i, t in enumerate(value):
        if type(t) is not int or t < 0:
            raise TraceError(path, lineno, f"{what}[{i}] must be an integer >= 0, got {t!r}")
    return value


@dataclass(frozen=True, slots=True)
class _MooncakeRecord:
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    timestamp: float


def load_mooncake(path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS) -> Workload[Any]:
    """Load a Mooncake-format jsonl trace (see the module docstring for the token mapping).

    Each line: ``{"timestamp": ms, "input_length": n, "output_length": m,
    "hash_ids": [...]}`` with ``len(hash_ids) == ceil(input_length / block_tokens)``.
    """
    if type(block_tokens) is not int or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    records: list[_MooncakeRecord] = []
    max_hash = -1
    for lineno, text in _read_lines(path):
        obj = _parse_json(path, lineno, text)
        if not isinstance(obj, dict):
            raise TraceError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
        input_length = _int_field(path, lineno, obj, "input_length", 1)
        output_length = _int_field(path, lineno, obj, "output_length", 0)
        if "hash_ids" not in obj:
            raise TraceError(path, lineno, "missing field 'hash_ids'")
        hash_ids = _token_list(path, lineno, obj["hash_ids"], "hash_ids", empty_ok=False)
        need = math.ceil(input_length / block_tokens)
        if len(hash_ids) != need:
            raise TraceError(
                path,
                lineno,
                f"{len(hash_ids)} hash_ids for input_length {input_length}, expected "
                f"ceil({input_length}/{block_tokens}) = {need} "
                f"(is --trace-block-tokens {block_tokens} right for this trace?)",
            )
        timestamp = obj.get("timestamp", 0)
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
            raise TraceError(path, lineno, f"field 'timestamp' must be a number, got {timestamp!r}")
        max_hash = max(max_hash, max(hash_ids))
        records.append(_MooncakeRecord(tuple(hash_ids), input_length, output_length, timestamp))
    if not records:
        raise TraceError(path, None, "trace has no requests")

    # Token ids: positions 1..T-1 (shared int objects), markers T + h, fillers above.
    positions = list(range(block_tokens))
    filler_base = block_tokens + max_hash + 1

    def build(index: int, rec: _MooncakeRecord) -> Request:
        prompt: list[int] = []
        last = len(rec.hash_ids) - 1
        for i, h in enumerate(rec.hash_ids):
            prompt.append(block_tokens + h)
            n = block_tokens if i < last else rec.input_length - last * block_tokens
            prompt.extend(positions[1:n])
        return Request(prompt, [filler_base + index] * rec.output_length, "", float(rec.timestamp))

    return Workload(
        Path(path).name,
        records,
        build,
        [r.input_length for r in records],
        [r.output_length for r in records],
        f"Mooncake trace {path} ({block_tokens} tokens per hash id)",
    )


@dataclass(frozen=True, slots=True)
class _TokenRecord:
    prompt: list[int]
    output: list[int] | int  # tokens, or a filler length
    namespace: str


def load_token_jsonl(path: str | Path) -> Workload[Any]:
    """Load a jsonl of token-id lists (one request per line; see the module docstring)."""
    records: list[_TokenRecord] = []
    max_token = -1
    for lineno, text in _read_lines(path):
        obj = _parse_json(path, lineno, text)
        output: list[int] | int = 0
        namespace = ""
        if isinstance(obj, list):
            prompt = _token_list(path, lineno, obj, "the token list", empty_ok=False)
        elif isinstance(obj, dict):
            if "tokens" not in obj:
                raise TraceError(path, lineno, "missing field 'tokens'")
            prompt = _token_list(path, lineno, obj["tokens"], "field 'tokens'", empty_ok=False)
            if "output" in obj:
                output = _token_list(path, lineno, obj["output"], "field 'output'", empty_ok=True)
                max_token = max(max_token, max(output, default=-1))
            elif "output_length" in obj:
                output = _int_field(path, lineno, obj, "output_length", 0)
            ns = obj.get("namespace", "")
            if not isinstance(ns, str):
                raise TraceError(path, lineno, f"field 'namespace' must be a string, got {ns!r}")
            namespace = ns
        else:
            raise TraceError(
                path, lineno, f"expected a list of token ids or an object, got {type(obj).__name__}"
            )
        max_token = max(max_token, max(prompt))
        records.append(_TokenRecord(prompt, output, namespace))
    if not records:
        raise TraceError(path, None, "trace has no requests")
    filler_base = max_token + 1

    def build(index: int, rec: _TokenRecord) -> Request:
        out = rec.output if isinstance(rec.output, list) else [filler_base + index] * rec.output
        return Request(rec.prompt, out, rec.namespace)

    return Workload(
        Path(path).name,
        records,
        build,
        [len(r.prompt) for r in records],
        [len(r.output) if isinstance(r.output, list) else r.output for r in records],
        f"token trace {path}",
    )


def detect_trace_format(path: str | Path) -> str:
    """'mooncake' or 'tokens', from the first non-blank line; TraceError if neither."""
    for lineno, text in _read_lines(path):
        obj = _parse_json(path, lineno, text)
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "mooncake"
        if isinstance(obj, list) or (isinstance(obj, dict) and "tokens" in obj):
            return "tokens"
        raise TraceError(
            path,
            lineno,
            "neither a Mooncake line (an object with 'hash_ids') nor a token line "
            "(a list of token ids, or an object with 'tokens')",
        )
    raise TraceError(path, None, "trace has no requests")


def load_trace(
    path: str | Path, fmt: str = "auto", block_tokens: int = TRACE_BLOCK_TOKENS
) -> Workload[Any]:
    """Load a trace file: `fmt` is 'auto', 'mooncake' or 'tokens'."""
    if fmt == "auto":
        fmt = detect_trace_format(path)
    if fmt == "mooncake":
        return load_mooncake(path, block_tokens)
    if fmt == "tokens":
        return load_token_jsonl(path)
    raise ValueError(f"unknown trace format {fmt!r} (expected auto, mooncake or tokens)")


# --------------------------------------------------------------------------
# Independent infinite-capacity count


@dataclass(frozen=True)
class PrefixCount:
    """What an infinite, attention-only cache would hit, counted directly."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    unique_blocks: int
    """Distinct full blocks (with their whole prefix) ever committed."""
    max_request_blocks: int
    """Most blocks one request's prompt plus decode covers."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def count_prefix_hits(
    workload: Workload[Any], block_size: int, max_decode_tokens: int | None = None
) -> PrefixCount:
    """Count, without any cache, the tokens an infinite prefix cache would serve.

    A request's hit is its longest prefix of whole blocks that an earlier
    request committed (its prompt, then its decoded output, up to
    `max_decode_tokens`), in the same namespace, capped so that at least one
    prompt token is left to compute. Prefixes are interned as integer ids:
    ``id(prefix + block) = table[(namespace, id(prefix), block tokens)]``.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    table: dict[tuple[Any, ...], int] = {}
    hit_tokens = 0
    prompt_tokens = 0
    max_blocks = 0
    requests = 0
    b = block_size
    for req in workload:
        requests += 1
        prompt = req.prompt
        prompt_tokens += len(prompt)
        limit = (len(prompt) - 1) // b
        prefix = -1
        hit = 0
        for i in range(limit):
            nxt = table.get((req.namespace, prefix, tuple(prompt[i * b : (i + 1) * b])))
            if nxt is None:
                break
            prefix = nxt
            hit += 1
        hit_tokens += hit * b
        output = req.output if max_decode_tokens is None else req.output[:max_decode_tokens]
        full = list(prompt) + list(output)
        nblocks = len(full) // b
        max_blocks = max(max_blocks, -(-len(full) // b))
        prefix = -1
        for i in range(nblocks):
            key = (req.namespace, prefix, tuple(full[i * b : (i + 1) * b]))
            nxt = table.get(key)
            if nxt is None:
                nxt = len(table)
                table[key] = nxt
            prefix = nxt
    return PrefixCount(requests, prompt_tokens, hit_tokens, len(table), max_blocks)
