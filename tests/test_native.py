"""The native core (`cache._native`, issue 47): choosing a backend, and the two backends
agreeing call by call.

- Backend selection (`cache.native.resolve_backend`): `CacheConfig.backend`,
  `BLOCKTRIE_BACKEND`, the fallback warning, the refusal when native is asked
  for and missing. These run with or without the extension.
- `PairedBackends`: one Hypothesis state machine drives a Python-core trie and
  a native-core trie with the same operations (tiny alphabet, a handful of
  blocks: eviction on most steps; namespaces, extra identities and 64-bit
  token ids take the kernels' fallback paths) and requires, after every step,
  equal results, equal errors, equal snapshots (every node, count, index and
  statistic) and equal events.
- The kernels' own contracts: `NodeLRU` against `cache.lru.LRUIndex`, the
  pool's all-or-nothing refusals, the spec's tables handed over at import.

Everything else the native backend must keep is the whole suite, run a second
time with ``BLOCKTRIE_BACKEND=native`` (``.ci/run``).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

import cache.native as native
from cache import BlockTrie, CacheConfig, Sequence, eviction
from cache.lru import LRUIndex
from cache.node import NO_BLOCK, NO_NODE, state_code, state_name
from spec.errors import CacheError, ConfigError, InvalidArgument
from spec.lifecycle import LIFECYCLES, NODE, NodeState, NodeTrigger
from tests.helpers import serve

ROOT = Path(__file__).resolve().parent.parent
NATIVE = native.native_module()
needs_native = pytest.mark.skipif(
    NATIVE is None, reason=f"no native core: {native.unavailable_reason()}"
)


BACKENDS = ("python", "native") if NATIVE is not None else ("python",)
"""The cores a test that names its backends runs (with `BLOCKTRIE_BACKEND` unset)."""


def _tiny(
    monkeypatch: pytest.MonkeyPatch, backend: str, num_blocks: int = 8, **config: Any
) -> BlockTrie:
    """A trie of 2-token blocks on the core `backend` names (`config`: any other
    `CacheConfig` field): `BLOCKTRIE_BACKEND` is unset first (the mutation tool sets
    it, which would make every trie native)."""
    monkeypatch.delenv(native.ENV, raising=False)
    return BlockTrie(CacheConfig(block_size=2, num_blocks=num_blocks, backend=backend, **config))


def _one_cached_block(trie: Any) -> Any:
    """The released sequence of a request that cached one block ([0, 0]) and left one
    token uncommitted: its `path[0]` is that block's node."""
    seq = trie.match([0, 0, 1])
    trie.allocate(seq, 3)
    trie.commit(seq, 2)
    trie.release(seq)
    return seq


def _fast_commit(fast: Any, trie: Any, seq: Any, num_tokens: int) -> bool:
    """`fast.commit` (a `FastAttach`) called as `BlockTrie.commit` calls it."""
    done: bool = fast.commit(
        seq, num_tokens, trie, trie._live, trie._evictor, trie._attach, trie._block_pins
    )
    return done


# ------------------------------------------------------------------ backend choice


def test_backend_is_validated_by_the_config() -> None:
    with pytest.raises(ConfigError, match="backend must be one of"):
        CacheConfig(block_size=2, num_blocks=4, backend="rust")
    assert CacheConfig(block_size=2, num_blocks=4).backend == "auto"


def test_python_backend_is_always_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENV, raising=False)
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4, backend="python"))
    assert trie.backend == "python"
    assert trie._kv.native is None


def test_the_environment_overrides_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV, "python")
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4, backend="native"))
    assert trie.backend == "python"
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ConfigError, match=r"\$BLOCKTRIE_BACKEND must be one of"):
        BlockTrie(CacheConfig(block_size=2, num_blocks=4))


def test_missing_native_core_is_refused_or_warned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "_MODULE", None)
    monkeypatch.setattr(native, "_REASON", "cache._native did not import (test)")
    monkeypatch.setattr(native, "_warned", False)
    with pytest.raises(ConfigError, match=r"did not import \(test\).*C\+\+17 compiler"):
        BlockTrie(CacheConfig(block_size=2, num_blocks=4, backend="native"))
    with pytest.warns(native.NativeUnavailableWarning, match="Python core: cache._native did not"):
        trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    assert trie.backend == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        assert BlockTrie(CacheConfig(block_size=2, num_blocks=4)).backend == "python"


@needs_native
def test_auto_runs_native_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENV, raising=False)
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    assert trie.backend == "native"
    assert type(trie._evictor.index).__name__ == "NodeLRU"
    # the whole-operation paths the paired machine below exercises
    assert trie._lookup.fast is not None and trie._attach.fast is not None
    assert trie._fast is not None
    events = BlockTrie(CacheConfig(block_size=2, num_blocks=4, enable_events=True))
    assert (events._attach.fast is not None) == (native.xxh3_address() != 0)
    vllm = BlockTrie(CacheConfig(block_size=2, num_blocks=4, enable_events=True, block_hash="vllm"))
    assert vllm._attach.fast is None  # sha256 chains: the Python core's commit


def test_xxh3_address_is_xxhash_own_function() -> None:
    """The native commit hashes with the function `xxh3_64_intdigest` calls, or not at
    all: `xxh3_address` checks it against the package before handing it over."""
    import ctypes

    xxhash = pytest.importorskip("xxhash")
    address = native.xxh3_address()
    if not address:
        pytest.skip("xxhash's extension exports no XXH3_64bits_withSeed here")
    fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64)(
        address
    )
    for data, seed in [(b"abc", 0), (bytes(64), 2**63 + 5), (b"\xff" * 100, 7)]:
        assert fn(data, len(data), seed) == xxhash.xxh3_64_intdigest(data, seed)


# ------------------------------------------------------------------ the spec drives it


