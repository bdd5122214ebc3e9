"""Child executions: registered under a run's grant, retired with it (docs/design.md, "Lineage").

Ids: a run's execution id is ``run:<row id>`` (row ids are never reused); a
child's is its parent's id + ``/child:`` + 12 random hex digits. So every
descendant of an execution lies in one primary-key range, ``[id + "/child:",
id + "/child;")`` (``descendants``), and ids sort parents first.

Authority:
- only the holder of the run's current grant (running, same attempt, fence and
  owner, lease not ended) registers a child, optionally under one of its live
  children, up to ``max_depth`` levels (past it: ``LineageTooDeep``);
- a child reports (``heartbeat``, ``deliver``) only while it is live and its
  parent's grant is the one it was registered under (``epoch`` = that fence)
  and still current; anything else is ``StaleHolder`` and changes nothing.

Every transition that ends a grant calls ``retire_children`` in its own
transaction: the run's live children turn ``terminal`` (``retired``) with their
bulky receipt compacted, digests kept. A child that delivers its result closes
the same way, and retires its own live descendants. Every write here locks the
run's row first, as the grant-ending transitions do, so they serialise on it.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, cast

from sqlalchemy import (
    Connection,
    Select,
    Table,
    Update,
    and_,
    bindparam,
    exc,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from core import db, shapes, validate
from core.errors import (
    DeliveryConflict,
    InvalidInput,
    LineageLive,
    LineageTooDeep,
    LostRace,
    NotFound,
    StaleHolder,
    TransientError,
)
from store import audit
from store.models import (
    LIVE_CHILD_SQL,
    LIVE_CHILD_STATUSES,
    MAX_LINEAGE_DEPTH,
    Assignment,
    ChildExecution,
    ChildOutcome,
    ChildStatus,
    EventKind,
    RowState,
)

A = Assignment
C = ChildExecution
_LIVE = [s.value for s in LIVE_CHILD_STATUSES]
SUFFIX_HEX = 12
CHILD_ID_RE = re.compile(rf"run:([1-9][0-9]{{0,9}})((?:/child:[0-9a-f]{{{SUFFIX_HEX}}})+)")


def execution_id(row_id: int) -> str:
    """The run's own execution id: the root of its lineage (never stored as a child)."""
    return f"run:{row_id}"


def descendants_range(execution: str) -> tuple[str, str]:
    """``[low, high)`` holding exactly the ids that start with ``execution + "/child:"``."""
    low = execution + "/child:"
    return low, low[:-1] + ";"  # ';' follows ':' bytewise


def in_range(execution: str) -> Any:
    """The primary-key range of ``execution``'s descendants (never a LIKE: an index range probe)."""
    low, high = descendants_range(execution)
    return and_(C.id >= low, C.id < high)


def row_of(child_id: object, field: str = "child_id") -> int:
    """The run a child id belongs to; ``InvalidInput`` unless it is a well-formed child id."""
    if not isinstance(child_id, str) or (m := CHILD_ID_RE.fullmatch(child_id)) is None:
        raise InvalidInput(field, "expected a child execution id, run:<row>/child:<12 hex digits>[/child:…]")
    return int(m.group(1))


# --- what callers send ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """The grant holder's identity: who may register children or report one vanished."""

    row_id: int
    attempt: int
    fence: int
    owner: str

    @classmethod
    def parse(cls, data: object, *, extra: tuple[str, ...] = ()) -> Grant:
        fields = ("row_id", "attempt", "fence", "owner")
        _check_keys(data, fields, extra)
        assert isinstance(data, Mapping)
        return cls(
            row_id=validate.integer("row_id", data["row_id"], *shapes.ROW_ID),
            attempt=validate.integer("attempt", data["attempt"], *shapes.ATTEMPT),
            fence=validate.integer("fence", data["fence"], *shapes.FENCE),
            owner=validate.name("owner", data["owner"], shapes.OWNER_CHARS),
        )


@dataclass(frozen=True)
class Report:
    """What a child sends: its id, the epoch it was registered under, and a receipt or its result."""

    child_id: str
    epoch: int
    document: str | None  # canonical JSON: a heartbeat's optional receipt, or the result

    @classmethod
    def parse(cls, data: object, *, with_result: bool) -> Report:
        key = "payload" if with_result else "receipt"  # a result is required; a receipt optional
        _check_keys(data, ("child_id", "epoch", key) if with_result else ("child_id", "epoch"), (key,))
        assert isinstance(data, Mapping)
        row_of(data["child_id"])
        return cls(
            child_id=data["child_id"],
            epoch=validate.integer("epoch", data["epoch"], *shapes.FENCE),
            document=validate.document(key, data[key]) if key in data else None,
        )


