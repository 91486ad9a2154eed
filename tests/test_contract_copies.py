"""Contract details of `cache.copies` (mutation survivors).

`DeviceCopies` on a CUDA device, against a fake CUDA runtime (this host has no
CUDA; the fake records every stream and event call): a copy is queued on the
engine's side stream of the pools' device, which first waits for that
device's current stream; its moves run inside the side stream, every CUDA
tensor they touch is recorded on it, and an event recorded after them decides
when the copy is done (its temporaries are released then). `wait()` blocks
the host on the event when a host tensor is read or written (stores, saves
and restores of host tensors), and only makes the device's current stream
wait when not (loads, device-only copies).

The engines' refusals name the engine and the copy exactly.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cache.copies import Copy, DeviceCopies, ManualCopies, TensorMove
from spec.errors import (
    CacheError,
    CopyFailed,
    IllegalTransition,
    InvalidArgument,
    InvalidType,
)
from spec.lifecycle import CopyTrigger


class _Log:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.active: list[Any] = []  # the stream context stack
        self.current: dict[Any, _Stream] = {}
        self.queued: list[Any] = []  # work a deferring stream has not run yet


class _Stream:
    def __init__(self, log: _Log, device: Any = None, name: str = "side") -> None:
        self.log, self.device, self.name = log, device, name

    def wait_stream(self, other: Any) -> None:
        self.log.calls.append(("wait_stream", self, other))

    def wait_event(self, event: Any) -> None:
        self.log.calls.append(("wait_event", self, event))

    def synchronize(self) -> None:
        self.log.calls.append(("stream_synchronize", self))
        while self.log.queued:  # what the stream still had to run, in order
            self.log.queued.pop(0)()

    def __repr__(self) -> str:
        return f"<{self.name} stream {self.device}>"


class _Event:
    def __init__(self, log: _Log) -> None:
        self.log, self.fired, self.stream = log, False, None
        log.calls.append(("event",))

    def record(self, stream: Any) -> None:
        self.stream = stream
        self.log.calls.append(("record", stream))

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.log.calls.append(("synchronize", self))


class _Tensor:
    """A long-lived tensor a move touches: on the device or on the host."""

    def __init__(self, log: _Log, is_cuda: bool) -> None:
        self.log, self.is_cuda = log, is_cuda

    def record_stream(self, stream: Any) -> None:
        self.log.calls.append(("record_stream", self, stream))


class _Move:
    def __init__(self, log: _Log, *tensors: _Tensor) -> None:
        self.log, self._tensors = log, tensors

    def run(self) -> None:
        self.log.calls.append(("run", self, self.log.active[-1] if self.log.active else None))

    def tensors(self) -> tuple[Any, ...]:
        return self._tensors

    def release(self) -> None:
        self.log.calls.append(("release", self))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _Log:
    log = _Log()

    def current_stream(device: Any = None) -> _Stream:
        if device not in log.current:
            log.current[device] = _Stream(log, device, "current")
        return log.current[device]

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        log.active.append(s)
        try:
            yield
        finally:
            log.active.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(log, device))
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log


CUDA1 = torch.device("cuda", 1)


def _engine(log: _Log) -> tuple[DeviceCopies, _Stream]:
    copies = DeviceCopies()
    copies.bind(CUDA1)
    assert copies._side is not None
    side = copies._side.stream
    assert isinstance(side, _Stream) and side.device == CUDA1
    return copies, side


def test_a_cuda_copy_runs_on_the_side_stream_and_finishes_with_its_event(
    fake_cuda: _Log,
) -> None:
    log = fake_cuda
    copies, side = _engine(log)
    assert log.calls == [], "binding creates the side stream only"
    device_t, host_t = _Tensor(log, True), _Tensor(log, False)
    first, second = _Move(log, device_t, host_t), _Move(log, device_t)
    copy = Copy("store", 0, [first, second], [], 7)
    copies.queue(copy)
    current = log.current[CUDA1]
    event = copy._event
    assert isinstance(event, _Event) and event.stream is side
    assert log.calls == [
        ("wait_stream", side, current),  # after the work already queued on the device
        ("run", first, side),
        ("run", second, side),
        ("record_stream", device_t, side),  # CUDA tensors only, once per move
        ("record_stream", device_t, side),
        ("event",),
        ("record", side),
    ]
    log.calls.clear()
    assert not copy.done and copy.state == "queued"
    assert copies.collect() == [] and log.calls == []
    event.fired = True
    assert copies.collect() == [copy]
    assert copy.done and copy.state == "finished"
    assert log.calls == [("release", first), ("release", second)], "temporaries dropped"
    assert copies.collect() == []


@pytest.mark.parametrize(
    ("kind", "host_tensor", "blocks_host"),
    [
        ("store", True, True),  # writes the host pool: the host waits
        ("save", True, True),  # a host tensor read or written
        ("restore", False, False),  # device tensors only: the device stream waits
        ("load", True, False),  # reads the host tier only: the device stream waits
    ],
)
def test_waiting_for_a_cuda_copy_blocks_the_host_only_for_host_tensors(
    fake_cuda: _Log, kind: str, host_tensor: bool, blocks_host: bool
) -> None:
    log = fake_cuda
    copies, _ = _engine(log)
    move = _Move(log, _Tensor(log, True), _Tensor(log, not host_tensor))
    copy = Copy(kind, 0, [move], [], 1)
    copies.queue(copy)
    log.calls.clear()
    copy.wait()
    event = copy._event
    if blocks_host:
        assert log.calls == [("synchronize", event)]
    else:
        assert log.calls == [("wait_event", log.current[CUDA1], event)]
        assert log.current[CUDA1].device == CUDA1, "the pools' device's current stream"


def test_an_engine_binds_once_and_names_itself_when_bound_again() -> None:
    for engine in (DeviceCopies(), ManualCopies()):
        engine.bind(torch.device("cpu"))
        name = type(engine).__name__
        with pytest.raises(CacheError, match=rf"^{name} is already bound to another BlockTrie$"):
            engine.bind(torch.device("cpu"))


def test_failing_a_copy_names_what_is_wrong() -> None:
    engine, other = ManualCopies(), DeviceCopies()
    with pytest.raises(InvalidType, match=r"^fail\(\) takes a Copy, got int$"):
        engine.fail(3)  # type: ignore[arg-type]
    stranger = Copy("save", 2, [], [("slot", 0)], 5)
    with pytest.raises(
        InvalidArgument, match=r"^<Copy #5 save step=2 queued> was not queued on this ManualCopies$"
    ):
        engine.fail(stranger)
    other.bind(torch.device("cpu"))
    done = Copy("store", 0, [], [], 6)
    other.queue(done)  # on CPU: finished at once
    with pytest.raises(
        InvalidArgument,
        match=r"^fail\(\): <Copy #6 store step=0 finished> already finished; its data arrived$",
    ):
        other.fail(done)
    with pytest.raises(
        InvalidArgument,
        match=r"^<Copy #6 store step=0 finished> was not queued on this ManualCopies$",
    ):
        engine.fail(done)


def test_a_failed_copy_can_neither_complete_nor_be_waited_for() -> None:
    engine = ManualCopies()
    copy = Copy("load", 0, [], [("block", 1)], 9)
    engine.queue(copy)
    engine.fail(copy)
    engine.fail(copy)  # failing a failed copy does nothing
    assert copy.failed and copy.state == "failed"
    with pytest.raises(
        CopyFailed,
        match=r"^complete\(\): <Copy #9 load step=0 failed> failed; it can never complete$",
    ):
        engine.complete(copy)
    with pytest.raises(
        CopyFailed, match=r"^<Copy #9 load step=0 failed> failed: its data never arrived$"
    ):
        copy.wait()
    stranger = Copy("save", 1, [], [], 4)
    with pytest.raises(
        InvalidArgument, match=r"^<Copy #4 save step=1 queued> was not queued on this ManualCopies$"
    ):
        engine.complete(stranger)


def test_a_failed_cuda_copy_keeps_its_temporaries_until_reaped(fake_cuda: _Log) -> None:
    """A CUDA copy declared failed may still be running on the side stream: its moves
    release their temporaries only when the trie reaps it."""
    log = fake_cuda
    copies, _ = _engine(log)
    move = _Move(log, _Tensor(log, True))
    copy = Copy("load", 0, [move], [], 3)
    assert copy.failed is False and copy.state == "queued"
    copies.queue(copy)
    log.calls.clear()
    copies.fail(copy)
    assert copy.failed is True and copy.state == "failed" and copy.done
    assert log.calls == [], "nothing released while the stream may still write"
    assert copies.collect() == [copy]
    assert log.calls == []
    copy.fire(CopyTrigger.REAP)
    assert copy.state == "reaped" and copy.failed is True
    assert log.calls == [("release", move)]


def test_an_illegal_copy_step_names_the_copy_and_changes_nothing() -> None:
    copy = Copy("restore", 3, [], [("slot", 1)], 7)
    message = (
        "copy lifecycle: trigger 'reap' is not allowed from state 'queued' "
        "on <Copy #7 restore step=3 queued>"
    )
    with pytest.raises(IllegalTransition, match=f"^{re.escape(message)}$"):
        copy.fire(CopyTrigger.REAP)
    assert copy.state == "queued" and copy.failed is False


def test_a_copy_never_queued_has_no_engine_to_wait_for() -> None:
    """`wait()` on a copy no engine has queued returns at once and changes nothing."""
    copy = Copy("save", 1, [], [("slot", 0)], 2)
    copy.wait()
    assert copy.state == "queued" and copy.failed is False


def test_forget_drops_exactly_the_copy_it_names_wherever_it_is_queued() -> None:
    engine = ManualCopies()
    first, middle, last = (Copy("save", 1, [], [("slot", i)], i) for i in range(3))
    for copy in (first, middle, last):
        engine.queue(copy)
    engine.forget(middle)
    assert engine.pending() == [first, last]
    engine.forget(last)
    assert engine.pending() == [first]
    engine.forget(Copy("save", 1, [], [], 9))  # never queued: nothing to drop
    assert engine.pending() == [first]
    engine.forget(first)
    engine.forget(first)  # nothing queued at all
    assert engine.pending() == [] and engine.collect() == []


def test_completing_a_non_copy_names_its_type() -> None:
    with pytest.raises(InvalidType, match=r"^complete\(\) takes a Copy, got int$"):
        ManualCopies().complete(3)  # type: ignore[arg-type]


def test_completing_a_copy_completes_only_the_earlier_pending_copies_it_shares_with() -> None:
    """A stream runs in order: completing a copy first completes each earlier pending
    copy that touches one of its slots or blocks, and no other."""
    engine = ManualCopies()
    data = [torch.full((2,), float(i + 1)) for i in range(3)]
    out = [torch.zeros(2) for _ in range(3)]
    other = Copy("save", 1, [TensorMove(data[0], out[0])], [("slot", 0)], 1)
    shared = Copy("save", 1, [TensorMove(data[1], out[1])], [("slot", 1)], 2)
    copy = Copy("restore", 1, [TensorMove(data[2], out[2])], [("slot", 1), ("block", 4)], 3)
    for c in (other, shared, copy):
        engine.queue(c)
    engine.complete(copy)
    assert [c.state for c in (other, shared, copy)] == ["queued", "finished", "finished"]
    assert [t.tolist() for t in out] == [[0.0, 0.0], [2.0, 2.0], [3.0, 3.0]]
    assert engine.pending() == [other]


def test_waiting_for_a_manual_copy_completes_it_with_the_copies_it_depends_on() -> None:
    engine = ManualCopies()
    src, mid, dst = torch.ones(2), torch.zeros(2), torch.zeros(2)
    first = Copy("save", 1, [TensorMove(src, mid)], [("slot", 0)], 1)
    second = Copy("restore", 1, [TensorMove(mid, dst)], [("slot", 0)], 2)
    engine.queue(first)
    engine.queue(second)
    second.wait()
    assert (first.state, second.state) == ("finished", "finished")
    assert dst.tolist() == [1.0, 1.0] and engine.pending() == []


class _FailsOnRun:
    """A move whose run declares another queued copy failed (as an engine that sees
    it go wrong would)."""

    def __init__(self, engine: ManualCopies) -> None:
        self.engine = engine
        self.victim: Copy | None = None

    def run(self) -> None:
        assert self.victim is not None
        self.engine.fail(self.victim)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def release(self) -> None:
        pass


def test_a_copy_failed_while_its_earlier_copies_complete_never_completes() -> None:
    engine = ManualCopies()
    move = _FailsOnRun(engine)
    earlier = Copy("save", 1, [move], [("slot", 0)], 1)
    out = torch.zeros(2)
    copy = Copy("restore", 1, [TensorMove(torch.ones(2), out)], [("slot", 0)], 2)
    move.victim = copy
    engine.queue(earlier)
    engine.queue(copy)
    with pytest.raises(
        CopyFailed,
        match=r"^complete\(\): <Copy #2 restore step=1 failed> failed; it can never complete$",
    ):
        engine.complete(copy)
    assert (earlier.state, copy.state) == ("finished", "failed")
    assert out.tolist() == [0.0, 0.0]


# ----------------------------------------- an interrupt after the copy was queued ([R59])


class _InterruptedEvent(_Event):
    """An event whose recording is interrupted (a KeyboardInterrupt, an allocator
    error): the copy is already queued on the stream, its event never recorded."""

    def record(self, stream: Any) -> None:
        raise KeyboardInterrupt


def test_an_interrupt_after_a_cuda_copy_was_queued_waits_the_stream_out_before_the_undo(
    fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 3. A restore of a partial checkpoint queues its copy on the
    side stream (the frozen tail -> the block the restore just allocated), then is
    interrupted before the copy's event is recorded. The [R38] undo frees that
    block: before [R59] at once, while the queued copy would still write it
    (another request's KV, once the block is handed out again). Now the stream is
    waited out first: the copy ran while the block was still the restore's."""
    from tests.helpers import empty_state, ssm_trie, state

    log = fake_cuda
    trie, _ = ssm_trie(manual=False)  # CPU pools; DeviceCopies
    seq = trie.match([1, 1, 1, 1, 2, 2, 3])
    trie.allocate(seq, 7)
    trie.commit(seq, 7)
    trie.save(seq, 6, state(5.0))  # a partial checkpoint, frozen tail [2, 2]
    trie.release(seq)
    engine = trie.copies
    assert isinstance(engine, DeviceCopies)
    engine._bind(CUDA1)  # from now on its copies go through the (fake) CUDA side stream
    hit = trie.match([1, 1, 1, 1, 2, 2, 9])
    assert hit.restore is not None and hit.restore.step == 6
    target = min(trie.snapshot()["free_blocks"])  # the private block [R33] will take
    held_when_written: list[bool] = []
    run = Copy.run

    def queue_it(copy: Copy) -> None:  # the stream runs it later, in order
        def later() -> None:
            held_when_written.append(trie._kv.refs[target] > 0)  # (inside the restore)
            run(copy)

        log.queued.append(later)

    monkeypatch.setattr(Copy, "run", queue_it)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _InterruptedEvent(log))
    before = trie.snapshot()
    out = empty_state()
    with pytest.raises(KeyboardInterrupt):
        trie.restore(hit, out)
    assert log.queued == [], "the stream was not waited out: the copy is still queued"
    assert held_when_written == [True], "the copy wrote a block already freed"
    assert trie.snapshot() == before, "the restore was undone"
    assert target in trie.snapshot()["free_blocks"]
    trie.release(hit)
    trie.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_interrupt_after_a_real_cuda_copy_was_queued_waits_for_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[R59] on a real device: a restore interrupted between queuing its copy and
    recording the event returns only once the side stream has run the copy."""
    from cache import BlockTrie, CacheConfig

    config = CacheConfig(
        block_size=4, num_blocks=8, kv_block_shape=(4, 1 << 18), kv_dtype=torch.float32,
        num_checkpoint_slots=2, state_shapes={"s": (1 << 22,)}, state_dtype=torch.float32,
        device="cuda",
    )  # fmt: skip
    trie = BlockTrie(config)
    seq = trie.match([1, 1, 1, 1, 2, 2, 3])
    trie.allocate(seq, 7)
    trie.commit(seq, 7)
    trie.save(seq, 6, {"s": torch.ones(1 << 22, device="cuda")})
    torch.cuda.synchronize()
    trie.poll()
    trie.release(seq)
    hit = trie.match([1, 1, 1, 1, 2, 2, 9])
    engine = trie.copies
    assert isinstance(engine, DeviceCopies) and engine._side is not None

    class Interrupted:
        def record(self, stream: Any) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(torch.cuda, "Event", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        trie.restore(hit, {"s": torch.zeros(1 << 22, device="cuda")})
    assert engine._side.stream.query(), "returned while the side stream still ran the copy"
    monkeypatch.undo()
    trie.release(hit)
    trie.check()