def test_native_sources_have_no_lifecycle_literals() -> None:
    """The C++ quotes no state or trigger name (the Python core's rule, same test):
    the codes come from `spec.lifecycle` through `cache.native._configure`. A Python
    attribute's or argument's name (`.def("...")`, `nb::arg("...")`, `BT_NAME("...")`)
    is a name, not a literal, as `__slots__` entries are in the Python test."""
    names = {s for life in LIFECYCLES for s in (*life.states, *life.triggers)}
    offenders = []
    for path in sorted((ROOT / "native" / "src").glob("*.[ch]pp")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            code = re.sub(r'(\.attr|\.def|nb::arg|BT_NAME)\(\s*"[^"]*"', "", code)  # names
            for literal in re.findall(r'"((?:[^"\\]|\\.)*)"', code):
                if literal in names:
                    offenders.append(f"{path.name}:{lineno}: {literal!r}")
    assert not offenders, "lifecycle literals in native/src:\n" + "\n".join(offenders)


def test_native_sources_cite_only_defined_rules() -> None:
    """Every [R] citation in the C++ names a rule of docs/semantics.md, and each
    kernel cites the rules of the Python loop it replaces."""
    semantics = (ROOT / "docs" / "semantics.md").read_text()
    defined = {int(n) for n in re.findall(r"\*\*\[R(\d+)\]", semantics)}
    cited: set[int] = set()
    for path in sorted((ROOT / "native" / "src").glob("*.[ch]pp")):
        cited |= {int(n) for n in re.findall(r"\[R(\d+)\]", path.read_text())}
    assert cited and cited <= defined, sorted(cited - defined)
    # the Python twins' rules: the walk, taking the hit, ticks, the chain, eviction
    assert {6, 8, 10, 12, 19, 23} <= cited


@needs_native
def test_every_name_of_the_extension_is_documented() -> None:
    """Each class and function `cache._native` exports says what it does (nanobind puts
    a function's signature first in its `__doc__`: the text after it is the docstring),
    and each names the Python core's code it is the twin of, or its rule."""
    assert NATIVE is not None
    undocumented = []
    for name in sorted(n for n in dir(NATIVE) if not n.startswith("_") and n != "ABI"):
        doc = getattr(NATIVE, name).__doc__ or ""
        if doc.startswith(f"{name}("):  # a function: its signature, then its docstring
            doc = doc.partition("\n\n")[2]
        if not doc.strip():
            undocumented.append(name)
    assert undocumented == []
    assert "LRUIndex" in NATIVE.NodeLRU.__doc__
    for name in sorted(n for n in dir(NATIVE) if not n.startswith("_") and n != "ABI"):
        doc = getattr(NATIVE, name).__doc__ or ""
        if doc.startswith(f"{name}("):
            doc = doc.partition("\n\n")[2]
        doc = doc.strip()
        # whole sentences, naming the Python twin or the rule the name stands for
        assert doc.endswith((".", ".)")), (name, doc)
        assert doc.count("(") == doc.count(")"), (name, doc)
        assert re.search(r"[A-Za-z_]+\.[A-Za-z_]+|\[R\d+\]", doc), (name, doc)
    assert (NATIVE.__doc__ or "").startswith("blocktrie's native core")  # the module's own


KERNEL_PARAMETERS = {
    "FastAttach.__init__": "table refs free_list owner sequence_type typecode block_size "
    "cached_code events xxh3",
    "FastAttach.commit": "seq num_tokens trie live evictor attach block_pins",
    "FastLookup.__init__": "table refs roots sequence_type array_type typecode block_size",
    "FastLookup.match": "tokens namespace trie stats live evictor serial",
    "FastTrie.__init__": "table refs free_list sequence_type settled faults fault_point block_size",
    "FastTrie.release": "seq trie live index evictor",
    "FastTrie.allocate": "seq num_tokens live",
    "NodeLRU.__init__": "ticks serials",
    "NodeLRU.add": "member",
    "NodeLRU.remove": "member",
    "attach_chain": "table parent keys start blocks serial tick code owner refs",
    "configure": "root_code evictable_code freed_from no_node no_child many no_block",
    "decref_all": "refs free_list blocks",
    "evict_inline": "n index evictor table kv removed settled",
    "hold_path": "held block state refs",
    "incref_all": "refs blocks",
    "set_ticks": "ticks path tick",
    "take": "refs free_list count",
    "walk": "keys start_node child tokens kids width",
}
"""Each kernel's parameters, by name: what a caller passing them by keyword relies on."""


@needs_native
def test_the_kernels_take_their_documented_parameter_names() -> None:
    """nanobind renders each binding's signature first in its `__doc__`; its parameter
    names are `KERNEL_PARAMETERS`' (`self` aside), none missing, none renamed."""
    assert NATIVE is not None
    for path, expected in KERNEL_PARAMETERS.items():
        owner, _, name = path.rpartition(".")
        function = getattr(getattr(NATIVE, owner), name) if owner else getattr(NATIVE, name)
        signature = function.__doc__.split("\n", 1)[0]
        assert signature.startswith(f"{name}("), path
        inside = signature[len(name) + 1 : signature.rindex(")")]
        params = [part.split(":", 1)[0].strip() for part in re.split(r",\s*(?![^\[]*\])", inside)]
        assert [p for p in params if p != "self"] == expected.split(), path


@needs_native
def test_the_spec_tables_reach_the_native_core() -> None:
    assert NATIVE is not None and NATIVE.configured()
    free = NodeTrigger.FREE.value
    rows = {state_code(s): state_code(d) for (t, s), d in NODE.table.items() if t == free}
    root, evictable, freed_from = NATIVE.tables()
    assert freed_from == rows == eviction._FREED_FROM and rows
    assert (root, evictable) == (
        state_code(NodeState.ROOT.value),
        state_code(NodeState.EVICTABLE.value),
    )


# ------------------------------------------------------------------ kernels


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_node_lru_orders_as_lru_index(seed: int) -> None:
    import random

    rng = random.Random(seed)
    ticks = [0] * 64
    from array import array

    serials = array("q", range(64))
    assert NATIVE is not None
    fast = NATIVE.NodeLRU(ticks, serials)
    slow: LRUIndex[int] = LRUIndex(ticks.__getitem__, serials.__getitem__)
    members: set[int] = set()
    for _ in range(300):
        node = rng.randrange(64)
        if node in members:
            fast.remove(node)
            slow.remove(node)
            members.discard(node)
        else:
            ticks[node] = rng.randrange(8)  # ties broken by serial
            fast.add(node)
            slow.add(node)
            members.add(node)
        assert len(fast) == len(slow) and bool(fast) == bool(slow)
        assert list(fast) == list(slow)
        assert sorted(fast.unordered()) == sorted(slow.unordered())
        if members:
            assert fast.oldest() == slow.oldest()
        assert all((n in fast) == (n in members) for n in range(64))
    with pytest.raises(KeyError):
        fast.remove(next(n for n in range(64) if n not in members) if len(members) < 64 else -1)
    while members:  # drained oldest first: a heap sort of what is left
        oldest = fast.oldest()
        assert oldest == slow.oldest()
        fast.remove(oldest)
        slow.remove(oldest)
        members.discard(oldest)
    assert not fast


@needs_native
def test_node_lru_refuses_what_lru_index_leaves_undefined() -> None:
    from array import array

    assert NATIVE is not None
    lru = NATIVE.NodeLRU([0, 0], array("q", [0, 1]))
    with pytest.raises(IndexError):
        lru.oldest()
    lru.add(1)
    with pytest.raises(ValueError):
        lru.add(1)  # already indexed
    with pytest.raises(IndexError):
        lru.add(2)  # no such row
    with pytest.raises(ValueError, match="a node id is >= 0"):
        lru.add(-1)
    assert "x" not in lru and 1 in lru and 0 not in lru
    for ticks, serials in (([0, 0, 0], [0, 1]), ([0, 0], [0, 1, 2])):  # one column short
        short = NATIVE.NodeLRU(ticks=ticks, serials=array("q", serials))
        with pytest.raises(IndexError, match="no such node row"):
            short.add(2)
        assert len(short) == 0
    wrong = NATIVE.NodeLRU([0, 0], array("i", [0, 1]))  # 4-byte serials: refused by name
    with pytest.raises(ValueError, match="column serial: items of 8 bytes"):
        wrong.add(1)
    assert len(wrong) == 0


@needs_native
def test_pool_kernels_are_all_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused `incref_all` / `decref_all` leaves every count and the free list as
    they were and raises the Python pool's `CacheError`, naming the block."""
    monkeypatch.delenv(native.ENV, raising=False)
    for backend in ("python", "native"):
        trie = BlockTrie(CacheConfig(block_size=2, num_blocks=6, backend=backend))
        kv = trie._kv
        taken = kv.take(3)
        before = (kv.counts(), kv.free_ids())
        with pytest.raises(CacheError, match=r"block \d+ is free; cannot take a reference"):
            kv.incref_all([taken[0], taken[1], kv.free_ids()[-1]])
        with pytest.raises(CacheError, match="NO_BLOCK"):
            kv.incref_all([taken[0], -1])
        assert (kv.counts(), kv.free_ids()) == before
        with pytest.raises(CacheError, match=r"already free \(double free\)"):
            kv.decref_all([taken[0], taken[0]])
        assert (kv.counts(), kv.free_ids()) == before
        kv.incref_all([taken[0], taken[1]])  # counts of 2: refused only at the third
        with pytest.raises(CacheError, match=rf"block {taken[1]} is already free"):
            kv.decref_all([taken[0], taken[1], taken[1], taken[1]])
        kv.decref_all([taken[0], taken[1]])
        assert (kv.counts(), kv.free_ids()) == before
        kv.decref_all([taken[2], taken[0]])
        assert kv.free_ids()[-2:] == [taken[2], taken[0]]


@needs_native
def test_native_match_reads_every_uint32_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids on both sides of 2**30 (one digit of a CPython int, read directly) and of
    2**32 (the Python core's uint64 keys) are stored and matched as the Python core
    does."""
    monkeypatch.delenv(native.ENV, raising=False)
    ids = [0, 1, 2**30 - 1, 2**30, 2**31 + 5, 2**32 - 1, 2**32, 2**40]
    for prompt in (ids[:6] * 2, ids * 2, [2**31 + 5, 7] * 3):
        seqs = []
        for backend in ("python", "native"):
            trie = BlockTrie(CacheConfig(block_size=2, num_blocks=32, backend=backend))
            seq = trie.match(prompt)
            assert seq.tokens == tuple(prompt)
            trie.allocate(seq, len(prompt))
            trie.commit(seq, len(prompt))
            trie.release(seq)
            again = trie.match([*prompt, 3])
            seqs.append((again.num_cached_tokens, again.block_ids, trie.snapshot()))
        assert seqs[0] == seqs[1]
        assert seqs[0][0] == len(prompt) // 2 * 2


@needs_native
def test_the_spec_tables_are_refused_whole_when_malformed() -> None:
    """`configure` checks every code before it replaces the tables: a refusal leaves
    the kernels running on the spec's."""
    assert NATIVE is not None
    before = NATIVE.tables()
    root, evictable, freed_from = before
    for bad in ({256: 1}, {-1: 1}, {1: 256}, {1: -3}):
        with pytest.raises(ValueError, match="state codes are bytes"):
            NATIVE.configure(root, evictable, {**freed_from, **bad}, -1, -1, -2, -1)
    assert NATIVE.tables() == before


@needs_native
def test_kernels_refuse_malformed_columns_by_name() -> None:
    """A column of the wrong item size or kind is refused with its name, before any
    change (the Python core never sends one: these are the kernels' own guards)."""
    from array import array

    assert NATIVE is not None
    refs = [0, 1, 1, 0]
    with pytest.raises(ValueError, match="column free_list: items of 4 bytes"):
        NATIVE.take(refs, array("q", [3]), 1)
    with pytest.raises(ValueError, match="column refs must be a list"):
        NATIVE.incref_all(array("i", refs), [1])
    with pytest.raises(ValueError, match="blocks must be a list"):
        NATIVE.decref_all(refs, array("i"), (1,))
    with pytest.raises(TypeError):  # an item that is no int: Python's own error
        NATIVE.incref_all(refs, [1, "2"])
    with pytest.raises(ValueError, match="walk: keys must be a list and kids a dict"):
        NATIVE.walk((b"",), 0, array("i", [-1]), bytearray(8), {}, 8)
    walked = NATIVE.walk(  # by keyword, as documented
        keys=[b"\0" * 8], start_node=0, child=array("i", [1, -1]), tokens=bytearray(16),
        kids={}, width=8,
    )  # fmt: skip
    assert walked == [1]
    with pytest.raises(TypeError, match="unhashable"):  # a key no dict can look up
        NATIVE.walk([[0]], 0, array("i", [-2]), bytearray(8), {0: {}}, 8)
    with pytest.raises(TypeError):  # a child id that is no int: Python's own error
        NATIVE.walk([b"\0" * 8], 0, array("i", [-2]), bytearray(8), {0: {b"\0" * 8: "1"}}, 8)
    with pytest.raises(ValueError, match="column state: items of 1 bytes"):
        NATIVE.hold_path([0], array("i", [0]), array("i", [0]), refs)
    assert NATIVE.incref_all(refs, [1, 9]) == 1  # a block past the pool is refused
    assert NATIVE.decref_all(refs, array("i"), [2, 4]) == 1  # (4: past the pool's 4 counts)
    assert refs == [0, 1, 1, 0]
    with pytest.raises(ValueError, match=r"^held must be a list$"):
        NATIVE.hold_path((0,), array("i", [0]), bytearray(1), refs)
    with pytest.raises(IndexError, match="set_ticks: no such node"):
        NATIVE.set_ticks([0, 0], [2], 5)
    with pytest.raises(ValueError, match="hold_path: a held node's block is free"):
        NATIVE.hold_path([0], array("i", [3]), bytearray(1), refs)
    with pytest.raises(ValueError, match="hold_path: a held node's block is free"):
        NATIVE.hold_path([0], array("i", [4]), bytearray(1), refs)  # one past the counts
    with pytest.raises(TypeError):  # a count that is no int: Python's own error
        NATIVE.hold_path([0], array("i", [1]), bytearray(1), [0, "x"])
    table: Any = type("Table", (), {"width": 2})()  # refused before anything of it is read
    with pytest.raises(ValueError, match="attach_chain: a committed block is free"):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [3], 1, 1, 0, array("i", [0] * 4), refs)
    with pytest.raises(ValueError, match="attach_chain: a committed block is free"):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [4], 1, 1, 0, array("i", [0] * 4), refs)
    negative = [0, 1, 1, -1]  # a count below zero is no reference either
    with pytest.raises(ValueError, match="attach_chain: a committed block is free"):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [3], 1, 1, 0, array("i", [0] * 4), negative)
    table.width, table._take = 2, lambda n: [1]  # rows taken; then its columns are read
    for name, column in (
        ("parent", array("i", [0] * 4)),
        ("child", array("i", [-1] * 4)),
        ("block", array("i", [0] * 4)),
        ("tick", [0] * 4),
        ("serial", array("q", [0] * 4)),
        ("state", bytearray(4)),
        ("namespace", array("i", [0] * 4)),
        ("tokens", array("i", [0] * 8)),  # 4-byte items where bytes are expected
    ):
        setattr(table, name, column)
    with pytest.raises(ValueError, match="column tokens: items of 1 bytes"):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [1], 1, 1, 0, array("i", [0] * 4), refs)
    table.tokens = bytearray(8)
    for name, width in (("parent", 4), ("child", 4), ("block", 4), ("serial", 8),
                        ("state", 1), ("namespace", 4)):  # fmt: skip
        right = getattr(table, name)
        setattr(table, name, array("h", [0] * 4))  # 2-byte items: wrong for every column
        with pytest.raises(ValueError, match=f"column {name}: items of {width} bytes"):
            NATIVE.attach_chain(table, 0, [b"ab"], 0, [1], 1, 1, 0, array("i", [0] * 4), refs)
        setattr(table, name, right)
    with pytest.raises(ValueError, match="column owner: items of 4 bytes"):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [1], 1, 1, 0, array("h", [0] * 4), refs)
    outside = "attach_chain: a row or block outside the table"
    table._take = lambda n: [99]  # a row past the columns
    with pytest.raises(IndexError, match=outside):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [1], 1, 1, 0, array("i", [0] * 4), refs)
    table.tokens, table._take = bytearray(2), lambda n: [1]  # no room for row 1's key
    with pytest.raises(IndexError, match=outside):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [1], 1, 1, 0, array("i", [0] * 4), refs)
    table.tokens, table._take = bytearray(64), lambda n: [1, 99]  # the second row is past
    with pytest.raises(IndexError, match=outside):
        NATIVE.attach_chain(table, 0, [b"ab", b"cd"], 0, [1, 2], 1, 1, 0, array("i", [0] * 4), refs)
    table.tokens, table._take = bytearray(64), lambda n: [5]  # a key's room, but no row 5
    with pytest.raises(IndexError, match=outside):
        NATIVE.attach_chain(table, 0, [b"ab"], 0, [1], 1, 1, 0, array("i", [0] * 4), refs)
    table._take = lambda n: [1]
    held = [0, 1, 1, 0, 1]  # block 4 is held, but the owner column has 4 blocks
    for owner_blocks in (4, 3):  # one past the column's end, and further
        with pytest.raises(IndexError, match=outside):
            owner = array("i", [0] * owner_blocks)
            NATIVE.attach_chain(table, 0, [b"ab"], 0, [4], 1, 1, 0, owner, held)
    assert (refs, held) == ([0, 1, 1, 0], [0, 1, 1, 0, 1])


