"""Trace readers: Mooncake, Alibaba Bailian and token-id jsonl files as `Workload`s.
Other formats are refused by name (a CSV file such as the Azure LLM inference
traces: token counts without token or hash ids say nothing of shared prefixes).

- `load_mooncake`: Mooncake-format jsonl (``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids``), one hash id per ``block_tokens`` tokens.
  Hash id ``h`` becomes a block of synthetic tokens: a marker token
  ``block_tokens + h`` followed by position tokens ``1, 2, ...``; so two
  prompts share a token prefix exactly when they share the hash-id prefix
  (the last, partial block of a prompt is a prefix of its id's block).
- `load_bailian`: the Alibaba Bailian (Qwen) usage-trace format: Mooncake's
  fields plus ``chat_id``, ``parent_chat_id``, ``turn``, ``type``, with one hash
  id per 16 tokens; the conversation structure gives branch points.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache.planner.workload import Filler, Request, Workload

__all__ = [
    "BAILIAN_BLOCK_TOKENS",
    "FORMATS",
    "READS",
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "default_block_tokens",
    "detect_trace_format",
    "load_bailian",
    "load_mooncake",
    "load_token_jsonl",
    "load_trace",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake traces."""

BAILIAN_BLOCK_TOKENS = 16
"""Tokens per hash id in the Alibaba Bailian (Qwen) usage traces."""

FORMATS = ("mooncake", "bailian", "tokens")


class TraceError(ValueError):
    """A trace file is missing or malformed. The message names the file and line."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


Progress = Callable[[int], None]
"""Called with the bytes of the file read so far (every 4096 lines, and at the end)."""

MAX_ID = 2**63
"""Token and hash ids must be below this (the cache takes ids below 2**64, and the
loaders number filler and marker tokens above the file's ids)."""


def _read_lines(path: str | Path, progress: Progress | None = None) -> Iterator[tuple[int, str]]:
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
    done = 0
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            done += len(raw)
            if progress is not None and lineno % 4096 == 0:
                progress(done)
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise TraceError(path, lineno, f"not UTF-8 text: {exc.reason}") from None
            if text:
                yield lineno, text
    if progress is not None:
        progress(done)


READS = "JSON-lines traces: Mooncake, Bailian (Qwen) or token ids (docs/replay.md)"
"""What the planner reads, as error messages name it."""


def _not_json(path: str | Path, lineno: int, text: str, exc: json.JSONDecodeError) -> TraceError:
    """The error for a line that is not JSON: a CSV file is named as one (the Azure LLM
    inference traces are CSV, with token counts but no token or hash ids)."""
    if lineno == 1 and text[:1] not in "{[" and "," in text:
        what = "a CSV file"
        header = [field.strip().lower() for field in text.split(",")]
        if "contexttokens" in header or "generatedtokens" in header:
            what = (
                "an Azure LLM inference trace (CSV: token counts per request, but no token "
                "or hash ids, so it cannot show which prompts share a prefix)"
            )
        return TraceError(path, lineno, f"{what}; the planner reads {READS}")
    reason = exc.msg[:1].lower() + exc.msg[1:]
    # Some of json's messages end in "at" (json itself appends ": line L column C").
    where = f" column {exc.colno}" if reason.endswith(" at") else f" (column {exc.colno})"
    return TraceError(path, lineno, f"not valid JSON: {reason}{where}")


def _parse_json(path: str | Path, lineno: int, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _not_json(path, lineno, text, exc) from None
    except RecursionError:
        raise TraceError(path, lineno, "JSON nested too deeply") from None


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
        if type(t) is not int or not 0 <= t < MAX_ID:
            raise TraceError(
                path, lineno, f"{what}[{i}] must be an integer in [0, 2**63), got {t!r}"
            )
    return value


@dataclass(frozen=True, slots=True)
class _HashRecord:
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    timestamp: float
    branch_steps: tuple[int, ...] = ()


def _hash_fields(
    path: str | Path, lineno: int, obj: Any, block_tokens: int
) -> tuple[dict[str, Any], list[int], int, int, float]:
    """The fields Mooncake and Bailian lines share: (object, hash_ids, input_length,
    output_length, timestamp), validated."""
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
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, (int, float))
        or not math.isfinite(timestamp)
    ):
        raise TraceError(path, lineno, f"field 'timestamp' must be a number, got {timestamp!r}")
    return obj, hash_ids, input_length, output_length, float(timestamp)


