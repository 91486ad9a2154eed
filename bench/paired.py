"""Two caches driven by one replay, call by call: a cost ratio that the machine's load cannot skew.

`PairedTimedCache` is what `cache.planner.replay.replay` drives in place of
`bench.run.TimedCache`: every call goes to both caches, `first` and `second`,
which take turns going first (call by call), and each side's thread CPU time
is kept apart (`OpTimes` each). On this shared 2-core machine the load of
other tenants drifts by tens of percent within seconds, so two replays run one
after the other can differ by more than what is measured (the events row of
`bench.peers` read +0.16x and +0.33x for the same code, run after run); calls of
microseconds, taken in turns, see the same load.

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

from bench.run import OpTimes

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
    module docstring); `t` and `t2` are the first's and the second's times.

    Eviction is explicit, as in `TimedCache`: before `allocate`, the first
    cache's shortfall is evicted from both (timed as evict).
    """

    def __init__(
        self,
        first: Any,
        second: Any,
        block_size: int,
        clock: Callable[[], int] = time.thread_time_ns,
    ) -> None:
        self.first = first
        self.second = second
        self.b = block_size
        self.t = OpTimes()
        self.t2 = OpTimes()
        self.clock = clock
        self._turn = False  # whether the second cache goes first on the next call

    # ------------------------------------------------------------ the pair

    def _both(
        self, op: str | None, on_first: Callable[[], Any], on_second: Callable[[], Any]
    ) -> tuple[Any, Any]:
        """Both calls, in this call's order, each timed into its side's `op` (its
        `other_ns` when `op` is None); their results, first's first."""
        clock = self.clock
        self._turn = not self._turn
        calls = ((on_first, self.t), (on_second, self.t2))
        results: list[Any] = [None, None]
        errors: list[Exception | None] = [None, None]
        for side in (1, 0) if self._turn else (0, 1):
            call, times = calls[side]
            t0 = clock()
            try:
                results[side] = call()
            except Exception as exc:  # the other side must raise it too (OutOfBlocks)
                errors[side] = exc
            finally:
                elapsed = clock() - t0
                if op is None:
                    times.other_ns += elapsed
                else:
                    times.ns[op] += elapsed
                times.calls += 1
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
        return int(self.first.num_free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return int(self.first.num_cached_blocks)

    @property
    def num_free_checkpoint_slots(self) -> int:
        return int(self.first.num_free_checkpoint_slots)

    @property
    def stats(self) -> Any:
        return self.first.stats

    # ----------------------------------------------------------- operations

    def match(self, tokens: list[int], namespace: str = "") -> PairedSequence:
        first, second = self.first, self.second
        a, b = self._both(
            "match", lambda: first.match(tokens, namespace), lambda: second.match(tokens, namespace)
        )
        self._same("hit", a.num_cached_tokens, b.num_cached_tokens)
        blocks = len(tokens) // self.b
        self.t.blocks["match"] += blocks
        self.t2.blocks["match"] += blocks
        return PairedSequence(a, b)

    def allocate(self, seq: PairedSequence, num_tokens: int) -> None:
        first, second = self.first, self.second
        need = -(-num_tokens // self.b) - len(seq.first.block_ids)
        if need <= 0:
            return
        short = need - first.num_free_blocks
        if short > 0:
            freed, freed2 = self._both(
                "evict", lambda: first.evict(short), lambda: second.evict(short)
            )
            self._same("evicted", freed, freed2)
            self.t.blocks["evict"] += freed
            self.t2.blocks["evict"] += freed2
        self._both(
            "allocate",
            lambda: first.allocate(seq.first, num_tokens),
            lambda: second.allocate(seq.second, num_tokens),
        )
        self._same("block table", list(seq.first.block_ids), list(seq.second.block_ids))
        self.t.blocks["allocate"] += need
        self.t2.blocks["allocate"] += need

    def commit(self, seq: PairedSequence, num_tokens: int) -> None:
        first, second = self.first, self.second
        before = seq.first.num_committed_tokens // self.b
        self._both(
            "commit",
            lambda: first.commit(seq.first, num_tokens),
            lambda: second.commit(seq.second, num_tokens),
        )
        blocks = num_tokens // self.b - before
        self.t.blocks["commit"] += blocks
        self.t2.blocks["commit"] += blocks

    def release(self, seq: PairedSequence) -> None:
        first, second = self.first, self.second
        n = len(seq.first.block_ids)
        self._both("release", lambda: first.release(seq.first), lambda: second.release(seq.second))
        self.t.blocks["release"] += n
        self.t2.blocks["release"] += n

    def append(self, seq: PairedSequence, tokens: list[int]) -> None:
        first, second = self.first, self.second
        self._both(
            None, lambda: first.append(seq.first, tokens), lambda: second.append(seq.second, tokens)
        )

    def abort(self, seq: PairedSequence) -> None:
        first, second = self.first, self.second
        self._both(None, lambda: first.abort(seq.first), lambda: second.abort(seq.second))

    def poll(self) -> int:
        first, second = self.first, self.second
        done, done2 = self._both(None, lambda: int(first.poll()), lambda: int(second.poll()))
        self._same("copies reaped", done, done2)
        return int(done)

    def check(self) -> None:
        first, second = self.first, self.second
        self._both(None, first.check, second.check)

    def save(self, seq: PairedSequence, num_tokens: int, runtime_state: Any) -> Any:
        raise TypeError("PairedTimedCache pairs attention-only replays: no SSM checkpoints")

    def restore(self, seq: PairedSequence, runtime_state: Any) -> Any:
        raise TypeError("PairedTimedCache pairs attention-only replays: no SSM checkpoints")

    def load(self, seq: PairedSequence) -> Any:
        raise TypeError("PairedTimedCache pairs attention-only replays: no host tier")