@needs_native
def test_a_refused_column_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A column refused for its item size is released before the error: the caller
    can still resize it (a column a kernel still exported would raise BufferError).
    An object that is no buffer, or no writable one, is refused with Python's own
    error for it."""
    from array import array

    assert NATIVE is not None
    free = array("q", [3])
    with pytest.raises(ValueError, match="column free_list: items of 4 bytes"):
        NATIVE.take([0, 0, 0, 0], free, 1)
    free.append(2)  # no export left behind
    with pytest.raises(TypeError, match="bytes-like object is required"):  # no buffer at all
        NATIVE.take([0, 0, 0, 0], [3], 1)
    with pytest.raises(BufferError, match="not writable"):  # a buffer the kernel cannot write
        NATIVE.take([0, 0, 0, 0], array("i", [3]).tobytes(), 1)
    state = bytearray(4)
    with pytest.raises(ValueError, match="column block: items of 4 bytes"):
        NATIVE.hold_path([0], array("q", [0]), state, [1])
    state.extend(b"\0")
    assert (list(free), len(state)) == ([3, 2], 5)


@needs_native
def test_a_column_must_be_one_dimensional() -> None:
    """A column is a flat buffer: one of the right item size but two dimensions is
    refused by name, as one of the wrong item size is."""
    from array import array

    assert NATIVE is not None
    flat = array("i", [3, 2, 1, 0])
    square = memoryview(flat).cast("B").cast("i", (2, 2))
    with pytest.raises(ValueError, match="column free_list: items of 4 bytes"):
        NATIVE.take([0, 0, 0, 0], square, 1)
    square.release()
    assert list(flat) == [3, 2, 1, 0]


@needs_native
def test_a_free_list_that_takes_no_append_raises() -> None:
    """The free list a kernel appends freed blocks to must take them: an object whose
    `append` fails raises that error (never a crash, never a silent loss)."""
    assert NATIVE is not None

    class Full(list[int]):
        def append(self, item: int) -> None:
            raise OverflowError("full")

    with pytest.raises(OverflowError, match="full"):
        NATIVE.decref_all([0, 1], Full(), [1])
    with pytest.raises(AttributeError):
        NATIVE.decref_all([0, 1], (), [1])


@needs_native
def test_appending_to_a_free_list_keeps_no_reference() -> None:
    """A kernel that appends a few freed blocks to a free list (`array.append`, one
    call each) lets go of what each call returned (None): None's count is what it
    was (Python 3.11 counts references to None; 3.12 makes it immortal)."""
    import sys
    from array import array

    assert NATIVE is not None
    free = array("i")
    before = sys.getrefcount(None)
    for _ in range(100):
        assert NATIVE.decref_all([1, 1, 1], free, [0, 1, 2]) == -1
        free = array("i")
    assert sys.getrefcount(None) - before < 50, "a reference kept per append"


@needs_native
def test_the_spec_tables_take_every_byte_code() -> None:
    """`configure` takes state codes 0 and 255 on both sides of a row (a code is one
    byte), and `tables` gives every row back, a destination of 0 included; the spec's
    own tables are put back after."""
    assert NATIVE is not None
    before = NATIVE.tables()
    root, evictable, freed_from = before
    edges = {0: 0, 255: 255, 7: 0}
    try:
        NATIVE.configure(root, evictable, {**freed_from, **edges}, -1, -1, -2, -1)
        assert NATIVE.tables() == (root, evictable, {**freed_from, **edges})
    finally:
        native._configure(NATIVE)
    assert NATIVE.tables() == before


def test_an_empty_request_is_refused_by_both_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """`match([])` is refused ([R1]) on either core, before anything changes: the native
    kernel hands an empty list to the Python core, whose error is the contract's."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        before = trie.snapshot()
        with pytest.raises(InvalidArgument, match="at least one token"):
            trie.match([])
        assert trie.snapshot() == before


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt of whole blocks, all cached, hits every block but its last: the engine
    must compute at least the last token (it needs its logits), on either core."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        serve(trie, [0, 0, 1, 1, 5])  # blocks [0, 0] and [1, 1] cached
        whole = trie.match([0, 0, 1, 1])
        assert (whole.num_cached_tokens, whole.branch_step) == (2, 4), backend
        trie.release(whole)
        trie.check()


