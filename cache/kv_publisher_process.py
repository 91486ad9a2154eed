"""`ProcessEventPublisher`: KV events encoded and published by another process.

`KVEventPublisher` encodes each batch in the engine's process, and a batch's
events are built there too, one `BlockStored` per commit: together about half
of what events cost the engine (docs/events.md, "Cost"). This publisher takes
what `BlockTrie.drain_event_records()` returns, the events *unbuilt*, packs
each commit's blocks into a few flat buffers (its hashes, block ids and token
bytes), and writes that frame, without blocking, to a child process. The child
builds the events and publishes them with a `KVEventPublisher` of its own, so
subscribers get exactly the bytes an in-process publisher would send
(`encode_batch` of the same events; vLLM's ZMQ wire, sequence numbers and
replay socket).

Transport: the child is started with the same interpreter (``python -m
cache.kv_publisher_process``); frames go down its stdin, each a 4-byte
little-endian length and the frame, and it reports on its stdout, one JSON
object per line (first that it is ready, or why its publisher failed; then how
many batches it has sent; each with its CPU time so far: `encoder_cpu_s`). The
engine's process runs no ZMQ at all: a frame costs it one non-blocking `write`
(a ZMQ socket cost it a wake-up of its I/O thread per frame, several times the
write, on the cores the engine and the child share). The child reads without
waiting on the pipe while frames keep coming (it naps a millisecond between
reads), so a write seldom has a sleeper to wake; after `_ACTIVE_S` without a
frame it waits on the pipe. It exits at the end of its stdin: when `close`
closes it, or when the engine's process is gone (also checked by its parent
pid while idle, in case another process holds the pipe).

Numbering and drops: the engine side numbers every batch. A frame the pipe
cannot take (the child is behind and the pipe's buffer, 1 MiB where Linux
allows, is full) waits in the engine, in order, up to `queue_batches` frames,
and goes with the next call (`publish`, `poll_status`, `wait_published`,
`close`); a batch past that is dropped there, counted in `dropped_batches` /
`dropped_events` and logged, and its number is skipped, so subscribers see the
gap. A batch published after the child has exited is dropped the same way,
logged as an error, and so are the frames still waiting for it (or waiting
when `close` runs out of time).
`published_batches` counts the batches the child has handed to its PUB
socket (it reports whenever it has caught up). Binding
errors (a port in use) are raised by the constructor as `zmq.ZMQError`, as
`KVEventPublisher`'s are; its bad sizes as `ValueError`.

Frame (msgpack): ``[seq, ts, items]``, the drained records as they are: a
commit's stored blocks as its recorded run (``[parent_hash, hashes, tokens,
block_ids, block_size, namespace]``, `hashes` the native-order uint64 bytes of
`cache.event_log.packed_hashes` (the child runs on the same machine), `tokens`
the blocks' uint32 key bytes, joined), a `BlockRemoved` as its five fields
(``[hashes, block_ids, namespace, medium, group_idx]``), and any other event
(rare: host-tier moves, checkpoints, clears) as its pickle (a msgpack bin).
Nothing is rebuilt per record: packing a batch costs the engine one check of
its records' types and msgspec's copy of them, encoded in place behind the
frame's length (rebuilding each record as a tagged list cost as much again).
Hashes are sent as they are, or as their low 64 bits (what the wire carries)
when one is wider (a `vllm` digest). A commit whose keys are not plain uint32 blocks (an
extra identity, 64-bit ids) was built by the commit itself (`cache.event_log`)
and is pickled.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

from cache.event_log import EventRecords, StoredRun
from cache.events import BlockRemoved, Event
from cache.extras import requires_extra

with requires_extra("events", "cache.kv_publisher_process"):
    import msgspec
    import zmq

__all__ = ["ProcessEventPublisher", "decode_frame", "decode_records", "encode_frame"]

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_RUN_FIELDS, _REMOVED_FIELDS = 6, 5
"""Fields of a stored run and of a `BlockRemoved` in a frame (how the child tells them apart)."""
_HEADER = 4
"""Bytes of a frame's length on the pipe (little-endian)."""
_PIPE_BYTES = 1 << 20
"""The pipe buffer asked for (Linux's default limit for an unprivileged process)."""
_ACTIVE_S = 0.05
"""The child keeps reading without waiting on the pipe this long after a frame."""
_NAP_S = 0.001
"""... napping this long between reads that find nothing."""
_IDLE_S = 0.1
"""Idle, the child waits on the pipe this long before checking its parent pid."""
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


