"""vLLM's own prefix cache (`vllm.v1.core.kv_cache_manager.KVCacheManager`) as a peer.

Issue 13 asks for blocktrie's per-block cost next to vLLM's, measured in the
same benchmark run. vLLM is not a dependency of this project (its wheel pins
its own torch and pulls in a serving stack), so `bench.peers` runs this module
in a child process, with whichever Python has vLLM installed:

    python -m bench.run --sections peers --vllm-python /path/to/venv/bin/python

The child replays one workload through `VLLMCache` with the same replay loop,
timing wrapper and clock as the in-process peers, and prints one JSON line.

`VLLMCache` drives vLLM the way its scheduler does, per request:
`get_computed_blocks` (the prefix hit) when it is matched, `allocate_slots`
for the prompt (with the hit's blocks) and again for decode tokens,
`Request.num_computed_tokens` advanced on commit, `free` when it finishes.
Block hashes are vLLM's default, ``sha256`` (computed by the request's block
hasher as tokens arrive, so their cost lands in `match` and `append`), and
vLLM caches a block when its slots are allocated, so its `commit` only moves
the request's computed-token count. vLLM evicts inside `allocate_slots` (its
free-block queue is its LRU): its free count includes idle cached blocks, so
the replay never calls `evict` on it. Its eviction count is not kept (a
counting hook would add to the timed cost), so rows show it as n/a.
"""

from __future__ import annotations

import json
import sys
from itertools import count
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/vllm_peer.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec.errors import OutOfBlocks

__all__ = ["VLLMCache", "VLLMSequence", "available", "make_vllm"]


def available() -> bool:
    """Whether this interpreter can import vLLM's KV cache manager."""
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:  # any import failure means "not usable here"
        return False
    return True


class VLLMStats:
    """The counters the replay reads (hits are counted by the replay itself)."""

    __slots__ = ("evicted_blocks", "hit_tokens", "query_tokens")

    def __init__(self) -> None:
        self.evicted_blocks = 0
        self.hit_tokens = 0
        self.query_tokens = 0


class VLLMSequence:
    """One request: vLLM's `Request`, the hit vLLM found, and the block table."""

    __slots__ = (
        "block_ids",
        "branch_step",
        "computed",
        "num_cached_tokens",
        "num_committed_tokens",
        "request",
        "restore",
        "started",
    )

    def __init__(self, request: Any, computed: Any, hit: int) -> None:
        self.request = request
        self.computed = computed  # KVCacheBlocks of the hit, handed to the first allocate
        self.num_cached_tokens = hit
        self.num_committed_tokens = hit
        self.block_ids: list[int] = []
        self.started = False
        self.branch_step = 0
        self.restore = None


class VLLMCache:
    """vLLM's `KVCacheManager` behind the replay's cache interface (attention only).

    `capacity` usable blocks: vLLM keeps block 0 as its null block, so the pool
    is built with one more.
    """

    def __init__(self, block_size: int, capacity: int, hash_algo: str = "sha256") -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        hash_fn = get_hash_fn_by_name(hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        self._hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
        )
        config = KVCacheConfig(
            num_blocks=capacity + 1,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)],
        )
        self._manager = KVCacheManager(
            config,
            max_model_len=1 << 30,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        self._pool = self._manager.block_pool
        self._request = Request
        self._params = SamplingParams(max_tokens=1 << 30)
        self._ids = count()
        self.block_size = block_size
        self.stats = VLLMStats()

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, idle cached ones included (vLLM evicts them as it allocates)."""
        return int(self._pool.get_num_free_blocks())

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a cached hash (held or idle)."""
        return len(self._pool.cached_block_hash_to_block)

    @property
    def num_free_checkpoint_slots(self) -> int:
        """No checkpoints: attention-only replays only."""
        return 0

    def match(self, tokens: list[int], namespace: str = "") -> VLLMSequence:
        request = self._request(
            str(next(self._ids)), list(tokens), self._params, None, block_hasher=self._hasher
        )
        computed, hit, *_ = self._manager.get_computed_blocks(request)
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += hit
        return VLLMSequence(request, computed, hit)

    def allocate(self, seq: VLLMSequence, num_tokens: int) -> None:
        request = seq.request
        if not seq.started:
            hit = seq.num_cached_tokens
            blocks = self._manager.allocate_slots(request, num_tokens - hit, hit, seq.computed)
            if blocks is None:
                raise OutOfBlocks(f"vLLM could not allocate {num_tokens - hit} tokens")
            seq.started = True
            seq.computed = None
            request.num_computed_tokens = hit
            seq.block_ids = list(self._manager.get_block_ids(request.request_id)[0])
            return
        new = num_tokens - request.num_computed_tokens
        if new <= 0:
            return
        blocks = self._manager.allocate_slots(request, new)
        if blocks is None:
            raise OutOfBlocks(f"vLLM could not allocate {new} tokens")
        seq.block_ids.extend(blocks.get_block_ids()[0])

    def commit(self, seq: VLLMSequence, num_tokens: int) -> None:
        seq.request.num_computed_tokens = num_tokens
        seq.num_committed_tokens = num_tokens

    def append(self, seq: VLLMSequence, tokens: list[int]) -> None:
        seq.request.append_output_token_ids(list(tokens))

    def release(self, seq: VLLMSequence) -> None:
        self._manager.free(seq.request)
        seq.block_ids = []

    def abort(self, seq: VLLMSequence) -> None:
        self.stats.hit_tokens -= seq.num_cached_tokens
        self.stats.query_tokens -= seq.request.num_prompt_tokens
        if seq.started:
            self._manager.free(seq.request)
        seq.block_ids = []

    def evict(self, num_blocks: int) -> int:
        """Nothing to do: vLLM evicts idle cached blocks inside `allocate_slots`."""
        return 0

    def poll(self) -> int:
        return 0

    def save(self, seq: VLLMSequence, num_tokens: int, runtime_state: Any) -> None:
        raise ValueError("the vLLM peer is attention-only")

    def restore(self, seq: VLLMSequence, runtime_state: Any) -> None:
        raise ValueError("the vLLM peer is attention-only")


def make_vllm(block_size: int, capacity: int) -> VLLMCache:
    return VLLMCache(block_size, capacity)


def main(argv: list[str]) -> int:
    """``--row TRACE BLOCK_SIZE CAPACITY REPEATS CLOCK_NS``: replay a rescaled Mooncake
    trace `REPEATS` times, print the best run as JSON (`bench.peers.run_once`'s keys);
    ``--memory N``: bytes per cached block (`bench.peers.memory_child`)."""
    from bench import peers

    peers.IMPLS["vllm"] = make_vllm
    if len(argv) == 6 and argv[0] == "--row":
        from cache.planner.traces import load_trace

        trace, b, cap, repeats, clock = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
        workload = load_trace(Path(trace), "mooncake", b)
        best: dict[str, Any] | None = None
        for _ in range(repeats):
            r = peers.run_once(workload, make_vllm, b, cap, float(clock))
            if best is None or r["ns_per_block"] < best["ns_per_block"]:
                best = r
        if best is None:
            raise SystemExit("REPEATS must be at least 1")
        best["evicted_blocks"] = None
        print(json.dumps(best))
        return 0
    if len(argv) == 2 and argv[0] == "--memory":
        print(json.dumps(peers.memory_child("vllm", int(argv[1]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
