"""Workloads for replaying through a prefix cache: the `Workload` container,
the built-in synthetic generator and an independent infinite-capacity hit
counter. Trace readers live in `cache.planner.traces`.

A workload is an ordered list of requests. Each `Request` carries its prompt
tokens and the output tokens its decode will append (so that a later turn of
the same conversation, whose prompt contains this output, can hit it).

`synthetic_workload` is the built-in default, seeded: sessions of multi-turn
chat that share a few system prompts, and agentic sessions whose turns are a
chain of short tool calls, each followed by a tool result that the next
request's prompt contains.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "Filler",
    "PrefixCount",
    "Request",
    "SyntheticParams",
    "Workload",
    "count_prefix_hits",
    "synthetic_workload",
]


class Filler(Sequence[int]):
    """`n` copies of one token, without storing them (trace outputs are unknown and may be
    long: ``Filler(t, 10**11)[:10]`` costs ten tokens). Slices are lists."""

    __slots__ = ("n", "token")

    def __init__(self, token: int, n: int) -> None:
        self.token = token
        self.n = n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self.token] * len(range(self.n)[index])
        range(self.n)[index]  # IndexError when out of range
        return self.token

    def __iter__(self) -> Iterator[int]:
        return itertools.repeat(self.token, self.n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Filler):
            return self.n == other.n and (self.n == 0 or self.token == other.token)
        if isinstance(other, (list, tuple)):
            return len(other) == self.n and all(t == self.token for t in other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.token, self.n))

    def __repr__(self) -> str:
        return f"Filler({self.token}, {self.n})"


@dataclass(frozen=True, slots=True)
class Request:
    """One request: prompt tokens, the output tokens decode appends, its namespace.

    `output` is a list, or a `Filler` for the unknown outputs of a trace (slice it
    before making it a list). `arrival_ms` is informational.
    """

    prompt: list[int]
    output: Sequence[int]
    namespace: str = ""
    arrival_ms: float = 0.0
    branch_steps: tuple[int, ...] = ()
    """Prompt steps the workload knows are branch points (a conversation tree's fork),
    besides the one the cache finds (``seq.branch_step``)."""


R = TypeVar("R")


class Workload(Generic[R]):
    """An ordered, re-iterable list of requests, built lazily from compact records.

    Iterating builds each `Request` on the fly (prompts of long traces are
    never all in memory at once). `prompt_tokens` and `output_tokens` are
    known without building anything. `arrivals_s` (optional) holds each
    request's arrival time in seconds, for `duration_s`.
    """

    def __init__(
        self,
        name: str,
        records: Sequence[R],
        build: Callable[[int, R], Request],
        prompt_lengths: Sequence[int],
        output_lengths: Sequence[int],
        description: str = "",
        arrivals_s: Sequence[float] | None = None,
    ) -> None:
        if not (len(records) == len(prompt_lengths) == len(output_lengths)):
            raise ValueError("records, prompt_lengths and output_lengths differ in length")
        if arrivals_s is not None and len(arrivals_s) != len(records):
            raise ValueError("arrivals_s and records differ in length")
        self.arrivals_s: Sequence[float] | None = arrivals_s
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

    @property
    def duration_s(self) -> float | None:
        """Seconds from the first arrival to the last (the trace time the requests
        span); None without arrival times or when they span no time (a trace whose
        timestamps are absent reads them as 0)."""
        arrivals = self.arrivals_s
        if not arrivals:
            return None
        span = max(arrivals) - min(arrivals)
        return span if span > 0 else None

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
            None if self.arrivals_s is None else self.arrivals_s[:n],
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


def synthetic_workload(
    params: SyntheticParams | None = None, progress: Callable[[int], None] | None = None
) -> Workload[Any]:
    """The built-in workload: seeded multi-turn chat and agentic sessions.

    Every session starts with one of `system_prompts` shared system prompts
    (chosen with weights 1, 1/2, 1/3, ...). A chat turn's prompt is the whole
    history (system prompt, earlier messages and answers) plus a new user
    message; its output is the answer. An agentic turn is `tool_calls + 1`
    requests: after the user message the model emits a short tool call, the
    tool result is appended, and the next request's prompt is the grown
    history; the last request of the turn produces the answer. Sessions start
    at Poisson times and their requests interleave by arrival time.
    `progress(n)` is called with the sessions made so far, every 64 and at the end.
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
    for user in range(p.users):
        if progress is not None and user % 64 == 0:
            progress(user)
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
    if progress is not None:
        progress(p.users)
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
        [r.arrival_ms / 1000.0 for r in records],
    )


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


