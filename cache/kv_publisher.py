"""`KVEventPublisher`: streams event batches over ZMQ the way vLLM's publisher does.

Wire (vLLM's ``ZmqEventPublisher``): a PUB socket sends each batch as three
frames ``(topic, seq, payload)``: the topic's UTF-8 bytes, the batch's
sequence number as 8 bytes big-endian, and `cache.kv_events.encode_batch`'s
msgpack. The PUB address is bound when it contains ``*`` (or ``::``, or is
``ipc://`` / ``inproc://``) and connected otherwise. An optional ROUTER
socket answers a replay request (frames ``[b"", start_seq]`` from a REQ /
DEALER client) with every buffered batch whose sequence number is
``>= start_seq`` as ``[b"", seq, payload]``, then ``[b"", (-1 as 8 signed
bytes), b""]``.

Never blocks the caller: `publish` encodes the batch (so a bad event raises
in the caller), then hands it to the PUB socket itself when the socket is free
and nothing is waiting (a non-blocking send: PUB drops past its high-water
mark instead of waiting), or else puts it on a bounded queue that a sender
thread drains in order. The socket is free unless the sender thread is
draining that queue or answering a replay request; sending in the caller saves
a thread hand-off (a wake-up and a GIL switch) per batch, which measured more
than the send, most of all with no core to spare. When the
queue is full the batch is dropped: counted in `dropped_batches` /
`dropped_events` and logged (at the 1st, 2nd, 4th, 8th... drop), and its
sequence number is still consumed, so a subscriber sees the gap (which replay
cannot fill: the consumer must resynchronise). ZMQ itself drops messages for
a subscriber past its high-water mark; the subscriber sees that as a gap too
and can replay it while it is buffered.

Ordering: batches reach the socket in sequence order. A sequence number is
taken, and the batch sent or queued, under one lock; the caller sends only
when the queue is empty and it holds the socket lock, and the thread takes a
batch off the queue only while it holds the socket lock, until it is sent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterable
from types import TracebackType

from cache.event_log import EventRecords
from cache.events import Event
from cache.extras import requires_extra
from cache.kv_events import encode_batch

with requires_extra("events", "cache.kv_publisher"):
    import zmq

__all__ = ["END_SEQ", "KVEventPublisher"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame that ends a replay answer."""

_POLL_S = 0.02
_MORE = zmq.NOBLOCK | zmq.SNDMORE


