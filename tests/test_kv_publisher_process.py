"""Events drained unbuilt (`BlockTrie.drain_event_records`) and published by an
encoder process (`cache.kv_publisher_process`).

What must hold: the records build exactly the events `drain_events` returns
(and `check()` sees them drained); a frame carries a batch to the child with
the same wire bytes (`encode_batch`) for every kind of event — commits with
and without a namespace, extra identities, 64-bit ids, evictions, clears,
checkpoints, the host tier, `vllm` hashes; and the publisher hands frames to
its child down a pipe and the child delivers those bytes over ZMQ, in order,
numbered, the engine never blocking and counting what it drops.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import inspect
import json
import logging
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import BlockTrie, CacheConfig
from cache.event_log import EventRecords
from cache.events import AllBlocksCleared, BlockRemoved
from cache.kv_events import encode_batch
from cache.kv_publisher import KVEventPublisher
from cache.kv_publisher_process import (
    ProcessEventPublisher,
    _child,
    decode_frame,
    decode_records,
    encode_frame,
)

BIG = 1 << 40

# A test here that hangs (a socket left open makes `zmq.Context.term` wait for it
# forever) ends the run with every thread's stack after 60 s, not at CI's limit,
# and counts as a failure: each test takes a few seconds at most.
pytestmark = pytest.mark.timeout(60, method="thread")


def _config(**kw: Any) -> CacheConfig:
    base: dict[str, Any] = {
        "block_size": 2,
        "num_blocks": 24,
        "kv_block_shape": None,
        "enable_events": True,
    }
    base.update(kw)
    return CacheConfig(**base)


OPS = st.lists(
    st.tuples(
        st.lists(st.sampled_from([1, 2, 3, BIG]), min_size=1, max_size=7),
        st.sampled_from(["", "lora-a"]),
        st.sampled_from([None, ("img",), ("img", 7)]),
        st.sampled_from(["keep", "evict", "clear"]),
    ),
    min_size=1,
    max_size=8,
)


def _run(trie: BlockTrie, ops: list[tuple[list[int], str, Any, str]]) -> None:
    for tokens, namespace, extra, then in ops:
        seq = trie.match(tokens, namespace, extra)
        trie.allocate(seq, len(tokens))
        trie.commit(seq, len(tokens))
        trie.release(seq)
        if then == "evict":
            trie.evict(2)
        elif then == "clear":
            trie.clear()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, scheme=st.sampled_from(["xxh3", "vllm"]))
def test_records_build_the_events_and_frames_carry_their_wire_bytes(
    ops: list[tuple[list[int], str, Any, str]], scheme: str
) -> None:
    built, records = _config(block_hash=scheme), _config(block_hash=scheme)
    a, b = BlockTrie(built), BlockTrie(records)
    _run(a, ops)
    _run(b, ops)
    events = a.drain_events()
    drained = b.drain_event_records()
    assert drained.events() == events
    assert len(drained) == len(events)
    b.check()  # invariant 10: the records count as drained
    assert b.snapshot() == a.snapshot()
    for legacy in (False, True):  # the records encode straight to their events' bytes
        assert encode_batch(drained, ts=1.5, data_parallel_rank=3, legacy=legacy) == (
            encode_batch(events, ts=1.5, data_parallel_rank=3, legacy=legacy)
        )
    seq, ts, decoded = decode_frame(encode_frame(drained, seq=7, ts=1.5))
    assert (seq, ts) == (7, 1.5)
    assert encode_batch(decoded, ts=1.5) == encode_batch(events, ts=1.5)
    # What the child publishes: the commits as stored runs again, not built.
    seq, ts, runs = decode_records(encode_frame(drained, seq=7, ts=1.5))
    assert (seq, ts) == (7, 1.5)
    kinds = [type(x) for x in runs.items]
    assert kinds == [tuple if type(x) is tuple else type(x) for x in drained.items]
    assert runs.events() == decoded
    for legacy in (False, True):
        assert encode_batch(runs, ts=1.5, legacy=legacy) == encode_batch(
            events, ts=1.5, legacy=legacy
        )
    if scheme == "xxh3":  # 64-bit hashes travel whole: the events themselves come back
        assert decoded == events  # block ids and namespaces too, which the wire lacks


def test_frames_carry_host_tier_and_checkpoint_events() -> None:
    with pytest.warns(UserWarning):  # the host tier with SSM checkpoints
        config = _config(
            block_size=4,
            num_blocks=8,
            num_host_blocks=8,
            num_checkpoint_slots=4,
            num_host_checkpoint_slots=2,
            state_shapes={"s": (2,)},
        )
    trie = BlockTrie(config)
    state = {"s": torch.ones(2)}
    for base in (1, 2, 3):
        seq = trie.match([base] * 9)
        trie.allocate(seq, 9)
        trie.commit(seq, 9)
        trie.save(seq, 8, state)
        trie.save(seq, 9, state)
        trie.release(seq)
    trie.poll()
    trie.evict(3)
    trie.poll()
    records = trie.drain_event_records()
    kinds = {type(e).__name__ for e in records.events()}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert {e.group_idx for e in records.events()} == {0, 1}
    assert {e.medium for e in records.events()} == {"GPU", "CPU"}
    _, _, decoded = decode_frame(encode_frame(records, seq=0, ts=0.0))
    assert encode_batch(decoded, ts=0.0) == encode_batch(records.events(), ts=0.0)
    assert decoded == records.events()
    trie.check()


def test_a_one_token_block_with_an_extra_identity_is_built_by_the_engine() -> None:
    """Keys that are not plain bytes (here an extra identity) are built into the event
    in the engine's process, even where their size could pass for packed tokens (one
    block of one token: 4 bytes)."""
    ops: list[tuple[list[int], str, Any, str]] = [([7], "", ["img"], "keep")]
    a, b = BlockTrie(_config(block_size=1)), BlockTrie(_config(block_size=1))
    _run(a, ops)
    _run(b, ops)
    events = a.drain_events()
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert tuple(events[0].token_ids) == (7,)  # type: ignore[union-attr]
    assert events[0].extra_keys is not None  # type: ignore[union-attr]  # its identity
    _, _, decoded = decode_frame(encode_frame(b.drain_event_records(), seq=0, ts=0.0))
    assert decoded == events


def test_a_frame_carries_the_records_as_drained_and_refuses_an_unknown_item() -> None:
    """Runs and removals go as their fields (nothing rebuilt per record); another
    event as its pickle; an item of another shape is refused, not guessed at."""
    run = (None, [11, 12], bytes(32), [3, 4], 4, "t")
    gone = BlockRemoved((11,), (3,), "t")
    seq, ts, items = msgspec.msgpack.decode(
        encode_frame(EventRecords([run, gone, AllBlocksCleared()]), seq=5, ts=0.5)
    )
    assert (seq, ts) == (5, 0.5)
    assert items[:2] == [list(run), [[11], [3], "t", "GPU", 0]]
    assert pickle.loads(items[2]) == AllBlocksCleared()
    _, _, records = decode_records(
        encode_frame(EventRecords([run, gone, AllBlocksCleared()]), seq=5, ts=0.5)
    )
    assert records.items == [run, gone, AllBlocksCleared()]
    with pytest.raises(ValueError, match="4 fields"):
        decode_records(msgspec.msgpack.encode([0, 0.0, [[1, 2, 3, 4]]]))


def test_vllm_digests_travel_as_their_low_64_bits() -> None:
    """Deterministic (the property test above reaches this only on some draws): a
    frame of 256-bit digests carries each hash, and a child commit's parent hash, cut
    to the 64 bits the wire carries; a root commit's parent stays None."""
    mask = (1 << 64) - 1
    ops: list[tuple[list[int], str, Any, str]] = [
        ([1, 2, 3, 4], "", None, "keep"),
        ([1, 2, 3, 4, 5, 6], "", None, "evict"),
    ]
    a, b = BlockTrie(_config(block_hash="vllm")), BlockTrie(_config(block_hash="vllm"))
    _run(a, ops)
    _run(b, ops)
    events = a.drain_events()
    frame = encode_frame(b.drain_event_records(), seq=1, ts=2.0)
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert len(stored) == 2 and removed
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash is not None
    assert all(h > mask for e in events for h in e.block_hashes)  # wider than the wire
    _, _, items = msgspec.msgpack.decode(frame)
    runs = [i for i in items if len(i) == 6]  # [parent_hash, hashes, tokens, ...]
    gone = [i for i in items if len(i) == 5]  # [hashes, block_ids, namespace, ...]
    assert len(runs) + len(gone) == len(items)
    assert [i[0] for i in runs] == [None, stored[1].parent_block_hash & mask]
    assert [i[1] for i in runs] == [[h & mask for h in e.block_hashes] for e in stored]
    assert [i[0] for i in gone] == [[h & mask for h in e.block_hashes] for e in removed]
    _, _, decoded = decode_frame(frame)
    assert encode_batch(decoded, ts=2.0) == encode_batch(events, ts=2.0)


