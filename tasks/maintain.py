"""``poolctl maintain --once``: every pass, in-process and synchronously, same per-key code.

For cron, debugging and tests. A transient failure is not retried in-process:
the row is backed off durably and the next run (or the plane) picks it up.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from poolkeeper.errors import TransientError
from tasks import runner, scan
from tasks.plane import Plane

ORDER = ("expire", "lease_failures", "results", "reconcile", "materialize", "gc")


def maintain_once(plane: Plane, now: float) -> dict[str, Counter[str]]:
    summary: dict[str, Counter[str]] = {name: Counter() for name in ORDER}
    queued: dict[str, list[Any]] = {name: [] for name in ORDER}

    def collect(pass_name: str, keys: list[Any]) -> None:
        queued[pass_name].extend(keys)

    for name in ("expire", "lease_failures", "results"):
        _guard(summary[name], lambda n=name: scan.scan(plane, n, now, collect))
    _guard(summary["reconcile"], lambda: scan.scan_boards(plane, collect))
    _guard(summary["materialize"], lambda: scan.dispatch(plane, collect))
    queued["gc"] = ["all"]
    for name in ORDER:
        for key in queued[name]:
            try:
                summary[name][runner.run_key(plane, name, key, now)] += 1
            except TransientError as err:
                summary[name][runner.give_up_transient(plane, name, key, err, now)] += 1
        plane.coord.clear_pending(name, [runner.key_name(name, k) for k in queued[name]])
    return summary


def _guard(counter: Counter[str], step: Any) -> None:
    try:
        step()
    except TransientError:
        counter["scan_busy"] += 1
