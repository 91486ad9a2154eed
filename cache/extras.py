"""Optional dependencies: a missing one names the extra that installs it.

The core needs torch and transitions only; each extra of the ``blocktrie``
distribution (pyproject's ``optional-dependencies``) brings the modules of one
feature: ``events`` (msgspec, xxhash, pyzmq, numpy) for the wire format, the
publishers and the fleet planner; ``cli`` (rich, tqdm, matplotlib) for the
``blocktrie`` command's report and plot; ``ray`` for ``--executor ray``;
``metrics`` (prometheus_client) for `cache.metrics`. A module
of `cache` imports an extra's module inside `requires_extra`, so that without
it the import raises `MissingExtra`, which names the feature, the missing module
and the pip command, instead of a bare ``ModuleNotFoundError``::

    with requires_extra("events", "cache.kv_publisher"):
        import zmq
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MissingExtra", "requires_extra"]


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed.

    A `ModuleNotFoundError` (so an ``except ImportError`` written for the bare
    error still catches it) whose message names what needs the module, the
    module, and ``pip install 'blocktrie[<extra>]'``. `extra` is that extra's
    name; `name` (as for any `ImportError`) the missing module's.
    """

    def __init__(self, extra: str, feature: str, module: str) -> None:
        super().__init__(
            f"{feature} needs the {extra!r} extra (no module named {module!r}): "
            f"pip install 'blocktrie[{extra}]'",
            name=module,
        )
        self.extra = extra
        self.feature = feature


@contextmanager
def requires_extra(extra: str, feature: str) -> Iterator[None]:
    """Turn a `ModuleNotFoundError` raised inside the block into `MissingExtra`.

    `extra` is the extra that installs the block's imports; `feature` names what
    needs them (a module, or an option such as ``block_hash='xxh3'``). An error
    that is already a `MissingExtra` passes through unchanged.
    """
    try:
        yield
    except MissingExtra:
        raise
    except ModuleNotFoundError as exc:
        raise MissingExtra(extra, feature, exc.name or "?") from exc
