"""Layering: the core cache pulls no CLI dependency; the planner sits on top of it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tests.helpers import python_without

ROOT = Path(__file__).resolve().parent.parent
CLI_ONLY = ("rich", "tqdm", "matplotlib")


def _core_modules() -> list[str]:
    """Every module of the core: `cache/*.py` (the planner and the test kit are layers above)."""
    names = sorted(p.stem for p in (ROOT / "cache").glob("*.py") if p.stem != "__init__")
    return ["cache", *(f"cache.{name}" for name in names)]


def _loaded_after(imports: list[str], blocked: tuple[str, ...] = ()) -> set[str]:
    """Top-level package names in sys.modules after importing `imports` in a fresh interpreter
    where the `blocked` packages are not installed (as after ``pip install blocktrie``)."""
    code = (
        "import importlib, json, sys\n"
        + f"for name in {imports!r}: importlib.import_module(name)\n"
        # A blocked package is in sys.modules as None.
        + "loaded = {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
        + "print(json.dumps(sorted(loaded)))\n"
    )
    proc = python_without(blocked, code)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout))


def test_core_imports_without_cli_dependencies() -> None:
    """The core imports with rich, tqdm and matplotlib absent (torch itself may use tqdm
    when it is installed, so the test removes them rather than inspecting sys.modules)."""
    modules = _core_modules()
    assert "cache.trie" in modules and "cache.planner" not in modules
    loaded = _loaded_after(modules, CLI_ONLY)
    assert "torch" in loaded  # the check sees real imports
    assert not loaded & set(CLI_ONLY)


def test_core_source_names_no_cli_dependency() -> None:
    for path in (ROOT / "cache").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in CLI_ONLY, f"{path.name}: {line.strip()}"


def test_core_does_not_import_the_planner() -> None:
    for path in (ROOT / "cache").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                top = ".".join(words[1].split(".")[:2])
                assert top not in ("cache.planner", "cache.testing"), f"{path.name}: {line}"


def test_public_names_resolve_lazily() -> None:
    """`cache` loads its public names on first use; each one is where `_HOME` says."""
    import cache

    assert set(cache._HOME) == set(cache.__all__)
    for name in cache.__all__:
        value = getattr(cache, name)
        assert value is getattr(importlib.import_module(cache._HOME[name]), name)
    with pytest.raises(AttributeError):
        cache.NoSuchName  # noqa: B018


def test_cli_module_imports_without_torch() -> None:
    """`blocktrie --help` and usage errors never load torch (it takes seconds)."""
    loaded = _loaded_after(["cache.planner.cli"], ("torch",))
    assert "cache" in loaded and "torch" not in loaded


def test_policy_codes_cover_every_placement() -> None:
    from cache.planner.policy import CODES, POLICY_NAMES

    assert set(CODES) == set(POLICY_NAMES)
    assert len(set(CODES.values())) == len(CODES)  # abbreviations are unambiguous
