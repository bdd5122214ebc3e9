"""The pool worker protocol: offer, heartbeat, result, release (docs/design.md, "Execution authority").

Each function takes the caller's connection or session (one short transaction), a ``now``
and the values it needs. Only the holder of the current attempt and fence may
write. Authority is checked before replay: a delivery replayed with the same
id and digest is a duplicate only for the fence that made it, while that
fence is still the row's last word; the same id with other content is a
conflict.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, NoReturn, cast

from sqlalchemy import Connection, Table, and_, bindparam, func, literal, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core import db, shapes, validate
from core.errors import CorruptRow, DeliveryConflict, LostRace, NotFound, StaleHolder, TransientError
from core.retry import RetryPolicy
from core.shapes import Offer
from store import audit, bookkeeping, lineage
from store.envelope import Envelope
from store.models import LIVE_SQL, Assignment, Delivery, EventKind, FenceSequence, RowState
from store.rows import CLEAR_BOOKKEEPING, get_row

T = cast(Table, Assignment.__table__)
_D = cast(Table, Delivery.__table__)
_F = cast(Table, FenceSequence.__table__)
RUNNING = RowState.RUNNING.value


class Held(NamedTuple):
    """A run's row as the worker calls read it (under its lock)."""

    id: int
    board: str
    task_id: str
    run_id: int
    ordinal: int
    state: str
    attempt: int
    fence: int | None
    owner: str | None
    lease_until: float | None
    payload_digest: str
    result_digest: str | None


# Prepared once: every worker call runs a few of these, and building them per call, loading
# ORM objects and SQLAlchemy's work per execute cost several times the database's
# (bench/store_bench.py).
_ROW = [T.c[name] for name in Held._fields]
# ``LIVE_SQL`` verbatim lets SQLite use the partial unique index on the ordinal.
_ON_ORDINAL = db.Prepared(
    select(*_ROW, T.c.payload, T.c.traceparent)
    .where(T.c.ordinal == bindparam("ordinal"), text(LIVE_SQL), T.c.state != RowState.RESULT.value)
    .with_for_update()
)
_BY_IDENTITY = db.Prepared(
    select(*_ROW)
    .where(
        T.c.board == bindparam("board"),
        T.c.task_id == bindparam("task_id"),
        T.c.run_id == bindparam("run_id"),
    )
    .with_for_update()
)
_ANY_ON_BOARD = db.Prepared(select(T.c.id).where(T.c.board == bindparam("board")).limit(1))
_MINT = db.Prepared(_F.update().where(_F.c.id == 1).values(value=_F.c.value + 1).returning(_F.c.value))
_GRANT = db.Prepared(
    T.update()
    .where(
        T.c.id == bindparam("row_id"),
        T.c.state == bindparam("was_state"),
        T.c.attempt == bindparam("was_attempt"),
        T.c.fence.is_not_distinct_from(bindparam("was_fence")),
    )
    .values(
        state=RUNNING,
        owner=bindparam("new_owner"),
        fence=bindparam("new_fence"),
        lease_until=bindparam("new_lease"),
        updated_at=bindparam("now"),
    )
)
# The holder's write is guarded on the whole holder identity, and its result checked.
_HOLDER = and_(
    T.c.board == bindparam("h_board"),
    T.c.task_id == bindparam("h_task_id"),
    T.c.run_id == bindparam("h_run_id"),
    T.c.state == RUNNING,
    T.c.ordinal == bindparam("h_ordinal"),
    T.c.attempt == bindparam("h_attempt"),
    T.c.fence == bindparam("h_fence"),
    T.c.payload_digest == bindparam("h_payload_digest"),
    T.c.lease_until >= bindparam("now"),
)
_EXTEND = db.Prepared(
    T.update().where(_HOLDER).values(lease_until=bindparam("new_lease"), updated_at=bindparam("now"))
)
_STORE_RESULT = db.Prepared(
    T.update()
    .where(_HOLDER)
    .values(
        state=RowState.RESULT.value,
        result=bindparam("new_result"),
        result_digest=bindparam("new_result_digest"),
        updated_at=bindparam("now"),
        **CLEAR_BOOKKEEPING,
    )
)
_HAND_BACK = db.Prepared(
    T.update()
    .where(_HOLDER)
    .values(
        state=bindparam("new_state"),
        attempt=bindparam("new_attempt"),
        lease_until=bindparam("now"),
        updated_at=bindparam("now"),
        **CLEAR_BOOKKEEPING,
    )
)
_DELIVERY = db.Prepared(select(_D.c.kind, _D.c.digest).where(_D.c.delivery_id == bindparam("delivery_id")))


