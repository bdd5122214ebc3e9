"""The beat schedule: every interval comes from the settings, none is a literal.

Each entry expires after its own interval, so a backlog of scanner messages
never piles up behind slow workers; two beats running at once only make the
scanners run twice, and the pending markers keep the per-row work single.
"""

from __future__ import annotations

from typing import Any

from poolkeeper.settings import Settings


def schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    def every(seconds: float, task: str, *args: Any) -> dict[str, Any]:
        return {"task": task, "schedule": seconds, "args": args, "options": {"expires": seconds}}

    tick = settings.tick_seconds
    return {
        "expire-leases": every(tick, "poolkeeper.scan", "expire"),
        "recover-results": every(tick, "poolkeeper.scan", "results"),
        "recover-lease-failures": every(tick, "poolkeeper.scan", "lease_failures"),
        "dispatch-claims": every(tick, "poolkeeper.dispatch"),
        "reconcile-boards": every(settings.reconcile_seconds, "poolkeeper.scan_boards"),
        "collect-garbage": every(settings.gc_seconds, "poolkeeper.gc"),
    }
