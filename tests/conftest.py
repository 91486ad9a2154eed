"""Hypothesis profiles and shared fixtures.

Profiles: `ci` (derandomized, loaded when CI=true), `dev` (the default),
`fuzz` (long runs: HYPOTHESIS_PROFILE=fuzz python -m pytest tests), and
`mutation` (derandomized and short, for `python -m tools.mutation`, which runs
the covering tests once per mutant).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "fuzz",
    max_examples=2000,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutation",
    derandomize=True,
    max_examples=20,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
TRACES = SHARED / "traces"


@pytest.fixture
def traces_dir() -> Path:
    """../shared/traces, or skip the test where it is absent."""
    if not TRACES.is_dir():
        pytest.skip("../shared/traces is not present")
    return TRACES
