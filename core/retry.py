"""The retry policy: exponential backoff with jitter, and when a row is quarantined.

One small value object, built from the settings at the edge and passed down:
the store records failures with it, the Celery tasks time their retries with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from core.settings import Settings, default


@dataclass(frozen=True)
class RetryPolicy:
    """Defaults: the settings' (``POOL_BACKOFF_*``, ``POOL_QUARANTINE_*``)."""

    base_seconds: float = default("backoff_base_seconds")
    max_seconds: float = default("backoff_max_seconds")
    quarantine_after: int = default("quarantine_after")
    quarantine_retry_seconds: float = default("quarantine_retry_seconds")

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(
            base_seconds=settings.backoff_base_seconds,
            max_seconds=settings.backoff_max_seconds,
            quarantine_after=settings.quarantine_after,
            quarantine_retry_seconds=settings.quarantine_retry_seconds,
        )

    def backoff(self, n: int, rng: random.Random | None = None) -> float:
        """Delay before retry ``n`` (1-based), capped, with "equal jitter": half fixed, half random."""
        ceiling = min(self.max_seconds, self.base_seconds * 2.0 ** min(max(n, 1) - 1, 30))
        return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)

    def delay(self, failures: int, rng: random.Random | None = None) -> tuple[float, bool]:
        """How long a row with ``failures`` in a row waits, and whether it is now quarantined."""
        if failures >= self.quarantine_after:
            return self.quarantine_retry_seconds, True
        return self.backoff(failures, rng), False
