"""nanobind's leak checker stays silent: the native core leaks no instance, type or
function by the time the interpreter exits (issue 47, "Assurance for C++").

nanobind counts, at interpreter exit, every C++ instance still bound to a Python
object, and the types and functions kept alive with them, and prints
``nanobind: leaked N instances!`` (then ``types``, ``functions``) to stderr. A
reference cycle through a native object that the garbage collector cannot see, or a
reference the bindings keep and never drop, shows there. These tests run a workload
in a fresh interpreter (the checker speaks only at its exit) and read its stderr.
Skipped where ``cache._native`` does not import (no compiler at install time).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

native = pytest.importorskip("cache._native", reason="the native core is not built")

LEAK_REPORT = "nanobind: leaked"

# The public API serves a short chat through the tiny model with the native backend
# (BLOCKTRIE_BACKEND=native): tries, sequences, hits, evictions, checkpoints and
# copies, and everything released. `{keep}` is where the control keeps the trie alive.
WORKLOAD = textwrap.dedent(
    """
    import ctypes
    import gc

    import torch

    from cache import BlockTrie, ManualCopies
    from cache.testing import Engine, TinyHybridConfig, TinyHybridModel, run_chat

    model = TinyHybridModel(
        TinyHybridConfig(
            vocab_size=16, d_model=8, n_heads=2, head_dim=4, d_state=2, conv_width=2,
            layers=("attn", "ssm"), seed=0, dtype=torch.float64, device="cpu",
        )
    )
    config = model.cache_config(block_size=2, num_blocks=8, num_checkpoint_slots=2)
    copies = ManualCopies()
    trie = BlockTrie(config, copies=copies)
    engine = Engine(model, trie, max_running=2, chunk_size=3, copies=copies,
                    complete_prob=0.5, seed=0, check=True)
    chats = [
        [([1, 2, 3, 4, 5], 2), ([6, 7], 2)],
        [([1, 2, 3, 9, 4, 4], 2)],
        [([5, 2, 8, 1], 3), ([3, 3], 2)],
        [([7, 7, 7, 6, 5], 2)],
    ]
    run_chat(engine, chats)
    engine.drain()
    trie.check()
    assert trie.backend == "native", trie.backend
    stats = trie.stats
    assert stats.evicted_blocks and stats.restores and stats.hit_tokens, stats
    {keep}
    del engine, trie, copies
    gc.collect()
    """
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, BLOCKTRIE_BACKEND="native")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_native_core_leaks_nothing_at_exit() -> None:
    done = _run(WORKLOAD.format(keep=""))
    assert done.returncode == 0, done.stderr
    assert LEAK_REPORT not in done.stderr, done.stderr


def test_the_leak_checker_is_on_and_its_report_is_the_one_read() -> None:
    """The control: the same workload with the trie kept alive on purpose (its
    reference count raised and never dropped) is reported, in the words the test
    above looks for. So the trie does hold native instances, the bindings have not
    turned the checker off, and the report's wording still matches."""
    done = _run(WORKLOAD.format(keep="ctypes.pythonapi.Py_IncRef(ctypes.py_object(trie))"))
    assert done.returncode == 0, done.stderr
    assert re.search(rf"^{LEAK_REPORT} \d+ instances!$", done.stderr, re.MULTILINE), done.stderr
