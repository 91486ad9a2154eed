"""A missing optional dependency names the extra that installs it (`cache.extras`)."""

from __future__ import annotations

import json

import pytest

from cache.extras import MissingExtra, requires_extra
from tests.helpers import python_without

_REPORT = """
import importlib, json
try:
    importlib.import_module({module!r})
except ImportError as exc:
    print(json.dumps({{"type": type(exc).__name__, "message": str(exc), "name": exc.name,
                      "import_error": isinstance(exc, ImportError),
                      "extra": getattr(exc, "extra", None)}}))
else:
    print(json.dumps(None))
"""


@pytest.mark.parametrize(
    ("module", "missing"),
    [
        ("cache.kv_publisher", "zmq"),
        ("cache.kv_publisher", "msgspec"),  # through cache.kv_events
        ("cache.kv_events", "msgspec"),
        ("cache.kv_events", "numpy"),
        ("cache.kv_publisher_process", "zmq"),
        ("cache.kv_publisher_process", "msgspec"),
        ("cache.planner.fleet", "msgspec"),
        ("cache.planner.publish", "zmq"),  # imports pyzmq only to publish: imports fine
        ("cache.metrics", "prometheus_client"),
    ],
)
def test_importing_a_module_without_its_extra_names_the_pip_command(
    module: str, missing: str
) -> None:
    proc = python_without([missing], _REPORT.format(module=module))
    assert proc.returncode == 0, proc.stderr
    raised = json.loads(proc.stdout)
    if module == "cache.planner.publish":
        assert raised is None
        return
    assert raised is not None, f"{module} imported with {missing} absent"
    assert raised["type"] == "MissingExtra"
    assert raised["import_error"]
    assert raised["name"] == missing
    extra = "metrics" if module == "cache.metrics" else "events"
    assert raised["extra"] == extra
    assert raised["message"].endswith(f"pip install 'blocktrie[{extra}]'")
    assert f"no module named {missing!r}" in raised["message"]


@pytest.mark.parametrize(
    ("missing", "argv", "extra"),
    [
        ("matplotlib", ["replay", "--plot", "out.png", "--sweep", "1k,2k"], "cli"),
        ("ray", ["replay", "--executor", "ray", "--sweep", "1k,2k"], "ray"),
        ("msgspec", ["replay", "--replicas", "2"], "events"),
        ("xxhash", ["replay", "--replicas", "2"], "events"),
        ("zmq", ["replay", "--publish", "tcp://127.0.0.1:*"], "events"),
    ],
)
def test_a_command_without_its_extra_names_the_pip_command(
    missing: str, argv: list[str], extra: str
) -> None:
    """`blocktrie ...` refuses, before any work, with the extra to install."""
    code = f"import sys\nfrom cache.planner.cli import main\nsys.exit(main({argv!r}))\n"
    proc = python_without([missing], code)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("blocktrie replay: error: ")
    assert proc.stderr.rstrip().endswith(f"pip install 'blocktrie[{extra}]'")
    assert "Traceback" not in proc.stderr


def test_the_core_imports_without_any_extra() -> None:
    """`cache` and a trie need torch and transitions only; the events extra's modules
    are imported when events are used."""
    events = ("zmq", "msgspec", "numpy", "xxhash")
    code = (
        "import torch\n"
        "from cache import BlockTrie, CacheConfig\n"
        "trie = BlockTrie(CacheConfig(block_size=4, num_blocks=8, kv_block_shape=(4, 2),"
        " kv_dtype=torch.float32))\n"
        "seq = trie.match([1, 2, 3, 4, 5])\n"
        "trie.allocate(seq, 5)\n"
        "trie.commit(seq, 5)\n"
        "trie.release(seq)\n"
        "print(trie.num_cached_blocks)\n"
    )
    proc = python_without(events, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1"]


def test_events_on_without_xxhash_name_the_extra() -> None:
    code = (
        "import torch\n"
        "from cache import BlockTrie, CacheConfig\n"
        "try:\n"
        "    BlockTrie(CacheConfig(block_size=4, num_blocks=8, kv_block_shape=(4, 2),"
        " kv_dtype=torch.float32, enable_events=True))\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    proc = python_without(["xxhash"], code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("pip install 'blocktrie[events]'")


def test_requires_extra_turns_a_missing_module_into_missing_extra() -> None:
    with pytest.raises(MissingExtra) as caught, requires_extra("events", "the feature"):
        raise ModuleNotFoundError("No module named 'zmq'", name="zmq")
    error = caught.value
    assert isinstance(error, ImportError)
    assert str(error) == (
        "the feature needs the 'events' extra (no module named 'zmq'): "
        "pip install 'blocktrie[events]'"
    )
    assert (error.extra, error.feature, error.name) == ("events", "the feature", "zmq")
    assert isinstance(error.__cause__, ModuleNotFoundError)


def test_requires_extra_passes_other_errors_through() -> None:
    # An installed module that fails to import (a broken build) is not a missing extra.
    broken = ImportError("cannot import name 'x' from 'zmq'", name="zmq")
    with pytest.raises(ImportError) as caught, requires_extra("events", "f"):
        raise broken
    assert caught.value is broken
    inner = MissingExtra("cli", "inner", "rich")
    with pytest.raises(MissingExtra) as nested, requires_extra("events", "outer"):
        raise inner
    assert nested.value is inner
    with requires_extra("events", "f"):
        pass  # nothing missing: nothing raised