_PLAIN = frozenset({tuple, BlockRemoved})
"""The record types a frame carries as they are (stored runs, `BlockRemoved`)."""


def _pickled(items: Sequence[Event | StoredRun]) -> list[Any]:
    """`items` with every record that is neither a stored run nor a `BlockRemoved`
    pickled (what a frame carries for the rare other events)."""
    return [
        x if type(x) in _PLAIN else pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in items
    ]


def _masked(items: list[Any]) -> list[Any]:
    """`items` (a frame's) with every hash cut to the 64 bits the wire carries
    (`vllm` digests)."""
    out: list[Any] = []
    for x in items:
        if type(x) is tuple:  # a stored run (its hashes a list: digests, not packed)
            parent, hashes, *rest = x
            parent = None if parent is None else parent & _MASK
            if type(hashes) is list:
                hashes = [h & _MASK for h in hashes]
            x = (parent, hashes, *rest)
        elif type(x) is BlockRemoved:
            x = x._replace(block_hashes=tuple(h & _MASK for h in x.block_hashes))
        out.append(x)
    return out


def encode_frame(
    batch: EventRecords | Sequence[Event], *, seq: int, ts: float | None = None
) -> bytes:
    """The frame the engine's process sends for one batch (see the module docstring)."""
    return bytes(memoryview(_framed(batch, seq, ts))[_HEADER:])


def _framed(batch: EventRecords | Sequence[Event], seq: int, ts: float | None) -> bytearray:
    """A batch's frame behind its length (`_HEADER` bytes): what goes down the pipe,
    encoded in place behind the header (no second copy of the frame to prefix it)."""
    items = batch.items if isinstance(batch, EventRecords) else batch
    if not _PLAIN.issuperset(map(type, items)):
        items = _pickled(items)
    stamp = time.time() if ts is None else float(ts)
    out = bytearray(_HEADER)
    try:
        _encoder.encode_into((seq, stamp, items), out, _HEADER)
    except OverflowError:  # a `vllm` 256-bit digest (`encode_into` resizes `out` again)
        _encoder.encode_into((seq, stamp, _masked(list(items))), out, _HEADER)
    out[:_HEADER] = (len(out) - _HEADER).to_bytes(_HEADER, "little")
    return out


def decode_frame(frame: bytes) -> tuple[int, float, list[Event]]:
    """`(seq, ts, events)` of a frame: the events its batch holds, built. Their
    wire bytes (`encode_batch`) are those of the events the frame was made from."""
    seq, ts, records = decode_records(frame)
    return seq, ts, records.events()


def decode_records(frame: bytes) -> tuple[int, float, EventRecords]:
    """`(seq, ts, records)` of a frame: its batch as the engine drained it, each
    commit's stored blocks a stored run again (what the child publishes: encoded
    straight from the runs, as `KVEventPublisher` does in the engine's process,
    with no event built per commit). `records.events()` is `decode_frame`'s list."""
    seq, ts, items = _decoder.decode(frame)
    runs: list[Event | StoredRun] = []
    for item in items:
        if type(item) is bytes:
            runs.append(pickle.loads(item))
        elif len(item) == _RUN_FIELDS:
            runs.append(tuple(item))
        elif len(item) == _REMOVED_FIELDS:
            hashes, blocks, namespace, medium, group = item
            runs.append(BlockRemoved(tuple(hashes), tuple(blocks), namespace, medium, group))
        else:
            raise ValueError(f"a frame item of {len(item)} fields")
    return seq, ts, EventRecords(runs)


# ---------------------------------------------------------------------- parent