@pytest.fixture
def publisher() -> Iterator[ProcessEventPublisher]:
    with ProcessEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", data_parallel_rank=3
    ) as pub:
        yield pub


def _subscriber(endpoint: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    time.sleep(0.3)  # the slow joiner: let the subscription reach the PUB socket
    return ctx, sub


def _skip_unless_a_pipe_can_hold_a_mebibyte() -> None:
    limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    if limit < 1 << 20:
        pytest.skip(f"pipes are limited to {limit} bytes here")


def test_the_pipe_to_the_child_holds_a_mebibyte_where_linux_allows_it(
    publisher: ProcessEventPublisher,
) -> None:
    _skip_unless_a_pipe_can_hold_a_mebibyte()
    size = fcntl.fcntl(publisher._frames, fcntl.F_GETPIPE_SZ)  # type: ignore[attr-defined]
    assert size == 1 << 20


def test_subscribers_get_each_batch_in_order_with_in_process_bytes(
    publisher: ProcessEventPublisher,
) -> None:
    ctx, sub = _subscriber(publisher.endpoint)
    trie = BlockTrie(_config())
    sent = []
    for r in range(5):
        _run(trie, [([1, 2, 3, r, r + 1], "", None, "evict")])
        records = trie.drain_event_records()
        assert publisher.publish(records, ts=float(r))
        assert publisher.queued_batches == 0  # written whole: nothing waits
        sent.append(encode_batch(records.events(), ts=float(r), data_parallel_rank=3))
    for seq, payload in enumerate(sent):
        topic, seq_bytes, got = sub.recv_multipart()
        assert (topic, int.from_bytes(seq_bytes, "big"), got) == (b"", seq, payload)
    started = publisher.encoder_cpu_s  # reported when it was ready: its imports
    assert started > 0.0
    assert publisher.wait_published(5)
    assert publisher.dropped_batches == 0
    assert started < publisher.encoder_cpu_s < 60.0  # the child's own CPU, as it reported
    # A late subscriber catches up through the child's replay socket.
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    assert publisher.replay_endpoint is not None
    req.connect(publisher.replay_endpoint)
    req.send_multipart([b"", (3).to_bytes(8, "big")])
    replayed = []
    while True:
        _, seq_bytes, payload = req.recv_multipart()
        if not payload:
            break
        replayed.append((int.from_bytes(seq_bytes, "big"), payload))
    assert replayed == [(3, sent[3]), (4, sent[4])]
    sub.close(linger=0)
    req.close(linger=0)
    ctx.term()


def test_an_empty_batch_is_not_sent_and_bad_batches_are_refused(
    publisher: ProcessEventPublisher,
) -> None:
    trie = BlockTrie(_config())
    assert publisher.publish(trie.drain_event_records())  # nothing to drain
    assert publisher.publish([])
    with pytest.raises(TypeError, match=r"EventRecords or a list of events, got str$"):
        publisher.publish("events")  # type: ignore[arg-type]
    assert publisher.wait_published(0)
    assert publisher.poll_status() == 0


def _fill(
    pub: ProcessEventPublisher, refusals: int = 50, events: int = 1, limit: int = 400_000
) -> list[bool]:
    """Publish batches of `events` events to a stalled child until `refusals` in a row
    are dropped (its pipe is full and `queue_batches` frames wait in the engine)."""
    results: list[bool] = []
    refused = 0
    while refused < refusals:
        assert len(results) < limit, "the pipe never filled"
        results.append(pub.publish([AllBlocksCleared()] * events))
        refused = 0 if results[-1] else refused + 1
    return results


def test_a_stalled_encoder_drops_and_counts_never_blocking(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=1)
    try:
        assert pub._proc is not None
        pub._proc.send_signal(signal.SIGSTOP)  # the child takes nothing more
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="cache.kv_publisher_process"):
            results = _fill(pub, refusals=200)
        assert time.monotonic() - t0 < 30
        assert pub.queued_batches == 1  # what the full pipe refused, waiting in order
        assert pub.dropped_batches == results.count(False) >= 200
        assert pub.dropped_events == pub.dropped_batches  # one event per batch
        first = results.index(False)
        assert all(results[:first]) and results[first:] == [False] * len(results[first:])
        assert caplog.records[0].getMessage() == (
            f"KV event encoder process is behind: dropped batch {first} (1 batches / 1 events "
            "dropped so far); subscribers will see a sequence gap"
        )
        logged = [int(r.getMessage().split("(")[1].split()[0]) for r in caplog.records]
        assert logged == [2**k for k in range(len(logged))]  # the 1st, 2nd, 4th, ... drop
        assert logged[-1] <= pub.dropped_batches < 2 * logged[-1]
        pub._proc.send_signal(signal.SIGCONT)
        assert pub.wait_published(first)  # every batch not dropped gets there
        assert pub.queued_batches == 0
    finally:
        pub.close()
    with pytest.raises(RuntimeError, match=r"^ProcessEventPublisher is closed$"):
        pub.publish([])
    pub.close()  # idempotent


