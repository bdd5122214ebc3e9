"""Pause and resume dispatch (drain mode): the one row of ``dispatch_pause``, and an audit event each.

While paused, dispatch (``tasks.materialize.dispatch``) claims nothing new from the
board; every run already claimed still runs, heartbeats, delivers and is maintained.
Each change is one conditional UPDATE of the one row (paused only where it was not,
resumed only where it was) and its audit event (``pause`` or ``resume``, on row id
``audit.POOL``: the pool as a whole) in the caller's transaction. Pausing a paused
pool, or resuming one that is not paused, matches nothing: it changes nothing, records
nothing, and says so (``False``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core import validate
from core.errors import InvalidInput
from store import audit
from store.models import DispatchPause, EventKind

P = DispatchPause
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Pause:
    """Dispatch as the store has it: paused or not, the operator's reason, who and since when."""

    paused: bool
    reason: str | None = None
    actor: str | None = None
    since: float | None = None


RUNNING = Pause(False)


def read(s: Session) -> Pause:
    """The pause row (a store ``init`` made; none reads as not paused)."""
    found = s.execute(select(P.paused, P.reason, P.actor, P.since).where(P.id == 1)).first()
    return RUNNING if found is None else Pause(bool(found.paused), found.reason, found.actor, found.since)


def pause(s: Session, reason: str, *, now: float, actor: str) -> bool:
    """Pause dispatch for ``reason``; False when it was paused already (nothing changed)."""
    reason = validate.text("reason", reason).strip()
    if not reason or len(reason) > MAX_REASON_CHARS:
        raise InvalidInput("reason", f"must be 1 to {MAX_REASON_CHARS} characters")
    event = audit.Event(audit.POOL, EventKind.PAUSE, actor, detail=reason)
    return _change(s, was=False, to=Pause(True, reason, actor, now), event=event)


def resume(s: Session, *, now: float, actor: str) -> bool:
    """Resume dispatch; False when it was not paused (nothing changed)."""
    return _change(
        s, was=True, to=Pause(False, None, actor, now), event=audit.Event(audit.POOL, EventKind.RESUME, actor)
    )


def _change(s: Session, *, was: bool, to: Pause, event: audit.Event) -> bool:
    """The one conditional UPDATE (``WHERE paused = was``) and, if it matched, its event."""
    actor = validate.storable(to.actor or "", audit.MAX_ACTOR_CHARS)
    stmt = update(P).where(P.id == 1, P.paused == was)
    stmt = stmt.values(paused=to.paused, reason=to.reason, actor=actor, since=to.since)
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    audit.append(s, [event], now=to.since or 0.0)
    return True
