"""Contract details of `cache.moves.BlockMove` (mutation survivors).

A load from the host to another device keeps every temporary it makes (the
host staging, the device copy of the gathered blocks, the device index) until
`release()`; the host -> device path scatters a load of two destination runs
block by block, and warns about nothing. The device -> host and host -> device
paths run here on CPU tensors (as `tests/test_moves.py` does) or on the `meta`
device, which checks devices and shapes but moves no data.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from cache.moves import MAX_RUN_OPS, SPLIT_RUN_BYTES, BlockMove, _runs, _words
from tests.helpers import spy_gather_ops
from tests.test_moves import check, pool, reference, run_path, same_bits


def test_a_load_to_another_device_keeps_its_temporaries_until_released() -> None:
    """Host -> `meta` (standing in for CUDA): the scattered source is gathered into a
    host staging tensor, copied to a tensor on the destination device, and scattered
    there through an index on that device; the move keeps all three until released."""
    src = pool(40)
    dst = torch.empty((40, 4, 3), dtype=torch.float16, device="meta")
    move = BlockMove(src, [30, 2, 17, 5], dst, [20, 3, 9, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        move.run()
    staging, values, index = move._keep
    words = _words(src, src)[0]
    assert staging.device.type == "cpu" and staging.dtype == torch.int64
    assert torch.equal(staging, words[[2, 5, 17, 30]])  # destination order: 3, 4, 9, 20
    assert values.device.type == "meta" and tuple(values.shape) == (4, 3)
    assert values.dtype == torch.int64
    assert index.device.type == "meta" and index.dtype == torch.int64
    assert tuple(index.shape) == (4,)
    move.release()
    assert move._keep == []


def test_a_load_of_one_destination_run_copies_straight_into_it() -> None:
    """Host -> `meta`, one destination run: staging only, no device temporary."""
    src = pool(40)
    dst = torch.empty((40, 4, 3), dtype=torch.float16, device="meta")
    move = BlockMove(src, [30, 2, 17, 5], dst, [6, 3, 5, 4])
    move.run()
    (staging,) = move._keep
    assert staging.device.type == "cpu"
    assert torch.equal(staging, _words(src, src)[0][[2, 5, 17, 30]])


def test_the_host_to_device_path_scatters_two_destination_runs() -> None:
    for src_ids, dst_ids in [
        ([0, 5, 9], [0, 1, 7]),  # two destination runs, scattered source
        ([3, 4, 5, 6], [10, 11, 30, 31]),  # two destination runs, one source run
        ([8, 1, 30], [2, 3, 4]),  # one destination run
    ]:
        for path in ("_from_host", "_to_other_device"):
            _, ok = run_path(path, src_ids, dst_ids)
            assert ok, (path, src_ids, dst_ids)


def test_the_host_to_device_staging_is_kept_and_warns_about_nothing() -> None:
    move, ok = run_path("_from_host", [30, 2, 17, 5, 11], [20, 21, 22, 23, 24])
    assert ok
    (staging,) = move._keep  # one destination run: straight from the staging
    assert tuple(staging.shape) == (5, 3) and staging.dtype == torch.int64


def _layout(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    return t.dtype, tuple(t.shape)


def test_blocks_are_moved_as_words_exactly_when_both_pools_allow_it() -> None:
    """`_words`: int64 words for contiguous pools of narrower elements whose blocks are a
    whole number of 8-byte words at 8-byte aligned offsets; flat blocks of their own
    elements otherwise (8-byte elements, bool and complex included); non-contiguous
    pools unchanged."""
    f16 = torch.zeros(10, 4, 3, dtype=torch.float16)  # 24-byte blocks
    assert [_layout(t) for t in _words(f16, f16)] == [(torch.int64, (10, 3))] * 2
    flat = torch.zeros(6, 4, dtype=torch.float16)  # one word a block, 1-D blocks
    assert [_layout(t) for t in _words(flat, flat)] == [(torch.int64, (6, 1))] * 2
    one = torch.zeros(6, dtype=torch.int32)  # 4-byte blocks: no whole word
    assert [_layout(t) for t in _words(one, one)] == [(torch.int32, (6, 1))] * 2
    odd = torch.zeros(10, 3, dtype=torch.float16)  # 6-byte blocks
    assert [_layout(t) for t in _words(odd, odd)] == [(torch.float16, (10, 3))] * 2
    wide = torch.zeros(10, 2, 2, dtype=torch.float64)  # already 8-byte elements
    assert [_layout(t) for t in _words(wide, wide)] == [(torch.float64, (10, 4))] * 2
    flags = torch.zeros(10, 8, dtype=torch.bool)
    assert [_layout(t) for t in _words(flags, flags)] == [(torch.bool, (10, 8))] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental
        halves = torch.zeros(10, 4, dtype=torch.complex32)
    assert [_layout(t) for t in _words(halves, halves)] == [(torch.complex32, (10, 4))] * 2
    # offsets: 4 float16 elements are 8 bytes (aligned), 1 is 2 bytes (not)
    aligned = torch.zeros(44, dtype=torch.float16)[4:].view(10, 4)
    shifted = torch.zeros(41, dtype=torch.float16)[1:].view(10, 4)
    base = torch.zeros(10, 4, dtype=torch.float16)
    for src, dst, want in [
        (aligned, base, torch.int64),
        (base, aligned, torch.int64),
        (shifted, base, torch.float16),
        (base, shifted, torch.float16),
    ]:
        s, d = _words(src, dst)
        assert _layout(s) == _layout(d) == (want, (10, 1 if want == torch.int64 else 4))
        assert s.data_ptr() == src.data_ptr() and d.data_ptr() == dst.data_ptr()
    strided = torch.zeros(10, 4, 2, dtype=torch.float16)[:, :, 0]
    for src, dst in [(strided, base), (base, strided), (strided, strided)]:
        s, d = _words(src, dst)
        assert s is src and d is dst, "a non-contiguous pool is left as it is"
    scalar = torch.zeros((), dtype=torch.float16)
    s, d = _words(scalar, scalar)
    assert s is scalar and d is scalar


def _spy_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the gathering operations a same-device move issues."""
    return spy_gather_ops(monkeypatch)