def test_a_frame_larger_than_the_pipe_goes_whole_and_in_order() -> None:
    """A frame the pipe takes only part of keeps its place: its rest goes first, on
    the next calls, and no other frame is written into the middle of it."""
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=1)
    try:
        assert pub._proc is not None
        pub._proc.send_signal(signal.SIGSTOP)
        big = [AllBlocksCleared()] * 60_000  # a frame of several MiB
        assert len(encode_frame(big, seq=0)) > 2 * (1 << 20)
        assert pub.publish(big)  # written in part; the rest waits
        assert pub.queued_batches == 1
        assert not pub.publish([AllBlocksCleared()])  # no room behind it: dropped
        assert (pub.dropped_batches, pub.dropped_events) == (1, 1)
        pub._proc.send_signal(signal.SIGCONT)
        assert pub.wait_published(1, timeout=30)  # its rest handed over by the waiting
        assert pub.publish([AllBlocksCleared(), AllBlocksCleared()])
        assert pub.wait_published(2, timeout=30)
        assert pub.queued_batches == 0 and pub.dropped_batches == 1
    finally:
        pub.close()


def test_batches_the_engine_side_dropped_are_a_gap_subscribers_see() -> None:
    """The engine side numbers every batch, sent or dropped; the child publishes each
    frame under the engine's number, so a subscriber sees the drops as a gap."""
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=1)
    ctx, sub = _subscriber(pub.endpoint)
    try:
        assert pub._proc is not None
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # PUB drops until the subscription has arrived
            assert time.monotonic() < deadline, "the subscriber never joined"
            pub.publish([AllBlocksCleared()])
        pub._proc.send_signal(signal.SIGSTOP)
        results = _fill(pub)
        assert not all(results)
        pub._proc.send_signal(signal.SIGCONT)
        while True:  # until the child has room again
            assert time.monotonic() < deadline + 10, "the child never caught up"
            last = pub._next_seq
            if pub.publish([AllBlocksCleared(), AllBlocksCleared()]):
                break
            time.sleep(0.01)
        seqs = []
        while True:
            _topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            if len(msgspec.msgpack.decode(payload)[1]) == 2:
                break
        assert seqs[-1] == last
        assert seqs == sorted(seqs) and len(seqs) < seqs[-1] - seqs[0] + 1  # a gap
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()


def test_a_dead_encoder_drops_and_logs_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with ProcessEventPublisher("tcp://127.0.0.1:*") as pub:
        assert pub._proc is not None
        pub._proc.kill()
        pub._proc.wait()
        trie = BlockTrie(_config())
        _run(trie, [([1, 2, 3], "", None, "keep")])
        with caplog.at_level("ERROR", logger="cache.kv_publisher_process"):
            assert not pub.publish(trie.drain_event_records())
        assert (pub.dropped_batches, pub.dropped_events) == (1, 1)
        assert [r.getMessage() for r in caplog.records] == [
            f"KV event encoder process exited ({-signal.SIGKILL}): dropped batch 0 (1 batches "
            "/ 1 events dropped so far)"
        ]
        caplog.clear()
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="cache.kv_publisher_process"):
            pub.close()  # nothing to hand a dead child, nothing to wait for
        assert time.monotonic() - t0 < 5
        assert caplog.records == []
        assert pub._proc.stdin is not None and pub._proc.stdin.closed