def _new_delivery(dialect: Any) -> Any:
    """A new heartbeat's delivery, recorded only if the holder is the row's current one (``_HOLDER``)
    and its id is new. ``new_heartbeat`` then extends the lease under the same guard: two
    statements where the long way (``_admit``) takes four; anything else records nothing."""
    return (
        dialect.insert(_D)
        .from_select(
            ["delivery_id", "assignment_id", "kind", "digest", "created_at"],
            select(
                bindparam("delivery_id"), T.c.id, literal("heartbeat"), bindparam("digest"), bindparam("now")
            ).where(_HOLDER),
        )
        .on_conflict_do_nothing(index_elements=["delivery_id"])
        .returning(_D.c.assignment_id)
    )


_NEW_HEARTBEAT = db.Prepared(_new_delivery(sqlite))
# On PostgreSQL both in one round trip: the guarded UPDATE of the row whose delivery it recorded.
_RECORDED = _new_delivery(postgresql).cte("recorded")
_EXTENDED = (
    T.update()
    .where(T.c.id.in_(select(_RECORDED.c.assignment_id)), _HOLDER)
    .values(lease_until=bindparam("new_lease"), updated_at=bindparam("now"))
    .returning(T.c.id)
    .cte("extended")
)
_NEW_HEARTBEAT_AT_ONCE = db.Prepared(
    select(
        select(func.count()).select_from(_RECORDED).scalar_subquery(),
        select(func.count()).select_from(_EXTENDED).scalar_subquery(),
    )
)
_FORGET = db.Prepared(_D.delete().where(_D.c.delivery_id == bindparam("delivery_id")))
_RECORD = {
    dialect.dialect.name: db.Prepared(
        dialect.insert(_D).on_conflict_do_nothing(index_elements=["delivery_id"]).returning(_D.c.delivery_id)
    )
    for dialect in (postgresql, sqlite)
}


def offer(
    s: Session | Connection, ordinal: int, *, owner: str, pool_size: int, lease_seconds: float, now: float
) -> Offer | None:
    """Grant the ordinal's run to the worker instance ``owner``.

    - ``assigned``: the lease starts under a freshly minted fence.
    - ``running`` with a live lease, asked by another owner: a restarted worker.
      It gets the same run back at once, same attempt, under a new fence and a
      new lease; the old instance is fenced out without burning an attempt.
    - ``running``, asked again by the owner that holds it: the same grant again
      (same fence, same lease), nothing written. A worker that lost the answer
      to its ``offer`` and asks again must not fence itself out, and a second
      fence for the same instance would only invite two loops to run one grant.
    - ``running`` with an ended lease: ``None``. That attempt has failed (its
      heartbeats are already refused); ``expire`` re-offers it at ``attempt+1``
      or parks it ``lease_failed``, so a worker cannot restart its way past
      ``max_attempts``.
    - nothing on the ordinal, or a row holding a result: ``None``.
    - a row whose stored payload cannot be read back: ``CorruptRow``, with nothing
      changed and no fence minted.

    Two live instances asking on one ordinal fence each other out in turn
    (the last to ask holds the run); the ordinal's credential is the
    authority, so only a misconfigured pool runs two.

    A new grant retires every live child of earlier grants in the same
    transaction (a restart's children are never adoptable), so a run and its
    lineage never run as two executions.

    The row is locked first (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE``
    already serialises writers), and the grant is one guarded UPDATE on the
    state, attempt and fence just read. A live grant never moves to another
    ordinal: only the row on ``ordinal`` is ever considered.
    """
    validate.ordinal("ordinal", ordinal, pool_size)
    validate.name("owner", owner, shapes.OWNER_CHARS)
    conn = db.connection_of(s)
    found = _ON_ORDINAL.run(conn, {"ordinal": ordinal}).rows
    if not found:
        return None
    row, traced = Held._make(found[0][:-2]), found[0][-1]
    payload = _stored_payload(row, found[0][-2])  # before any fence: a row we cannot hand out is not granted
    if row.state == RUNNING:
        assert row.fence is not None and row.lease_until is not None  # CHECK running_has_lease
        if row.lease_until < now:
            return None
        if row.owner == owner:
            return _grant(row, owner, row.fence, row.lease_until, payload, traced)
    lineage.retire_children(conn, [row.id], now, actor=audit.by_worker(ordinal))  # the earlier grant's
    fence = mint_fence(conn)
    lease_until = now + lease_seconds
    granted = {"row_id": row.id, "was_state": row.state, "was_attempt": row.attempt, "was_fence": row.fence}
    granted.update(new_owner=owner, new_fence=fence, new_lease=lease_until, now=now)
    if _GRANT.run(conn, granted).rowcount != 1:
        raise LostRace(
            f"offer: row {row.id} changed under us (expected state={row.state}, "
            f"attempt={row.attempt}, fence={row.fence})"
        )
    actor, detail = audit.by_worker(ordinal), f"owner {owner}"
    grant = audit.Event(row.id, EventKind.GRANT, actor, row.state, RUNNING, row.attempt, fence, detail)
    audit.append(conn, [grant], now=now)
    return _grant(row, owner, fence, lease_until, payload, traced)


