"""``blocktrie replay --replicas / --router / --publish``: usage errors, the ``fleet``
report (JSON and text), and a loopback subscriber receiving a replay's events."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from cache.planner.publish import replica_endpoints
from cache.planner.report import FLEET_KEYS, FLEET_RESULT_KEYS, REPLICA_KEYS
from tests.helpers import SMALL_WORKLOAD, run_cli

SMALL = SMALL_WORKLOAD


run = run_cli


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--router", "prefix"], "--router needs --replicas"),
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "-2"], "--replicas"),
        (["--replicas", "2000"], "--replicas"),
        (["--replicas", "two"], "--replicas"),
        (["--replicas", "2", "--router", "random"], "--router"),
        (["--replicas", "2", "--sweep", "1k,2k"], "not --sweep"),
        (["--replicas", "2", "--ssm"], "--ssm"),
        (["--replicas", "2", "--csv"], "--csv"),
        (["--publish", "tcp://127.0.0.1:5557", "--sweep", "1k,2k"], "not --sweep"),
        (["--publish", "udp://127.0.0.1:5557"], "--publish"),
        (["--publish", "tcp://127.0.0.1:x"], "port"),
        (["--replicas", "3", "--publish", "tcp://*:65534"], "65535"),
        (["--publish-wait", "1"], "--publish-wait needs --publish"),
        (["--publish", "tcp://*:5557", "--publish-wait", "-1"], "--publish-wait"),
        (["--hash-seed", "3"], "--hash-seed needs --replicas or --publish"),
        (["--block-hash", "vllm", "--hash-seed", "3"], "need --replicas"),
        (["--replicas", "2", "--hash-seed", "-1"], "--hash-seed"),
        (["--replicas", "2", "--router", "round-robin", "--prefix-max-load", "2"], "prefix"),
        (["--replicas", "2", "--prefix-max-load", "0.5"], "--prefix-max-load"),
    ],
)
def test_bad_fleet_flags_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    code, out, err = run(capsys, "replay", *SMALL, *argv)
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1 and "error" in err and "Traceback" not in err
    assert words in err, err


def test_replica_endpoints() -> None:
    assert replica_endpoints("tcp://*:5557", 3) == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert replica_endpoints("tcp://127.0.0.1:*", 2) == ["tcp://127.0.0.1:*"] * 2
    assert replica_endpoints("ipc:///tmp/kv", 1) == ["ipc:///tmp/kv"]
    assert replica_endpoints("ipc:///tmp/kv", 2) == ["ipc:///tmp/kv-0", "ipc:///tmp/kv-1"]
    for bad in ("tcp://host", "tcp://:1", "tcp://h:0", "ipc://", "inproc://x"):
        with pytest.raises(ValueError):
            replica_endpoints(bad, 1)


pytest.importorskip("msgspec")
pytest.importorskip("xxhash")


def _check_fleet(fleet: dict[str, Any], replicas: int) -> None:
    assert tuple(fleet) == FLEET_KEYS
    for key in ("result", "round_robin"):
        assert tuple(fleet[key]) == FLEET_RESULT_KEYS
        per = fleet[key]["per_replica"]
        assert len(per) == replicas and all(tuple(p) == REPLICA_KEYS for p in per)
        assert sum(p["requests"] for p in per) == fleet[key]["requests"]
        counts = [p["requests"] for p in per]
        assert fleet[key]["load_balance"] == pytest.approx(max(counts) * replicas / sum(counts))
    assert fleet["gain_vs_round_robin"] == pytest.approx(
        fleet["result"]["hit_rate"] - fleet["round_robin"]["hit_rate"]
    )


def test_json_fleet_section(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "replay", *SMALL, "--replicas", "3", "--capacity", "60", "--concurrency", "2",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert list(doc) == ["schema", "workload", "runs", "recommended", "fleet"]
    assert doc["schema"] == 1 and len(doc["runs"]) == 1 and doc["runs"][0]["capacity"] == 60
    fleet = doc["fleet"]
    _check_fleet(fleet, 3)
    assert fleet["router"] == "prefix" and fleet["capacity"] == 60 and fleet["publish"] is None
    assert fleet["round_robin"]["router"] == "round-robin"
    assert fleet["result"]["requests"] == doc["workload"]["requests"]
    assert fleet["gain_vs_round_robin"] > 0  # the built-in sessions share prompts


def test_text_fleet_section(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "replay", *SMALL, "--replicas", "2", "--router", "least-loaded",
        "--capacity", "80", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "fleet: 2 replicas x 80 blocks, least-loaded router" in out
    assert "least-loaded gains" in out and "max/mean req" in out


def test_round_robin_is_its_own_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(
        capsys, "replay", *SMALL, "--replicas", "2", "--router", "round-robin", "--json"
    )
    fleet = json.loads(out)["fleet"]
    assert fleet["result"] == fleet["round_robin"] and fleet["gain_vs_round_robin"] == 0.0


zmq = pytest.importorskip("zmq")


def _receive(sub: Any, done: threading.Event, got: list[list[bytes]]) -> None:
    while True:
        if sub.poll(100):
            got.append(sub.recv_multipart())
        elif done.is_set():
            return


def test_publish_streams_every_batch_to_a_subscriber(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """One replica: a SUB socket bound on an ephemeral loopback port receives every batch
    the replay published (the publisher connects to it), in order, decodable."""
    import msgspec

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
    got: list[list[bytes]] = []
    done = threading.Event()
    thread = threading.Thread(target=_receive, args=(sub, done, got), daemon=True)
    thread.start()
    try:
        code, out, err = run(
            capsys, "replay", *SMALL, "--publish", endpoint, "--publish-wait", "0.5",
            "--capacity", "100", "--json",
        )  # fmt: skip
    finally:
        done.set()
        thread.join(10)
        sub.close(linger=0)
        ctx.term()
    assert code == 0, err
    fleet = json.loads(out)["fleet"]
    _check_fleet(fleet, 1)
    [stats] = fleet["publish"]
    assert stats["endpoint"] == endpoint and stats["dropped_batches"] == 0
    assert stats["published_batches"] == len(got) > 0
    assert [int.from_bytes(seq, "big") for _, seq, _ in got] == list(range(len(got)))
    stored = removed = 0
    for topic, _, payload in got:
        _ts, events, rank = msgspec.msgpack.decode(payload)
        assert topic == b"" and rank == 0
        stored += sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
        removed += sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
    assert removed == fleet["result"]["evicted_blocks"] > 0
    assert stored > removed


def test_publish_on_a_used_port_fails_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:*")
    port = taken.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
    try:
        code, _out, err = run(
            capsys, "replay", *SMALL, "--publish", f"tcp://*:{port}", "--publish-wait", "0"
        )
    finally:
        taken.close(linger=0)
        ctx.term()
    assert code == 1 and err.count("\n") == 1 and "--publish" in err, err


def test_publish_one_stream_per_replica(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Two replicas on ipc://PATH-0 and -1: each stream carries its replica's rank and
    exactly its published batches; the evictions add up to the report's."""
    import msgspec

    base = f"ipc://{tmp_path}/kv"
    ctx = zmq.Context()
    subs = []
    for i in range(2):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"{base}-{i}")  # ZMQ retries until the replay binds
        subs.append(sub)
    got: list[list[list[bytes]]] = [[], []]
    done = threading.Event()
    threads = [
        threading.Thread(target=_receive, args=(sub, done, out), daemon=True)
        for sub, out in zip(subs, got, strict=True)
    ]
    for t in threads:
        t.start()
    try:
        code, out, err = run(
            capsys, "replay", *SMALL, "--replicas", "2", "--publish", base,
            "--publish-wait", "0.5", "--capacity", "60", "--json",
        )  # fmt: skip
    finally:
        done.set()
        for t in threads:
            t.join(10)
        for sub in subs:
            sub.close(linger=0)
        ctx.term()
    assert code == 0, err
    fleet = json.loads(out)["fleet"]
    removed = 0
    for i, stats in enumerate(fleet["publish"]):
        assert stats["endpoint"] == f"{base}-{i}" and stats["dropped_batches"] == 0
        assert stats["published_batches"] == len(got[i]) > 0
        for _, _, payload in got[i]:
            _ts, events, rank = msgspec.msgpack.decode(payload)
            assert rank == i
            removed += sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
    assert removed == fleet["result"]["evicted_blocks"] > 0
