"""Worker presence: the last worker call (offer, heartbeat, result) and its owner, per ordinal.

The worker calls note themselves in their own transaction (``PoolStore.offer``,
``heartbeat``, ``accept_result``), one upsert on ``ordinal_presence``. Kept cheap: a
``Gate`` per store handle lets through at most one write per ``EVERY_SECONDS`` (or a
quarter lease, if shorter) per ordinal (an idle worker polls ``offer`` every second or
so), except when the owner changes (a restarted worker) or for a result, which changes
its row anyway. Dispatch fills only ordinals seen within a lease (``staffed``).
``read`` gives, for every ordinal of the pool, what was seen last, or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Table, bindparam, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core import db
from store.models import Assignment, Call, OrdinalPresence

EVERY_SECONDS = 5.0  # presence is judged against a lease (90 s by default); a short lease writes more often

P = OrdinalPresence.__table__
assert isinstance(P, Table)
_A = Assignment.__table__
assert isinstance(_A, Table)
# A heartbeat or result names its run, not its instance: the owner is the run's last grant's.
_OWNER_OF_RUN = (
    select(_A.c.owner)
    .where(
        _A.c.board == bindparam("board"),
        _A.c.task_id == bindparam("task_id"),
        _A.c.run_id == bindparam("run_id"),
    )
    .scalar_subquery()
)


def _upsert(dialect: object, owner: object) -> db.Prepared:
    ins = dialect.insert(P).values(  # type: ignore[attr-defined]
        ordinal=bindparam("ordinal"), owner=owner, call=bindparam("call"), at=bindparam("at")
    )
    set_ = {"owner": ins.excluded.owner, "call": ins.excluded.call, "at": ins.excluded.at}
    return db.Prepared(ins.on_conflict_do_update(index_elements=["ordinal"], set_=set_))


_BY_OWNER = {d.dialect.name: _upsert(d, bindparam("owner")) for d in (postgresql, sqlite)}
_BY_RUN = {d.dialect.name: _upsert(d, _OWNER_OF_RUN) for d in (postgresql, sqlite)}


@dataclass(frozen=True)
class Seen:
    """What an ordinal's worker did last: ``call`` at ``at``, by ``owner`` (None: no call seen yet)."""

    ordinal: int
    owner: str | None
    call: str | None
    at: float | None


class Gate:
    """Per store handle: which ordinals were written lately, so most polls write nothing."""

    def __init__(self, every: float = EVERY_SECONDS) -> None:
        self.every = every
        self._last: dict[int, tuple[str | None, float]] = {}

    def due(self, ordinal: int, owner: str | None, call: Call, now: float) -> bool:
        last = self._last.get(ordinal)
        if call is Call.RESULT or last is None:
            return True
        changed = owner is not None and owner != last[0]
        return changed or not 0 <= now - last[1] < self.every

    def written(self, ordinal: int, owner: str | None, now: float) -> None:
        previous = self._last.get(ordinal)
        self._last[ordinal] = (owner if owner is not None else previous and previous[0], now)


def note(conn: Connection, ordinal: int, call: Call, now: float, *, owner: str) -> None:
    """The instance ``owner`` made ``call`` on ``ordinal`` (an offer)."""
    values = {"ordinal": ordinal, "owner": owner, "call": call.value, "at": now}
    _BY_OWNER[conn.dialect.name].run(conn, values)


def note_run(
    conn: Connection, ordinal: int, call: Call, now: float, *, board: str, task_id: str, run_id: int
) -> None:
    """The holder of that run made ``call`` on ``ordinal`` (a heartbeat or a result)."""
    values = {"ordinal": ordinal, "call": call.value, "at": now, "board": board, "task_id": task_id}
    _BY_RUN[conn.dialect.name].run(conn, {**values, "run_id": run_id})


def read(s: Session, pool_size: int) -> list[Seen]:
    """Every ordinal of the pool, with its last call, or ``None`` fields when none was seen."""
    found = {r.ordinal: r for r in s.execute(select(P).where(P.c.ordinal < pool_size))}
    return [
        Seen(o, found[o].owner, found[o].call, found[o].at) if o in found else Seen(o, None, None, None)
        for o in range(pool_size)
    ]


def staffed(s: Session, pool_size: int, since: float) -> set[int]:
    """The ordinals of the pool whose worker made a call at ``since`` or later."""
    return set(s.scalars(select(P.c.ordinal).where(P.c.ordinal < pool_size, P.c.at >= since)))
