"""KV-event cost per stored block, against the cache's own per-block cost in the same run.

`bench_events(...)` returns a dict (ns per block; ratios); `print_events(result)`
prints it. ``python -m bench.run`` runs it as its ``events`` section
(`bench.run.bench_events_section`). Standalone: ``python -m bench.events
[--chains N] [--json PATH]``.

Measured, per stored block (chains of `chain_blocks` full blocks of
`block_size` tokens, one commit per chain, `commits_per_batch` commits per
published batch, as an engine draining events once per step would):

- ``dict_insert``: a plain dict-of-children trie insert (`bench.baseline`'s
  kind of work, stripped to the insert);
- ``blocktrie``: `cache.BlockTrie` match + allocate + commit + release, events off;
- ``hash[scheme]``: hashing one block's packed key under its parent, as the
  trie does (``xxh3``: one `BlockHasher.plain_digest` C call; ``vllm``:
  `BlockHasher.packed_fn`);
- ``build``: building the `BlockStored` tuples a commit emits (token ids as
  `PackedTokens` over the joined keys);
- ``encode``: `encode_batch` of those events;
- ``publish``: `KVEventPublisher.publish` (encode, then send or enqueue; caller side) on
  loopback with no subscriber, and ``publish_e2e``: until every batch has
  been handed to ZMQ, by the caller or the sender thread (what the process
  pays in total);
- ``blocktrie_events``: the same BlockTrie loop with events on (``xxh3``),
  draining every `commits_per_batch` commits and publishing each batch on
  loopback, until everything has been sent: what an engine
  pays in total;
- ratios: ``events_over_blocktrie`` = (``blocktrie_events`` - ``blocktrie``)
  / ``blocktrie``, the median over `repeat` interleaved rounds (each round
  runs events off, then on, so both see the same machine load): issue 9's
  goal is <= 0.25. ``components_over_blocktrie`` = (hash xxh3 + build +
  publish_e2e) / blocktrie sums the parts measured alone (it misses the
  commit-side bookkeeping the end-to-end figure includes), and
  ``events_over_dict_insert`` the same over ``dict_insert``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/events.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

perf_ns = time.perf_counter_ns
cpu_ns = time.process_time_ns  # this process's CPU: the engine's, not an encoder process's


def _chains(n: int, chain_blocks: int, block_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32_000) for _ in range(chain_blocks * block_size)] for _ in range(n)]


def _best(fn: Callable[[], int], repeat: int) -> int:
    """Best of `repeat` runs of `fn` (which returns elapsed ns)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    times = []
    for _ in range(repeat):
        gc.collect()
        times.append(fn())
    return min(times)