def test_frames_waiting_for_a_child_that_dies_are_counted_as_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Batches `publish` accepted but could not yet write (the pipe was full) never
    reach a child that has died: they count as dropped, with the one refused then."""
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=3)
    try:
        assert pub._proc is not None
        pub._proc.send_signal(signal.SIGSTOP)
        results = _fill(pub, refusals=1)
        assert pub.queued_batches == 3 and pub.dropped_batches == 1
        pub._proc.kill()
        pub._proc.wait()
        caplog.clear()
        with caplog.at_level("ERROR", logger="cache.kv_publisher_process"):
            assert pub.publish([])  # nothing to send, but what waits is found lost
            assert not pub.publish([AllBlocksCleared(), AllBlocksCleared()])
        assert pub.queued_batches == 0
        assert (pub.dropped_batches, pub.dropped_events) == (5, 6)
        assert [r.getMessage() for r in caplog.records] == [  # (the 5th drop: not logged)
            "KV event encoder process exited: dropped the 3 batches waiting for it (4 batches "
            "/ 4 events dropped so far)"
        ]
        assert pub.wait_published(len(results)) is False  # gone: not waited for
    finally:
        pub.close()


@pytest.mark.parametrize("finder", ["poll_status", "close"])
def test_what_waits_for_a_child_that_has_died_is_counted_and_logged(
    finder: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`poll_status` and `close` hand the child what waits for room, as every call
    does; a dead child's broken pipe drops and logs it there, without raising and
    without waiting."""
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=2)
    try:
        pub._proc.send_signal(signal.SIGSTOP)
        _fill(pub, refusals=1)
        dropped = pub.dropped_batches
        pub._proc.kill()
        pub._proc.wait()
        caplog.clear()
        t0 = time.monotonic()
        with caplog.at_level("ERROR", logger="cache.kv_publisher_process"):
            if finder == "poll_status":
                assert pub.poll_status() == pub.published_batches
            else:
                pub.close(timeout=30.0)
        assert time.monotonic() - t0 < 10  # nothing waited for
        assert (pub.queued_batches, pub.dropped_batches) == (0, dropped + 2)
        assert [r.getMessage() for r in caplog.records] == [
            "KV event encoder process exited: dropped the 2 batches waiting for it "
            f"({dropped + 2} batches / {dropped + 2} events dropped so far)"
        ]
    finally:
        pub.close()


