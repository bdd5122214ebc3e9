"""``poolctl maintain --once``: every pass, in-process and synchronously, same per-key code.

For cron, debugging and tests. Each scanner is isolated: one that fails is
counted (and logged) and the other passes still run. A transient failure of
a key is not retried in-process: the row is backed off durably and the next
run (or the plane) picks it up.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from core.errors import TransientError
from tasks import failures, registry, runner, scan
from tasks.declaration import Key, Outcome
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")


def maintain_once(plane: Plane, now: float) -> dict[str, Counter[Outcome]]:
    summary: dict[str, Counter[Outcome]] = {p.name: Counter() for p in registry.PASSES}
    queued: dict[str, list[Key]] = {p.name: [] for p in registry.PASSES}

    def collect(pass_name: str, keys: Sequence[Key]) -> None:
        queued[pass_name].extend(keys)

    for p in registry.PASSES:
        try:
            scan.scan(plane, p.name, now, collect)
        except TransientError as err:
            log.warning("%s: scan skipped: %s", p.name, err)
            summary[p.name][Outcome.SCAN_BUSY] += 1
        except Exception:
            log.exception("%s: scan failed", p.name)
            summary[p.name][Outcome.SCAN_FAILED] += 1
    for p in registry.PASSES:
        for key in queued[p.name]:
            try:
                summary[p.name][runner.run_key(plane, p.name, key, now)] += 1
            except Exception as err:  # only transient errors come out of run_key
                summary[p.name][failures.give_up(plane, p, key, err, now)] += 1
        plane.coord.clear_pending(p.name, [p.key_name(k) for k in queued[p.name]])
    return summary