def bench_events(
    chains: int = 2_000,
    chain_blocks: int = 16,
    block_size: int = 16,
    commits_per_batch: int = 8,
    repeat: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the measurements above; returns ns per block and ratios (see module docstring)."""
    from cache import BlockTrie, CacheConfig
    from cache.block_hash import BlockHasher
    from cache.events import BlockStored
    from cache.keys import joined_tokens, pack_tokens
    from cache.kv_events import encode_batch
    from cache.kv_publisher import KVEventPublisher
    from cache.kv_publisher_process import ProcessEventPublisher

    data = _chains(chains, chain_blocks, block_size, seed)
    n_blocks = chains * chain_blocks
    b = block_size
    blocks = [[tuple(toks[i * b : (i + 1) * b]) for i in range(chain_blocks)] for toks in data]
    packed = [[pack_tokens(block) for block in chain] for chain in blocks]  # the trie's keys

    def dict_insert() -> int:
        root: dict[Any, Any] = {}
        t0 = perf_ns()
        for chain in blocks:
            node = root
            for key in chain:
                child = node.get(key)
                if child is None:
                    child = node[key] = {}
                node = child
        return perf_ns() - t0

    def serve(trie: BlockTrie, toks: list[int]) -> None:
        """One request, every block new: match, allocate, commit, release."""
        seq = trie.match(toks)
        trie.allocate(seq, len(toks))
        trie.commit(seq, len(toks))
        trie.release(seq)

    def blocktrie(events: bool = False) -> tuple[int, int]:
        config = CacheConfig(block_size=b, num_blocks=n_blocks + 1, enable_events=events)
        trie = BlockTrie(config)
        publisher = None
        if events:
            publisher = KVEventPublisher("tcp://127.0.0.1:*", queue_batches=chains + 1)
        try:
            batches = 0
            t0, c0 = perf_ns(), cpu_ns()
            for i, toks in enumerate(data, 1):
                serve(trie, toks)
                if publisher is not None and (i % commits_per_batch == 0 or i == chains):
                    drained = trie.drain_events()
                    if drained:  # an empty batch is not sent
                        if not publisher.publish(drained):
                            raise RuntimeError("benchmark publisher dropped a batch")
                        batches += 1
            if publisher is not None:
                while publisher.published_batches < batches:
                    time.sleep(0.0002)
            elapsed = perf_ns() - t0, cpu_ns() - c0
        finally:
            if publisher is not None:
                publisher.close()
        return elapsed

    def blocktrie_process(publisher: ProcessEventPublisher) -> tuple[int, int]:
        """The loop with events on, published through `publisher`'s encoder process,
        until the child has published every batch."""
        config = CacheConfig(block_size=b, num_blocks=n_blocks + 1, enable_events=True)
        trie = BlockTrie(config)
        target = publisher.poll_status()
        t0, c0 = perf_ns(), cpu_ns()
        for i, toks in enumerate(data, 1):
            serve(trie, toks)
            if i % commits_per_batch == 0 or i == chains:
                records = trie.drain_event_records()
                if records:
                    if not publisher.publish(records):
                        raise RuntimeError("benchmark publisher dropped a batch")
                    target += 1
        if not publisher.wait_published(target, timeout=60.0):
            raise RuntimeError("the encoder process did not publish every batch")
        return perf_ns() - t0, cpu_ns() - c0

    out: dict[str, Any] = {
        "chains": chains,
        "chain_blocks": chain_blocks,
        "block_size": block_size,
        "commits_per_batch": commits_per_batch,
        "blocks": n_blocks,
        "repeat": repeat,
    }
    out["dict_insert"] = _best(dict_insert, repeat) / n_blocks
    off_ns: list[tuple[int, int]] = []
    on_ns: list[tuple[int, int]] = []
    process_ns: list[tuple[int, int]] = []
    with ProcessEventPublisher("tcp://127.0.0.1:*", queue_batches=chains + 1) as process:
        for _ in range(repeat):  # interleaved: each round sees all three under the same load
            gc.collect()
            off_ns.append(blocktrie(False))
            gc.collect()
            on_ns.append(blocktrie(True))
            gc.collect()
            process_ns.append(blocktrie_process(process))

    def added(on: list[tuple[int, int]], part: int) -> float:
        """Median over rounds of on / off - 1 (`part` 0: wall time, 1: this process's CPU)."""
        return statistics.median(x[part] / o[part] - 1.0 for x, o in zip(on, off_ns, strict=True))

    out["blocktrie"] = min(w for w, _ in off_ns) / n_blocks
    out["blocktrie_events"] = min(w for w, _ in on_ns) / n_blocks
    out["blocktrie_events_process"] = min(w for w, _ in process_ns) / n_blocks
    out["events_over_blocktrie"] = added(on_ns, 0)
    out["events_process_over_blocktrie"] = added(process_ns, 0)
    out["events_cpu_over_blocktrie"] = added(on_ns, 1)
    out["events_process_cpu_over_blocktrie"] = added(process_ns, 1)

    hashes: dict[str, list[list[int]]] = {}
    out["hash"] = {}
    for scheme in ("xxh3", "vllm"):
        hasher = BlockHasher(scheme, 0)
        per_chain: list[list[int]] = []

        def run_hash(h: BlockHasher = hasher, acc: list[list[int]] = per_chain) -> int:
            acc.clear()
            root = h.root("")
            # what the trie calls per attached plain block, on the key bytes it holds
            digest = h.plain_digest
            packed_fn = h.packed_fn
            t0 = perf_ns()
            for chain in packed:
                p = root
                hs = []
                for key in chain:
                    p = digest(key, p) if digest is not None else packed_fn(p, key)
                    hs.append(p)
                acc.append(hs)
            return perf_ns() - t0

        rounds = repeat if scheme == "xxh3" else 1
        out["hash"][scheme] = _best(run_hash, rounds) / n_blocks
        hashes[scheme] = per_chain

    xh = hashes["xxh3"]
    ids = [list(range(i * chain_blocks, (i + 1) * chain_blocks)) for i in range(chains)]

    def build_events() -> list[BlockStored]:
        return [
            BlockStored(tuple(xh[i]), tuple(ids[i]), None, joined_tokens(packed[i], b), b, "")
            for i in range(chains)
        ]

    def run_build() -> int:
        t0 = perf_ns()
        build_events()
        return perf_ns() - t0

    out["build"] = _best(run_build, repeat) / n_blocks
    events = build_events()
    batches = [events[i : i + commits_per_batch] for i in range(0, chains, commits_per_batch)]

    def run_encode() -> int:
        t0 = perf_ns()
        for batch in batches:
            encode_batch(batch, ts=0.0)
        return perf_ns() - t0

    out["encode"] = _best(run_encode, repeat) / n_blocks
    out["bytes_per_block"] = sum(len(encode_batch(x, ts=0.0)) for x in batches) / n_blocks

    def run_publish(e2e: bool) -> int:
        with KVEventPublisher("tcp://127.0.0.1:*", queue_batches=len(batches) + 1) as pub:
            t0 = perf_ns()
            for batch in batches:
                pub.publish(batch, ts=0.0)
            if e2e:
                while pub.published_batches < len(batches):
                    time.sleep(0.0002)
            elapsed = perf_ns() - t0
            if pub.dropped_batches:
                raise RuntimeError(f"benchmark publisher dropped {pub.dropped_batches} batches")
        return elapsed

    out["publish"] = _best(lambda: run_publish(False), repeat) / n_blocks
    out["publish_e2e"] = _best(lambda: run_publish(True), repeat) / n_blocks
    events_cost = out["hash"]["xxh3"] + out["build"] + out["publish_e2e"]
    out["events_per_block"] = events_cost
    out["components_over_blocktrie"] = events_cost / out["blocktrie"]
    out["events_over_dict_insert"] = events_cost / out["dict_insert"]
    return out


def print_events(r: dict[str, Any], emit: Callable[[str], object] = print) -> None:
    """Human-readable summary of `bench_events`'s result."""
    emit(
        f"KV events: {r['blocks']} blocks ({r['chains']} chains x {r['chain_blocks']} blocks "
        f"of {r['block_size']} tokens; {r['commits_per_batch']} commits per batch)"
    )
    rows = [
        ("dict-trie insert", r["dict_insert"]),
        ("BlockTrie match+allocate+commit+release (events off)", r["blocktrie"]),
        ("  the same, events on, drained and published until sent", r["blocktrie_events"]),
        ("  the same, published by the encoder process", r["blocktrie_events_process"]),
        ("hash xxh3", r["hash"]["xxh3"]),
        ("hash vllm (sha256/CBOR)", r["hash"]["vllm"]),
        ("build BlockStored", r["build"]),
        ("encode_batch", r["encode"]),
        ("publish (caller: encode + send or enqueue)", r["publish"]),
        ("publish end to end (until sent)", r["publish_e2e"]),
        ("parts alone (xxh3 + build + publish e2e)", r["events_per_block"]),
    ]
    for name, ns in rows:
        emit(f"  {name:<55} {ns:9.0f} ns/block")
    emit(f"  wire bytes per block: {r['bytes_per_block']:.1f}")
    emit(
        f"  events on costs +{r['events_over_blocktrie']:.2f}x of events off with "
        f"KVEventPublisher, +{r['events_process_over_blocktrie']:.2f}x with "
        f"ProcessEventPublisher (wall time, median of {r['repeat']} interleaved rounds; "
        "goal <= 0.25)"
    )
    emit(
        f"  the engine process's CPU: +{r['events_cpu_over_blocktrie']:.2f}x with "
        f"KVEventPublisher, +{r['events_process_cpu_over_blocktrie']:.2f}x with "
        "ProcessEventPublisher (its encoder process's CPU not counted)"
    )
    emit(
        f"  parts alone / BlockTrie: {r['components_over_blocktrie']:.2f}   "
        f"parts alone / dict-trie insert: {r['events_over_dict_insert']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chains", type=int, default=2_000)
    p.add_argument("--chain-blocks", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--commits-per-batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    r = bench_events(a.chains, a.chain_blocks, a.block_size, a.commits_per_batch, a.repeat)
    print_events(r)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