def _grant(
    row: Held, owner: str, fence: int, lease_until: float, payload: dict[str, Any], traced: str | None
) -> Offer:
    """The grant; its ``traceparent`` is the run's (the row's) until the server's grant span replaces it."""
    return Offer(
        row_id=row.id,
        board=row.board,
        task_id=row.task_id,
        run_id=row.run_id,
        ordinal=row.ordinal,
        owner=owner,
        attempt=row.attempt,
        fence=fence,
        lease_until=lease_until,
        payload=payload,
        payload_digest=row.payload_digest,
        traceparent=traced,
    )


def _stored_payload(row: Held, stored: str | None) -> dict[str, Any]:
    """The row's payload, or ``CorruptRow`` if the stored text is not what ``add_run`` wrote."""
    text = stored or ""  # a live row always has one (CHECK live_has_payload)
    if validate.sha256(text) != row.payload_digest:
        raise CorruptRow(row.id, "the stored payload does not match its digest; not granted")
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError):
        payload = None
    if not isinstance(payload, dict):
        raise CorruptRow(row.id, "the stored payload is not a JSON object; not granted")
    return payload


def note_corrupt(
    s: Session, row_id: int, problem: str, *, policy: RetryPolicy, now: float, actor: str
) -> None:
    """Record an unreadable row on itself (backoff, then quarantine) so an operator sees it.

    A worker polls ``offer`` often: only a row whose backoff has run out takes
    another record, so the failure count follows the retry policy, not the poll rate.
    """
    row = get_row(s, row_id)
    if row.state == RowState.ASSIGNED.value and row.next_attempt_at <= now:
        bookkeeping.record_failure(s, row_id, problem, policy=policy, now=now, actor=actor)


def mint_fence(s: Session | Connection) -> int:
    rows = _MINT.run(db.connection_of(s)).rows
    if not rows:
        raise NotFound("the fence sequence row is missing: run `poolctl init`")
    return int(rows[0][0])


def heartbeat(
    s: Session | Connection, env: Envelope, *, lease_seconds: float, now: float
) -> Literal["applied", "duplicate"]:
    """Extend the lease of the exact attempt and fence the envelope names."""
    conn = db.connection_of(s)
    if new_heartbeat(conn, env, lease_seconds=lease_seconds, now=now):
        return "applied"
    return checked_heartbeat(conn, env, lease_seconds=lease_seconds, now=now)


def checked_heartbeat(
    conn: Connection, env: Envelope, *, lease_seconds: float, now: float
) -> Literal["applied", "duplicate"]:
    """``heartbeat`` the long way, once ``new_heartbeat`` did not apply it: every check, and
    the refusal or the replay's answer that names what it found."""
    row, digest = _admit(conn, env, "heartbeat", now)
    if digest is None:
        return "duplicate"
    if row.state != RUNNING:  # the holder of the row's result sends no new heartbeats
        raise StaleHolder(f"state: stale holder refused: row {row.id} is {row.state}, not running")
    _apply(conn, _EXTEND, env, now, new_lease=now + lease_seconds)
    _record_delivery(conn, row.id, env, "heartbeat", digest, now)
    return "applied"


def new_heartbeat(conn: Connection, env: Envelope, *, lease_seconds: float, now: float) -> bool:
    """``heartbeat``'s common case, applied: the current holder's heartbeat under a new delivery id.

    False, with nothing written, for anything else: ``heartbeat`` then takes the long way,
    checking and answering it. Raises only what the database raises.
    """
    holder = {**_holder(env, now), "delivery_id": env.delivery_id, "digest": env.digest()}
    holder["new_lease"] = now + lease_seconds
    if conn.dialect.name == "postgresql":
        recorded, extended = _NEW_HEARTBEAT_AT_ONCE.run(conn, holder).rows[0]
    else:
        recorded = len(_NEW_HEARTBEAT.run(conn, holder).rows)
        extended = _EXTEND.run(conn, holder).rowcount if recorded else 0
    if not recorded:
        return False
    if extended == 1:
        return True
    _FORGET.run(conn, holder)  # the row moved between the two (PostgreSQL): the long way says how
    return False


