"""The beat schedule: one entry per registered pass, every interval from the settings.

Beat runs each pass's scanner (``scan_task``, named in the deployment's
namespace, with the pass name) at the interval the pass declares. Each entry
expires after its own interval, so a backlog of scanner messages never piles
up behind slow workers; two beats
running at once only make the scanners run twice, and the pending markers
keep the per-key work single.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from core.settings import Settings


def scan_task(settings: Settings) -> str:
    """The scanner task's name: in the namespace, so another deployment's worker never runs it."""
    return f"{settings.namespace}.scan"


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
            "task": scan_task(settings),
            "schedule": seconds,
            "args": (p.name,),
            "options": {"expires": seconds},
        }
    return entries