class _Prefixes:
    """Every distinct block prefix seen, held exactly and compactly: a trie whose rows
    are prefixes, stored as columns (about 70 bytes a prefix, no object per row).

    A row's last block is its tokens packed as native uint32 (`width` bytes in
    `tokens`), or, when an id needs 64 bits, as uint64 plus a marker byte in
    `wide`; `child` holds a row's only child, `_NONE` or `_MANY` (then its
    children are in `kids`, keyed by packed block; roots always use `kids`).
    Compared byte for byte: a hash never decides identity.
    """

    _NONE = -1
    _MANY = -2

    def __init__(self, block_size: int) -> None:
        self.width = 4 * block_size
        self.tokens = bytearray()
        self.child = array("i")
        self.kids: dict[int, dict[bytes, int]] = {}
        self.wide: dict[int, bytes] = {}
        self.roots: dict[str, int] = {}
        self.distinct = 0
        """Rows that are block prefixes (not roots)."""

    def pack(self, block: Sequence[int]) -> bytes:
        try:
            return array("I", block).tobytes()
        except OverflowError:  # an id past 32 bits (token traces allow 64)
            return array("Q", block).tobytes() + b"\x08"

    def _row(self, packed: bytes) -> int:
        row = len(self.child)
        self.child.append(self._NONE)
        if len(packed) == self.width:
            self.tokens += packed
        else:
            self.tokens += bytes(self.width)
            self.wide[row] = packed
        return row

    def root(self, namespace: str) -> int:
        row = self.roots.get(namespace)
        if row is None:
            row = self.roots[namespace] = self._row(bytes(self.width))
            self.child[row] = self._MANY
            self.kids[row] = {}
        return row

    def find(self, parent: int, packed: bytes) -> int:
        """The row of `parent` + the block packed as `packed`, or -1."""
        only = self.child[parent]
        if only >= 0:
            wide = self.wide.get(only)
            if wide is not None:
                return only if wide == packed else -1
            at = only * self.width
            same = len(packed) == self.width and self.tokens.startswith(packed, at, at + self.width)
            return only if same else -1
        if only == self._NONE:
            return -1
        return self.kids[parent].get(packed, -1)

    def add(self, parent: int, packed: bytes) -> int:
        """The row of `parent` + the block packed as `packed`, made if new."""
        row = self.find(parent, packed)
        return row if row >= 0 else self._attach(parent, packed)

    def _attach(self, parent: int, packed: bytes) -> int:
        """A new row for `parent` + `packed` (which `parent` must not have yet)."""
        row = self._row(packed)
        self.distinct += 1
        only = self.child[parent]
        if only == self._NONE:
            self.child[parent] = row
        elif only >= 0:  # a second child: both go to a dict
            self.kids[parent] = {self._packed(only): only, packed: row}
            self.child[parent] = self._MANY
        else:
            self.kids[parent][packed] = row
        return row

    def commit(self, root: int, blocks: Sequence[int], block_size: int) -> int:
        """Add every whole-block prefix of `blocks` under `root`; returns how many
        of them were there before (the leading blocks an earlier commit made).

        One walk: the blocks are packed in one call when every id fits 32 bits,
        and past the first new block every later prefix is new too (a new row
        has no children), so those are attached without a lookup.
        """
        n = len(blocks) // block_size
        width = self.width
        try:
            buf = array("I", blocks[: n * block_size]).tobytes()
            keys = [buf[at : at + width] for at in range(0, n * width, width)]
        except OverflowError:  # an id past 32 bits: each block packs by its own ids
            keys = [self.pack(blocks[i * block_size : (i + 1) * block_size]) for i in range(n)]
        prefix = root
        for i, packed in enumerate(keys):
            row = self.find(prefix, packed)
            if row < 0:
                for rest in keys[i:]:
                    prefix = self._attach(prefix, rest)
                return i
            prefix = row
        return n

    def _packed(self, row: int) -> bytes:
        wide = self.wide.get(row)
        if wide is not None:
            return wide
        at = row * self.width
        return bytes(self.tokens[at : at + self.width])


def count_prefix_hits(
    workload: Workload[Any],
    block_size: int,
    max_decode_tokens: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> PrefixCount:
    """Count, without any cache, the tokens an infinite prefix cache would serve.

    A request's hit is its longest prefix of whole blocks that an earlier
    request committed (its prompt, then its decoded output, up to
    `max_decode_tokens`), in the same namespace, capped so that at least one
    prompt token is left to compute. The prefixes seen are held exactly in a
    compact trie of their own (`_Prefixes`), sharing no code with the cache.
    `progress(n)` is called with the requests counted so far, every 256 and at the end.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    prefixes = _Prefixes(block_size)
    hit_tokens = 0
    prompt_tokens = 0
    max_blocks = 0
    requests = 0
    b = block_size
    for req in workload:
        requests += 1
        if progress is not None and requests % 256 == 0:
            progress(requests)
        prompt = req.prompt
        prompt_tokens += len(prompt)
        output = req.output if max_decode_tokens is None else req.output[:max_decode_tokens]
        full = [*prompt, *output]
        max_blocks = max(max_blocks, -(-len(full) // b))
        # The prompt's first blocks are the committed sequence's first blocks, so
        # the prefixes earlier requests made are what this request hits, capped so
        # that one prompt token is left to compute.
        known = prefixes.commit(prefixes.root(req.namespace), full, b)
        hit_tokens += max(0, min(known, (len(prompt) - 1) // b)) * b
    if progress is not None:
        progress(requests)
    return PrefixCount(requests, prompt_tokens, hit_tokens, prefixes.distinct, max_blocks)