def new_heartbeats(
    conn: Connection, envs: Sequence[Envelope], *, lease_seconds: float, now: float
) -> list[bool]:
    """``new_heartbeat`` over a batch in one statement: which of ``envs`` it applied.

    Each heartbeat is applied exactly as ``new_heartbeat`` applies it: its delivery recorded
    and its lease extended only under the whole ``_HOLDER`` guard and only if its id is new;
    a False one wrote nothing and goes the long way (``checked_heartbeat``). The batch must
    name each delivery id and each run at most once (``PoolStore.heartbeats`` keeps the rest
    back): one statement cannot apply two heartbeats of one row in order, nor record one id twice.
    One round trip on PostgreSQL (``unnest`` of the batch's columns, the insert and the update
    in one statement), two on SQLite; either way on the driver's cursor, compiled by nobody.
    """
    if not envs:
        return []
    columns = [
        [e.delivery_id for e in envs],
        [e.digest() for e in envs],
        [e.board for e in envs],
        [e.task_id for e in envs],
        [e.run_id for e in envs],
        [e.worker_ordinal for e in envs],
        [e.attempt for e in envs],
        [e.fence for e in envs],
        [e.payload_digest for e in envs],
    ]
    lease = now + lease_seconds
    applied: set[str] = set()
    moved: list[str] = []  # recorded, but the row moved before its update (PostgreSQL)
    if conn.dialect.name == "postgresql":
        with db.driver_cursor(conn, _PG_HEARTBEATS) as cursor:  # prepared: the plan is the cost
            found = cursor.execute(_PG_HEARTBEATS, [*columns, now, now, lease, now, now]).fetchall()
        applied = {delivery_id for delivery_id, extended in found if extended}
        moved = [delivery_id for delivery_id, extended in found if not extended]
    else:
        rows = [value for row in zip(*columns, strict=True) for value in row]
        recorded = db.raw(conn, _sqlite_heartbeats(len(envs), _SQLITE_RECORD), [*rows, now, now])
        if recorded:
            of_row = {row_id: delivery_id for delivery_id, row_id in recorded}  # one per run
            sql = _sqlite_heartbeats(len(envs), _SQLITE_EXTEND.format(among=",".join("?" * len(of_row))))
            applied = {of_row[r[0]] for r in db.raw(conn, sql, [*rows, lease, now, now, *of_row])}
            moved = [r[0] for r in recorded if r[0] not in applied]
    if moved:  # the long way says how
        among, params = db.among(conn, moved)
        db.raw(conn, f"DELETE FROM {_D.name} WHERE delivery_id {among}", params)
    return [e.delivery_id in applied for e in envs]


_BATCH = "h(delivery_id, digest, board, task_id, run_id, ordinal, attempt, fence, payload_digest)"
_HOLDER_OF_H = (  # ``_HOLDER``, for the batch's row ``h``
    "a.board = h.board AND a.task_id = h.task_id AND a.run_id = h.run_id AND a.state = 'running'"
    " AND a.ordinal = h.ordinal AND a.attempt = h.attempt AND a.fence = h.fence"
    " AND a.payload_digest = h.payload_digest AND a.lease_until >= {now}"
)
_PG_HEARTBEATS = f"""
WITH h AS (
    SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[], %s::int[],
                         %s::int[], %s::bigint[], %s::text[]) AS {_BATCH}
), recorded AS (
    INSERT INTO {_D.name} (delivery_id, assignment_id, kind, digest, created_at)
    SELECT h.delivery_id, a.id, 'heartbeat', h.digest, %s
    FROM h JOIN {T.name} a ON {_HOLDER_OF_H.format(now="%s")}
    ON CONFLICT (delivery_id) DO NOTHING
    RETURNING delivery_id, assignment_id
), extended AS (
    UPDATE {T.name} a SET lease_until = %s, updated_at = %s
    FROM h JOIN recorded r ON r.delivery_id = h.delivery_id
    WHERE a.id = r.assignment_id AND {_HOLDER_OF_H.format(now="%s")}
    RETURNING r.delivery_id
)
SELECT r.delivery_id, e.delivery_id IS NOT NULL FROM recorded r LEFT JOIN extended e USING (delivery_id)
"""
_SQLITE_RECORD = f"""
INSERT INTO {_D.name} (delivery_id, assignment_id, kind, digest, created_at)
SELECT h.delivery_id, a.id, 'heartbeat', h.digest, ?
FROM h JOIN {T.name} a ON {_HOLDER_OF_H.format(now="?")}
WHERE true ON CONFLICT (delivery_id) DO NOTHING
RETURNING delivery_id, assignment_id
"""
_SQLITE_EXTEND = f"""
UPDATE {T.name} AS a SET lease_until = ?, updated_at = ?
FROM h WHERE {_HOLDER_OF_H.format(now="?")} AND a.id IN ({{among}})
RETURNING id
"""


