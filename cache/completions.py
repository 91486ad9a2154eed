"""Copy completion and failure reported from other threads ([R58]).

A trie belongs to one scheduler thread ([R45]), but engines learn that a copy
finished or failed on threads of their own: a CUDA host callback, an RDMA or
NIXL transfer thread, a watchdog that cancels a request. `CompletionQueue` is
the one door those reports come through. A report is either applied at once,
when that is safe, or recorded (a `deque` append, atomic in CPython) and
applied later by the owning thread, so no state the scheduler is in the middle
of changing is ever changed under it:

- On a thread other than the owner, a report is always recorded; it never
  takes the trie's gate, so the scheduler's own calls are never refused
  because a completion thread happened to be inside.
- On the owning thread, outside any operation, it takes the gate (without
  waiting), applies what was recorded before it, then itself. Inside an
  operation of that thread (a callback the operation ran) or while a monitor
  holds the gate, it is recorded. Inside the data movement of a copy that the
  owning thread is completing (a move that reports its own copy failed), it is
  applied at once: nothing else is half-done there.
- Recorded reports are applied by the owning thread, in the order they were
  made, at its next `poll()` (before it reaps, so that poll reaps them), its
  next `Copy.wait()` or its next report. Each acts as the call would have at
  that moment; a report that no longer applies (a failure of a copy that has
  finished since, a completion of one that has failed) is dropped.

The owning thread is the one that built the trie, and then the last one to
call `poll()` (reaping is the scheduler's call).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Report = Callable[[bool], None]
"""A report: called with True when it is applied later (recorded), False when at
once (it may then raise to the caller)."""


class CompletionQueue:
    """The reports other threads make about one trie's copies, until applied."""

    __slots__ = ("_gate", "_nested", "_owner", "_records")

    def __init__(self, gate: threading.Lock) -> None:
        self._gate = gate
        self._owner = threading.get_ident()
        self._records: deque[Report] = deque()
        self._nested = 0

    def __len__(self) -> int:
        """Reports recorded and not applied yet."""
        return len(self._records)

    def on_owner(self) -> bool:
        """Whether the calling thread is the owning thread."""
        return threading.get_ident() == self._owner

    def submit(self, report: Report) -> None:
        """Apply `report` now when that is safe, else record it (module docstring)."""
        if threading.get_ident() != self._owner:
            self._records.append(report)
            return
        if self._nested:
            report(False)
            return
        gate = self._gate
        if not gate.acquire(False):  # an operation (or a monitor) holds the trie
            self._records.append(report)
            return
        try:
            try:
                self._apply()
            except BaseException:  # an interrupt inside an earlier report: this one waits
                self._records.append(report)
                raise
            report(False)
        finally:
            gate.release()

    def flush(self) -> None:
        """Apply the recorded reports now, when the calling thread is the owner and
        nothing holds the trie (`Copy.wait()`: a failure reported before the wait
        is seen by it)."""
        if not self._records or self._nested or threading.get_ident() != self._owner:
            return
        gate = self._gate
        if not gate.acquire(False):
            return
        try:
            self._apply()
        finally:
            gate.release()

    def claim_and_apply(self) -> None:
        """The trie's `poll()`, under its gate: the calling thread becomes the owner,
        and every recorded report is applied, oldest first."""
        self._owner = threading.get_ident()
        self._apply()

    def _apply(self) -> None:
        records = self._records
        while records:
            records.popleft()(True)

    @contextmanager
    def running(self) -> Iterator[None]:
        """While the owning thread runs a copy's data movement: a report made inside
        it (on that thread) is applied at once."""
        self._nested += 1
        try:
            yield
        finally:
            self._nested -= 1