def _check_keys(data: object, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping):
        raise InvalidInput("request", f"expected a JSON object, got {type(data).__name__}")
    for key in required:
        if key not in data:
            raise InvalidInput(key, "missing")
    unknown = set(data) - set(required) - set(optional)
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "unknown field")


@dataclass(frozen=True)
class Child:
    """A registered child: ``token()`` is what its process needs to report."""

    id: str
    row_id: int
    parent_id: str
    epoch: int
    depth: int

    def token(self) -> dict[str, Any]:
        return {"child_id": self.id, "epoch": self.epoch}


# --- the holder's side ----------------------------------------------------------------------------


def register(
    s: Session, grant: Grant, *, under: str | None, max_depth: int, now: float, key: str | None = None
) -> Child:
    """Register a child under the holder's grant, or under one of its live children (depth + 1).

    With a ``key`` the suffix is derived from (grant, parent, key) instead of
    drawn at random, so registering again with the same key under the same
    grant and parent returns the child already registered (whatever its status)
    and writes nothing: a retry after a lost answer does not make a second child.
    """
    validate.integer("max_depth", max_depth, 1, MAX_LINEAGE_DEPTH)
    row = _holder_row(s, grant, now)
    parent_id, depth = execution_id(row.id), 1
    if under is not None:
        if row_of(under, "under") != row.id:
            raise InvalidInput("under", f"{under} is not a child of row {row.id}")
        parent = _child(s, under, "under")
        if parent.status not in _LIVE or parent.epoch != grant.fence:
            _stale("under", f"child {under} is {_status(parent)}; only a live child takes children")
        parent_id, depth = parent.id, parent.depth + 1
    if depth > max_depth:
        raise LineageTooDeep(
            f"under: a child of {parent_id} would be at depth {depth}, past the cap of {max_depth}"
            " (POOL_LINEAGE_MAX_DEPTH); nothing was registered"
        )
    child_id = f"{parent_id}/child:{_suffix(grant, parent_id, key)}"
    child = Child(child_id, row.id, parent_id, grant.fence, depth)
    if key is not None and (known := s.get(C, child_id)) is not None:  # the row lock serialises this
        if known.epoch != grant.fence:  # 48 bits met a child of another grant: never hand it over
            raise TransientError(f"child id {child.id} was taken; register again with another key")
        return child
    values = {
        "id": child.id,
        "row_id": row.id,
        "parent_id": parent_id,
        "status": ChildStatus.REGISTERED.value,
        "epoch": grant.fence,
        "depth": depth,
        "created_at": now,
        "updated_at": now,
    }
    try:
        s.execute(insert(C).values(**values))
    except exc.IntegrityError:  # 48 random bits met a sibling: nothing was written
        raise TransientError(f"child id {child.id} was taken; register again") from None
    return child