def test_an_identity_key_never_walks_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose block 1 carries an extra identity, over a trie of plain nodes
    only (no wide key anywhere yet): its key for block 1 is a tuple that starts with
    the same token bytes, and it must not hit the plain block 1 ([R5], [R12]), on
    either core: the walk compares it with `==`, never as a prefix of token bytes."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        serve(trie, [0, 0, 1, 1, 5])  # blocks [0, 0] and [1, 1] cached
        assert not trie._nodes.wide  # type: ignore[attr-defined]
        tagged = trie.match([0, 0, 1, 1, 5], extra=[None, "img"])
        assert tagged.num_cached_tokens == 2, backend
        trie.abort(tagged)
        trie.check()


def test_a_plain_key_never_equals_a_lone_wide_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The only wide node of a trie (an extra identity on block 1) keeps a row of
    token bytes it never uses (zeros): a plain block of zero tokens under the same
    parent, of which the wide node is the only child, is a new node beside it, not
    a hit on it ([R5], [R19])."""
    results = []
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        wide = trie.match([5, 5, 0, 0, 1], extra=[None, "img"])
        trie.allocate(wide, 5)
        trie.commit(wide, 4)
        plain = trie.match([5, 5, 0, 0, 1])
        assert plain.num_cached_tokens == 2
        trie.allocate(plain, 5)
        trie.commit(plain, 4)
        assert plain.block_ids[1] != wide.block_ids[1]
        assert trie.num_cached_blocks == 3
        trie.check()
        results.append((wide.block_ids, plain.block_ids, trie.snapshot()))
    assert all(result == results[0] for result in results)


@needs_native
def test_fast_attach_commit_takes_its_arguments_by_keyword(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`FastAttach.commit`'s arguments have the names `BlockTrie.commit` documents for
    it (`cache/trie.py` passes them by position)."""
    trie: Any = _tiny(monkeypatch, "native")
    seq = trie.match([0, 0, 1])
    trie.allocate(seq, 3)
    done = trie._attach.fast.commit(
        seq=seq, num_tokens=2, trie=trie, live=trie._live, evictor=trie._evictor,
        attach=trie._attach, block_pins=trie._block_pins,
    )  # fmt: skip
    assert done is True
    assert (seq.num_committed_tokens, trie.num_cached_blocks) == (2, 1)
    trie.check()


