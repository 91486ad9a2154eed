"""Which core runs a trie: the native kernels (`cache._native`) or the Python core.

The native core (C++17 + nanobind, built by scikit-build-core when the package
is installed with a C++ compiler; sources in `native/src/`) replaces the
per-block loops of the hot operations with one native call each: the prefix
walk and the taking of the hit (`match`), the chain of new nodes (`commit`),
the ticks (`release`), the reference counts (`KVBlockPool`), and the eviction
index (`NodeLRU`) with the make-room loop of a trie without a host tier or
checkpoints. The kernels work on the Python core's own columns (`NodeTable`'s
arrays and lists), so both backends keep one state and one set of rules: the
Python loops stay as the fallback and the reference, and the test suite runs
on both (`BLOCKTRIE_BACKEND`).

The spec drives the kernels: `_configure` hands them, at import, the node
lifecycle's state codes and the `NODE` table's `free` row (`spec.lifecycle`);
a parent's new state after an eviction comes from the Python core's memo of
the spec's routes. The C++ has no state or trigger literal (a test checks).

Selecting: `CacheConfig(backend="auto" | "native" | "python")`, default
`"auto"` (native when the extension imports, else Python with one
`NativeUnavailableWarning` saying why and how to get native); the
environment variable `BLOCKTRIE_BACKEND` overrides the configuration (for
running a whole suite on one backend). `BlockTrie.backend` says which runs.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

from cache.config import BACKENDS
from cache.node import MANY, NO_BLOCK, NO_CHILD, NO_NODE, state_code
from spec.errors import ConfigError
from spec.lifecycle import NODE, NodeState, NodeTrigger

__all__ = [
    "ABI",
    "BACKENDS",
    "ENV",
    "NativeUnavailableWarning",
    "native_module",
    "resolve_backend",
    "unavailable_reason",
]

ENV = "BLOCKTRIE_BACKEND"
"""The environment variable that overrides `CacheConfig.backend`."""

HOW_TO_GET_NATIVE = (
    "reinstall blocktrie where a C++17 compiler, CMake and Python's headers are "
    "available (pip builds cache._native with scikit-build-core and nanobind), e.g. "
    "`python -m pip install -e .` in a checkout (docs/quickstart.md, 'Without a compiler')"
)


class NativeUnavailableWarning(RuntimeWarning):
    """`backend="auto"` fell back to the Python core: the native extension did not
    import (the message says why and how to get it). Issued once per process."""


ABI = 1
"""The version of the kernels' signatures this Python code calls (`cache._native.ABI`):
bumped with any change to them, so that a module built from an older checkout (an
editable install not rebuilt since) is refused instead of called wrongly."""


def _load() -> tuple[ModuleType | None, str]:
    try:
        from cache import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"cache._native did not import ({exc})"
    reason = _stale(_native)
    if reason:
        return None, reason
    _configure(_native)
    return _native, ""


def _stale(module: ModuleType) -> str:
    """Why `module` cannot serve this code ("" when it can): its ABI is not `ABI`."""
    built = getattr(module, "ABI", None)
    if built == ABI:
        return ""
    return (
        f"cache._native is a stale build (its ABI is {built!r}, this code needs {ABI}): "
        "rebuild it with `python -m pip install -e .` in the checkout"
    )


def _configure(module: ModuleType) -> None:
    """Hand the spec's tables to the native core (no literal is duplicated in C++)."""
    free = NodeTrigger.FREE.value
    freed_from = {
        state_code(state): state_code(dest)
        for (trigger, state), dest in NODE.table.items()
        if trigger == free
    }
    module.configure(
        root_code=state_code(NodeState.ROOT.value),
        evictable_code=state_code(NodeState.EVICTABLE.value),
        freed_from=freed_from,
        no_node=NO_NODE,
        no_child=NO_CHILD,
        many=MANY,
        no_block=NO_BLOCK,
    )


_MODULE, _REASON = _load()
_warned = False


def native_module() -> ModuleType | None:
    """The configured native extension, or None when it is not built or did not import."""
    return _MODULE


def unavailable_reason() -> str:
    """Why the native core is unavailable ("" when it is available)."""
    return _REASON


_XXH3: int | None = None


def xxh3_address() -> int:
    """The address of `XXH3_64bits_withSeed` in the `xxhash` package's extension (the
    function its `xxh3_64_intdigest` calls), checked against it on a few inputs; 0
    when the package or the symbol is missing or disagrees (the native commit then
    leaves events-on commits to the Python core). Found once, with `ctypes`."""
    global _XXH3
    if _XXH3 is None:
        _XXH3 = 0
        try:
            import ctypes

            import xxhash
            from xxhash import _xxhash  # type: ignore[attr-defined]

            fn = ctypes.CDLL(_xxhash.__file__).XXH3_64bits_withSeed
            fn.restype = ctypes.c_uint64
            fn.argtypes = (ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64)
            samples = [(b"", 0), (b"blocktrie" * 7, 2**64 - 1), (bytes(range(64)), 12345)]
            if all(fn(d, len(d), s) == xxhash.xxh3_64_intdigest(d, s) for d, s in samples):
                _XXH3 = ctypes.cast(fn, ctypes.c_void_p).value or 0
        except (ImportError, OSError, AttributeError):
            pass
    return _XXH3


def resolve_backend(requested: str) -> str:
    """The backend a trie configured with `requested` runs: `"native"` or `"python"`.

    `BLOCKTRIE_BACKEND`, when set, replaces `requested`. `"native"` without the
    extension raises `ConfigError` (saying why it is missing and how to get it);
    `"auto"` falls back to `"python"` with one `NativeUnavailableWarning`.
    """
    global _warned
    env = os.environ.get(ENV, "")
    choice = env or requested
    if choice not in BACKENDS:
        source = f"${ENV}" if env else "CacheConfig.backend"
        raise ConfigError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    if choice == "python":
        return "python"
    if _MODULE is not None:
        return "native"
    if choice == "native":
        raise ConfigError(
            f"the native backend was asked for but {_REASON}; {HOW_TO_GET_NATIVE}, "
            'or use backend="python"'
        )
    if not _warned:
        _warned = True
        warnings.warn(
            f"blocktrie runs its Python core: {_REASON}. For the native core, "
            f"{HOW_TO_GET_NATIVE}; set {ENV}=python to choose the Python core silently.",
            NativeUnavailableWarning,
            stacklevel=3,
        )
    return "python"
