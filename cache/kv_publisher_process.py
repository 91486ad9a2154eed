"""`ProcessEventPublisher`: KV events encoded and published by another process.

`KVEventPublisher` encodes each batch in the engine's process, and a batch's
events are built there too, one `BlockStored` per commit: together about half
of what events cost the engine (docs/events.md, "Cost"). This publisher takes
what `BlockTrie.drain_event_records()` returns, the events *unbuilt*, packs
each commit's blocks into a few flat buffers (its hashes, block ids and token
bytes), and pushes that frame, without blocking, to a child process. The child
builds the events and publishes them with a `KVEventPublisher` of its own, so
subscribers get exactly the bytes an in-process publisher would send
(`encode_batch` of the same events; vLLM's ZMQ wire, sequence numbers and
replay socket).

Numbering and drops: the engine side numbers every batch. A batch the child
cannot take in time (its queue of `queue_batches` frames is full) is dropped
there, counted in `dropped_batches` / `dropped_events` and logged, and its
number is skipped, so subscribers see the gap. `published_batches` counts the
batches the child has handed to its PUB socket (it reports as it goes).

The child is started with the same interpreter (``python -m
cache.kv_publisher_process``), talks over two ZMQ ``ipc://`` sockets in a
private temporary directory, and exits when told to (`close`), when the
engine's process is gone, or when its sockets fail. Binding errors (a port in
use) are raised by the constructor as `zmq.ZMQError`, as `KVEventPublisher`'s
are; its bad sizes as `ValueError`.

Frame (msgpack): ``[seq, ts, items]``; an item is ``[0, parent_hash,
block_size, namespace, hashes, block_ids, tokens]`` for a commit's stored
blocks (`tokens`: the blocks' uint32 key bytes, joined), ``[1, hashes,
block_ids, namespace, medium, group_idx]`` for a `BlockRemoved`, and ``[2,
pickle]`` for any other event (rare: host-tier moves, checkpoints, clears).
Hashes are sent as they are, or as their low 64 bits (what the wire carries)
when one is wider (a `vllm` digest). A commit whose keys are not plain uint32
blocks (an extra identity, 64-bit ids) was built by the commit itself
(`cache.event_log`) and is sent as ``[2, ...]``. Packing a commit costs the
engine one small list and msgpack's copy of what the commit recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec
import zmq

from cache.event_log import (
    EventRecords,
    StoredRun,
    device_stored,
    plain_extra_keys,
)
from cache.events import (
    BlockRemoved,
    Event,
)
from cache.keys import PackedTokens

__all__ = ["ProcessEventPublisher", "decode_frame", "encode_frame"]

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_STORED, _REMOVED, _OTHER = 0, 1, 2
_STOP = b""
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _stored_item(run: StoredRun) -> list[Any]:
    """A commit's stored blocks as a frame item (the run's values, as recorded)."""
    parent_hash, hashes, tokens, blocks, block_size, namespace = run
    return [_STORED, parent_hash, block_size, namespace, hashes, blocks, tokens]


def _event_item(event: Event) -> list[Any]:
    if type(event) is BlockRemoved:
        return [
            _REMOVED,
            list(event.block_hashes),
            event.block_ids,
            event.namespace,
            event.medium,
            event.group_idx,
        ]
    return [_OTHER, pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)]


def _masked(items: list[list[Any]]) -> list[list[Any]]:
    """`items` with every hash cut to the 64 bits the wire carries (`vllm` digests)."""
    for item in items:
        if item[0] == _STORED:
            item[1] = None if item[1] is None else item[1] & _MASK
            item[4] = [h & _MASK for h in item[4]]
        elif item[0] == _REMOVED:
            item[1] = [h & _MASK for h in item[1]]
    return items


def encode_frame(
    batch: EventRecords | Sequence[Event], *, seq: int, ts: float | None = None
) -> bytes:
    """The frame the engine's process sends for one batch (see the module docstring)."""
    items = [
        _stored_item(x) if type(x) is tuple else _event_item(x)  # type: ignore[arg-type]
        for x in (batch.items if isinstance(batch, EventRecords) else batch)
    ]
    stamp = time.time() if ts is None else float(ts)
    try:
        return _encoder.encode([seq, stamp, items])
    except OverflowError:  # a `vllm` 256-bit digest
        return _encoder.encode([seq, stamp, _masked(items)])


def decode_frame(frame: bytes) -> tuple[int, float, list[Event]]:
    """`(seq, ts, events)` of a frame: the events its batch holds, built. Their
    wire bytes (`encode_batch`) are those of the events the frame was made from."""
    seq, ts, items = _decoder.decode(frame)
    events: list[Event] = []
    for item in items:
        kind = item[0]
        if kind == _STORED:
            _, parent, block_size, namespace, hashes, blocks, tokens = item
            extras = plain_extra_keys(namespace, len(hashes))
            token_ids = PackedTokens(tokens)
            stored = device_stored(
                tuple(hashes), tuple(blocks), parent, token_ids, block_size, namespace, extras
            )
            events.append(stored)
        elif kind == _REMOVED:
            _, hashes, blocks, namespace, medium, group = item
            events.append(BlockRemoved(tuple(hashes), tuple(blocks), namespace, medium, group))
        else:
            events.append(pickle.loads(item[1]))
    return seq, ts, events


# ---------------------------------------------------------------------- parent


