"""Gathered block moves (`cache.moves.BlockMove`): every layout of ids moves exactly the
bytes a per-block ``copy_`` would, and nothing else."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.copies import BlockMove, Copy, DeviceCopies, ManualCopies, TensorMove, block_moves
from cache.moves import MAX_RUN_OPS, SPLIT_RUN_BYTES, _common_runs, _runs, _words
from tests.helpers import spy_gather_ops


def pool(
    n: int, shape: tuple[int, ...] = (4, 3), dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """`n` blocks of random bits (NaN payloads included: the move must copy bits, not values)."""
    gen = torch.Generator().manual_seed(n * 31 + len(shape))
    raw = torch.randint(0, 256, (n, *shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(n, *shape).clone()


def reference(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> torch.Tensor:
    """What one ``copy_`` per block leaves in `dst` (on a clone)."""
    out = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        out[d].copy_(src[s])
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check(
    src_ids: list[int],
    dst_ids: list[int],
    *,
    shape: tuple[int, ...] = (4, 3),
    dtype: torch.dtype = torch.float16,
    n_src: int = 40,
    n_dst: int = 40,
) -> BlockMove:
    src, dst = pool(n_src, shape, dtype), pool(n_dst + 1, shape, dtype)[1:]
    src_before = src.clone()
    want = reference(src, src_ids, dst, dst_ids)
    move = BlockMove(src, src_ids, dst, dst_ids)
    with torch.no_grad():
        move.run()
    assert same_bits(dst, want), (src_ids, dst_ids)
    assert same_bits(src, src_before), "the source is never written"
    return move


LAYOUTS = {
    "one block": ([7], [3]),
    "contiguous runs": ([4, 5, 6, 7], [10, 11, 12, 13]),
    "descending runs (a LIFO free list)": ([9, 8, 7, 6], [3, 2, 1, 0]),
    "destination run, scattered source": ([30, 2, 17, 5, 11], [20, 21, 22, 23, 24]),
    "source run, scattered destination": ([0, 1, 2, 3, 4, 5], [33, 1, 17, 9, 25, 4]),
    "a few destination runs": ([1, 2, 3, 20, 21, 8, 30], [5, 6, 7, 12, 13, 30, 31]),
    "scattered both ways": ([3, 19, 7, 25, 11, 0, 36, 14], [28, 2, 15, 9, 33, 21, 6, 39]),
    "many runs, some longer than a block": (
        [0, 1, 5, 9, 10, 11, 20, 30, 39],
        [10, 11, 3, 20, 21, 22, 0, 7, 15],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((4, 3), torch.float16),
        ((3,), torch.float16),
        ((2, 2), torch.float64),
        ((5,), torch.uint8),
        ((SPLIT_RUN_BYTES // 2,), torch.float16),  # big blocks: split into runs on the CPU
    ],
)
def test_every_layout_moves_the_bits_a_per_block_copy_would(
    layout: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    src_ids, dst_ids = LAYOUTS[layout]
    check(src_ids, dst_ids, shape=shape, dtype=dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cross_device_paths_move_the_same_bits_on_cpu(layout: str) -> None:
    """The device -> host and host -> device paths are device-agnostic: run on CPU
    tensors, they must agree with a per-block copy too."""
    src_ids, dst_ids = LAYOUTS[layout]
    for path in ("_to_other_device", "_from_host"):
        _, same = run_path(path, src_ids, dst_ids)
        assert same, (path, layout)


def run_path(path: str, src_ids: list[int], dst_ids: list[int]) -> tuple[BlockMove, bool]:
    """Run one cross-device path (`BlockMove._to_other_device` / `._from_host`) of a
    move on CPU tensors, warnings as errors; returns the move and whether `dst` then
    holds what a per-block copy leaves."""
    src, dst = pool(40), pool(41)[1:]
    want = reference(src, src_ids, dst, dst_ids)
    move = BlockMove(src, src_ids, dst, dst_ids)
    s, d = _words(src, dst)
    pairs = sorted(zip(dst_ids, src_ids, strict=True))
    d_ids, s_ids = [p[0] for p in pairs], [p[1] for p in pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(move, path)(s, s_ids, d, d_ids, _runs(d_ids))
    return move, same_bits(dst, want)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 24).flatmap(
        lambda n: st.tuples(
            st.permutations(list(range(32))).map(lambda p: p[:n]),
            st.permutations(list(range(32))).map(lambda p: p[:n]),
            st.sampled_from([(2,), (4, 3), (3,)]),
        )
    )
)
def test_any_distinct_ids_move_like_per_block_copies(
    case: tuple[list[int], list[int], tuple[int, ...]],
) -> None:
    src_ids, dst_ids, shape = case
    check(src_ids, dst_ids, shape=shape, n_src=32, n_dst=32)


def test_runs_and_the_paths_they_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _runs([1, 2, 3, 7, 8, 10]) == [(0, 3), (3, 2), (5, 1)]
    assert _runs([4]) == [(0, 1)]
    calls = spy_gather_ops(monkeypatch)
    check([4, 5, 6], [9, 10, 11])  # both runs: one slice copy_
    assert calls == []
    check([9, 2, 5], [0, 1, 2])  # one destination run: one index_select into it
    assert calls == ["index_select"]
    calls.clear()
    many = list(range(0, 4 * (MAX_RUN_OPS + 1), 4))  # MAX_RUN_OPS + 1 destination runs
    check(list(range(len(many))), many)  # gather (a slice: the source is a run) + scatter
    assert calls == ["index_copy_"]
    calls.clear()
    check(many[::-1], many)
    assert calls == ["index_select", "index_copy_"]
    calls.clear()
    check(many[::-1], many, shape=(SPLIT_RUN_BYTES // 2,))  # big blocks: a copy_ per run
    assert calls == []
    check(many[::-1], many, shape=(SPLIT_RUN_BYTES // 2 - 8,))  # just below: gathered
    assert calls == ["index_select", "index_copy_"]
    assert _common_runs([1, 2, 3, 5, 6], [7, 8, 2, 3, 4]) == [(0, 2), (2, 1), (3, 2)]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "one by one"])
def test_big_scattered_blocks_are_copied_run_by_run_in_one_batch(
    monkeypatch: pytest.MonkeyPatch, foreach: bool
) -> None:
    """Past `MAX_RUN_OPS` runs of big blocks on the CPU, every run consecutive on both
    sides is one ``copy_``, issued together by ``torch._foreach_copy_`` (or one by one
    where torch lacks it): single blocks by index, longer runs as slices."""
    import cache.moves as moves

    batches: list[list[tuple[int, ...]]] = []
    real = moves._FOREACH_COPY
    assert real is not None  # the torch this project pins has it

    def spy(dst_views: list[torch.Tensor], src_views: list[torch.Tensor]) -> None:
        batches.append([tuple(t.shape) for t in dst_views])
        assert [t.shape for t in src_views] == [t.shape for t in dst_views]
        real(dst_views, src_views)

    monkeypatch.setattr(moves, "_FOREACH_COPY", spy if foreach else None)
    block = SPLIT_RUN_BYTES // 2  # float16 elements: one block is SPLIT_RUN_BYTES
    src_ids, dst_ids = LAYOUTS["many runs, some longer than a block"]
    check(src_ids, dst_ids, shape=(block,))
    if foreach:
        words = block * 2 // 8  # blocks are moved as int64 words
        runs = [1, 1, 1, 2, 3, 1]  # destination order: 0 | 3 | 7 | 10-11 | 15 | 20-22
        assert sorted(batches[0]) == sorted((words,) if n == 1 else (n, words) for n in runs)
        assert len(batches) == 1
    else:
        assert batches == []


def test_temporaries_are_kept_until_released() -> None:
    many = list(range(0, 40, 4))
    move = check(many[::-1], many)  # the gather + scatter path: index tensors and values
    assert move._keep
    move.release()
    assert move._keep == []
    assert check([1, 2], [3, 4])._keep == []  # a slice copy_ makes none


def test_bad_moves_are_refused() -> None:
    src, dst = pool(4), pool(4)
    with pytest.raises(ValueError, match="source ids"):
        BlockMove(src, [0, 1], dst, [0])
    with pytest.raises(ValueError, match="into"):
        BlockMove(src, [0], pool(4, (3,)), [0])
    with pytest.raises(ValueError, match="into"):
        BlockMove(src, [0], dst.to(torch.float32), [0])
    assert block_moves(None, [0], dst, [0]) == [] == block_moves(src, [0], None, [0])
    assert block_moves(src, [], dst, []) == []
    (move,) = block_moves(src, [0, 1], dst, [2, 3])
    assert isinstance(move, BlockMove) and len(move) == 2 and move.tensors() == (src, dst)
    assert "2 blocks cpu -> cpu" in repr(move)


def test_tensor_moves_unpack_and_copy() -> None:
    src, dst = torch.arange(4.0), torch.zeros(4)
    move = TensorMove(src, dst)
    a, b = move
    assert a is src and b is dst and move.tensors() == (src, dst)
    move.run()
    move.release()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("engine", ["device", "manual"])
def test_a_copy_drops_its_temporaries_once_its_data_moved(engine: str) -> None:
    many = list(range(0, 40, 4))
    src, dst = pool(40), pool(40)
    want = reference(src, many[::-1], dst, many)
    move = BlockMove(src, many[::-1], dst, many)
    copy = Copy("store", 0, [move], [("block", 0)], 1)
    copies = DeviceCopies() if engine == "device" else ManualCopies()
    copies.bind(torch.device("cpu"))
    copies.queue(copy)
    if isinstance(copies, ManualCopies):
        assert same_bits(dst, pool(40)), "a manual copy moves nothing until completed"
        copies.complete(copy)
    assert copy.done and same_bits(dst, want)
    assert move._keep == []


def test_a_random_mix_of_moves_in_one_copy_runs_in_order() -> None:
    """Moves run in list order: a later move sees what an earlier one wrote."""
    rng = random.Random(3)
    a, b, c = pool(16), pool(16), pool(16)
    ids = rng.sample(range(16), 6)
    first = BlockMove(a, ids, b, list(range(6)))
    second = BlockMove(b, list(range(6)), c, ids[::-1])
    want = reference(reference(a, ids, b, list(range(6))), list(range(6)), c, ids[::-1])
    Copy("store", 0, [first, second], [], 1).run()
    assert same_bits(c, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_and_pinned_host_round_trip_on_a_side_stream(layout: str) -> None:
    """Device -> pinned host -> device on a side stream, every layout, bit for bit."""
    src_ids, dst_ids = LAYOUTS[layout]
    device = torch.device("cuda")
    gpu = pool(40).to(device)
    host = pool(41)[1:].pin_memory()
    want_host = reference(gpu.cpu(), src_ids, host, dst_ids)
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    store = BlockMove(gpu, src_ids, host, dst_ids)
    with torch.cuda.stream(stream), torch.no_grad():
        store.run()
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    event.synchronize()  # type: ignore[no-untyped-call]
    store.release()
    assert same_bits(host, want_host)
    back = torch.zeros_like(gpu)
    want_back = reference(host, dst_ids, back.cpu(), src_ids)
    load = BlockMove(host, dst_ids, back, src_ids)
    with torch.cuda.stream(stream), torch.no_grad():
        load.run()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    load.release()
    assert same_bits(back.cpu(), want_back)
