"""Hypothesis profiles and budgets: property tests are bounded by examples, never by wall time.

``tests/conftest.py`` calls ``load()`` before any test module is imported, so every
``settings(...)`` a test builds inherits the profile:

- ``ci`` (the default): no per-example deadline and no ``too_slow`` health check, so a
  loaded machine makes a run slower, never a failure; derandomized under ``CI=true`` so
  CI explores the same examples on every run.
- ``long`` (``HYPOTHESIS_PROFILE=long``): the same, with ten times each test's examples
  and twice its state machine steps, for a deeper search on demand.

Each test states its own budget with ``budget(examples, steps)`` (or ``examples(n)``
where the count is also asserted on). ``conftest`` marks every Hypothesis test
``property`` and gives it no pytest-timeout: its examples bound it, and the 300 s of
``[tool.pytest.ini_options]`` stay for everything else. A test that runs a state
machine or ``@given`` inside its body carries ``@pytest.mark.property`` itself.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

PROFILES = {"ci": (1, 1), "long": (10, 2)}  # name: (examples, steps) multipliers


def load() -> str:
    """Register the profiles and load the one ``HYPOTHESIS_PROFILE`` names (default ``ci``)."""
    for name in PROFILES:
        settings.register_profile(
            name,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            derandomize=os.environ.get("CI") == "true",
            print_blob=True,
        )
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)  # an unknown name raises, naming it
    return name


def _scale() -> tuple[int, int]:
    return PROFILES.get(os.environ.get("HYPOTHESIS_PROFILE", "ci"), (1, 1))


def examples(n: int) -> int:
    """A test's example count under the loaded profile."""
    return n * _scale()[0]


def budget(
    n: int, steps: int | None = None, *, suppress: tuple[HealthCheck, ...] = (), **extra: Any
) -> settings:
    """This test's settings: ``n`` examples (and ``steps`` per state machine run) under the profile.

    ``suppress`` adds health checks to the profile's (a plain ``suppress_health_check``
    would replace them).
    """
    if steps is not None:
        extra["stateful_step_count"] = steps * _scale()[1]
    profile = settings.default
    checks = [*(profile.suppress_health_check if profile else ()), *suppress]
    return settings(max_examples=examples(n), suppress_health_check=checks, **extra)