def test_up_to_max_run_ops_destination_runs_are_one_operation_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _spy_ops(monkeypatch)
    dst_ids = list(range(0, 4 * MAX_RUN_OPS, 4))  # exactly MAX_RUN_OPS runs of one block
    src_ids = [3 * i for i in range(MAX_RUN_OPS)]
    src, dst = pool(40), pool(41)[1:]
    want = reference(src, src_ids, dst, dst_ids)
    BlockMove(src, src_ids, dst, dst_ids).run()
    assert same_bits(dst, want)
    assert calls == [], "one slice copy_ per run, no gather"
    scattered = [[30, 2], [17, 5], [11, 0], [36, 14]][:MAX_RUN_OPS]
    dst_runs = [[4 * i, 4 * i + 1] for i in range(MAX_RUN_OPS)]
    src_ids = [s for run in scattered for s in run]
    dst_ids = [d for run in dst_runs for d in run]
    want = reference(src, src_ids, dst, dst_ids)
    BlockMove(src, src_ids, dst, dst_ids).run()
    assert same_bits(dst, want)
    assert calls == ["index_select"] * MAX_RUN_OPS, "one index_select into each run"


def test_one_source_block_copied_to_many_scattered_destinations() -> None:
    """Source ids may repeat (only destinations may not); a one-block source pool works
    on every path, the per-run copies of big blocks included."""
    for shape in [(4, 3), (SPLIT_RUN_BYTES // 2,)]:
        src, dst = pool(1, shape), pool(41, shape)[1:]
        dst_ids = list(range(0, 4 * (MAX_RUN_OPS + 1), 4))
        src_ids = [0] * len(dst_ids)
        want = reference(src, src_ids, dst, dst_ids)
        BlockMove(src, src_ids, dst, dst_ids).run()
        assert same_bits(dst, want), shape
        assert all(same_bits(dst[d], src[0]) for d in dst_ids)


def test_id_lists_that_came_to_differ_in_length_are_refused_when_run() -> None:
    """The pairs are zipped strictly: a move whose id lists were changed after it was
    built (so that they no longer pair up) raises instead of dropping blocks."""
    src, dst = pool(8), pool(8)
    move = BlockMove(src, [0, 1], dst, [2, 3])
    move.src_ids.append(4)
    with pytest.raises(ValueError, match="zip"):
        move.run()


def test_a_cpu_gather_keeps_only_the_gathered_blocks() -> None:
    """On the CPU the index tensors are used at once (nothing runs asynchronously):
    only the gathered blocks are kept, until released."""
    src, dst = pool(40), pool(41)[1:]
    many = list(range(0, 4 * (MAX_RUN_OPS + 1), 4))
    move = BlockMove(src, many[::-1], dst, many)
    move.run()
    (values,) = move._keep
    assert torch.equal(values, _words(src, src)[0][many[::-1]])
    one_run = BlockMove(src, [9, 2, 5], dst, [0, 1, 2])
    one_run.run()
    assert one_run._keep == [], "an index_select straight into the run keeps nothing"


def test_an_index_for_cuda_is_pinned_and_moved_without_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_index` on a CUDA device (faked: no CUDA here): the host index is page-locked,
    sent without blocking, and both the pinned and the device index are kept until
    released."""
    calls: list[tuple[str, Any]] = []

    def fake_pin(self: torch.Tensor) -> torch.Tensor:
        pinned = self.clone()
        calls.append(("pin_memory", pinned))
        return pinned

    def fake_to(self: torch.Tensor, device: torch.device, non_blocking: bool = False) -> Any:
        calls.append(("to", (self, device, non_blocking)))
        return ("on", device)

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    move = BlockMove(pool(8), [0], pool(8), [1])
    cuda = torch.device("cuda", 0)
    on_device = move._index([5, 1, 3], cuda)
    assert on_device == ("on", cuda)
    (pin, pinned), (to, (sent, device, non_blocking)) = calls
    assert (pin, to) == ("pin_memory", "to")
    assert sent is pinned and device == cuda and non_blocking is True
    assert pinned.dtype == torch.int64 and pinned.tolist() == [5, 1, 3]
    assert move._keep == [pinned, on_device]
    calls.clear()
    meta = move._index([2], torch.device("meta"))  # another device: sent, not pinned
    assert meta == ("on", torch.device("meta")) and [c[0] for c in calls] == ["to"]


def test_a_store_from_another_device_gathers_there_then_copies_run_by_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move whose source is not on the CPU (`meta` standing in for CUDA) takes the
    device -> host path with both pools as word views and the pairs in destination
    order, cut into destination runs."""
    seen: list[tuple[Any, ...]] = []

    def spy(self: BlockMove, *args: Any) -> None:
        seen.append(args)

    monkeypatch.setattr(BlockMove, "_to_other_device", spy)
    monkeypatch.setattr(BlockMove, "_from_host", lambda *a: pytest.fail("not a load"))
    monkeypatch.setattr(BlockMove, "_same_device", lambda *a: pytest.fail("two devices"))
    src = torch.empty((40, 4, 3), dtype=torch.float16, device="meta")
    dst = pool(40)
    BlockMove(src, [30, 2, 17, 5, 11], dst, [21, 3, 20, 4, 9]).run()
    ((s, s_ids, d, d_ids, runs),) = seen
    assert s.device.type == "meta" and _layout(s) == (torch.int64, (40, 3))
    assert d.device.type == "cpu" and _layout(d) == (torch.int64, (40, 3))
    assert d.data_ptr() == dst.data_ptr()
    assert d_ids == [3, 4, 9, 20, 21] and s_ids == [2, 5, 11, 17, 30]
    assert runs == [(0, 2), (2, 1), (3, 2)]


def test_a_refused_move_names_both_block_layouts() -> None:
    """The refusal of pools that differ in block shape or dtype states each pool's
    block shape (its shape past the block dimension) and dtype, word for word."""
    src = pool(4)  # blocks (4, 3) float16
    with pytest.raises(ValueError) as info:
        BlockMove(src, [0], pool(4, (3,)), [0])
    assert str(info.value) == "BlockMove: blocks (4, 3) torch.float16 into (3,) torch.float16"
    with pytest.raises(ValueError) as info:
        BlockMove(pool(4, (3,)), [0], pool(4, (2, 5), torch.float64), [0])
    assert str(info.value) == "BlockMove: blocks (3,) torch.float16 into (2, 5) torch.float64"
    with pytest.raises(ValueError) as info:
        BlockMove(src, [0, 1], src, [0])
    assert str(info.value) == "BlockMove: 2 source ids, 1 destination"


def test_sources_that_only_end_like_a_run_are_gathered_not_sliced() -> None:
    """A run of source blocks is consecutive all the way: ids whose first and last
    are as far apart as a run's ([5, 7, 6, 8]) are gathered block by block on every
    path, never copied as the slice between their ends."""
    cases = [
        ([5, 7, 6, 8], [0, 1, 2, 3]),  # one destination run
        ([5, 7, 6, 8, 9, 10], [0, 2, 4, 6, 8, 10]),  # more runs than MAX_RUN_OPS
    ]
    assert len(_runs(cases[1][1])) > MAX_RUN_OPS
    for src_ids, dst_ids in cases:
        check(src_ids, dst_ids)
        for path in ("_from_host", "_to_other_device"):
            _, ok = run_path(path, src_ids, dst_ids)
            assert ok, (path, src_ids, dst_ids)