@needs_native
def test_the_native_core_matches_commits_and_evicts_in_its_own_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For the usual request (plain tokens, no extra identity, no host tier) the native
    core's match, commit and eviction do the whole operation: the Python core's
    fallbacks (`token_list` for a match, `Attach.commit`, `Evictor._free` for each
    freed leaf, `Evictor._implied` for a parent's state the settled memo knows) do not
    run, as they do for what the kernels decline."""
    from cache import attach, lookup

    trie = _tiny(monkeypatch, "native", 4)
    slow: list[str] = []

    def spy(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            slow.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    def serve_three() -> None:
        for prompt in ([0, 0, 1, 1, 2], [3, 3, 4, 4, 2], [0, 0, 1, 1, 2]):
            seq = trie.match(prompt)
            trie.allocate(seq, 5)
            trie.commit(seq, 4)
            trie.release(seq)

    def evict_all() -> None:
        cached = trie.num_cached_blocks
        assert cached >= 2  # a chain: its leaf first, then the parent it leaves evictable
        assert trie.evict(cached) == cached and trie.num_cached_blocks == 0
        trie.check()

    serve_three()
    evict_all()  # the settled memo learns every fact these steps meet
    spy(lookup, "token_list")
    spy(attach.Attach, "commit")
    spy(eviction.Evictor, "_free")
    serve_three()
    spy(eviction.Evictor, "_implied")  # (a match's hit settles through the Python core)
    evict_all()
    assert slow == []
    seq = trie.match([0, 0, 1], extra=["img"])  # an extra identity: the Python core
    trie.allocate(seq, 3)
    trie.commit(seq, 2)
    assert slow == ["token_list", "commit"]


@needs_native
def test_the_native_allocate_takes_free_blocks_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """With enough free blocks, the native core's allocate takes them in its one call:
    the Python core's allocate (`BlockTrie._blocks_needed` onwards) does not run."""
    trie = _tiny(monkeypatch, "native")
    slow: list[object] = []
    needed = BlockTrie._blocks_needed

    def counted(self: BlockTrie, *args: Any) -> int:
        slow.append(args)
        return needed(self, *args)  # type: ignore[no-any-return]

    monkeypatch.setattr(BlockTrie, "_blocks_needed", counted)
    seq = trie.match([0, 0, 1, 1, 2])
    trie.allocate(seq, 5)
    assert (len(seq.block_ids), trie.num_free_blocks, slow) == (3, 5, [])
    with pytest.raises(InvalidArgument, match=r"outside 0\.\.5"):  # refused by the Python core
        trie.allocate(seq, 9)
    assert slow


@needs_native
def test_the_native_release_settles_from_the_memo_unless_checkpoints_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release on the native core settles a plain node from the settled memo itself,
    without calling back into `Evictor.settle`; once the trie holds a checkpoint (a
    pin the memo's facts leave out) it leaves settling to the Python core."""
    calls: list[int] = []
    settle = eviction.Evictor.settle

    def counted(self: eviction.Evictor, node: int) -> None:
        calls.append(node)
        settle(self, node)

    plain = _tiny(monkeypatch, "native")
    seq = plain.match([0, 0, 1])
    plain.allocate(seq, 3)
    plain.commit(seq, 2)
    plain.release(seq)
    monkeypatch.setattr(eviction.Evictor, "settle", counted)
    for _ in range(2):  # the first round fills the memo
        held, other = plain.match([0, 0, 1]), plain.match([0, 0, 1])
        assert held.num_cached_tokens == other.num_cached_tokens == 2
        for seq in (held, other):
            plain.allocate(seq, 3)
        calls.clear()  # the match settled the hit (the match kernel calls back for that)
        plain.release(other)  # still held by one: it stays `cached` (code 0)
        plain.release(held)  # evictable
    assert calls == [], "settled from the memo, natively"
    config = CacheConfig(
        block_size=2, num_blocks=8, backend="native", num_checkpoint_slots=2,
        state_shapes={"s": (2,)},
    )  # fmt: skip
    trie = BlockTrie(config)
    seq = trie.match([5, 5, 1])
    trie.allocate(seq, 3)
    trie.commit(seq, 2)
    assert trie.save(seq, 2, {"s": torch.zeros(2)}) is not None
    trie.poll()
    trie.release(seq)
    held = trie.match([5, 5, 1])
    assert held.num_cached_tokens == 2
    trie.allocate(held, 3)
    calls.clear()
    trie.release(held)
    assert calls, "with a checkpoint in the trie, the Python core settles"
    trie.check()


def test_a_plain_block_beside_a_wide_only_child_is_a_new_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain key under a parent whose only child has a wide key (an extra identity)
    never equals it: the commit attaches a new node beside it ([R5], [R19])."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        first = trie.match([0, 0, 1, 1, 5], extra=[None, "img"])
        trie.allocate(first, 5)
        trie.commit(first, 4)
        trie.release(first)
        second = trie.match([0, 0, 1, 1, 5])
        assert second.num_cached_tokens == 2
        trie.allocate(second, 5)
        trie.commit(second, 4)
        assert trie.num_cached_blocks == 3  # the shared block 0, the wide child, the plain one
        trie.release(second)
        assert trie.match([0, 0, 1, 1, 5]).num_cached_tokens == 4
        trie.check()


@needs_native
def test_a_commit_refuses_a_cached_node_without_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached node with no device block and no host tier cannot exist; the native
    commit refuses one (a trie corrupted on purpose) instead of deduplicating onto it."""
    trie = _tiny(monkeypatch, "native")
    first, second = trie.match([0, 0, 1, 1, 9]), trie.match([0, 0, 1, 1, 9])
    for seq in (first, second):
        trie.allocate(seq, 5)
    trie.commit(first, 4)
    trie._nodes.block[first.path[-1]] = NO_BLOCK  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="an offloaded node without a host tier"):
        trie.commit(second, 4)


@needs_native
def test_a_commit_names_a_corrupted_kids_dict_or_event_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tries corrupted on purpose: a root (which always keeps its children in a `kids`
    dict) with none, and an event log whose records are not a list. The native commit
    names what is wrong instead of failing inside a C-API call."""
    trie: Any = _tiny(monkeypatch, "native", enable_events=True)
    _one_cached_block(trie)
    seq = trie.match([5, 5, 1])
    trie.allocate(seq, 3)
    root = trie._roots[""]
    kids = trie._nodes.kids.pop(root)
    with pytest.raises(RuntimeError, match="a node with many children has no kids dict"):
        trie.commit(seq, 2)
    trie._nodes.kids[root] = kids
    trie._events._events = ()
    with pytest.raises(RuntimeError, match="the event log's records are not a list"):
        trie.commit(seq, 2)


def test_eviction_derives_what_the_settled_memo_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `eviction._SETTLED` empty (a fresh process), each parent an eviction frees
    into settles through `Evictor._implied`, which derives its state from the spec;
    both cores then free the same chain, in the same order, and fill the memo alike."""
    results = []
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        seq = trie.match([0, 0, 1, 1, 2, 2, 3])
        trie.allocate(seq, 7)
        trie.commit(seq, 6)
        trie.release(seq)
        monkeypatch.setattr(eviction, "_SETTLED", {})
        freed = trie.evict(2)
        trie.check()
        free_rows = list(trie._nodes.free_rows)  # type: ignore[attr-defined]
        results.append((freed, trie.num_cached_blocks, dict(eviction._SETTLED), free_rows))
    assert all(result == results[0] for result in results)
    freed, cached, memo, free_rows = results[0]
    assert (freed, cached) == (2, 1)
    assert memo, "the parent's state was derived (and memoized), not guessed"
    assert len(set(free_rows)) == len(free_rows), "a row was freed twice"


def test_the_kernels_leave_what_they_do_not_check_to_the_python_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native `match` takes only ASCII namespaces and `allocate` only a live
    sequence and an exact `int`: the rest goes to the Python core, whose errors are
    the contract's ([R1], [R57])."""
    from spec.errors import InvalidArgument, InvalidType, SequenceNotLive

    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        with pytest.raises(InvalidArgument, match="lone surrogate"):
            trie.match([1, 2, 3], namespace="\ud800")
        assert trie.match([1, 2, 3], namespace="é").num_cached_tokens == 0
        for bad in (-1, -(2**40), 2**64):  # one digit, several, past the range ([R2])
            with pytest.raises(InvalidArgument, match=r"tokens must be in \[0, 2\*\*64\)"):
                trie.match([1, bad, 2])
        seq = trie.match([1, 2, 3])
        with pytest.raises(InvalidType, match="num_tokens must be an int"):
            trie.allocate(seq, True)  # type: ignore[arg-type]
        for count in (-1, 4, 2**70):  # negative, past the tokens, past 64 bits
            with pytest.raises(InvalidArgument, match="num_tokens"):
                trie.allocate(seq, count)
        assert len(seq.block_ids) == 0
        trie.release(seq)
        with pytest.raises(SequenceNotLive):
            trie.allocate(seq, 2)
        assert trie.num_free_blocks == 8


def test_the_native_commit_leaves_a_dead_or_foreign_sequence_to_the_python_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spec.errors import SequenceNotLive

    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        other = _tiny(monkeypatch, backend)
        seq, foreign = trie.match([1, 2, 3]), other.match([1, 2, 3])  # the same serial
        trie.allocate(seq, 3)
        other.allocate(foreign, 3)
        with pytest.raises(SequenceNotLive):
            trie.commit(foreign, 2)
        trie.release(seq)
        with pytest.raises(SequenceNotLive):
            trie.commit(seq, 2)
        assert trie.num_cached_blocks == 0 and other.num_cached_blocks == 0


@needs_native
@pytest.mark.parametrize("whose", ["cached", "own"])
def test_the_native_commit_refuses_a_held_block_counted_free(
    whose: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deduplicating onto a cached block ([R18]) needs the cached block and the
    request's own one held; a trie corrupted on purpose to count one free is refused."""
    trie = _tiny(monkeypatch, "native")
    first, second = trie.match([0, 0, 1, 1, 9]), trie.match([0, 0, 1, 1, 9])
    for seq in (first, second):
        trie.allocate(seq, 5)
    trie.commit(first, 4)
    block = first.block_ids[0] if whose == "cached" else second.block_ids[0]
    trie._kv.refs[block] = 0  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="commit: a held block is free"):
        trie.commit(second, 4)


def test_a_parent_left_evictable_waits_behind_older_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[R10]: evicting the oldest leaf leaves its parent evictable; the parent is freed
    at once only when it is older than every indexed leaf. Here it was used last (a
    request of its block and a token), so `evict(2)` frees the old leaf and the
    other old leaf, not the parent, on either core."""
    outcomes = []
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend)
        for prompt in ([0, 0, 1, 1, 5], [7, 7, 5]):  # chain P -> C, then leaf L
            seq = trie.match(prompt)
            trie.allocate(seq, len(prompt))
            trie.commit(seq, len(prompt) - 1)
            trie.release(seq)
        toucher = trie.match([0, 0, 9])  # P used last: C is oldest, then L, then P
        assert toucher.num_cached_tokens == 2
        trie.allocate(toucher, 3)
        trie.release(toucher)
        parent = toucher.path[0]
        assert trie.evict(2) == 2
        trie.check()
        outcomes.append((trie._nodes.block[parent] != NO_BLOCK, trie.snapshot()))
    assert outcomes[0][0], "the parent, used last, is still cached"
    assert all(outcome == outcomes[0] for outcome in outcomes)


@needs_native
def test_the_native_release_refuses_a_path_outside_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence corrupted on purpose: its path names a row past the node table. The
    native release refuses it before touching a tick or a count."""
    trie: Any = _tiny(monkeypatch, "native")
    seq = trie.match([0, 0, 1])
    trie.allocate(seq, 3)
    trie.commit(seq, 2)
    before = (list(trie._nodes.tick), list(trie._kv.refs))
    seq.path.append(10**6)
    with pytest.raises(IndexError, match="release: no such node"):
        trie.release(seq)
    assert (list(trie._nodes.tick), list(trie._kv.refs)) == before


def test_an_evicted_block_has_no_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction gives a node's block back with no owner left in the evictor's block ->
    node map, on either core: a later reference dropped on that block settles no
    freed node."""
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend)
        seq = _one_cached_block(trie)
        block = seq.block_ids[0]
        assert trie._evictor.owner[block] == seq.path[0]
        assert trie.evict(1) == 1
        assert trie._evictor.owner[block] == NO_NODE, backend


def test_evicting_a_block_counted_free_is_the_pools_double_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trie corrupted on purpose: an evictable node whose block is counted free.
    Evicting it is the KV pool's double free on either core ([R23]), never a count
    taken below zero."""
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend)
        seq = _one_cached_block(trie)
        block = trie._nodes.block[seq.path[0]]
        trie._kv.refs[block] = 0
        with pytest.raises(CacheError, match=f"block {block} is already free"):
            trie.evict(1)
        assert trie._kv.refs[block] == 0, backend


def test_a_double_free_met_mid_eviction_keeps_what_was_freed_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trie corrupted on purpose: of two evictable leaves, the younger's block is
    counted free. `evict(2)` frees the older, then meets the double free: both cores
    raise it with the older leaf freed and its block on the free list."""
    outcomes = []
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend)
        for prompt in ([0, 0, 1], [5, 5, 1]):
            seq = trie.match(prompt)
            trie.allocate(seq, 3)
            trie.commit(seq, 2)
            trie.release(seq)
        younger = trie.match([5, 5, 1])
        block = younger.block_ids[0]
        trie.abort(younger)
        free_before = trie.num_free_blocks
        trie._kv.refs[block] = 0
        with pytest.raises(CacheError, match=f"block {block} is already free"):
            trie.evict(2)
        outcomes.append((trie.num_free_blocks - free_before, trie._kv.free_ids()))
    assert all(outcome == outcomes[0] for outcome in outcomes)
    assert outcomes[0][0] == 1


@needs_native
def test_the_native_eviction_refuses_what_it_cannot_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tries corrupted on purpose: an indexed node whose state has no `free` row goes to
    the Python core's `Evictor._free`, which names the illegal transition; a column of
    the wrong item size is refused by name before anything changes."""
    from array import array

    from spec.errors import IllegalTransition

    trie = _tiny(monkeypatch, "native")
    node = _one_cached_block(trie).path[-1]
    evictor = trie._evictor  # type: ignore[attr-defined]
    owner = evictor.owner
    evictor.owner = array("q", owner)
    with pytest.raises(ValueError, match="column owner: items of 4 bytes"):
        trie.evict(1)
    evictor.owner = owner
    parents = trie._nodes.parent  # type: ignore[attr-defined]
    trie._nodes.parent = array("q", parents)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="column parent: items of 4 bytes"):
        trie.evict(1)
    trie._nodes.parent = parents  # type: ignore[attr-defined]
    kv: Any = trie._kv  # type: ignore[attr-defined]
    refs, kv.refs = kv.refs, array("q", kv.refs)
    with pytest.raises(ValueError, match="column refs must be a list"):
        trie.evict(1)
    kv.refs = refs
    nodes: Any = trie._nodes  # type: ignore[attr-defined]
    ticks, nodes.tick = nodes.tick, array("q", nodes.tick)
    with pytest.raises(ValueError, match="column tick must be a list"):
        trie.evict(1)
    nodes.tick = ticks
    for name, width in (("child", 4), ("block", 4), ("state", 1), ("serial", 8)):
        right = getattr(nodes, name)
        setattr(nodes, name, array("h", bytes(2 * len(right))))  # 2-byte items: wrong
        with pytest.raises(ValueError, match=f"column {name}: items of {width} bytes"):
            trie.evict(1)
        setattr(nodes, name, right)
    assert trie.num_cached_blocks == 1
    trie._nodes.state[node] = state_code("cached")  # type: ignore[attr-defined]
    with pytest.raises(IllegalTransition):
        trie.evict(1)


