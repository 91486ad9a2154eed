"""Events drained unbuilt (`BlockTrie.drain_event_records`) and published by an
encoder process (`cache.kv_publisher_process`).

What must hold: the records build exactly the events `drain_events` returns
(and `check()` sees them drained); a frame carries a batch to the child with
the same wire bytes (`encode_batch`) for every kind of event — commits with
and without a namespace, extra identities, 64-bit ids, evictions, clears,
checkpoints, the host tier, `vllm` hashes; and the publisher delivers those
bytes over ZMQ in order, numbered, never blocking, counting what it drops.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import BlockTrie, CacheConfig
from cache.kv_events import encode_batch
from cache.kv_publisher_process import ProcessEventPublisher, decode_frame, encode_frame

BIG = 1 << 40


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
    seq, ts, decoded = decode_frame(encode_frame(drained, seq=7, ts=1.5))
    assert (seq, ts) == (7, 1.5)
    assert encode_batch(decoded, ts=1.5) == encode_batch(events, ts=1.5)


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
    trie.check()


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
        sent.append(encode_batch(records.events(), ts=float(r), data_parallel_rank=3))
    for seq, payload in enumerate(sent):
        topic, seq_bytes, got = sub.recv_multipart()
        assert (topic, int.from_bytes(seq_bytes, "big"), got) == (b"", seq, payload)
    assert publisher.wait_published(5)
    assert publisher.dropped_batches == 0
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
    with pytest.raises(TypeError, match="EventRecords or a list of events"):
        publisher.publish("events")  # type: ignore[arg-type]
    assert publisher.wait_published(0)
    assert publisher.poll_status() == 0


def test_a_stalled_encoder_drops_and_counts_never_blocking() -> None:
    pub = ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=1)
    try:
        assert pub._proc is not None
        pub._proc.send_signal(signal.SIGSTOP)  # the child takes nothing more
        trie = BlockTrie(_config(num_blocks=400))
        results = []
        t0 = time.monotonic()
        for r in range(200):
            _run(trie, [([r, r + 1, r + 2], "", None, "keep")])
            results.append(pub.publish(trie.drain_event_records()))
        assert time.monotonic() - t0 < 30
        assert not all(results)
        assert pub.dropped_batches == results.count(False)
        assert pub.dropped_events == pub.dropped_batches  # one BlockStored per batch
        pub._proc.send_signal(signal.SIGCONT)
    finally:
        pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([])
    pub.close()  # idempotent


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
        assert "encoder process exited" in caplog.text


def test_a_bad_endpoint_fails_the_constructor_with_the_childs_reason() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            ProcessEventPublisher(f"tcp://*:{port}")
    with pytest.raises(ValueError, match="buffer_batches"):
        ProcessEventPublisher("tcp://127.0.0.1:*", buffer_batches=-1)
    with pytest.raises(ValueError, match="queue_batches"):
        ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=0)