def _suffix(grant: Grant, parent_id: str, key: str | None) -> str:
    if key is None:
        return secrets.token_hex(SUFFIX_HEX // 2)
    return validate.sha256(f"{grant.row_id}:{grant.fence}:{parent_id}:{key}")[:SUFFIX_HEX]


def vanished(s: Session, grant: Grant, child_id: str, *, now: float) -> int:
    """The holder lost a live child's worker: it and its live descendants become ``unknown``.

    They are never resumed; an operator reset (``requeue``) discards them.
    Returns how many turned ``unknown``.
    """
    row = _holder_row(s, grant, now)
    if row_of(child_id) != row.id:
        raise InvalidInput("child_id", f"{child_id} is not a child of row {row.id}")
    child = _child(s, child_id)
    if child.status not in _LIVE or child.epoch != grant.fence:
        _stale("status", f"child {child_id} is {_status(child)}, not live under this grant")
    stmt = (
        update(C)
        .where(or_(C.id == child_id, in_range(child_id)), C.status.in_(_LIVE))
        .values(status=ChildStatus.UNKNOWN.value, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(s.execute(stmt).rowcount)  # type: ignore[attr-defined]


def _holder_row(s: Session, grant: Grant, now: float) -> Assignment:
    """Lock the run's row and check that ``grant`` is its current, live grant."""
    row = s.scalar(
        select(A).where(A.id == grant.row_id).with_for_update().execution_options(populate_existing=True)
    )
    if row is None:
        raise NotFound(f"row_id: no row {grant.row_id}")
    checks = [
        ("state", row.state == RowState.RUNNING.value, f"row {row.id} is {row.state}, not running"),
        ("attempt", row.attempt == grant.attempt, f"current attempt is {row.attempt}"),
        ("fence", row.fence == grant.fence, f"current fence is {row.fence}"),
        ("owner", row.owner == grant.owner, "the grant belongs to another worker instance"),
        ("lease", (row.lease_until or 0) >= now, f"the lease ended at {row.lease_until}"),
    ]
    for field, ok, why in checks:
        if not ok:
            _stale(field, why)
    return row


# --- the child's side -----------------------------------------------------------------------------


def heartbeat(s: Session, report: Report, *, now: float) -> Literal["applied"]:
    """The child is alive (``registered`` → ``running``); an optional receipt replaces the last one."""
    row, child = _admit(s, report, now)
    if child.status not in _LIVE:
        _stale("status", f"child {child.id} is {_status(child)}")
    _grant_is_current(row, report.epoch, now)
    receipt = {}
    if report.document is not None:
        receipt = {"receipt": report.document, "receipt_digest": validate.sha256(report.document)}
    _guarded_child(s, report, now, status=ChildStatus.RUNNING.value, updated_at=now, **receipt)
    return "applied"


def deliver(s: Session, report: Report, *, now: float) -> Literal["applied", "duplicate"]:
    """The child's result: it turns ``terminal`` (``done``) and its live descendants retire.

    Only the digest is kept (the receipt is compacted in this transaction). The
    same result again is a ``duplicate`` while the parent's grant is current, and
    refused as stale once it has ended; other content is a ``DeliveryConflict``.
    """
    assert report.document is not None
    row, child = _admit(s, report, now)
    digest = validate.sha256(report.document)
    if child.result_digest is not None:
        if child.result_digest != digest:
            raise DeliveryConflict(f"payload: child {child.id} already delivered a different result")
        _grant_is_current(row, report.epoch, now)
        return "duplicate"
    if child.status not in _LIVE:
        _stale("status", f"child {child.id} is {_status(child)}")
    _grant_is_current(row, report.epoch, now)
    _guarded_child(
        s,
        report,
        now,
        status=ChildStatus.TERMINAL.value,
        outcome=ChildOutcome.DONE.value,
        result_digest=digest,
        receipt=None,
        updated_at=now,
    )
    low, high = descendants_range(child.id)
    s.execute(RETIRE_RANGE, {"low": low, "high": high, "now": now})
    return "applied"


def _admit(s: Session, report: Report, now: float) -> tuple[Assignment, ChildExecution]:
    row = s.scalar(
        select(A)
        .where(A.id == row_of(report.child_id))
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    child = _child(s, report.child_id) if row is not None else None
    if row is None or child is None:
        raise NotFound(f"child_id: no child execution {report.child_id}")
    if child.epoch != report.epoch:
        _stale("epoch", f"child {child.id} was registered under epoch {child.epoch}")
    return row, child


def _grant_is_current(row: Assignment, epoch: int, now: float) -> None:
    if row.state != RowState.RUNNING.value:
        _stale("state", f"parent row {row.id} is {row.state}, not running")
    if row.fence != epoch:
        _stale("fence", f"parent row {row.id} is granted under fence {row.fence} now, not {epoch}")
    if (row.lease_until or 0) < now:
        _stale("lease", f"parent row {row.id}'s lease ended at {row.lease_until}")


def _guarded_child(s: Session, report: Report, now: float, **values: Any) -> None:
    """One UPDATE guarded on the child being live and its parent's grant current and unexpired."""
    grant_current = exists().where(
        A.id == C.row_id,
        A.state == RowState.RUNNING.value,
        A.fence == report.epoch,
        A.lease_until >= now,
    )
    stmt = (
        update(C)
        .where(C.id == report.child_id, C.epoch == report.epoch, C.status.in_(_LIVE), grant_current)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        raise LostRace(f"child {report.child_id} changed concurrently")


def _child(s: Session, child_id: str, field: str = "child_id") -> ChildExecution:
    child = s.get(C, child_id, populate_existing=True)
    if child is None:
        raise NotFound(f"{field}: no child execution {child_id}")
    return child


def _status(child: ChildExecution) -> str:
    return child.status + (f" ({child.outcome})" if child.outcome else "")


def _stale(field: str, why: str) -> NoReturn:
    raise StaleHolder(f"{field}: stale child refused: {why}")


# --- retirement, reset, reading -------------------------------------------------------------------


def retire_children(
    conn: Session | Connection, row_ids: Iterable[int], now: float, *, actor: str = audit.UNATTRIBUTED
) -> int:
    """Turn every live child of these runs ``terminal`` (``retired``), receipts compacted.

    Called by every transition that ends a grant, in its transaction; one
    probe of ``ix_child_executions_row_id`` per run when it has no children,
    and no event. Each run that retired any appends one ``children_retired``
    event (the count in its detail) for ``actor``, the grant's ender.
    Returns how many children retired.
    """
    ids = list(row_ids)
    if not ids:
        return 0
    c = db.connection_of(conn)
    if len(ids) == 1:  # one run's grant: the count is its own, and a row count costs less than rows
        n = RETIRE_RUN.run(c, {"row_id": ids[0], "now": now}).rowcount
        retired = Counter({ids[0]: n} if n else {})
    else:
        among, params = db.among(c, ids)
        sql = RETIRE_RUNS_SQL.format(p=db.placeholder(c), among=among)
        retired = Counter(row_id for (row_id,) in db.raw(c, sql, (now, *params)))
    if retired:
        counts = [(row_id, None, f"{n} child execution(s) retired") for row_id, n in sorted(retired.items())]
        audit.observed(conn, EventKind.CHILDREN_RETIRED, counts, actor=actor, now=now)
    return sum(retired.values())


def _retire_statement(which: Any) -> Update:
    table = cast(Table, C.__table__)
    return (
        table.update()
        .where(which, or_(*[table.c.status == status for status in _LIVE]))  # no IN list: preparable
        .values(
            status=ChildStatus.TERMINAL.value,
            outcome=ChildOutcome.RETIRED.value,
            receipt=None,
            updated_at=bindparam("now"),
        )
    )


# Built once, like expire's statement: every grant's end runs one, and building it per
# call cost more than the index probe itself (bench/lineage_bench.py).
RETIRE_RUN = db.Prepared(_retire_statement(C.row_id == bindparam("row_id")))  # one grant's end
# A batch's, on the driver's cursor (``db.raw``), which runs retired children coming back:
# through the SQL layer, a part of a split batch spent more on its IN list than on the probes.
RETIRE_RUNS_SQL = (
    f"UPDATE {C.__tablename__} SET status = '{ChildStatus.TERMINAL}', outcome = '{ChildOutcome.RETIRED}',"
    f" receipt = NULL, updated_at = {{p}} WHERE row_id {{among}} AND {LIVE_CHILD_SQL} RETURNING row_id"
)
RETIRE_RANGE = _retire_statement(and_(C.id >= bindparam("low"), C.id < bindparam("high")))


def reset(s: Session, row_id: int, *, now: float) -> int:
    """An operator reset of a run: discard its ``unknown`` children; refused while one is live.

    The caller holds the row's lock. Returns how many were discarded.
    """
    refuse_live(s, row_id)
    stmt = (
        update(C)
        .where(C.row_id == row_id, C.status == ChildStatus.UNKNOWN.value)
        .values(
            status=ChildStatus.TERMINAL.value,
            outcome=ChildOutcome.DISCARDED.value,
            receipt=None,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    return int(s.execute(stmt).rowcount)  # type: ignore[attr-defined]


def refuse_live(s: Session, row_id: int) -> None:
    """``LineageLive`` naming the row and its live children while one is ``registered`` or ``running``."""
    live = s.execute(
        select(C.id, C.status).where(C.row_id == row_id, C.status.in_(_LIVE)).order_by(C.id).limit(4)
    ).all()
    if not live:
        return
    counts = dict(
        s.execute(
            select(C.status, func.count()).where(C.row_id == row_id, C.status.in_(_LIVE)).group_by(C.status)
        ).all()
    )
    described = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    named = ", ".join(child_id for child_id, _ in live[:3]) + (", ..." if len(live) > 3 else "")
    raise LineageLive(
        f"row {row_id} has live child executions ({described}): {named}; they retire when its grant ends,"
        " reset it after that"
    )


def descendants(s: Session, execution: str) -> list[ChildExecution]:
    """Every descendant of ``execution`` (``run:<row>`` or a child id), parents first: one range probe."""
    return list(s.scalars(descendants_query(execution)))


def descendants_query(execution: str) -> Select[ChildExecution]:
    return select(C).where(in_range(execution)).order_by(C.id)


def live_count(s: Session) -> int:
    return s.scalar(select(func.count()).select_from(C).where(C.status.in_(_LIVE))) or 0


def tree(s: Session, row_id: int) -> list[dict[str, Any]]:
    """The run's children as nested dicts (``children`` under each), for the operator."""
    nodes: dict[str, dict[str, Any]] = {}
    roots: list[dict[str, Any]] = []
    for c in descendants(s, execution_id(row_id)):  # parents sort before their children
        node: dict[str, Any] = {
            "id": c.id,
            "status": c.status,
            "outcome": c.outcome,
            "epoch": c.epoch,
            "depth": c.depth,
            "receipt_digest": c.receipt_digest,
            "result_digest": c.result_digest,
            "updated_at": c.updated_at,
            "children": [],
        }
        nodes[c.id] = node
        parent = nodes.get(c.parent_id)
        (parent["children"] if parent is not None else roots).append(node)
    return roots