def test_the_built_extension_is_the_one_loaded() -> None:
    """Where the checkout holds a built `cache/_native*.so`, it imports and is used: a
    build that cannot be loaded fails here instead of every native test skipping."""
    built = sorted(Path(native.__file__).parent.glob("_native*.so"))
    if not built:
        pytest.skip("no native extension built in this checkout")
    assert NATIVE is not None, native.unavailable_reason()
    assert native.unavailable_reason() == ""


def test_a_stale_build_is_refused_with_the_fix() -> None:
    from types import SimpleNamespace

    assert native._stale(SimpleNamespace(ABI=native.ABI)) == ""  # type: ignore[arg-type]
    for module in (SimpleNamespace(ABI=native.ABI - 1), SimpleNamespace()):
        reason = native._stale(module)  # type: ignore[arg-type]
        assert "stale build" in reason and "pip install -e ." in reason


def test_a_walk_stops_at_the_first_missing_block_under_a_node_of_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[R12]: a miss under a node with several children ends the walk, even where a
    later block's key is one of that node's children."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        for prompt in ([0, 0, 9], [1, 1, 9]):  # the root gets two children
            seq = trie.match(prompt)
            trie.allocate(seq, 3)
            trie.commit(seq, 2)
            trie.release(seq)
        assert trie.match([2, 2, 1, 1, 0, 0, 9]).num_cached_tokens == 0
        assert trie.match([1, 1, 0, 0, 9]).num_cached_tokens == 2
        deeper = trie.match([0, 0, 7, 7, 9])  # walks block 0 (of size 2), misses block 1
        assert (deeper.num_cached_tokens, deeper.branch_step) == (2, 2)


def test_an_allocate_that_needs_no_block_takes_none_and_counts_no_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        seq = trie.match([1, 2, 3])
        trie.allocate(seq, 3)
        taken = (trie.faults.count, trie.num_free_blocks)
        for count in (3, 2, 0):  # already covered
            trie.allocate(seq, count)
            assert (trie.faults.count, trie.num_free_blocks) == taken


@needs_native
def test_the_native_release_refuses_a_held_block_counted_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trie corrupted on purpose (the request's first block counted free): the release
    is refused whole, every other count as it was."""
    trie = _tiny(monkeypatch, "native")
    seq = trie.match([1, 2, 3])
    trie.allocate(seq, 3)
    refs = trie._kv.refs  # type: ignore[attr-defined]
    refs[seq.block_ids[0]] = 0
    before = list(refs)
    with pytest.raises(RuntimeError, match="release: a held block was free"):
        trie.release(seq)
    assert list(refs) == before


def test_a_commit_below_what_is_committed_goes_to_the_python_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spec.errors import InvalidArgument

    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        seq = trie.match([1, 2, 3])
        trie.allocate(seq, 3)
        trie.commit(seq, 1)
        with pytest.raises(InvalidArgument, match=r"num_tokens=0 must be in 1\.\.3"):
            trie.commit(seq, 0)
        assert seq.num_committed_tokens == 1


@needs_native
def test_fast_attach_needs_the_hash_function_when_events_are_on() -> None:
    from cache.node import state_code as code
    from cache.validation import U32

    assert NATIVE is not None
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=8, enable_events=True))
    kv, evictor = trie._kv, trie._evictor  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="FastAttach: events on need the xxh3 function"):
        NATIVE.FastAttach(
            trie._nodes, kv.refs, kv._free, evictor.owner, Sequence, U32, 2,  # type: ignore[attr-defined]
            code("cached"), trie._events, 0,  # type: ignore[attr-defined]
        )  # fmt: skip


def test_an_evicted_wide_node_gives_its_row_back_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting the only node with a wide key (an extra identity) forgets its key: the
    row, reused by a plain block, then holds that block's key ([R5], [R12])."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend, 2)
        wide = trie.match([0, 0, 1], extra=["img"])
        trie.allocate(wide, 3)
        trie.commit(wide, 2)
        trie.release(wide)
        assert trie.evict(1) == 1
        plain = trie.match([5, 5, 1])
        trie.allocate(plain, 3)
        trie.commit(plain, 2)
        trie.release(plain)
        assert trie.match([5, 5, 1]).num_cached_tokens == 2
        trie.check()


def test_a_parent_keeping_two_children_is_not_evictable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parent of three leaves loses one to eviction: it keeps a dict of two children,
    so it stays cached, and only leaves are evicted after it ([R10], [R23])."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        for last in (1, 2, 3):
            seq = trie.match([0, 0, last, last, 9])
            trie.allocate(seq, 5)
            trie.commit(seq, 4)
            trie.release(seq)
        assert trie.evict(1) == 1
        trie.check()
        assert trie.match([0, 0, 9]).num_cached_tokens == 2


def test_settling_reads_every_fact_of_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached block held by three requests, then by none, is evictable: the state a
    release settles it to depends on its reference count (3, 2, then 1), also when
    every one of those facts was memoized by an earlier round ([R10])."""
    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        for _ in range(2):  # the second round finds every fact memoized
            first = trie.match([0, 0, 1])
            trie.allocate(first, 3)
            trie.commit(first, 2)
            trie.release(first)
            holders = [trie.match([0, 0, 1]) for _ in range(3)]
            assert [h.num_cached_tokens for h in holders] == [2, 2, 2]
            for left in (2, 1, 0):
                trie.release(holders[left])
                trie.check()  # evictable exactly when no request holds it (invariant 7)
                assert trie.evict(1) == (1 if left == 0 else 0)


# ------------------------------------------------------------------ paired backends

TOKENS = st.lists(st.sampled_from([0, 1, 2**40]), min_size=1, max_size=9)
NAMESPACES = st.sampled_from(["", "b"])
# a wide key under a plain parent ([None, "img"]) must never be compared as tokens
EXTRAS = st.one_of(st.none(), st.just(["img"]), st.just([None, "img"]))


def _both(trie_py: BlockTrie, trie_nat: BlockTrie, op: str, *args: Any) -> Any:
    """Call `op` on both tries; both raise the same error class or return equal results."""
    outcome = []
    for trie in (trie_py, trie_nat):
        try:
            outcome.append(("ok", getattr(trie, op)(*args)))
        except Exception as exc:  # the error class is part of the contract
            outcome.append(("err", type(exc)))
    assert outcome[0][0] == outcome[1][0], (op, outcome)
    return outcome


class PairedBackends(RuleBasedStateMachine):
    """A Python-core trie and a native-core trie, driven alike, must stay equal."""

    seqs = Bundle("seqs")

    @initialize(
        capacity=st.integers(3, 10),
        events=st.booleans(),
        scheme=st.sampled_from(["xxh3", "vllm"]),
    )
    def build(self, capacity: int, events: bool, scheme: str) -> None:
        def make(backend: str) -> BlockTrie:
            return BlockTrie(
                CacheConfig(
                    block_size=2,
                    num_blocks=capacity,
                    enable_events=events,
                    block_hash=scheme,
                    backend=backend,
                )
            )

        env = os.environ.pop(native.ENV, None)  # this pair names its backends itself
        try:
            self.py = make("python")
            self.nat = make("native")
        finally:
            if env is not None:
                os.environ[native.ENV] = env
        assert (self.py.backend, self.nat.backend) == ("python", "native")

    @rule(
        target=seqs,
        tokens=TOKENS,
        namespace=NAMESPACES,
        extra=EXTRAS,
        fill=st.booleans(),
        form=st.sampled_from(["list", "list", "tuple", "bools"]),
    )
    def match(
        self, tokens: list[int], namespace: str, extra: list[str] | None, fill: bool, form: str
    ) -> tuple[Sequence, Sequence]:
        # a tuple, or bools among the ids, take the native match's fallback
        given: Any = tuple(tokens) if form == "tuple" else tokens
        if form == "bools":
            given = [bool(t) if t < 2 else t for t in tokens]
        a = self.py.match(given, namespace, extra)
        b = self.nat.match(given, namespace, extra)
        assert (a.num_cached_tokens, a.block_ids) == (b.num_cached_tokens, b.block_ids)
        if fill:  # the engine's usual next steps: allocate and commit what it computed
            out_a = out_b = None
            try:
                self.py.allocate(a, len(tokens))
            except CacheError as exc:
                out_a = type(exc)
            try:
                self.nat.allocate(b, len(tokens))
            except CacheError as exc:
                out_b = type(exc)
            assert out_a == out_b
            if out_a is None:
                self.py.commit(a, len(tokens))
                self.nat.commit(b, len(tokens))
                assert a.block_ids == b.block_ids
        return (a, b)

    @rule(pair=seqs, more=TOKENS)
    def append_allocate_commit(self, pair: tuple[Sequence, Sequence], more: list[int]) -> None:
        a, b = pair
        self.py.append(a, more)
        self.nat.append(b, more)
        n = len(a.tokens)
        errors: list[type[Exception] | None] = []
        for trie, seq in ((self.py, a), (self.nat, b)):
            try:
                trie.allocate(seq, n)
                trie.commit(seq, n)
                errors.append(None)
            except CacheError as exc:
                errors.append(type(exc))
        assert errors[0] == errors[1]
        assert a.block_ids == b.block_ids and a.num_committed_tokens == b.num_committed_tokens

    @rule(pair=consumes(seqs))
    def release(self, pair: tuple[Sequence, Sequence]) -> None:
        self.py.release(pair[0])
        self.nat.release(pair[1])

    @rule(pair=consumes(seqs))
    def abort(self, pair: tuple[Sequence, Sequence]) -> None:
        self.py.abort(pair[0])
        self.nat.abort(pair[1])

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        assert self.py.evict(n) == self.nat.evict(n)

    @rule()
    def clear(self) -> None:
        _both(self.py, self.nat, "clear")  # refused alike while a sequence is live

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "py"):
            return
        assert self.py.snapshot() == self.nat.snapshot()
        assert self.py.drain_events() == self.nat.drain_events()
        # the allocation points seen (the native allocate records its own)
        assert (self.py.faults.count, self.py.faults.points) == (
            self.nat.faults.count,
            self.nat.faults.points,
        )
        self.nat.check()


