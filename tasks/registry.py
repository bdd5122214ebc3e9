"""The one list of maintenance passes. Adding a pass: write its module, add one line here.

The order is the order ``poolctl maintain --once`` runs them in: leases are
expired before the rows they free are recovered, and claims are materialized
after reconcile has handed over the orphans it found.
"""

from __future__ import annotations

from core.errors import InvalidInput
from tasks import expire, gc, lease_failures, materialize, reconcile, results
from tasks.declaration import Pass

PASSES: tuple[Pass, ...] = (
    expire.PASS,
    lease_failures.PASS,
    results.PASS,
    reconcile.PASS,
    materialize.PASS,
    gc.PASS,
)
_BY_NAME = {p.name: p for p in PASSES}


def get(name: str) -> Pass:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise InvalidInput("pass", f"unknown pass {name!r}; one of {', '.join(_BY_NAME)}") from None