@functools.lru_cache(maxsize=128)
def _sqlite_heartbeats(n: int, statement: str) -> str:
    """``statement`` over a batch of ``n`` heartbeats (``h``: ``VALUES``, SQLite 3.33+)."""
    values = ",".join(["(?,?,?,?,?,?,?,?,?)"] * n)
    return f"WITH {_BATCH} AS (VALUES {values}) {statement}"


def accept_result(s: Session | Connection, env: Envelope, *, now: float) -> Literal["applied", "duplicate"]:
    """Store the worker's result; the row moves to ``result`` until the board has it.

    The holder that delivered the row's result may deliver it again under a new
    delivery id (a retry after a lost answer): ``duplicate``, recorded; other
    content is a ``DeliveryConflict``.
    """
    assert env.result is not None
    conn = db.connection_of(s)
    row, digest = _admit(conn, env, "result", now)
    if digest is None:
        return "duplicate"
    result_digest = validate.sha256(env.result)
    if row.result_digest is not None:
        if row.result_digest != result_digest:
            raise DeliveryConflict(f"payload: row {row.id} already has a different result")
        _record_delivery(conn, row.id, env, "result", digest, now)
        return "duplicate"
    _apply(conn, _STORE_RESULT, env, now, new_result=env.result, new_result_digest=result_digest)
    _audit(conn, row.id, env, EventKind.RESULT, RowState.RESULT.value, row.attempt, now)  # then children's
    lineage.retire_children(conn, [row.id], now, actor=audit.by_worker(env.worker_ordinal))
    _record_delivery(conn, row.id, env, "result", digest, now)
    return "applied"


def release(
    s: Session | Connection, env: Envelope, *, max_attempts: int, now: float
) -> Literal["reoffered", "lease_failed", "duplicate"]:
    """The holder hands its run back: re-offered at once (``attempt+1``), or ``lease_failed`` at the last.

    Only the current holder (running, live lease, same attempt and fence) may
    release. Its replay stays a ``duplicate`` until the run is granted again
    under a newer fence; after that the old fence is refused like any other.
    """
    conn = db.connection_of(s)
    row, digest = _admit(conn, env, "release", now)
    if digest is None:
        return "duplicate"
    if row.state != RUNNING:  # a row holding a result is the results pass's now
        raise StaleHolder(f"state: stale holder refused: row {row.id} is {row.state}, not running")
    last = row.attempt >= max_attempts
    to = RowState.LEASE_FAILED.value if last else RowState.ASSIGNED.value
    attempt = row.attempt if last else row.attempt + 1
    _apply(conn, _HAND_BACK, env, now, new_state=to, new_attempt=attempt)
    _audit(conn, row.id, env, EventKind.RELEASE, to, attempt, now)  # before its children's: the trail chains
    lineage.retire_children(conn, [row.id], now, actor=audit.by_worker(env.worker_ordinal))
    _record_delivery(conn, row.id, env, "release", digest, now)
    return "lease_failed" if last else "reoffered"