TestPairedBackends = needs_native(PairedBackends.TestCase)


@needs_native
@pytest.mark.parametrize("events", [False, True])
def test_the_native_commit_declines_keys_that_are_not_plain_bytes(
    monkeypatch: pytest.MonkeyPatch, events: bool
) -> None:
    """`FastAttach.commit` reads a key as the table's bytes only after checking it is
    one: a sequence whose keys are anything else (as a key-hash trie's are; the Python
    core never sends those) is declined before anything changes, events on or off,
    instead of being read as bytes (it crashed the process with events on)."""
    trie: Any = _tiny(monkeypatch, "native", enable_events=events)
    seq = trie.match([0, 0, 1, 1, 2])
    trie.allocate(seq, 5)
    fast = trie._attach.fast
    assert fast is not None
    before = trie.snapshot()
    keys_tried = (
        [7, 8], [b"\0" * 8, 8], [b"\0" * 4, b"\0" * 8], [b"\0" * 8, b"\0" * 12],
        (b"\0" * 8, b"\1" * 8),
    )  # fmt: skip
    for keys in keys_tried:
        seq.keys = keys if type(keys) is tuple else list(keys)
        done = _fast_commit(fast, trie, seq, 4)
        assert done is False, keys
        assert trie.snapshot() == before and seq.num_committed_tokens == 0
    seq.keys = []
    for name in ("path", "blocks"):  # a record's lists as tuples: declined too
        right = getattr(seq, name)
        setattr(seq, name, tuple(right))
        done = _fast_commit(fast, trie, seq, 4)
        assert done is False, name
        setattr(seq, name, right)
        assert trie.snapshot() == before and seq.num_committed_tokens == 0


def test_a_commit_of_an_object_of_another_type_is_the_python_cores_to_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`commit` of anything but a `Sequence` raises the Python core's `InvalidType` on
    either core. The native commit declines every other type whichever side of its
    sequence type the other type's object lies in memory: a `FastAttach` made with
    the middle one of some types by address declines an object of the lowest and
    of the highest."""
    from cache.attach import _CACHED_CODE
    from cache.validation import U32
    from spec.errors import InvalidType

    made = [type(f"Other{i}", (), {}) for i in range(16)]
    kinds = sorted([int, str, object, dict, list, *made], key=id)
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend)
        for kind in (kinds[0], kinds[-1], type(None)):
            with pytest.raises(InvalidType, match="expected a Sequence"):
                trie.commit(kind(), 2)
        assert trie.num_cached_blocks == 0
    if NATIVE is None:
        return
    trie = _tiny(monkeypatch, "native")
    fast = NATIVE.FastAttach(
        trie._nodes, trie._kv.refs, trie._kv._free, trie._evictor.owner,
        kinds[len(kinds) // 2], U32, 2, _CACHED_CODE, None, 0,
    )  # fmt: skip
    for kind in (kinds[0], kinds[-1]):
        assert _fast_commit(fast, trie, kind(), 2) is False, kind


def test_a_commit_inside_a_muted_event_log_records_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`EventLog.muted()` (what `clear()` evicts under) silences every record: a
    commit made inside it records no stored run and marks no block in the replay
    bitmap, on either core."""
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend, enable_events=True)
        with trie._events.muted():
            serve(trie, [1, 2, 3, 4, 5])
        assert trie.num_cached_blocks == 2, backend
        assert len(trie.drain_event_records()) == 0, backend
        assert not any(trie._events._gpu_view._bits), backend


def test_a_released_node_with_many_children_stays_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose path ends at a node with two children: its release drops that
    node's last reference, and the node stays `cached` (not a leaf: never indexed
    for eviction), on either core; eviction then frees the two leaves first."""
    results = []
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend, num_blocks=8)
        serve(trie, [1, 1, 2, 2, 3, 3, 9])
        serve(trie, [1, 1, 2, 2, 4, 4, 9])  # block (2, 2) now has two children
        seq = trie.match([1, 1, 2, 2, 9])
        trie.allocate(seq, 5)
        trie.commit(seq, 4)
        branch = seq.path[-1]
        trie.release(seq)
        trie.check()
        assert state_name(trie._nodes.state[branch]) == "cached", backend
        assert trie.evict(2) == 2
        trie.check()
        results.append((state_name(trie._nodes.state[branch]), trie.snapshot()))
    assert all(result == results[0] for result in results)


def test_an_evicted_row_reads_as_freed_with_no_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """`NodeTable.release`'s contract, kept by the eviction that frees rows inline: a
    freed row reads as `freed` with no parent until it is handed out again, on
    either core."""
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend)
        seq = trie.match([1, 1, 2, 2, 9])
        trie.allocate(seq, 5)
        trie.commit(seq, 4)
        rows = list(seq.path)
        trie.release(seq)
        assert trie.evict(2) == 2
        nodes = trie._nodes
        assert [nodes.parent[row] for row in rows] == [NO_NODE, NO_NODE], backend
        assert [state_name(nodes.state[row]) for row in rows] == ["freed", "freed"], backend
        trie.check()


@needs_native
def test_take_refuses_more_blocks_than_are_free() -> None:
    """`take` of more blocks than the free list holds (its caller checks first) is
    refused before anything changes, never read past the list."""
    from array import array

    assert NATIVE is not None
    refs, free = [0, 0, 0], array("i", [2, 1])
    with pytest.raises(ValueError, match="take: not enough free blocks"):
        NATIVE.take(refs, free, 3)
    assert (refs, list(free)) == ([0, 0, 0], [2, 1])


@needs_native
def test_pool_kernels_refuse_every_negative_block() -> None:
    """Every negative id, -1 (`NO_BLOCK`) included, is outside the pool and refused,
    never counted against a block from the end (nor against the guard entry)."""
    from array import array

    assert NATIVE is not None
    refs = [1, 1, 1, 0]  # three blocks in use and the guard
    for bad in (-1, -2, -4, -5, -(2**31)):
        assert NATIVE.incref_all(refs, [0, bad]) == 1, bad
        assert NATIVE.decref_all(refs, array("i"), [0, bad]) == 1, bad
    assert refs == [1, 1, 1, 0]


@needs_native
def test_take_refuses_a_free_block_outside_the_pool() -> None:
    """A free list naming a block past the counts (a pool corrupted on purpose) is
    refused before the free list or a count changes."""
    from array import array

    assert NATIVE is not None
    refs, free = [0, 0], array("i", [0, 3])
    with pytest.raises(IndexError, match="take: a free block outside the pool"):
        NATIVE.take(refs, free, 1)  # block 3's count would be past the 2-entry list
    with pytest.raises(IndexError, match="take: a free block outside the pool"):
        NATIVE.take(refs, array("i", [-1]), 1)
    one_past = array("i", [0, 2])  # block 2: one past the 2-entry list
    with pytest.raises(IndexError, match="take: a free block outside the pool"):
        NATIVE.take(refs, one_past, 1)
    assert list(one_past) == [0, 2]
    assert (refs, list(free)) == ([0, 0], [0, 3])
    assert NATIVE.take(refs, array("i", [0, 1]), 2) == [1, 0]
    below_top = array("i", [3, 0])  # the bad block second: every block taken is checked
    with pytest.raises(IndexError, match="take: a free block outside the pool"):
        NATIVE.take(refs, below_top, 2)
    assert (refs, list(below_top)) == ([1, 1], [3, 0])


@needs_native
def test_the_native_release_names_a_malformed_state_or_child_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`FastTrie` keeps the columns it was made with; a state or child column of the
    wrong item size (the Python core never makes one) is refused by the release's
    settle naming that column."""
    from array import array
    from types import SimpleNamespace

    assert NATIVE is not None
    for name, right_size in (("state", 1), ("child", 4)):
        trie: Any = _tiny(monkeypatch, "native")
        nodes = trie._nodes
        columns = {
            "child": nodes.child, "block": nodes.block, "state": nodes.state,
            "tick": nodes.tick, "serial": nodes.serial, "checkpoint": nodes.checkpoint,
        }  # fmt: skip
        columns[name] = array("h", [0] * len(columns[name]))
        trie._fast = NATIVE.FastTrie(
            SimpleNamespace(**columns), trie._kv.refs, trie._kv._free, Sequence,
            eviction._SETTLED, trie.faults, trie._kv._fault_point, 2,
        )  # fmt: skip
        seq = trie.match([0, 0, 1])
        trie.allocate(seq, 3)
        trie.commit(seq, 2)
        with pytest.raises(ValueError, match=f"column {name}: items of {right_size} bytes"):
            trie.release(seq)


