"""Two caches driven by one replay, call by call: a cost ratio that the machine's load cannot skew.

`PairedTimedCache` is what `cache.planner.replay.replay` drives in place of
`bench.run.TimedCache`: every call goes to both caches, `first` and `second`,
each behind its own `TimedCache` (which times and counts it, eviction made
explicit), and the two take turns going first, call by call, each operation
on its own: the second side of a call finds the caches warm with what the
first side just read (the request's tokens), and a replay's calls come in a
fixed pattern (`match`, `allocate`, `commit`, `release`, `poll` per request),
so a single turn for all calls put the same side first on every `match` and
every `poll`, which biased the events row by about 0.02x. On this shared
2-core machine the load of other tenants drifts by tens of percent within
seconds, so two replays run one after the other can differ by more than what
is measured (the events row of `bench.peers` read +0.16x and +0.33x for the
same code, run after run); calls of microseconds, taken in turns, see the same
load.

Both caches must behave identically (the same hits, the same evictions: the
pair checks it on every call and raises `RuntimeError` on the first
difference): the pairing measures what one costs over the other, say events
on over events off. What the replay sees is the first cache's answers; the
sequence it holds is a `PairedSequence`, whose attributes are the first
cache's sequence's.

Attention-only (no host tier, no SSM checkpoints): the calls `bench.peers`'s
rows make.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.run import OpTimes, TimedCache

__all__ = ["PairedSequence", "PairedTimedCache"]


class PairedSequence:
    """The two caches' sequences for one request; reads are the first's."""

    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any) -> None:
        self.first = first
        self.second = second

    def __getattr__(self, name: str) -> Any:
        return getattr(self.first, name)


class PairedTimedCache:
    """`bench.run.TimedCache`'s interface over two caches called in turns (see the
    module docstring); `t` and `t2` are the first's and the second's times."""

    def __init__(
        self,
        first: Any,
        second: Any,
        block_size: int,
        clock: Callable[[], int] = time.thread_time_ns,
        same_events: bool = False,
    ) -> None:
        """`same_events`: at each `poll`, both caches' events are drained (untimed) and
        must be equal (both built with events on)."""
        self.first = first
        self.second = second
        self.same_events = same_events
        self._sides = (TimedCache(first, block_size, clock), TimedCache(second, block_size, clock))
        # operation -> whether the second cache goes first on its next call
        self._turns: dict[str, bool] = {}

    @property
    def t(self) -> OpTimes:
        return self._sides[0].t

    @property
    def t2(self) -> OpTimes:
        return self._sides[1].t

    def _both(
        self, op: str, call: Callable[[TimedCache, Any], Any], seq: PairedSequence | None = None
    ) -> tuple[Any, Any]:
        """`call(timed, its sequence)` for each side, in the order `op`'s turn says;
        their results, first's first. When one raises, the other must raise the same
        kind (`OutOfBlocks`, which the replay handles): that is re-raised."""
        second_first = self._turns[op] = not self._turns.get(op, False)
        seqs = (None, None) if seq is None else (seq.first, seq.second)
        results: list[Any] = [None, None]
        errors: list[Exception | None] = [None, None]
        for side in (1, 0) if second_first else (0, 1):
            try:
                results[side] = call(self._sides[side], seqs[side])
            except Exception as exc:
                errors[side] = exc
        first_error, second_error = errors
        if first_error is not None or second_error is not None:
            if type(first_error) is not type(second_error):
                raise RuntimeError(
                    f"the paired caches differ: {first_error!r} vs {second_error!r}"
                ) from (first_error or second_error)
            raise first_error  # type: ignore[misc]  # both raised the same kind
        return results[0], results[1]

    @staticmethod
    def _same(what: str, a: object, b: object) -> None:
        if a != b:
            raise RuntimeError(f"the paired caches differ: {what} {a!r} vs {b!r}")

    # ------------------------------------------------------- what replay reads

    @property
    def num_free_blocks(self) -> int:
        return self._sides[0].num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._sides[0].num_cached_blocks

    @property
    def num_free_checkpoint_slots(self) -> int:
        return self._sides[0].num_free_checkpoint_slots

    @property
    def stats(self) -> Any:
        return self._sides[0].stats

    # ----------------------------------------------------------- operations

    def match(self, tokens: list[int], namespace: str = "") -> PairedSequence:
        a, b = self._both("match", lambda timed, _: timed.match(tokens, namespace))
        self._same("hit", a.num_cached_tokens, b.num_cached_tokens)
        return PairedSequence(a, b)

    def allocate(self, seq: PairedSequence, num_tokens: int) -> None:
        self._both("allocate", lambda timed, own: timed.allocate(own, num_tokens), seq)
        self._same("evicted", self.t.blocks["evict"], self.t2.blocks["evict"])
        self._same("block table", list(seq.first.block_ids), list(seq.second.block_ids))

    def commit(self, seq: PairedSequence, num_tokens: int) -> None:
        self._both("commit", lambda timed, own: timed.commit(own, num_tokens), seq)

    def release(self, seq: PairedSequence) -> None:
        self._both("release", lambda timed, own: timed.release(own), seq)

    def append(self, seq: PairedSequence, tokens: list[int]) -> None:
        self._both("append", lambda timed, own: timed.append(own, tokens), seq)

    def abort(self, seq: PairedSequence) -> None:
        self._both("abort", lambda timed, own: timed.abort(own), seq)

    def poll(self) -> int:
        done, done2 = self._both("poll", lambda timed, _: timed.poll())
        self._same("copies reaped", done, done2)
        if self.same_events:
            self._same("events", self.first.drain_events(), self.second.drain_events())
        return int(done)

    def check(self) -> None:
        self._both("check", lambda timed, _: timed.cache.check())

    def save(self, seq: PairedSequence, num_tokens: int, runtime_state: Any) -> Any:
        raise TypeError("PairedTimedCache pairs attention-only replays: no SSM checkpoints")

    def restore(self, seq: PairedSequence, runtime_state: Any) -> Any:
        raise TypeError("PairedTimedCache pairs attention-only replays: no SSM checkpoints")

    def load(self, seq: PairedSequence) -> Any:
        raise TypeError("PairedTimedCache pairs attention-only replays: no host tier")