def _binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KVEventPublisher:
    """Publishes `cache.events` batches on a ZMQ PUB socket (see the module docstring).

    - `endpoint`: PUB address (``tcp://*:5557`` binds, ``tcp://host:5557``
      connects; ``tcp://127.0.0.1:*`` binds an ephemeral port, read back from
      `endpoint` afterwards).
    - `replay_endpoint`: ROUTER address for replay requests (always bound), or None.
    - `topic`: first frame of every message.
    - `buffer_batches`: sent batches kept for replay.
    - `data_parallel_rank`: written into every batch. Unlike vLLM, the port
      is not offset by the rank: give each rank its own endpoint.
    - `queue_batches`: batches that may wait for the sender thread before
      `publish` starts dropping.
    - `legacy`: send vLLM's pre-2026 positional event encoding.
    - `hwm`: the PUB socket's send high-water mark (messages per subscriber).

    Raises `ValueError` for bad sizes and `zmq.ZMQError` when an address
    cannot be bound / connected. Use as a context manager or call `close`.
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
    ) -> None:
        for name, value in (
            ("buffer_batches", buffer_batches),
            ("queue_batches", queue_batches),
            ("hwm", hwm),
        ):
            if type(value) is not int or value < 0 or (value == 0 and name == "queue_batches"):
                raise ValueError(f"KVEventPublisher {name} must be a non-negative int: {value!r}")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.legacy = legacy
        self.published_batches = 0
        """Batches handed to the PUB socket."""
        self.dropped_batches = 0
        """Batches dropped because the queue was full (never silent: also logged)."""
        self.dropped_events = 0
        """Events in the dropped batches."""
        self._topic = topic.encode("utf-8")
        self._next_seq = 0  # the next batch's sequence number
        self._queue_batches = queue_batches
        # Batches waiting for the sender thread, in sequence order.
        self._queue: deque[tuple[int, bytes]] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._wake = threading.Event()  # set while `_queue` may hold batches, or on close
        self._stop = threading.Event()
        self._closed = False
        # Sequence numbers, the queue and `_closed`: publish may be called from
        # several threads. Taken before `_socket_lock` (never waited for under it).
        self._lock = threading.Lock()
        # Whoever holds it may use the sockets and `_buffer` (ZMQ sockets are not
        # thread-safe; a lock hand-over is the memory barrier ZMQ asks for).
        self._socket_lock = threading.Lock()

        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if _binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint: str = self._last_endpoint(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._last_endpoint(self._replay, replay_endpoint)
        except BaseException:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _last_endpoint(sock: zmq.Socket[bytes], fallback: str) -> str:
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) and last else fallback

    # ----------------------------------------------------------------- API

    def publish(
        self,
        events: Iterable[Event] | EventRecords,
        *,
        ts: float | None = None,
        seq: int | None = None,
    ) -> bool:
        """Send or queue one batch of `events`; False when it was dropped (queue full).

        `events` is a list of events, or what `BlockTrie.drain_event_records()`
        returns (the cheaper: its commits go to the wire without an event object
        each; the bytes are the same).

        Sent before returning when the socket is free and no batch is queued
        (`published_batches` has counted it); queued for the sender thread
        otherwise. An empty batch is not sent (returns True). `seq` gives the
        batch its sequence number (at least the next one; the numbers it skips
        are a gap subscribers see): for a publisher whose batches were numbered,
        and some dropped, before they reached this one
        (`cache.kv_publisher_process`). Raises `RuntimeError` after `close`,
        `TypeError` for an object that is not an event, `ValueError` for a
        `seq` below the next number.
        """
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        evs = events if isinstance(events, (list, EventRecords)) else list(events)
        if not evs:
            return True
        payload = encode_batch(
            evs, ts=ts, data_parallel_rank=self.data_parallel_rank, legacy=self.legacy
        )
        with self._lock:
            if self._closed:  # closed while encoding
                raise RuntimeError("KVEventPublisher is closed")
            if seq is None:
                seq = self._next_seq
            elif type(seq) is not int or seq < self._next_seq:
                raise ValueError(
                    f"KVEventPublisher.publish: seq must be an int >= {self._next_seq}, got {seq!r}"
                )
            self._next_seq = seq + 1
            if not self._queue and self._socket_lock.acquire(blocking=False):
                try:
                    if not self._pub.closed:  # closed only by a failed sender thread
                        self._send(seq, payload)
                        return True
                finally:
                    self._socket_lock.release()
            if len(self._queue) < self._queue_batches:
                self._queue.append((seq, payload))
                self._wake.set()
                return True
            self.dropped_batches += 1
            self.dropped_events += len(evs)
            n = self.dropped_batches
        if n & (n - 1) == 0:
            log.warning(
                "KV event queue full: dropped batch %d (%d batches / %d events dropped so far); "
                "subscribers will see a sequence gap",
                seq,
                n,
                self.dropped_events,
            )
        return False

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout` s), stop the thread, close the sockets.

        Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a wedged socket
            log.error("KV event publisher thread did not stop within %.1f s", timeout)
            return
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def queued_batches(self) -> int:
        """Batches waiting for the sender thread."""
        return len(self._queue)

    # -------------------------------------------------------------- thread

    def _run(self) -> None:
        """Send queued batches in order and answer replay requests, until closed."""
        try:
            # Without a replay socket there is nothing to poll: sleep until woken.
            timeout = None if self._replay is None else _POLL_S
            while True:
                self._wake.wait(timeout)
                stopping = self._stop.is_set()  # read first: a close queues nothing after it
                with self._socket_lock:
                    self._send_queued()
                    if self._replay is not None:
                        self._serve_replays(self._replay)
                if stopping:
                    break
        except Exception:  # logged, never silent; publish then queues, and drops when full
            log.exception("KV event publisher thread failed")
        finally:
            with self._socket_lock:
                self._pub.close(linger=0)
                if self._replay is not None:
                    self._replay.close(linger=0)

    def _send_queued(self) -> None:
        """Send every queued batch; the caller holds `_socket_lock`."""
        while True:
            with self._lock:
                if not self._queue:
                    if not self._stop.is_set():
                        self._wake.clear()
                    return
                seq, payload = self._queue.popleft()
            self._send(seq, payload)

    def _send(self, seq: int, payload: bytes) -> None:
        """Hand one batch to the PUB socket and keep it for replay; needs `_socket_lock`."""
        # PUB never blocks: past the HWM, ZMQ drops for that subscriber. Three
        # sends rather than `send_multipart`, which costs three times as much.
        send = self._pub.send
        with contextlib.suppress(zmq.Again):
            send(self._topic, _MORE)
            send(seq.to_bytes(8, "big"), _MORE)
            send(payload, zmq.NOBLOCK)
        self.published_batches += 1
        if self._buffer.maxlen:
            self._buffer.append((seq, payload))

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", END_SEQ, b""))