def test_a_stored_run_is_recorded_alike_by_both_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """With events on, the native commit records each chain's stored run itself (the
    Python `EventLog.stored`'s record: the same tuple, the same replay bitmap) and
    leaves a namespace with a bound LoRA id, whose event is built at once, to the
    Python core. Both cores drain the same records, block for block, and a block past
    the bitmap's bytes grows it as the Python core does."""
    from cache.event_log import EventLog

    outcomes = []
    python_stored = EventLog.stored
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend, num_blocks=64, enable_events=True)
        calls: list[str] = []

        def spy(log: Any, *args: Any, calls: list[str] = calls) -> None:
            calls.append(args[-1])  # the namespace
            python_stored(log, *args)

        monkeypatch.setattr(EventLog, "stored", spy)
        trie.bind_lora("adapter", 7)
        serve(trie, [1, 2, 3, 4, 5])
        serve(trie, [1, 2, 3, 4, 9, 9, 9])  # under a cached parent
        serve(trie, [5, 6, 7, 8], namespace="adapter")
        for n in range(20):  # blocks past the bitmap's first bytes
            serve(trie, [100 + n, 1, 2, 3])
        records = trie.drain_event_records()
        bits = bytes(trie._events._gpu_view._bits)
        monkeypatch.setattr(EventLog, "stored", python_stored)
        trie.check()
        native_took = backend == "native"
        assert (calls == ["adapter"]) if native_took else (len(calls) == 23), calls
        outcomes.append((records.items, records.events(), bits))
    assert all(outcome == outcomes[0] for outcome in outcomes)


def test_decode_blocks_committed_one_at_a_time_are_found_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks completed by decode tokens appended after the match get their keys from
    the token ids, in order, one commit at a time; a later request for the whole
    sequence hits every one of them, on either core."""
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend, num_blocks=16)
        seq = trie.match([1, 2, 3])
        trie.allocate(seq, 3)
        trie.commit(seq, 2)
        for more in ([4], [5, 6], [7, 8], [9, 10]):
            trie.append(seq, more)
            trie.allocate(seq, len(seq.tokens))
            trie.commit(seq, len(seq.tokens))
        tokens = list(seq.tokens)
        trie.release(seq)
        trie.check()
        assert tokens == list(range(1, 11)), backend
        again = trie.match([*tokens, 11])
        assert again.num_cached_tokens == 10, backend
        trie.abort(again)


def test_a_commit_beside_a_wide_node_still_deduplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node with a wide key (an extra identity) anywhere in the trie does not stop a
    plain commit from finding the plain child it duplicates: the second of two
    requests matched before either committed switches to the first one's blocks."""
    outcomes = []
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend, num_blocks=16)
        serve(trie, [7, 7, 7], extra=("image",))  # a wide node
        assert trie._nodes.wide
        serve(trie, [5, 6, 9])  # a plain node with no child yet
        first, second = trie.match([5, 6, 8, 8, 9]), trie.match([5, 6, 8, 8, 9])
        for seq in (first, second):
            trie.allocate(seq, 5)
        trie.commit(first, 4)  # (8, 8): the only child of (5, 6)
        cached = trie.num_cached_blocks
        trie.commit(second, 4)
        assert trie.num_cached_blocks == cached, backend
        assert second.block_ids[:2] == first.block_ids[:2], backend
        for seq in (first, second):
            trie.release(seq)
        trie.check()
        outcomes.append(trie.snapshot())
    assert all(outcome == outcomes[0] for outcome in outcomes)


def test_a_wide_token_sequence_commits_decode_blocks_on_the_python_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request with a token id past 32 bits keeps uint64 ids, which the native commit
    declines (its keys are read as uint32): its decode blocks are committed by the
    Python core on either backend."""
    for backend in BACKENDS:
        trie: Any = _tiny(monkeypatch, backend, num_blocks=16)
        seq = trie.match([2**40, 1, 2])
        assert seq.token_list.typecode != "I"
        trie.allocate(seq, 3)
        trie.commit(seq, 2)
        trie.append(seq, [3])
        trie.allocate(seq, 4)
        trie.commit(seq, 4)
        trie.release(seq)
        trie.check()
        again = trie.match([2**40, 1, 2, 3, 4])
        assert again.num_cached_tokens == 4, backend
        trie.abort(again)


@needs_native
def test_the_native_commit_names_a_malformed_tokens_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`FastAttach` keeps the columns it was made with; a tokens column of the wrong
    item size (the Python core never makes one) is refused by name when a commit
    compares a key with a cached child's."""
    from array import array
    from types import SimpleNamespace

    from cache.attach import _CACHED_CODE
    from cache.validation import U32

    assert NATIVE is not None
    trie: Any = _tiny(monkeypatch, "native")
    nodes = trie._nodes
    serve(trie, [0, 0, 1, 1, 9])  # block (0, 0) has one child: (1, 1)
    table = SimpleNamespace(
        child=nodes.child, tokens=array("i", bytes(len(nodes.tokens))), block=nodes.block,
        state=nodes.state, tick=nodes.tick, kids=nodes.kids, wide=nodes.wide,
        width=nodes.width,
    )  # fmt: skip
    fast = NATIVE.FastAttach(
        table, trie._kv.refs, trie._kv._free, trie._evictor.owner, Sequence, U32, 2,
        _CACHED_CODE, None, 0,
    )  # fmt: skip
    seq = trie.match([0, 0, 2, 2, 9])  # hits (0, 0); (2, 2) is compared with (1, 1)
    trie.allocate(seq, 5)
    with pytest.raises(ValueError, match="column tokens: items of 1 bytes"):
        _fast_commit(fast, trie, seq, 4)


@needs_native
def test_an_events_on_commit_names_a_malformed_state_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With events on, the native commit reads the state column it was made with to
    tell a chain under a root (whose stored run has no parent hash); one of the wrong
    item size (the Python core never makes one) is refused by name."""
    from array import array

    from cache.attach import _CACHED_CODE
    from cache.native import xxh3_address
    from cache.validation import U32

    assert NATIVE is not None
    trie: Any = _tiny(monkeypatch, "native", enable_events=True)
    nodes = trie._nodes
    right = nodes.state
    nodes.state = array("h", bytes(2 * len(right)))  # seen by the kernel made now only
    fast = NATIVE.FastAttach(
        nodes, trie._kv.refs, trie._kv._free, trie._evictor.owner, Sequence, U32, 2,
        _CACHED_CODE, trie._events, xxh3_address(),
    )  # fmt: skip
    nodes.state = right
    seq = trie.match([3, 3, 9])
    trie.allocate(seq, 3)
    with pytest.raises(ValueError, match="column state: items of 1 bytes"):
        _fast_commit(fast, trie, seq, 2)


def test_both_cores_build_one_key_per_full_block_at_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A match builds the key of each full block of the prompt and nothing past it
    (a partial last block has none yet), the same keys on either core."""
    for tokens in ([1], [1, 2], [1, 2, 3], [1, 2, 3, 4, 5], list(range(9))):
        keys = []
        for backend in BACKENDS:
            trie: Any = _tiny(monkeypatch, backend)
            serve(trie, [1, 2, 3, 4, 5, 6])
            seq = trie.match(tokens)
            keys.append(list(seq.keys))
            assert len(seq.keys) == len(tokens) // 2, (backend, tokens)
            trie.abort(seq)
        assert all(k == keys[0] for k in keys), tokens


@needs_native
def test_the_eviction_kernel_frees_nothing_for_a_count_of_zero_or_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`evict_inline(n, ...)` frees leaves until `n` blocks are freed: for `n <= 0`
    that is none at once (the public `evict` refuses a negative count before it)."""
    assert NATIVE is not None
    trie: Any = _tiny(monkeypatch, "native")
    serve(trie, [0, 0, 1, 1, 2])
    before = trie.snapshot()
    evictor = trie._evictor
    for n in (0, -1, -(2**40)):
        freed = NATIVE.evict_inline(
            n, evictor.index, evictor, trie._nodes, trie._kv, None, eviction._SETTLED
        )
        assert freed == 0, n
        assert trie.snapshot() == before
    assert NATIVE.evict_inline(
        1, evictor.index, evictor, trie._nodes, trie._kv, None, eviction._SETTLED
    ) == 1  # fmt: skip


def test_release_allocate_and_commit_leave_other_objects_to_the_python_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An object that is no `Sequence` of this cache (of a class made after the
    cache's own, so its type sits anywhere in memory) is refused by the Python core
    with `InvalidType` on either backend: the native release, allocate and commit
    decline it by its exact type before reading anything of it."""
    from spec.errors import InvalidType

    class Impostor:  # no `serial`, nothing a sequence has
        pass

    for backend in BACKENDS:
        trie = _tiny(monkeypatch, backend)
        serve(trie, [1, 2, 3])
        before = trie.snapshot()
        for _ in range(3):
            impostor: Any = type("Impostor", (Impostor,), {})()  # fresh heap types
            with pytest.raises(InvalidType):
                trie.release(impostor)
            with pytest.raises(InvalidType):
                trie.allocate(impostor, 2)
            with pytest.raises(InvalidType):
                trie.commit(impostor, 2)
        assert trie.snapshot() == before, backend