class ProcessEventPublisher:
    """`KVEventPublisher`'s interface, with building, encoding and sending in a child
    process (see the module docstring). The arguments are `KVEventPublisher`'s;
    `queue_batches` bounds the frames waiting in the engine for room in the pipe,
    and `start_timeout` how long the child may take to start and bind.

    `publish` takes what `BlockTrie.drain_event_records()` returns (or a list of
    events) and never blocks. Not thread-safe: one engine thread publishes.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        data_parallel_rank: int | None = None,
        *,
        queue_batches: int = 10_000,
        legacy: bool = False,
        hwm: int = 100_000,
        start_timeout: float = 60.0,
    ) -> None:
        if type(queue_batches) is not int or queue_batches < 1:
            raise ValueError(
                f"ProcessEventPublisher queue_batches must be a positive int: {queue_batches!r}"
            )
        self.published_batches = 0
        """Batches the child has handed to its PUB socket (as last reported)."""
        self.dropped_batches = 0
        """Batches dropped: no room for them in the engine, or the child had exited
        (also logged)."""
        self.dropped_events = 0
        """Events in the dropped batches."""
        self.encoder_cpu_s = 0.0
        """CPU seconds the child has used (its `time.process_time()`, as last reported):
        what encoding and sending cost, off the engine's process."""
        self._next_seq = 0
        self._closed = False
        self._queue_batches = queue_batches
        # Frames the pipe had no room for, in order, with their event counts; the
        # first may be partly written (its rest must go before anything else).
        self._backlog: deque[tuple[memoryview, int]] = deque()
        self._status_tail = b""  # a report line not yet complete
        config = {
            "parent": os.getpid(),
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "topic": topic,
            "buffer_batches": buffer_batches,
            "data_parallel_rank": data_parallel_rank,
            "queue_batches": queue_batches,
            "legacy": legacy,
            "hwm": hwm,
        }
        proc: subprocess.Popen[bytes] | None = None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cache.kv_publisher_process", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            self._proc = proc
            self._finalizer = weakref.finalize(self, _reap, proc)
            self._frames = proc.stdin.fileno()  # type: ignore[union-attr]  # PIPE: made
            self._status = proc.stdout.fileno()  # type: ignore[union-attr]
            _grow_pipe(self._frames)
            os.set_blocking(self._frames, False)
            os.set_blocking(self._status, False)
            ready = self._wait_status(start_timeout)
            if "error" in ready:  # what the child's KVEventPublisher raised
                message = f"ProcessEventPublisher: {ready['error']}"
                if ready.get("type") == "ZMQError":
                    raise zmq.ZMQError(ready.get("errno"), message)
                raise ValueError(message)
        except BaseException:
            self._closed = True
            if hasattr(self, "_finalizer"):  # the child was started: reap it once
                self._finalizer()
            else:
                _reap(proc)
            raise
        self.encoder_cpu_s = float(ready["cpu"])  # starting it: mostly imports
        self.endpoint: str = ready["endpoint"]
        self.replay_endpoint: str | None = ready["replay_endpoint"]

    def _wait_status(self, timeout: float) -> dict[str, Any]:
        """The child's first report (it reports readiness or why it failed)."""
        deadline = time.monotonic() + timeout
        while True:
            reports = self._reports()
            if reports:
                return reports[0]
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"ProcessEventPublisher: the encoder process exited ({self._proc.returncode})"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ProcessEventPublisher: the encoder process did not start in {timeout} s"
                )
            select.select([self._status], [], [], min(left, 0.1))

    def _reports(self) -> list[dict[str, Any]]:
        """The complete reports the child has written since the last call (never blocks)."""
        chunks = []
        while True:
            try:
                chunk = os.read(self._status, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:  # the child has closed its end
                break
            chunks.append(chunk)
        if not chunks:
            return []
        *lines, self._status_tail = (self._status_tail + b"".join(chunks)).split(b"\n")
        return [json.loads(line) for line in lines]

    def publish(self, batch: EventRecords | Sequence[Event], *, ts: float | None = None) -> bool:
        """Hand one batch to the child; False when it was dropped (no room for it in the
        engine, or the child has exited: logged as an error). Never blocks. An empty
        batch is not sent (returns True), but frames waiting for room go first, as with
        any call. Raises `RuntimeError` after `close`, `TypeError` for an object that
        is not a batch."""
        if self._closed:
            raise RuntimeError("ProcessEventPublisher is closed")
        if not isinstance(batch, (EventRecords, list, tuple)):
            raise TypeError(
                f"publish takes EventRecords or a list of events, got {type(batch).__name__}"
            )
        if not batch:
            with contextlib.suppress(BrokenPipeError):  # (counted and logged there)
                self._flush()
            return True
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._flush()  # what waits for room goes first
            if self._send(_framed(batch, seq, ts), len(batch)):
                return True
        except BrokenPipeError:  # the child has exited: its end of the pipe is closed
            self._dropped(seq, len(batch), exited=self._proc)
            return False
        self._dropped(seq, len(batch), exited=None)
        return False

    def _send(self, data: bytearray, events: int) -> bool:
        """Write a frame, or keep it (or the rest of it) for later; False when the
        frames waiting for room are already `queue_batches`."""
        if not self._backlog:
            try:
                written = os.write(self._frames, data)
            except BlockingIOError:  # the pipe is full
                pass
            else:  # all of it, or a part (never none): its rest must go before anything
                if written < len(data):
                    self._backlog.append((memoryview(data)[written:], events))
                return True
        if len(self._backlog) >= self._queue_batches:
            return False
        self._backlog.append((memoryview(data), events))
        return True

    def _flush(self) -> None:
        """Write the frames waiting for room, in order, as far as the pipe takes them.
        Raises `BrokenPipeError` when the child's end is closed, having dropped them."""
        backlog = self._backlog
        while backlog:
            data, events = backlog[0]
            try:
                written = os.write(self._frames, data)
            except BlockingIOError:
                return
            except BrokenPipeError:
                self._drop_backlog("exited")
                raise
            if written < len(data):
                backlog[0] = (data[written:], events)
                return
            backlog.popleft()

    def _drop_backlog(self, why: str) -> None:
        """Count and log as dropped the frames waiting for room: accepted by `publish`,
        they will never reach the child."""
        for _, lost in self._backlog:
            self.dropped_batches += 1
            self.dropped_events += lost
        log.error(
            "KV event encoder process %s: dropped the %d batches waiting for it "
            "(%d batches / %d events dropped so far)",
            why,
            len(self._backlog),
            self.dropped_batches,
            self.dropped_events,
        )
        self._backlog.clear()

    def _dropped(self, seq: int, events: int, exited: subprocess.Popen[bytes] | None) -> None:
        """Count and log (the 1st, 2nd, 4th, 8th... time) a dropped batch."""
        self.dropped_batches += 1
        self.dropped_events += events
        n = self.dropped_batches
        if n & (n - 1) == 0:
            if exited is not None:
                log.error(
                    "KV event encoder process exited (%s): dropped batch %d (%d batches / "
                    "%d events dropped so far)",
                    exited.poll(),
                    seq,
                    n,
                    self.dropped_events,
                )
            else:
                log.warning(
                    "KV event encoder process is behind: dropped batch %d (%d batches / "
                    "%d events dropped so far); subscribers will see a sequence gap",
                    seq,
                    n,
                    self.dropped_events,
                )

    @property
    def queued_batches(self) -> int:
        """Frames waiting in the engine for room in the pipe."""
        return len(self._backlog)

    def poll_status(self) -> int:
        """Hand the child what waits for room, read its reports; returns
        `published_batches`."""
        if not self._closed:
            with contextlib.suppress(BrokenPipeError):
                self._flush()
        for report in self._reports():  # after the first (`_wait_status`): {sent, cpu}
            self.published_batches = max(self.published_batches, int(report["sent"]))
            self.encoder_cpu_s = max(self.encoder_cpu_s, float(report["cpu"]))
        return self.published_batches

    def wait_published(self, batches: int, timeout: float = 10.0) -> bool:
        """Wait until the child has published `batches` batches; False on timeout, or
        at once when the child has exited."""
        deadline = time.monotonic() + timeout
        while self.poll_status() < batches:
            if self._closed or self._proc.poll() is not None or time.monotonic() >= deadline:
                return False
            select.select([self._status], [], [], 0.01)  # a report, or 10 ms to flush again
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Hand the child what waits for room (for up to `timeout` s), end its stdin,
        let it send what it holds and exit (for up to `timeout` s more), then reap it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        deadline = time.monotonic() + timeout
        with contextlib.suppress(BrokenPipeError):  # it has exited: what waits is dropped
            while True:
                self._flush()
                left = deadline - time.monotonic()
                if not self._backlog or left <= 0:
                    break
                select.select([], [self._frames], [], min(left, 0.1))
        if self._backlog:  # it took nothing more in time: they never reach it
            self._drop_backlog(f"took no more within {timeout:.1f} s")
        _close_stream(proc.stdin)  # the end of its stdin: its STOP (nothing is buffered)
        if proc.poll() is None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("KV event encoder process did not stop within %.1f s", timeout)
        self.poll_status()  # its last reports
        self._finalizer()

    def __enter__(self) -> ProcessEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _close_stream(stream: IO[bytes] | None) -> None:
    if stream is not None:
        stream.close()


def _grow_pipe(fd: int) -> None:
    """Ask for a `_PIPE_BYTES` pipe buffer (Linux; elsewhere, or past the system's
    limit, the pipe keeps its default size)."""
    setpipe = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setpipe is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, setpipe, _PIPE_BYTES)


