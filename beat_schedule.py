"""The beat schedule: one entry per registered pass, every interval from the settings.

Beat runs each pass's scanner (``SCAN_TASK`` with the pass name) at the
interval the pass declares. Each entry expires after its own interval, so a
backlog of scanner messages never piles up behind slow workers; two beats
running at once only make the scanners run twice, and the pending markers
keep the per-key work single.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from core.settings import Settings

SCAN_TASK = "poolkeeper.scan"


class Scheduled(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def interval(self) -> Callable[[Settings], float]: ...


def schedule(settings: Settings, passes: Iterable[Scheduled]) -> dict[str, dict[str, Any]]:
    entries = {}
    for p in passes:
        seconds = p.interval(settings)
        entries[f"scan-{p.name}"] = {
            "task": SCAN_TASK,
            "schedule": seconds,
            "args": (p.name,),
            "options": {"expires": seconds},
        }
    return entries
