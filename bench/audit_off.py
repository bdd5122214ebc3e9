"""The Celery app with the audit trail switched off: storm.py's (a0) line, what the trail costs the plane.

For the benchmark only (``celery -A bench.audit_off``): every writer in ``store.audit``
becomes a no-op before the app is loaded, so the plane runs exactly as in (a) otherwise.
"""

from __future__ import annotations

from typing import Any

from store import audit


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


audit.append = audit.observed = audit.expired = _nothing
# On PostgreSQL expire writes its events in its UPDATE (``audit.expired_from``): an inert CTE instead.
audit.expired_from = lambda rows, p: f"SELECT {p}::float8, {p}::text"

from tasks.celery import app  # noqa: E402  (after the switch: the app must see it)

__all__ = ["app"]
