"""Benchmarks (``python -m bench.run``; docs/benchmarks.md). Not part of the package."""

from __future__ import annotations

import os
from pathlib import Path

TRACES_ENV = "BLOCKTRIE_TRACES_DIR"
"""Environment variable naming the folder of the public traces."""

CHECKOUT = Path(__file__).resolve().parent.parent
"""The source checkout this ``bench`` package belongs to."""


def default_traces_dir() -> Path:
    """Where the benchmarks and tests look for the public traces by default:
    ``$BLOCKTRIE_TRACES_DIR`` when set, else ``shared/traces`` beside the checkout
    (``<checkout>/../shared/traces``). ``--traces-dir`` / ``--trace`` override it;
    docs/benchmarks.md says where each trace is published."""
    configured = os.environ.get(TRACES_ENV)
    return Path(configured) if configured else CHECKOUT.parent / "shared" / "traces"