def test_a_child_that_dies_while_close_hands_it_what_waits_is_reaped_quietly(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close` found the child running, then its pipe broke (it died in between): what
    waited counts as dropped, and `close` still ends and reaps without raising."""
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=2)
    proc = pub._proc
    proc.send_signal(signal.SIGSTOP)
    _fill(pub, refusals=1)
    assert pub.queued_batches == 2
    dropped = pub.dropped_batches
    proc.kill()
    proc.wait()
    monkeypatch.setattr(proc, "poll", lambda: None)  # as seen just before it died
    caplog.clear()
    with caplog.at_level("WARNING", logger="cache.kv_publisher_process"):
        pub.close(timeout=1.0)
    assert pub.queued_batches == 0
    assert pub.dropped_batches == dropped + 2
    assert [r.getMessage() for r in caplog.records] == [
        f"KV event encoder process exited: dropped the 2 batches waiting for it ({dropped + 2} "
        f"batches / {dropped + 2} events dropped so far)"
    ]
    assert proc.stdin is not None and proc.stdin.closed


def test_a_bad_endpoint_fails_the_constructor_with_the_childs_reason() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(
            zmq.ZMQError, match=r"^ProcessEventPublisher: Address already in use"
        ) as refused:
            ProcessEventPublisher(f"tcp://*:{port}")
        assert refused.value.errno == zmq.EADDRINUSE
    with pytest.raises(ValueError, match="buffer_batches"):
        ProcessEventPublisher("tcp://127.0.0.1:*", buffer_batches=-1)
    for bad in (0, "3", 2.0):
        with pytest.raises(ValueError, match=f"queue_batches must be a positive int: {bad!r}$"):
            ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=bad)  # type: ignore[arg-type]


def test_it_takes_kv_event_publishers_arguments_with_the_same_defaults() -> None:
    ours = inspect.signature(ProcessEventPublisher).parameters
    theirs = inspect.signature(KVEventPublisher).parameters
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name
    assert set(ours) - set(theirs) == {"start_timeout"}


def test_the_child_is_given_kv_event_publishers_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the constructor hands the child when called with no arguments (a child that
    exits at once, so nothing binds 5557)."""
    children = _record_children(monkeypatch)
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setattr(sys, "executable", false)
    with pytest.raises(RuntimeError, match="exited"):
        ProcessEventPublisher()
    config = json.loads(children[0].args[-1])
    for name, parameter in inspect.signature(KVEventPublisher).parameters.items():
        assert config[name] == parameter.default, name


def test_close_waits_up_to_its_timeout_for_room_to_hand_the_child_its_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A child that is behind (its pipe full) still gets what waits and the end of its
    stdin once it catches up within `timeout`, and exits by itself: nothing logged,
    nothing killed, its pipes closed."""
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=1)
    proc = pub._proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    _fill(pub, events=50)  # the pipe is full, and a frame waits in the engine: no room
    dropped = pub.dropped_batches
    resume = threading.Timer(0.5, proc.send_signal, (signal.SIGCONT,))
    resume.start()
    with caplog.at_level("ERROR", logger="cache.kv_publisher_process"):
        pub.close(timeout=1.2)  # for room, then as long again for its exit
    resume.join()
    assert proc.returncode == 0
    assert [r.message for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert pub.queued_batches == 0  # handed over before its stdin was ended
    assert pub.dropped_batches == dropped  # nothing lost
    assert proc.stdin is not None and proc.stdin.closed
    assert proc.stdout is not None and proc.stdout.closed


# ------------------------------------------------- the child's loop, in this process
#
# `ProcessEventPublisher` runs `_child(config)` in another process, where neither
# coverage nor mutmut sees it. These tests run it in a thread of the test process,
# wired as the parent wires it: a pipe for frames (the child's stdin in its own
# process) and a pipe for its reports (its stdout), and a config like the parent's.

LOOP = "tcp://127.0.0.1:*"
WAIT_MS = 10_000
TCP = re.compile(r"tcp://127\.0\.0\.1:\d+")
Ctx = zmq.Context[zmq.Socket[bytes]]
CHILD_THREAD = "in-process-encoder"
PUBLISHER: dict[str, Any] = {  # the child's publisher settings, as the parent gives them
    "endpoint": LOOP,
    "replay_endpoint": None,
    "topic": "",
    "buffer_batches": 10_000,
    "data_parallel_rank": None,
    "queue_batches": 10_000,
    "legacy": False,
    "hwm": 100_000,
}


class _Child:
    """`_child(config)` in a daemon thread. `parent_gone` makes `os.getppid()`
    (patched for the test) stop returning the parent the config names, as when the
    engine's process dies and the child is re-parented."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **config: Any) -> None:
        self.frames_in, self.frames = os.pipe()  # the child reads, the test writes
        self.status, self.status_out = os.pipe()  # the child writes, the test reads
        self._tail = b""
        self._lines: list[bytes] = []
        parent = os.getppid()
        self.parent_gone = threading.Event()
        monkeypatch.setattr(os, "getppid", lambda: -1 if self.parent_gone.is_set() else parent)
        self.config: dict[str, Any] = {
            "frames_fd": self.frames_in,
            "status_fd": self.status_out,
            "parent": parent,
            **PUBLISHER,
            **config,
        }
        self.returned: list[int] = []
        target = self._target
        self.thread = threading.Thread(target=target, name=CHILD_THREAD, daemon=True)
        self.thread.start()

    def _target(self) -> None:
        self.returned.append(_child(self.config))

    def send(self, frame: bytes) -> None:
        """Write one frame as the parent does (its length, then the frame), waiting
        for room."""
        self.write(len(frame).to_bytes(4, "little") + frame)

    def write(self, data: bytes) -> None:
        """Write `data` down the frames pipe, waiting for room."""
        view = memoryview(data)
        while view:
            view = view[os.write(self.frames, view) :]

    def stop(self) -> None:
        """End the child's stdin, as `close` does: it publishes what it holds and exits."""
        os.close(self.frames)
        self.frames = -1

    def _line(self, ms: int) -> bytes | None:
        """The next report line, waiting up to `ms` for it; None if none comes."""
        deadline = time.monotonic() + ms / 1000
        while not self._lines:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.status], [], [], left)[0]:
                return None
            chunk = os.read(self.status, 1 << 16)
            if not chunk:  # the child's end is closed
                return None
            *lines, self._tail = (self._tail + chunk).split(b"\n")
            self._lines.extend(lines)
        return self._lines.pop(0)

    def report(self) -> dict[str, Any]:
        """The child's next status report (fails after `WAIT_MS`)."""
        line = self._line(WAIT_MS)
        assert line is not None, "the child sent no status report"
        report: dict[str, Any] = json.loads(line)
        return report

    def sent_reports_until(self, sent: int) -> list[int]:
        """The `sent` counts the child reports, up to and including `sent` (it reports
        each time it has caught up, so several frames may share one report)."""
        counts: list[int] = []
        while not counts or counts[-1] < sent:
            counts.append(_sent(self.report()))
        assert counts == sorted(set(counts)), counts
        return counts

    def quiet(self, ms: int = 300) -> bool:
        """No report comes within `ms`."""
        return self._line(ms) is None

    def exit_code(self) -> int:
        """What `_child` returned (fails if it has not returned within `WAIT_MS`)."""
        self.thread.join(WAIT_MS / 1000)
        assert not self.thread.is_alive(), "the child did not exit"
        return self.returned[0]

    def close(self) -> None:
        if self.thread.is_alive():  # a failed test: take both ways out of the loop
            self.parent_gone.set()
            if self.frames >= 0:
                self.stop()
            self.thread.join(WAIT_MS / 1000)
        for fd in (self.frames, self.frames_in, self.status, self.status_out):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


@pytest.fixture
def start_child(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _Child]]:
    started: list[_Child] = []

    def start(**config: Any) -> _Child:
        child = _Child(monkeypatch, **config)
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def _sub_socket(ctx: Ctx) -> zmq.Socket[bytes]:
    """A SUB socket for every topic, that waits up to `WAIT_MS` and lingers not."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    sub.setsockopt(zmq.LINGER, 0)
    return sub


def _join(child: _Child, sub: zmq.Socket[bytes]) -> int:
    """Send probe frames (an `AllBlocksCleared` batch each, numbered 0, 1, ...) until
    `sub` receives one (PUB drops until the subscription has arrived), then take the
    probes `sub` got and the child's reports for them. Returns the number of probes."""
    deadline = time.monotonic() + WAIT_MS / 1000
    probes = 0
    while True:
        assert time.monotonic() < deadline, "the subscriber never joined"
        child.send(encode_frame([AllBlocksCleared()], seq=probes, ts=0.0))
        probes += 1
        if sub.poll(50):
            break
    while int.from_bytes(sub.recv_multipart()[1], "big") != probes - 1:
        pass
    assert child.sent_reports_until(probes)[-1] == probes
    return probes


def _evicting_batches(n: int) -> list[Any]:
    """`n` batches of records from a trie: stored runs and evictions (`BlockRemoved`)."""
    trie = BlockTrie(_config())
    out = []
    for r in range(n):
        _run(trie, [([1, 2, 3, r, r + 1], "", None, "evict")])
        out.append(trie.drain_event_records())
    return out


def _replay(ctx: Ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[tuple[int, bytes]] = []
    try:
        while True:
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                return out
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_the_child_publishes_each_frame_with_its_number_and_in_process_bytes(
    start_child: Callable[..., _Child],
) -> None:
    child = start_child(topic="kv", data_parallel_rank=3)
    ready = child.report()
    assert set(ready) == {"endpoint", "replay_endpoint", "cpu"} and ready["cpu"] > 0
    assert TCP.fullmatch(ready["endpoint"]) and ready["replay_endpoint"] is None
    ctx: Ctx = zmq.Context()
    sub = _sub_socket(ctx)
    try:
        sub.connect(ready["endpoint"])
        first = _join(child, sub)
        # Idle past its poll (100 ms) with the engine's process there: it keeps running.
        assert child.quiet(300)
        assert child.thread.is_alive()
        batches = _evicting_batches(3)
        seqs = [first, first + 2, first + 5]  # the engine dropped first+1, first+3, first+4
        for seq, records in zip(seqs, batches, strict=True):
            child.send(encode_frame(records, seq=seq, ts=seq / 4))
        got = [sub.recv_multipart() for _ in seqs]
        assert [(t, int.from_bytes(s, "big"), p) for t, s, p in got] == [
            (b"kv", seq, encode_batch(records.events(), ts=seq / 4, data_parallel_rank=3))
            for seq, records in zip(seqs, batches, strict=True)
        ]
        assert {type(e).__name__ for r in batches for e in r.events()} == {
            "BlockStored",
            "BlockRemoved",
        }
        assert child.sent_reports_until(first + 3)[-1] == first + 3
        child.stop()
        assert child.exit_code() == 0
        assert _sent(child.report()) == first + 3  # its last word
        assert child.quiet(100)
        assert not sub.poll(100)
        # Its publisher is closed: the address is free again.
        with ctx.socket(zmq.PUB) as again:
            again.setsockopt(zmq.LINGER, 0)
            again.bind(ready["endpoint"])
    finally:
        sub.close(linger=0)
        ctx.term()


def test_the_child_keeps_batches_for_replay_in_the_encoding_asked_for(
    start_child: Callable[..., _Child],
) -> None:
    child = start_child(replay_endpoint=LOOP, buffer_batches=2, legacy=True)
    ready = child.report()
    assert TCP.fullmatch(ready["endpoint"]) and TCP.fullmatch(ready["replay_endpoint"])
    assert ready["endpoint"] != ready["replay_endpoint"]
    batches = _evicting_batches(3)
    for seq, records in enumerate(batches):
        child.send(encode_frame(records, seq=seq, ts=float(seq)))
    wire = [encode_batch(r.events(), ts=float(s), legacy=True) for s, r in enumerate(batches)]
    assert wire[0] != encode_batch(batches[0].events(), ts=0.0)  # legacy is another encoding
    counts = child.sent_reports_until(3)  # a batch queued behind a replay poll may share one
    assert counts == sorted(set(counts)) and counts[-1] == 3
    ctx: Ctx = zmq.Context()
    try:
        # buffer_batches=2: the last two are kept, with the numbers the frames gave.
        assert _replay(ctx, ready["replay_endpoint"], 0) == [(1, wire[1]), (2, wire[2])]
        assert _replay(ctx, ready["replay_endpoint"], 2) == [(2, wire[2])]
    finally:
        ctx.term()
    child.stop()
    assert child.exit_code() == 0
    assert _sent(child.report()) == 3


def test_the_child_takes_a_frame_that_comes_in_pieces_once_it_is_whole(
    start_child: Callable[..., _Child],
) -> None:
    """The pipe may hand a frame over in parts (a write it could take only in part):
    the child publishes nothing until the frame is whole, then that frame once."""
    child = start_child()
    assert TCP.fullmatch(child.report()["endpoint"])
    records = _evicting_batches(2)
    first = encode_frame(records[0], seq=0, ts=0.0)
    second = encode_frame(records[1], seq=1, ts=0.0)
    data = len(first).to_bytes(4, "little") + first + len(second).to_bytes(4, "little")
    cuts = [2, 9, len(data) - 3, len(data)]  # in the header, the frame, the next header
    at = 0
    for cut in cuts:
        child.write(data[at:cut])
        at = cut
        time.sleep(0.05)  # each piece read on its own
        if cut < len(first) + 4:
            assert child.quiet(100)  # nothing whole yet: nothing sent
    assert child.sent_reports_until(1) == [1]
    child.write(second[:5])
    assert child.quiet(200)  # the second frame's start alone: nothing more
    child.write(second[5:])
    assert child.sent_reports_until(2) == [2]
    child.stop()
    assert child.exit_code() == 0


def test_the_child_exits_when_the_engine_process_is_gone(
    start_child: Callable[..., _Child],
) -> None:
    child = start_child()
    assert TCP.fullmatch(child.report()["endpoint"])
    child.send(encode_frame(_evicting_batches(1)[0], seq=0, ts=0.0))
    assert _sent(child.report()) == 1
    assert child.quiet(300)
    assert child.thread.is_alive()
    child.parent_gone.set()  # os.getppid() is no longer the engine's pid
    t0 = time.monotonic()
    assert child.exit_code() == 0
    assert time.monotonic() - t0 < 5  # at its next idle poll, not at some timeout
    assert _sent(child.report()) == 1
    assert child.quiet(100)


def _sent(report: dict[str, Any]) -> int:
    """The batch count of a child's "sent" report, checked for its shape: the count
    and the child's CPU time so far (`ProcessEventPublisher.encoder_cpu_s`)."""
    assert set(report) == {"sent", "cpu"}, report
    assert type(report["sent"]) is int and type(report["cpu"]) is float, report
    assert report["cpu"] > 0, report  # it has started an interpreter at least
    sent: int = report["sent"]
    return sent


def _program(**config: Any) -> subprocess.Popen[bytes]:
    """``python -m cache.kv_publisher_process CONFIG``, as the engine starts it."""
    config = {"parent": os.getpid(), **PUBLISHER, **config}
    return subprocess.Popen(
        [sys.executable, "-m", "cache.kv_publisher_process", json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def test_the_program_reads_its_stdin_reports_on_its_stdout_and_ignores_ctrl_c() -> None:
    proc = _program(topic="t")
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready = json.loads(proc.stdout.readline())
        assert TCP.fullmatch(ready["endpoint"]) and ready["replay_endpoint"] is None
        proc.send_signal(signal.SIGINT)  # Ctrl-C in the engine's terminal: not its call
        frame = encode_frame(_evicting_batches(1)[0], seq=4, ts=0.0)
        proc.stdin.write(len(frame).to_bytes(4, "little") + frame)
        proc.stdin.flush()
        assert _sent(json.loads(proc.stdout.readline())) == 1
        proc.stdin.close()  # the end of its stdin: it stops
        assert proc.wait(WAIT_MS / 1000) == 0
        assert [_sent(json.loads(line)) for line in proc.stdout] == [1]  # its last word
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_the_program_exits_with_2_when_its_publisher_cannot_be_made() -> None:
    proc = _program(buffer_batches=-1)
    out, _ = proc.communicate(timeout=WAIT_MS / 1000)
    assert proc.returncode == 2
    assert [json.loads(line) for line in out.splitlines()] == [
        {
            "error": "KVEventPublisher buffer_batches must be a non-negative int: -1",
            "type": "ValueError",
        }
    ]


def _expected_error(make: Callable[[], object]) -> dict[str, Any]:
    """The report for what `KVEventPublisher` raises with the child's arguments."""
    with pytest.raises((zmq.ZMQError, ValueError, TypeError)) as info:
        make()
    return {"error": str(info.value)}


@pytest.mark.parametrize("case", ["address in use", "bad size", "not an address"])
def test_the_child_reports_why_its_publisher_failed_and_returns_2(
    case: str,
    start_child: Callable[..., _Child],
) -> None:
    with contextlib.ExitStack() as stack:
        if case == "address in use":
            taken = stack.enter_context(stack.enter_context(zmq.Context()).socket(zmq.PUB))
            taken.setsockopt(zmq.LINGER, 0)
            endpoint = f"tcp://*:{taken.bind_to_random_port('tcp://127.0.0.1')}"  # binds
            expected = _expected_error(lambda: KVEventPublisher(endpoint))
            expected |= {"type": "ZMQError", "errno": zmq.EADDRINUSE}
            assert "Address already in use" in expected["error"]
            child = start_child(endpoint=endpoint)
        elif case == "bad size":
            expected = _expected_error(lambda: KVEventPublisher(LOOP, buffer_batches=-1))
            expected |= {"type": "ValueError"}
            assert expected["error"] == (
                "KVEventPublisher buffer_batches must be a non-negative int: -1"
            )
            child = start_child(buffer_batches=-1)
        else:
            expected = _expected_error(lambda: KVEventPublisher(5))  # type: ignore[arg-type]
            expected |= {"type": "TypeError"}
            child = start_child(endpoint=5)
        assert child.report() == expected
        assert child.exit_code() == 2
        assert child.quiet(100)  # nothing after the error


def test_a_child_whose_publisher_failed_exits_by_itself(
    start_child: Callable[..., _Child],
) -> None:
    """It closes every socket it made, so its context terminates and it returns 2
    without the parent having to terminate it."""
    child = start_child(buffer_batches=-1)
    assert child.report()["type"] == "ValueError"
    child.thread.join(1.0)
    assert not child.thread.is_alive()
    assert child.exit_code() == 2


# ------------------------------------------------ the parent when its child fails


def _open_fds() -> set[str]:
    """This process's open file descriptors."""
    return set(os.listdir("/proc/self/fd"))


def _record_children(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """The processes `subprocess.Popen` starts from now on."""
    made: list[subprocess.Popen[bytes]] = []

    class Recording(subprocess.Popen[bytes]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    return made


def _silent_children(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> list[subprocess.Popen[bytes]]:
    """From now on the publisher's "Python" is a child that never reports (it sleeps
    60 s); returns the processes started, as `_record_children`."""
    silent = tmp_path / "silent-child"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")
    silent.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(silent))
    return _record_children(monkeypatch)


def test_a_child_that_exits_before_reporting_fails_the_constructor_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    false = shutil.which("false")
    assert false is not None
    fds = _open_fds()
    monkeypatch.setattr(sys, "executable", false)  # a "child" that exits with 1
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"^ProcessEventPublisher: the encoder process exited \(1\)$"
    ):
        ProcessEventPublisher(LOOP, start_timeout=30.0)
    assert time.monotonic() - t0 < 10  # seen exiting, not waited for
    assert _open_fds() == fds  # its pipes closed


def test_a_failed_constructor_reaps_its_child_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its finalizer does the reaping, so collecting the half-built publisher later
    reaps nothing twice."""
    import cache.kv_publisher_process as module

    reaped: list[object] = []
    reap = module._reap

    def counting(proc: Any, *args: Any) -> None:
        reaped.append(proc)
        reap(proc, *args)

    false = shutil.which("false")
    assert false is not None
    monkeypatch.setattr(module, "_reap", counting)
    monkeypatch.setattr(sys, "executable", false)  # a "child" that exits with 1
    with contextlib.suppress(RuntimeError):  # (the raising is another test's)
        ProcessEventPublisher(LOOP, start_timeout=30.0)
    gc.collect()
    assert len(reaped) == 1 and reaped[0] is not None


def test_a_child_that_cannot_be_started_fails_the_constructor_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fds = _open_fds()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(FileNotFoundError):
        ProcessEventPublisher(LOOP)
    assert _open_fds() == fds


def test_a_child_that_never_reports_times_out_and_is_terminated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fds = _open_fds()
    children = _silent_children(monkeypatch, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"^ProcessEventPublisher: the encoder process did not start in 0.3 s$"
    ):
        ProcessEventPublisher(LOOP, start_timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 10
    assert len(children) == 1 and children[0].returncode == -signal.SIGTERM
    assert _open_fds() == fds


def test_ctrl_c_before_the_childs_finalizer_is_registered_still_reaps_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The one window where the child runs but no finalizer owns it: the constructor
    reaps it itself (here a `KeyboardInterrupt` raised as the finalizer is made)."""
    import weakref

    fds = _open_fds()
    children = _silent_children(monkeypatch, tmp_path)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(weakref, "finalize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ProcessEventPublisher(LOOP, start_timeout=30.0)
    assert len(children) == 1 and children[0].returncode == -signal.SIGTERM
    assert _open_fds() == fds


def test_reports_are_read_whole_however_the_pipe_splits_them() -> None:
    """`_reports` reads until the pipe is empty, joins what it read, returns each
    complete line and keeps a partial one for the next call: here more than one
    read's worth (64 KiB), a line straddling each read."""
    _skip_unless_a_pipe_can_hold_a_mebibyte()
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(read_end, fcntl.F_SETPIPE_SZ, 1 << 20)  # type: ignore[attr-defined]
        os.set_blocking(read_end, False)
        reader = ProcessEventPublisher.__new__(ProcessEventPublisher)
        reader._status = read_end
        reader._status_tail = b""
        assert reader._reports() == []  # nothing written yet
        sent = [{"seq": i, "pad": "x" * (i % 97)} for i in range(3000)]
        data = b"".join(json.dumps(report).encode() + b"\n" for report in sent)
        assert len(data) > 3 << 16
        last = json.dumps({"seq": 3000}).encode()
        os.write(write_end, data + last[:5])  # the last report half-written
        assert reader._reports() == sent
        os.write(write_end, last[5:] + b"\n")
        assert reader._reports() == [{"seq": 3000}]
        assert reader._reports() == []
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_child_that_does_not_stop_on_close_is_logged_then_killed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = ProcessEventPublisher(LOOP, queue_batches=1)
    proc = pub._proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)  # reads nothing more, and holds SIGTERM pending
    _fill(pub)  # and its pipe is full, a frame waiting in the engine: no room
    caplog.clear()
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="cache.kv_publisher_process"):
        pub.close(timeout=0.3)
    elapsed = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL  # terminate() waited 2 s in vain, then kill()
    assert 2.3 <= elapsed < 20
    assert [r.getMessage() for r in caplog.records] == [
        f"KV event encoder process took no more within 0.3 s: dropped the 1 batches waiting "
        f"for it ({pub.dropped_batches} batches / {pub.dropped_events} events dropped so far)",
        "KV event encoder process did not stop within 0.3 s",
    ]


def test_wait_published_gives_up_at_its_timeout_and_when_the_child_is_gone() -> None:
    with ProcessEventPublisher(LOOP) as pub:
        t0 = time.monotonic()
        assert pub.wait_published(1, timeout=0.3) is False  # nothing was published
        assert 0.3 <= time.monotonic() - t0 < 10
        assert pub.publish(_evicting_batches(1)[0])
        assert pub.wait_published(1) is True
        assert pub.published_batches == 1
        assert pub._proc is not None
        pub._proc.kill()
        pub._proc.wait()
        t0 = time.monotonic()
        assert pub.wait_published(2, timeout=60.0) is False  # gone: not waited for
        assert time.monotonic() - t0 < 10


def test_reports_nobody_reads_never_block_the_child_and_the_last_is_sent_later(
    start_child: Callable[..., _Child],
) -> None:
    """An engine that publishes for hours and never polls fills the status pipe: the
    child drops the reports it cannot send (it neither blocks nor raises), and once
    the engine reads again it reports the count it could not send (else
    `wait_published` would wait for a report that never comes)."""
    child = start_child()
    endpoint = child.report()["endpoint"]
    # One page of pipe: about 270 reports fill it.
    fcntl.fcntl(child.status, fcntl.F_SETPIPE_SZ, 4096)  # type: ignore[attr-defined]
    ctx: Ctx = zmq.Context()
    sub = _sub_socket(ctx)
    try:
        sub.connect(endpoint)
        first = _join(child, sub)
        last = first + 1_000  # far more reports than the pipe holds
        for seq in range(first, last):  # one at a time: it catches up, and reports, after each
            child.send(encode_frame([AllBlocksCleared()], seq=seq, ts=0.0))
            assert int.from_bytes(sub.recv_multipart()[1], "big") == seq  # never blocked
        time.sleep(0.3)  # the child tries to report the last batch into the full pipe
        counts = child.sent_reports_until(last)
        assert len(counts) < last - first  # reports were dropped
        assert counts[-1] == last
        child.stop()
        assert child.exit_code() == 0
    finally:
        sub.close(linger=0)
        ctx.term()


def test_the_child_builds_its_publisher_with_the_engines_settings(
    start_child: Callable[..., _Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[KVEventPublisher] = []

    class Recording(KVEventPublisher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("cache.kv_publisher.KVEventPublisher", Recording)
    child = start_child(
        topic="kv", buffer_batches=9, data_parallel_rank=2, queue_batches=7, legacy=True, hwm=123
    )
    assert set(child.report()) == {"endpoint", "replay_endpoint", "cpu"}
    (publisher,) = made
    assert (publisher.topic, publisher.data_parallel_rank, publisher.legacy) == ("kv", 2, True)
    assert (publisher._buffer.maxlen, publisher._queue_batches) == (9, 7)
    assert publisher._pub.getsockopt(zmq.SNDHWM) == 123
    child.stop()
    assert child.exit_code() == 0


def test_a_child_stopped_while_nobody_reads_its_reports_still_exits_cleanly(
    start_child: Callable[..., _Child],
) -> None:
    """Its last report does not fit in the full status pipe: dropped, never waited for."""
    child = start_child()
    assert set(child.report()) == {"endpoint", "replay_endpoint", "cpu"}
    for seq in range(40_000):
        child.send(encode_frame([AllBlocksCleared()], seq=seq, ts=0.0))
    child.stop()
    assert child.exit_code() == 0
