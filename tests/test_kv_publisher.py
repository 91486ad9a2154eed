"""`KVEventPublisher` on loopback: ordering, replay, never blocking, clean shutdown."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("xxhash")

import msgspec
import zmq

from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from cache.kv_events import encode_batch
from cache.kv_publisher import END_SEQ, KVEventPublisher, _binds

LOOP = "tcp://127.0.0.1:*"
TIMEOUT_MS = 5_000
Ctx = zmq.Context[zmq.Socket[bytes]]

# A hang here (a sender thread that never ends, a socket left open so that
# `zmq.Context.term` waits forever) uses no CPU, so only a wall-clock limit
# catches it: 60 s per test, against well under a second each.
pytestmark = pytest.mark.timeout(60, method="thread")


def _batch(i: int) -> list[Event]:
    return [BlockStored((i,), (i,), None, (i, i), 2, ""), BlockRemoved((i,), (i,), "")]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    c: Ctx = zmq.Context()
    yield c
    c.destroy(linger=0)


def _sub(ctx: Ctx, endpoint: str, topic: bytes = b"") -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(endpoint)
    return sub


def _wait_joined(pub: KVEventPublisher, sub: zmq.Socket[bytes]) -> None:
    """PUB drops messages until a subscription arrives: probe until one gets through.

    The probes are `AllBlocksCleared` batches; `_recv_real` skips them.
    """
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.poll(50):
            return
    raise AssertionError("subscriber never joined")


def _is_probe(payload: bytes) -> bool:
    return _decode(payload)[1] == [{"type": "AllBlocksCleared"}]


def _recv_real(sub: zmq.Socket[bytes], n: int) -> list[list[bytes]]:
    """The next `n` messages that are not join probes."""
    out: list[list[bytes]] = []
    while len(out) < n:
        msg = sub.recv_multipart()
        if not _is_probe(msg[2]):
            out.append(msg)
    return out


def _decode(payload: bytes) -> list[object]:
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list)
    return raw


def test_subscriber_receives_every_batch_in_order(ctx: Ctx) -> None:
    with KVEventPublisher(LOOP, topic="kv", data_parallel_rank=2) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        sub = _sub(ctx, pub.endpoint, b"kv")
        _wait_joined(pub, sub)
        for i in range(200):
            assert pub.publish(_batch(i), ts=float(i))
        got = []
        for topic, seq, payload in _recv_real(sub, 200):
            assert topic == b"kv" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), _decode(payload)))
        first = got[0][0]
        assert [s for s, _ in got] == list(range(first, first + 200))
        for i, (_, raw) in enumerate(got):
            ts, events, rank = raw
            assert ts == float(i) and rank == 2
            assert isinstance(events, list) and events[0]["block_hashes"] == [i]
            assert events[1]["type"] == "BlockRemoved"
        assert pub.dropped_batches == 0
    sub.close(linger=0)


def _replay(ctx: Ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER: ``[b"", start]`` -> ``[b"", seq, payload]``... END."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        empty, seq_b, payload = dealer.recv_multipart()
        assert empty == b""
        if seq_b == END_SEQ:
            assert payload == b""
            break
        out.append((int.from_bytes(seq_b, "big"), payload))
    dealer.close(linger=0)
    return out


def test_late_subscriber_catches_up_through_replay(ctx: Ctx) -> None:
    with KVEventPublisher(LOOP, replay_endpoint=LOOP, buffer_batches=1_000) as pub:
        assert pub.replay_endpoint is not None
        for i in range(80):  # nobody listens yet: PUB drops these, the buffer keeps them
            pub.publish(_batch(i))
        # Connect only once the sender thread has sent them all: a subscriber joining
        # while it still sends would receive the last few, and take probes for gaps.
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while pub.published_batches < 80 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pub.published_batches == 80
        sub = _sub(ctx, pub.endpoint)
        _wait_joined(pub, sub)  # the probes (AllBlocksCleared batches) take sequence numbers
        for i in range(80, 100):
            pub.publish(_batch(i))
        live = _recv_real(sub, 20)
        live_seqs = [int.from_bytes(m[1], "big") for m in live]
        first_live = live_seqs[0]
        assert live_seqs == list(range(first_live, first_live + 20))
        # the subscriber missed everything before its first message: replay from 0
        missed = _replay(ctx, pub.replay_endpoint, 0)
        seqs = [s for s, _ in missed]
        assert seqs == list(range(first_live + 20))  # the whole history, in order
        assert [p for s, p in missed if s >= first_live] == [m[2] for m in live]
        stored = []
        for _, payload in missed[:80]:
            events = _decode(payload)[1]
            assert isinstance(events, list)
            stored.append(events[0]["block_hashes"][0])
        assert stored == list(range(80))
    sub.close(linger=0)


def test_replay_from_before_the_buffer_returns_what_is_kept(
    ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cache.kv_publisher")
    with KVEventPublisher(LOOP, replay_endpoint=LOOP, buffer_batches=5) as pub:
        for i in range(12):
            pub.publish(_batch(i))
        deadline = time.monotonic() + 5
        while pub.published_batches < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.replay_endpoint is not None
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, 0)] == [7, 8, 9, 10, 11]
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", b"bad"))  # malformed: ignored, the socket keeps serving
        dealer.send_multipart((b"", (11).to_bytes(8, "big")))
        assert dealer.recv_multipart()[1] == (11).to_bytes(8, "big")
        assert dealer.recv_multipart()[1] == END_SEQ
        dealer.close(linger=0)
        assert _replay(ctx, pub.replay_endpoint, 12) == []
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring malformed KV event replay request (3 frames)"  # identity, empty, b"bad"
    ]


def test_publish_without_subscriber_never_blocks() -> None:
    with KVEventPublisher(LOOP) as pub:
        batch = _batch(1)
        t0 = time.perf_counter()
        for _ in range(5_000):
            pub.publish(batch)
        elapsed = time.perf_counter() - t0
    assert elapsed < 5.0  # ~10 us each; a blocked send would hang here
    assert pub.dropped_batches + pub.published_batches == 5_000


def _busy_sender(pub: KVEventPublisher) -> tuple[threading.Event, threading.Event]:
    """Make the sender thread hold the socket (as while it answers a long replay)
    until the returned `release` is set; `busy` is set once it holds it."""
    busy = threading.Event()
    release = threading.Event()
    orig_serve = pub._serve_replays

    def slow_serve(replay: zmq.Socket[bytes]) -> None:
        busy.set()
        release.wait(5)
        orig_serve(replay)

    pub._serve_replays = slow_serve  # type: ignore[method-assign]
    return busy, release


def test_publish_sends_in_the_caller_when_the_socket_is_free() -> None:
    with KVEventPublisher(LOOP) as pub:
        for i in range(3):
            assert pub.publish(_batch(i))
            assert pub.published_batches == i + 1  # handed to ZMQ before returning
            assert pub.queued_batches == 0
        assert pub._thread.is_alive()  # the thread is there for queued batches and replays


def test_full_queue_drops_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    pub = KVEventPublisher(LOOP, replay_endpoint=LOOP, queue_batches=2)
    busy, release = _busy_sender(pub)
    with caplog.at_level(logging.WARNING, logger="cache.kv_publisher"):
        assert busy.wait(5)  # the thread holds the socket: publish must queue
        t0 = time.perf_counter()
        results = [pub.publish(_batch(i)) for i in range(9)]
        assert time.perf_counter() - t0 < 1.0  # dropping, not waiting
        assert pub.queued_batches == 2 and pub.published_batches == 0
    release.set()
    pub.close()
    assert results[:2] == [True, True] and not any(results[2:])
    assert pub.dropped_batches == 7 and pub.dropped_events == 14
    assert pub.published_batches == 2  # close sent what was queued
    warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    # The 1st, 2nd and 4th drop (batches 2, 3 and 5, two events each): logged, not
    # flooded, each saying what a subscriber will see.
    assert warnings == [
        f"KV event queue full: dropped batch {seq} ({n} batches / {2 * n} events dropped "
        "so far); subscribers will see a sequence gap"
        for seq, n in ((2, 1), (3, 2), (5, 4))
    ]


def test_batches_keep_their_order_when_the_sender_is_busy(ctx: Ctx) -> None:
    """Sent inline, queued behind a busy sender, then inline again: a subscriber
    sees every sequence number once, in order (a publish never overtakes the queue)."""
    with KVEventPublisher(LOOP, replay_endpoint=LOOP) as pub:
        sub = _sub(ctx, pub.endpoint)
        _wait_joined(pub, sub)
        for i in range(3):
            pub.publish(_batch(i))  # inline (or queued while the thread polls for replays)
        with pub._socket_lock:  # as while the sender thread is busy
            for i in range(3, 8):
                pub.publish(_batch(i))  # queued: the socket is held
            assert pub.queued_batches >= 5
        # The socket is free now but batches are still queued: these must queue
        # behind them (this thread keeps the GIL, so the sender has not drained yet).
        for i in range(8, 40):
            pub.publish(_batch(i))
        msgs = _recv_real(sub, 40)
        seqs = [int.from_bytes(m[1], "big") for m in msgs]
        assert seqs == sorted(seqs) and len(set(seqs)) == 40
        assert [_decode(m[2])[1][0]["block_hashes"] for m in msgs] == [[i] for i in range(40)]
        assert pub.dropped_batches == 0
        sub.close(linger=0)


def test_a_failed_sender_thread_is_logged_and_publish_degrades_to_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """If the sender thread dies (here: answering a replay raises), its sockets close;
    `publish` must neither raise nor send on a closed socket: it queues, then drops
    and counts, as with a stuck sender."""
    pub = KVEventPublisher(LOOP, replay_endpoint=LOOP, queue_batches=2)

    def broken(replay: zmq.Socket[bytes]) -> None:
        raise RuntimeError("replay socket broke")

    with caplog.at_level(logging.ERROR, logger="cache.kv_publisher"):
        pub._serve_replays = broken  # type: ignore[method-assign]
        pub._thread.join(5)
    assert not pub._thread.is_alive()
    (failed,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert failed.getMessage() == "KV event publisher thread failed"
    assert failed.exc_info is not None and "replay socket broke" in str(failed.exc_info[1])
    assert [pub.publish(_batch(i)) for i in range(4)] == [True, True, False, False]
    assert pub.published_batches == 0 and pub.dropped_batches == 2
    pub.close()


def test_close_is_clean_and_idempotent() -> None:
    before = {t.ident for t in threading.enumerate()}
    pub = KVEventPublisher(LOOP, replay_endpoint=LOOP)
    for i in range(10):
        pub.publish(_batch(i))
    pub.close()
    pub.close()
    assert pub.published_batches == 10  # close sends what was queued
    assert not pub._thread.is_alive()
    assert {t.ident for t in threading.enumerate()} <= before | {None}
    with pytest.raises(RuntimeError, match=r"^KVEventPublisher is closed$"):
        pub.publish(_batch(0))


def test_connect_mode_and_bad_arguments(ctx: Ctx) -> None:
    sub = ctx.socket(zmq.SUB)  # the bound side is the subscriber (a collector)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.bind(LOOP)
    addr = sub.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(addr, bytes)
    with KVEventPublisher(addr.decode()) as pub:
        assert pub.endpoint == addr.decode()
        _wait_joined(pub, sub)
    sub.close(linger=0)
    with pytest.raises(ValueError, match="queue_batches"):
        KVEventPublisher(LOOP, queue_batches=0)
    with pytest.raises(ValueError, match="buffer_batches"):
        KVEventPublisher(LOOP, buffer_batches=-1)
    with pytest.raises(ValueError, match=r"^KVEventPublisher hwm must be a non-negative int: -1$"):
        KVEventPublisher(LOOP, hwm=-1)
    with pytest.raises(TypeError):
        KVEventPublisher(LOOP).publish([object()])  # type: ignore[list-item]
    with pytest.raises(zmq.ZMQError):
        KVEventPublisher("tcp://256.0.0.1:*")


def _wait_published(pub: KVEventPublisher, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while pub.published_batches < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pub.published_batches == n


def test_an_empty_batch_is_not_sent_and_takes_no_sequence_number(ctx: Ctx) -> None:
    with KVEventPublisher(LOOP, replay_endpoint=LOOP) as pub:
        assert pub.publish([]) is True
        assert pub.publish(iter(())) is True
        assert (pub.published_batches, pub.queued_batches, pub.dropped_batches) == (0, 0, 0)
        assert pub.publish(_batch(1), ts=1.0) is True
        _wait_published(pub, 1)
        assert pub.replay_endpoint is not None
        assert _replay(ctx, pub.replay_endpoint, 0) == [(0, encode_batch(_batch(1), ts=1.0))]


def test_a_batch_whose_publisher_closes_while_it_is_built_is_refused() -> None:
    pub = KVEventPublisher(LOOP)

    def events() -> Iterator[Event]:
        yield from _batch(0)
        pub.close()  # as another thread may, while `publish` builds the batch

    with pytest.raises(RuntimeError, match=r"^KVEventPublisher is closed$"):
        pub.publish(events())
    assert (pub.published_batches, pub.queued_batches, pub.dropped_batches) == (0, 0, 0)


def test_a_given_seq_numbers_the_batch_and_may_only_skip_ahead(ctx: Ctx) -> None:
    with KVEventPublisher(LOOP, replay_endpoint=LOOP) as pub:
        assert pub.publish(_batch(0), ts=0.0, seq=5) is True
        for bad in (5, 3, "7", 6.0, True):
            message = f"KVEventPublisher.publish: seq must be an int >= 6, got {bad!r}"
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                pub.publish(_batch(9), seq=bad)  # type: ignore[arg-type]
        assert pub.publish(_batch(1), ts=1.0) is True  # the next number: 6
        assert pub.publish(_batch(2), ts=2.0, seq=7) is True  # the next number, given
        assert pub.publish(_batch(3), ts=3.0, seq=10) is True
        _wait_published(pub, 4)
        assert pub.replay_endpoint is not None
        assert _replay(ctx, pub.replay_endpoint, 0) == [
            (seq, encode_batch(_batch(i), ts=float(i))) for i, seq in enumerate((5, 6, 7, 10))
        ]


def test_without_a_replay_buffer_a_replay_gets_only_its_end(ctx: Ctx) -> None:
    with KVEventPublisher(LOOP, replay_endpoint=LOOP, buffer_batches=0) as pub:
        for i in range(3):
            assert pub.publish(_batch(i)) is True
        _wait_published(pub, 3)
        assert pub.replay_endpoint is not None
        assert _replay(ctx, pub.replay_endpoint, 0) == []


def test_a_replay_address_in_use_fails_the_constructor_and_closes_its_sockets(ctx: Ctx) -> None:
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    before = set(threading.enumerate())
    raised: list[BaseException] = []

    def construct() -> None:
        try:
            KVEventPublisher(LOOP, replay_endpoint=f"tcp://127.0.0.1:{port}")
        except BaseException as exc:
            raised.append(exc)

    # In a thread: a socket left open would block the constructor's ctx.term() for good.
    thread = threading.Thread(target=construct, daemon=True)
    thread.start()
    thread.join(TIMEOUT_MS / 1000)
    assert not thread.is_alive(), "the constructor hung: a socket was left open"
    assert len(raised) == 1 and isinstance(raised[0], zmq.ZMQError)
    assert raised[0].errno == zmq.EADDRINUSE
    assert set(threading.enumerate()) <= before  # no sender thread was started
    taken.close(linger=0)


class _Socket:
    """What `KVEventPublisher._last_endpoint` reads of a socket."""

    def __init__(self, last: object) -> None:
        self.last = last

    def getsockopt(self, option: int) -> object:
        assert option == zmq.LAST_ENDPOINT
        return self.last


def test_the_bound_address_falls_back_to_the_one_given_when_zmq_reports_none() -> None:
    read = KVEventPublisher._last_endpoint
    assert read(_Socket(b"tcp://127.0.0.1:5999"), "tcp://127.0.0.1:*") == "tcp://127.0.0.1:5999"
    assert read(_Socket(b""), "tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"  # type: ignore[arg-type]
    assert read(_Socket(None), "ipc://x") == "ipc://x"  # type: ignore[arg-type]


def test_wildcard_ipv6_ipc_and_inproc_addresses_bind_others_connect() -> None:
    """vLLM's rule: an address with a wildcard (`*`, or IPv6's `::`), and any ipc or
    inproc address, is bound; any other is connected to."""
    for endpoint in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert _binds(endpoint), endpoint
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://router:5557"):
        assert not _binds(endpoint), endpoint


def test_the_documented_defaults() -> None:
    """The issue's interface: `tcp://*:5557`, 10,000 batches kept for replay; and a
    send high-water mark of 100,000 messages; the topic given is kept."""
    try:
        default = KVEventPublisher()
    except zmq.ZMQError as exc:  # pragma: no cover - another program holds the port
        if exc.errno != zmq.EADDRINUSE:
            raise
        pytest.skip("port 5557 is in use")
    with default:
        assert default.endpoint == "tcp://0.0.0.0:5557"  # `*` bound on every interface
    with KVEventPublisher(LOOP, topic="kv") as pub:
        assert pub.topic == "kv"
        # A named daemon thread: it shows in thread dumps, and never holds up exit.
        assert pub._thread.name == "kv-event-publisher" and pub._thread.daemon is True
        assert pub._buffer.maxlen == 10_000
        with pub._socket_lock:  # as if the thread were busy: 10,000 batches may wait
            assert all(pub.publish(_batch(i)) for i in range(10_000))
            assert not pub.publish(_batch(10_000))
        assert pub.dropped_batches == 1
        assert pub._pub.getsockopt(zmq.SNDHWM) == 100_000


def test_an_idle_publisher_sleeps() -> None:
    """With nothing queued (and no replay socket to poll), the sender thread waits to
    be woken: it burns no CPU while the engine has nothing to publish."""
    with KVEventPublisher(LOOP) as pub:
        with pub._socket_lock:  # as if the thread were sending: publish queues
            assert pub.publish(_batch(0))
            assert pub.queued_batches == 1
        _wait_published(pub, 1)  # the thread woke, sent it, and has nothing left
        time.sleep(0.05)
        cpu = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - cpu < 0.1


def test_drained_records_go_out_as_the_bytes_of_their_events(ctx: Ctx) -> None:
    """`publish(trie.drain_event_records())`: the commits' records are encoded
    without building their events, into the bytes their events encode to; a
    dropped batch counts its events."""
    from cache import BlockTrie, CacheConfig

    def served(namespaces: list[str]) -> BlockTrie:
        trie = BlockTrie(
            CacheConfig(block_size=2, num_blocks=16, kv_block_shape=None, enable_events=True)
        )
        for i, namespace in enumerate(namespaces):
            seq = trie.match([1, 2, 3, 4, 5, i], namespace)
            trie.allocate(seq, 6)
            trie.commit(seq, 6)
            trie.release(seq)
        trie.evict(2)
        return trie

    namespaces = ["", "lora-a", ""]
    events = served(namespaces).drain_events()
    records = served(namespaces).drain_event_records()
    assert any(type(item) is tuple for item in records.items)  # unbuilt commits
    with KVEventPublisher(LOOP) as pub:
        sub = _sub(ctx, pub.endpoint)
        _wait_joined(pub, sub)
        assert pub.publish(records, ts=3.0)
        ((_, _, payload),) = _recv_real(sub, 1)
    assert payload == encode_batch(events, ts=3.0)
    sub.close(linger=0)

    with KVEventPublisher(LOOP, queue_batches=1) as pub, pub._socket_lock:  # sender busy
        assert pub.publish(served(namespaces).drain_event_records())  # queued
        assert not pub.publish(records)  # the queue is full: dropped
        assert (pub.dropped_batches, pub.dropped_events) == (1, len(records))