def _reap(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop the child if it still runs and close its pipes."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):  # nothing is buffered: closing cannot fail
        _close_stream(stream)


# ----------------------------------------------------------------------- child


def _report(fd: int, report: dict[str, Any]) -> bool:
    """Write one report line; False when the pipe refuses it (full: nobody reads;
    or closed: the engine is gone). A line under 4 KiB is written whole or not at all."""
    try:
        os.write(fd, json.dumps(report).encode() + b"\n")
    except OSError:
        return False
    return True


def _take_frames(pending: bytearray) -> list[bytes]:
    """The complete frames at the start of `pending`, removed from it."""
    frames = []
    at = 0
    while True:
        start = at + _HEADER
        end = start + int.from_bytes(pending[at:start], "little")
        if end > len(pending):  # a partial header (past the end however short) or frame
            break
        frames.append(bytes(pending[start:end]))
        at = end
    del pending[:at]
    return frames


def _child(config: dict[str, Any]) -> int:
    """The encoder process: frames in (`frames_fd`: its stdin), `KVEventPublisher` out,
    reports back (`status_fd`: its stdout). Returns its exit code: 0, or 2 when its
    publisher could not be made (the first report says why)."""
    from cache.kv_publisher import KVEventPublisher

    frames = config["frames_fd"]
    status = config["status_fd"]
    os.set_blocking(frames, False)
    os.set_blocking(status, False)  # a report the full pipe refuses is tried again later
    try:
        publisher = KVEventPublisher(
            config["endpoint"],
            config["replay_endpoint"],
            config["topic"],
            config["buffer_batches"],
            config["data_parallel_rank"],
            queue_batches=config["queue_batches"],
            legacy=config["legacy"],
            hwm=config["hwm"],
        )
    except (zmq.ZMQError, ValueError, TypeError) as exc:
        report: dict[str, object] = {"error": str(exc), "type": type(exc).__name__}
        if isinstance(exc, zmq.ZMQError):
            report["errno"] = exc.errno
        _report(status, report)
        return 2
    ready = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
    _report(status, ready | {"cpu": time.process_time()})
    parent = config["parent"]
    reported = 0
    pending = bytearray()
    active_until = 0.0
    try:
        while True:
            try:
                chunk = os.read(frames, _PIPE_BYTES)
            except BlockingIOError:  # caught up
                # Report what was sent, by this loop or since by the publisher's thread.
                sent = publisher.published_batches
                if sent != reported and _report(status, _sent(sent)):
                    reported = sent
                if time.monotonic() < active_until:
                    time.sleep(_NAP_S)  # not waiting on the pipe: a write wakes nobody
                elif not select.select([frames], [], [], _IDLE_S)[0] and os.getppid() != parent:
                    break  # the engine's process is gone (and another holds the pipe)
                continue
            if not chunk:  # the engine ended its stream (close), or is gone
                break
            pending += chunk
            for frame in _take_frames(pending):
                seq, ts, records = decode_records(frame)
                publisher.publish(records, ts=ts, seq=seq)
            active_until = time.monotonic() + _ACTIVE_S
    finally:
        publisher.close()
        _report(status, _sent(publisher.published_batches))
    return 0


def _sent(batches: int) -> dict[str, Any]:
    """The report of how many batches the child has sent, and its CPU time so far."""
    return {"sent": batches, "cpu": time.process_time()}


if __name__ == "__main__":  # the child, as the engine starts it
    _status = os.dup(1)  # stdout carries the reports: nothing else may write to it
    os.dup2(2, 1)
    # Ctrl-C in the engine's terminal reaches the whole process group: the engine
    # decides, and the child ends with its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(_child(json.loads(sys.argv[1]) | {"frames_fd": 0, "status_fd": _status}))