def _hash_workload(
    path: str | Path,
    records: list[_HashRecord],
    block_tokens: int,
    max_hash: int,
    description: str,
    seconds_per_tick: float,
) -> Workload[Any]:
    """Requests whose prompts are hash-id blocks (the mapping in the module docstring);
    `seconds_per_tick` is the unit of the records' timestamps (1e-3 for milliseconds)."""
    if not records:
        raise TraceError(path, None, "trace has no requests")
    # Token ids: positions 1..T-1 (shared int objects), markers T + h, fillers above.
    positions = list(range(block_tokens))
    filler_base = block_tokens + max_hash + 1

    def build(index: int, rec: _HashRecord) -> Request:
        prompt: list[int] = []
        last = len(rec.hash_ids) - 1
        for i, h in enumerate(rec.hash_ids):
            prompt.append(block_tokens + h)
            n = block_tokens if i < last else rec.input_length - last * block_tokens
            prompt.extend(positions[1:n])
        output = Filler(filler_base + index, rec.output_length)
        arrival_ms = rec.timestamp * seconds_per_tick * 1000.0
        return Request(prompt, output, "", arrival_ms, rec.branch_steps)

    return Workload(
        Path(path).name,
        records,
        build,
        [r.input_length for r in records],
        [r.output_length for r in records],
        description,
        [r.timestamp * seconds_per_tick for r in records],
    )


def _check_block_tokens(block_tokens: int) -> None:
    if type(block_tokens) is not int or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")


def load_mooncake(
    path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS, progress: Progress | None = None
) -> Workload[Any]:
    """Load a Mooncake-format jsonl trace (see the module docstring for the token mapping).

    Each line: ``{"timestamp": ms, "input_length": n, "output_length": m,
    "hash_ids": [...]}`` with ``len(hash_ids) == ceil(input_length / block_tokens)``.
    """
    _check_block_tokens(block_tokens)
    records: list[_HashRecord] = []
    max_hash = -1
    for lineno, text in _read_lines(path, progress):
        obj = _parse_json(path, lineno, text)
        _obj, hash_ids, input_length, output_length, timestamp = _hash_fields(
            path, lineno, obj, block_tokens
        )
        max_hash = max(max_hash, max(hash_ids))
        records.append(_HashRecord(tuple(hash_ids), input_length, output_length, timestamp))
    return _hash_workload(
        path,
        records,
        block_tokens,
        max_hash,
        f"Mooncake trace {path} ({block_tokens} tokens per hash id)",
        1e-3,  # Mooncake timestamps are milliseconds
    )


