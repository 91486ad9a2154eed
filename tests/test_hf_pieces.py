"""The parts of the Hugging Face integration that need no transformers: `plan_pieces` (how
`HFEngine` cuts a prefill into forward calls) and the CLI's refusal without the extra."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from cache.integrations.transformers.engine import plan_pieces
from tests.helpers import python_without


def test_pieces_end_at_every_cut_and_at_the_end() -> None:
    assert plan_pieces(0, 20, [8, 16, 13]) == [(0, 8), (8, 13), (13, 16), (16, 20)]
    assert plan_pieces(5, 20, [0, 5, 8, 20, 25]) == [(5, 8), (8, 20)]
    assert plan_pieces(7, 8, [8]) == [(7, 8)]


def test_no_one_token_pieces_drops_the_cuts_that_would_make_one() -> None:
    assert plan_pieces(0, 17, [8, 16], one_token_pieces=False) == [(0, 8), (8, 17)]
    assert plan_pieces(7, 20, [8, 16], one_token_pieces=False) == [(7, 16), (16, 20)]
    assert plan_pieces(7, 8, [], one_token_pieces=False) == [(7, 8)]  # nothing else to do


def test_without_multi_token_continuation_every_piece_after_a_state_is_one_token() -> None:
    assert plan_pieces(0, 5, [3], multi_token_continuation=False) == [
        (0, 3),
        (3, 4),
        (4, 5),
    ]
    assert plan_pieces(0, 4, [], multi_token_continuation=False) == [(0, 4)]
    assert plan_pieces(2, 5, [4], multi_token_continuation=False) == [(2, 3), (3, 4), (4, 5)]


@given(
    start=st.integers(0, 40),
    length=st.integers(1, 40),
    cuts=st.lists(st.integers(0, 90), max_size=8),
    multi=st.booleans(),
    one=st.booleans(),
)
def test_pieces_cover_the_prefill_in_order(
    start: int, length: int, cuts: list[int], multi: bool, one: bool
) -> None:
    end = start + length
    pieces = plan_pieces(start, end, cuts, multi_token_continuation=multi, one_token_pieces=one)
    assert pieces[0][0] == start and pieces[-1][1] == end
    for (_, e), (s, _) in itertools.pairwise(pieces):
        assert e == s
    ends = {e for _, e in pieces}
    assert all(s < e for s, e in pieces)
    if not multi:  # every position after the first piece runs alone
        assert all(e - s == 1 for s, e in pieces[1:])
        if start > 0:
            assert pieces[0] == (start, start + 1)
    elif not one:
        assert all(e - s >= 2 for s, e in pieces) or pieces == [(start, end)]
    else:
        assert {c for c in cuts if start < c < end} <= ends


def test_demo_model_without_transformers_names_the_extra() -> None:
    code = (
        "import sys\n"
        "from cache.planner.cli import main\n"
        "sys.exit(main(['demo', '--model', 'bamba']))\n"
    )
    proc = python_without(["transformers"], code)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("blocktrie demo: error: --model needs transformers")
    assert proc.stderr.rstrip().endswith("pip install 'blocktrie[hf]'")
    assert "Traceback" not in proc.stderr


def test_the_adapter_without_transformers_names_the_extra() -> None:
    code = (
        "import torch\n"
        "from cache.integrations.transformers import HFModel\n"
        "try:\n"
        "    HFModel(torch.nn.Linear(2, 2))\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    proc = python_without(["transformers"], code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MissingExtra ")
    assert proc.stdout.rstrip().endswith("pip install 'blocktrie[hf]'")
