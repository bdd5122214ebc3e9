"""Pause and resume dispatch (drain mode), for the whole pool or for one board, and an audit event each.

While paused, dispatch (``tasks.materialize.dispatch``) claims nothing new from the
board (or from the paused board, while it claims from the others as ever); every run
already claimed still runs, heartbeats, delivers and is maintained. Pool-wide, each
change is one conditional UPDATE of the one row of ``dispatch_pause`` (paused only where
it was not, resumed only where it was); for a board, an INSERT of its ``board_pauses``
row that does nothing where it is there already, and a DELETE of it. Each has its audit
event (``pause`` or ``resume``, on row id ``audit.POOL``, a board's naming it first in
its detail: ``board NAME: reason``) in the caller's transaction. Pausing what is paused,
or resuming what is not, matches nothing: it changes nothing, records nothing, and says
so (``False``). The two are apart: resuming the pool leaves a paused board paused.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core import shapes, validate
from core.errors import InvalidInput
from store import audit
from store.models import BoardPause, DispatchPause, EventKind

P, B = DispatchPause, BoardPause
MAX_REASON_CHARS = 500
MAX_PAUSED_BOARDS = 1000  # boards one read lists (and one dispatch round skips) at most
_INSERT = {d.dialect.name: d.insert for d in (postgresql, sqlite)}


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


def boards(s: Session) -> dict[str, Pause]:
    """The boards paused on their own, by name (at most ``MAX_PAUSED_BOARDS``, by name)."""
    found = s.execute(select(B.board, B.reason, B.actor, B.since).order_by(B.board).limit(MAX_PAUSED_BOARDS))
    return {r.board: Pause(True, r.reason, r.actor, r.since) for r in found}


def pause(s: Session, reason: str, *, now: float, actor: str, board: str | None = None) -> bool:
    """Pause dispatch (of ``board`` alone, if given) for ``reason``; False when it was paused already."""
    reason = validate.text("reason", reason).strip()
    if not reason or len(reason) > MAX_REASON_CHARS:
        raise InvalidInput("reason", f"must be 1 to {MAX_REASON_CHARS} characters")
    if board is None:
        event = audit.Event(audit.POOL, EventKind.PAUSE, actor, detail=reason)
        return _change(s, was=False, to=Pause(True, reason, actor, now), event=event)
    validate.name("board", board, shapes.BOARD_CHARS)
    actor = validate.storable(actor, audit.MAX_ACTOR_CHARS)
    if (s.scalar(select(func.count()).select_from(B).where(B.board != board)) or 0) >= MAX_PAUSED_BOARDS:
        raise InvalidInput(  # a dispatch round skips this many at most: one more would be claimed from
            "board",
            f"{MAX_PAUSED_BOARDS} boards are paused on their own already: resume one, or pause all dispatch",
        )
    row = {"board": board, "reason": reason, "actor": actor, "since": now}
    stmt = _INSERT[s.get_bind().dialect.name](B).values(row).on_conflict_do_nothing(index_elements=["board"])
    if s.execute(stmt.returning(B.board)).first() is None:  # there already
        return False
    audit.append(
        s, [audit.Event(audit.POOL, EventKind.PAUSE, actor, detail=f"board {board}: {reason}")], now=now
    )
    return True


def resume(s: Session, *, now: float, actor: str, board: str | None = None) -> bool:
    """Resume dispatch (of ``board`` alone, if given); False when it was not paused (nothing changed)."""
    if board is None:
        event = audit.Event(audit.POOL, EventKind.RESUME, actor)
        return _change(s, was=True, to=Pause(False, None, actor, now), event=event)
    validate.name("board", board, shapes.BOARD_CHARS)
    if s.execute(delete(B).where(B.board == board)).rowcount != 1:  # type: ignore[attr-defined]
        return False
    event = audit.Event(audit.POOL, EventKind.RESUME, actor, detail=f"board {board}")
    audit.append(s, [event], now=now)
    return True


def _change(s: Session, *, was: bool, to: Pause, event: audit.Event) -> bool:
    """The one conditional UPDATE (``WHERE paused = was``) and, if it matched, its event."""
    actor = validate.storable(to.actor or "", audit.MAX_ACTOR_CHARS)
    stmt = update(P).where(P.id == 1, P.paused == was)
    stmt = stmt.values(paused=to.paused, reason=to.reason, actor=actor, since=to.since)
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    audit.append(s, [event], now=to.since or 0.0)
    return True