def load_bailian(
    path: str | Path, block_tokens: int = BAILIAN_BLOCK_TOKENS, progress: Progress | None = None
) -> Workload[Any]:
    """Load an Alibaba Bailian (Qwen) usage trace: one request per line,
    ``{"chat_id": int, "parent_chat_id": int (-1 for the first turn), "timestamp": s,
    "input_length": n, "output_length": m, "type": str, "turn": int, "hash_ids": [...]}``
    with one hash id per `block_tokens` (16) tokens. Prompts are built from hash ids as for
    Mooncake.

    The conversation structure becomes branch points: a request whose parent turn is in
    the file records the step where its prompt leaves the parent's (the whole blocks of
    hash ids they share); the ``branch-points`` checkpoint placement saves there, which is
    where a regenerated or edited sibling of this turn leaves the conversation too.
    A parent outside the file (the trace window cut it) makes the request a first turn.
    """
    _check_block_tokens(block_tokens)
    records: list[_HashRecord] = []
    max_hash = -1
    by_chat: dict[int, int] = {}  # chat_id -> index of its record
    for lineno, text in _read_lines(path, progress):
        raw = _parse_json(path, lineno, text)
        obj, hash_ids, input_length, output_length, timestamp = _hash_fields(
            path, lineno, raw, block_tokens
        )
        chat_id = _int_field(path, lineno, obj, "chat_id", 0)
        parent = _int_field(path, lineno, obj, "parent_chat_id", -1)
        _int_field(path, lineno, obj, "turn", 0)
        kind = obj.get("type", "")
        if not isinstance(kind, str):
            raise TraceError(path, lineno, f"field 'type' must be a string, got {kind!r}")
        if chat_id in by_chat:
            raise TraceError(path, lineno, f"chat_id {chat_id} appears twice")
        if parent == chat_id:
            raise TraceError(path, lineno, f"chat_id {chat_id} is its own parent")
        branch: tuple[int, ...] = ()
        if parent in by_chat:
            shared = 0
            parent_ids = records[by_chat[parent]].hash_ids
            for x, y in zip(parent_ids, hash_ids, strict=False):
                if x != y:
                    break
                shared += 1
            step = min(shared * block_tokens, input_length)
            if 0 < step < input_length:
                branch = (step,)
        by_chat[chat_id] = len(records)
        max_hash = max(max_hash, max(hash_ids))
        records.append(_HashRecord(tuple(hash_ids), input_length, output_length, timestamp, branch))
    return _hash_workload(
        path,
        records,
        block_tokens,
        max_hash,
        f"Bailian trace {path} ({block_tokens} tokens per hash id)",
        1.0,  # Bailian timestamps are seconds
    )


@dataclass(frozen=True, slots=True)
class _TokenRecord:
    prompt: list[int]
    output: list[int] | int  # tokens, or a filler length
    namespace: str


def load_token_jsonl(path: str | Path, progress: Progress | None = None) -> Workload[Any]:
    """Load a jsonl of token-id lists (one request per line; see the module docstring)."""
    records: list[_TokenRecord] = []
    max_token = -1
    for lineno, text in _read_lines(path, progress):
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
        out = (
            rec.output if isinstance(rec.output, list) else Filler(filler_base + index, rec.output)
        )
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
    """'mooncake', 'bailian' or 'tokens', from the first non-blank line; TraceError if none."""
    for lineno, text in _read_lines(path):
        obj = _parse_json(path, lineno, text)
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "bailian" if "chat_id" in obj else "mooncake"
        if isinstance(obj, list) or (isinstance(obj, dict) and "tokens" in obj):
            return "tokens"
        raise TraceError(
            path,
            lineno,
            "neither a Mooncake or Bailian line (an object with 'hash_ids') nor a token line "
            "(a list of token ids, or an object with 'tokens')",
        )
    raise TraceError(path, None, "trace has no requests")


def default_block_tokens(fmt: str) -> int:
    """Tokens per hash id of a hash-id format when the user does not say."""
    return BAILIAN_BLOCK_TOKENS if fmt == "bailian" else TRACE_BLOCK_TOKENS


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    block_tokens: int | None = None,
    progress: Progress | None = None,
) -> Workload[Any]:
    """Load a trace file: `fmt` is 'auto' or one of `FORMATS`. `block_tokens` (tokens per
    hash id) applies to the hash-id formats; None takes the format's default."""
    if fmt == "auto":
        fmt = detect_trace_format(path)
    if fmt == "tokens":
        return load_token_jsonl(path, progress)
    tokens = default_block_tokens(fmt) if block_tokens is None else block_tokens
    if fmt == "mooncake":
        return load_mooncake(path, tokens, progress)
    if fmt == "bailian":
        return load_bailian(path, tokens, progress)
    raise ValueError(f"unknown trace format {fmt!r} (expected auto, {', '.join(FORMATS)})")