def _admit(conn: Connection, env: Envelope, kind: str, now: float) -> tuple[Held, str | None]:
    """Check before replay: lock the run's row, check the sender's authority, then the delivery id.

    Returns the locked row and the envelope's digest, or ``None`` for a replay
    (``duplicate``). Authority, in order:
    - ``running``: the holder of the current attempt, fence and live lease;
    - a row holding a result (``result``, or terminal with its digest kept):
      the fence that delivered it, for its own replays and its result again;
    - a row its holder released: that fence, for the replay of its release,
      until a newer fence is granted.
    Anyone else is refused as a ``StaleHolder`` naming the first field that
    differs, before the delivery id is looked at, so nothing from a stale fence
    is ever recorded or called a duplicate.

    Locking first makes a concurrent replay wait for the delivery being applied
    and then find it: ``duplicate`` on every backend (PostgreSQL ``FOR UPDATE``;
    SQLite's ``BEGIN IMMEDIATE`` already serialises writers). So the delivery is
    read by a statement of its own, after the lock: one joined to the locking
    read would see PostgreSQL's snapshot from before the wait.
    """
    found = _BY_IDENTITY.run(conn, {"board": env.board, "task_id": env.task_id, "run_id": env.run_id}).rows
    if not found:
        if not _ANY_ON_BOARD.run(conn, {"board": env.board}).rows:
            raise NotFound(f"board: unknown board {env.board!r}")
        raise NotFound(f"task_id/run_id: no assignment for {env.board}/{env.task_id} run {env.run_id}")
    row = Held._make(found[0])
    digest = env.digest()
    if row.state == RUNNING:
        _check_holder(row, env, now, lease=True)
    elif row.result_digest is not None:
        _check_holder(row, env, now, lease=False)
    elif kind == "release" and row.fence == env.fence and _known(conn, env) == ("release", digest):
        return row, None
    else:
        _stale("state", f"row {row.id} is {row.state}, not running")
    known = _known(conn, env)
    if known is None:
        return row, digest
    if known != (kind, digest):
        raise DeliveryConflict(f"delivery_id: {env.delivery_id!r} was already used with other content")
    return row, None


def _known(conn: Connection, env: Envelope) -> tuple[str, str] | None:
    """The kind and digest of the delivery recorded under the envelope's id, if any."""
    known = _DELIVERY.run(conn, {"delivery_id": env.delivery_id}).rows
    return (known[0][0], known[0][1]) if known else None


def _check_holder(row: Held, env: Envelope, now: float, *, lease: bool) -> None:
    checks = [
        ("worker_ordinal", row.ordinal == env.worker_ordinal, f"the run is on ordinal {row.ordinal}"),
        ("attempt", row.attempt == env.attempt, f"current attempt is {row.attempt}"),
        ("fence", row.fence == env.fence, f"current fence is {row.fence}"),
        ("payload_digest", row.payload_digest == env.payload_digest, "does not match the assignment"),
        ("lease", not lease or (row.lease_until or 0) >= now, f"the lease ended at {row.lease_until}"),
    ]
    for field, ok, why in checks:
        if not ok:
            _stale(field, why)


def _stale(field: str, why: str) -> NoReturn:
    raise StaleHolder(f"{field}: stale holder refused: {why}")


def _apply(conn: Connection, stmt: db.Prepared, env: Envelope, now: float, **values: Any) -> None:
    """The holder's write (a statement guarded by ``_HOLDER``); ``LostRace`` if it matched nothing."""
    if stmt.run(conn, {**_holder(env, now), **values}).rowcount != 1:
        raise LostRace(f"{env.board}/{env.task_id} run {env.run_id} changed concurrently")


def _holder(env: Envelope, now: float) -> dict[str, Any]:
    """The parameters of ``_HOLDER``."""
    return {
        "h_board": env.board,
        "h_task_id": env.task_id,
        "h_run_id": env.run_id,
        "h_ordinal": env.worker_ordinal,
        "h_attempt": env.attempt,
        "h_fence": env.fence,
        "h_payload_digest": env.payload_digest,
        "now": now,
    }


def _record_delivery(
    conn: Connection, row_id: int, env: Envelope, kind: str, digest: str, now: float
) -> None:
    values = {
        "delivery_id": env.delivery_id,
        "assignment_id": row_id,
        "kind": kind,
        "digest": digest,
        "created_at": now,
    }
    if not _RECORD[conn.dialect.name].run(conn, values).rows:
        raise TransientError(f"delivery_id: {env.delivery_id!r} is being delivered concurrently; retry")


def _audit(
    conn: Connection, row_id: int, env: Envelope, kind: EventKind, to: str, attempt: int, now: float
) -> None:
    """The holder's transition, as one audit event in its transaction.

    Like every event, it carries the row as the transition left it (``to``, ``attempt``;
    the fence stays the holder's), so a row's trail replays to its state.
    """
    actor, detail = audit.by_worker(env.worker_ordinal), f"delivery {env.delivery_id}"
    event = audit.Event(row_id, kind, actor, RUNNING, to, attempt, env.fence, detail)
    audit.append(conn, [event], now=now)