class ProcessEventPublisher:
    """`KVEventPublisher`'s interface, with building, encoding and sending in a child
    process (see the module docstring). The arguments are `KVEventPublisher`'s;
    `queue_batches` bounds the frames waiting for the child, and `start_timeout`
    how long the child may take to start and bind.

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
        """Batches dropped because the child's queue was full (also logged)."""
        self.dropped_events = 0
        """Events in the dropped batches."""
        self._next_seq = 0
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="blocktrie-events-")
        self._ctx = zmq.Context()
        self._frames: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        self._status: zmq.Socket[bytes] = self._ctx.socket(zmq.PULL)
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._frames.setsockopt(zmq.SNDHWM, queue_batches)
            self._frames.setsockopt(zmq.LINGER, 0)
            self._status.setsockopt(zmq.LINGER, 0)
            frames_ep = f"ipc://{self._dir}/frames"
            status_ep = f"ipc://{self._dir}/status"
            self._frames.bind(frames_ep)
            self._status.bind(status_ep)
            config = {
                "frames": frames_ep,
                "status": status_ep,
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
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "cache.kv_publisher_process", json.dumps(config)],
                stdin=subprocess.DEVNULL,
            )
            self._finalizer = weakref.finalize(
                self, _reap, self._proc, self._dir, self._ctx, self._frames, self._status
            )
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
                _reap(self._proc, self._dir, self._ctx, self._frames, self._status)
            raise
        self.endpoint: str = ready["endpoint"]
        self.replay_endpoint: str | None = ready["replay_endpoint"]

    def _wait_status(self, timeout: float) -> dict[str, Any]:
        """The child's first status message (it reports readiness or why it failed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._status.poll(100):
                message: dict[str, Any] = json.loads(self._status.recv())
                return message
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"ProcessEventPublisher: the encoder process exited ({self._proc.returncode})"
                )
        raise TimeoutError(
            f"ProcessEventPublisher: the encoder process did not start in {timeout} s"
        )

    def publish(self, batch: EventRecords | Sequence[Event], *, ts: float | None = None) -> bool:
        """Hand one batch to the child; False when it was dropped (the child's queue
        is full, or the child has exited: logged as an error). Never blocks. An
        empty batch is not sent (returns True). Raises `RuntimeError` after
        `close`, `TypeError` for an object that is not a batch."""
        if self._closed:
            raise RuntimeError("ProcessEventPublisher is closed")
        if not isinstance(batch, (EventRecords, list, tuple)):
            raise TypeError(
                f"publish takes EventRecords or a list of events, got {type(batch).__name__}"
            )
        if not batch:
            return True
        seq = self._next_seq
        self._next_seq += 1
        proc = self._proc
        exited = proc is None or proc.poll() is not None
        if not exited:
            frame = encode_frame(batch, seq=seq, ts=ts)
            try:
                self._frames.send(frame, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
        self.dropped_batches += 1
        self.dropped_events += len(batch)
        n = self.dropped_batches
        if n & (n - 1) == 0:
            if exited:
                log.error(
                    "KV event encoder process exited (%s): dropped batch %d (%d batches / "
                    "%d events dropped so far)",
                    None if proc is None else proc.returncode,
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
        return False

    def poll_status(self) -> int:
        """Read the child's reports; returns `published_batches`."""
        while self._status.poll(0):
            report = json.loads(self._status.recv())
            self.published_batches = max(self.published_batches, int(report.get("sent", 0)))
        return self.published_batches

    def wait_published(self, batches: int, timeout: float = 10.0) -> bool:
        """Wait until the child has published `batches` batches; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.poll_status() < batches:
            if time.monotonic() >= deadline or self._proc is None or self._proc.poll() is not None:
                return False
            self._status.poll(10)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Let the child send what it holds (for up to `timeout` s), then stop it and
        close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._frames.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
            with contextlib.suppress(zmq.ZMQError):
                self._frames.send(_STOP)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("KV event encoder process did not stop within %.1f s", timeout)
        with contextlib.suppress(zmq.ZMQError):
            self.poll_status()
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


def _reap(
    proc: subprocess.Popen[bytes] | None,
    directory: str,
    ctx: zmq.Context[zmq.Socket[bytes]],
    *sockets: zmq.Socket[bytes],
) -> None:
    """Stop the child if it still runs, close the sockets, remove the directory."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------- child


def _child(config: dict[str, Any]) -> int:
    """The encoder process: frames in, `KVEventPublisher` out, status reports back."""
    from cache.kv_publisher import KVEventPublisher

    ctx = zmq.Context()
    frames = ctx.socket(zmq.PULL)
    status = ctx.socket(zmq.PUSH)
    status.setsockopt(zmq.LINGER, 1000)
    frames.connect(config["frames"])
    status.connect(config["status"])
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
        status.send(json.dumps(report).encode())
        frames.close(linger=0)  # every socket closed, or `term` waits for it forever
        status.close()
        ctx.term()
        return 2
    status.send(
        json.dumps(
            {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
        ).encode()
    )
    parent = config["parent"]
    reported = 0
    try:
        while True:
            if frames.poll(100):
                frame = frames.recv()
                if frame == _STOP:
                    break
                seq, ts, events = decode_frame(frame)
                publisher.publish(events, ts=ts, seq=seq)
            elif os.getppid() != parent:  # the engine's process is gone
                break
            # Report what was sent, by this loop or since by the publisher's thread.
            # A report the full pipe refuses (nobody reads) is tried again later.
            sent = publisher.published_batches
            if sent != reported:
                with contextlib.suppress(zmq.Again):
                    status.send(json.dumps({"sent": sent}).encode(), zmq.NOBLOCK)
                    reported = sent
    finally:
        publisher.close()
        with contextlib.suppress(zmq.Again):
            status.send(json.dumps({"sent": publisher.published_batches}).encode(), zmq.NOBLOCK)
        frames.close(linger=0)
        status.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
