"""The built-in Kanban board on any SQLAlchemy URL (SQLite by default).

Other writers (a UI, a CLI, crons) share its database, so each call is one
short transaction and "busy"/"locked" surfaces as ``TransientError``.
``claim_ready`` is atomic: ``BEGIN IMMEDIATE`` on SQLite, ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL, and a guarded UPDATE per task either way, so two
claimers never take the same task. Each task is claimed in its own savepoint:
one that cannot be claimed is skipped and reported once, never failing the
others. Run ids never repeat for a (board, task id), even after the task was
deleted and added again: a claim mints past every run the ``runs`` table holds.
A stored result that cannot be decoded reads as ``None`` (reported once), so
one task's bad data never makes its board or its status unreadable.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    column,
    delete,
    exc,
    func,
    insert,
    literal_column,
    or_,
    select,
    table,
    tuple_,
    update,
)
from sqlalchemy.engine import Row

from board.protocol import SEARCH_LIMIT, BoardTask, Claim, TaskSpec, TaskStatus, archived, search_text
from board.schema import boards, claim_requests, metadata, runs, tasks
from core import db, logs, shapes, validate
from core.errors import InvalidInput, NotFound, TransientError, Unsupported
from core.settings import default

T = tasks.c
CR = claim_requests.c
CLAIM_MEMORY_SECONDS = 24 * 3600.0  # how long a claim request id is remembered
log = logging.getLogger("poolkeeper.board")


class KanbanBoard:
    def __init__(self, url: str, engine: Engine | None = None) -> None:
        self.engine = engine or db.make_engine(url)
        self._reported: OrderedDict[str, str] = OrderedDict()  # task -> last problem logged

    def migrate(self) -> None:
        db.migrate(self.engine, "board", metadata, "board")

    def require_schema(self, *, writable: bool = False) -> None:
        """``ConfigError`` unless ``migrate`` has set this board up (creates nothing)."""
        db.require_schema(self.engine, "board", "board", writable=writable)

    def require_creatable(self) -> None:
        db.require_creatable(self.engine, "board")

    def location(self) -> str:
        return logs.mask_url(self.engine.url)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self, *, readonly: bool = False) -> Iterator[Connection]:
        engine = db.readonly(self.engine) if readonly else self.engine
        with db.transient_errors("board", engine.url), engine.begin() as conn:
            yield conn

    # --- the Board protocol ----------------------------------------------

    def list_boards(self, include_archived: bool = False) -> list[str]:
        stmt = select(boards.c.name).order_by(boards.c.name)
        if not include_archived:
            stmt = stmt.where(boards.c.archived.is_(False))
        with self._tx(readonly=True) as conn:
            return list(conn.scalars(stmt))

    def running_tasks(self, board: str) -> list[BoardTask]:
        stmt = select(tasks).where(T.board == board, T.status == TaskStatus.RUNNING.value)
        with self._tx(readonly=True) as conn:
            return [self._task(r) for r in conn.execute(stmt)]

    def get_task(self, board: str, task_id: str) -> BoardTask | None:
        with self._tx(readonly=True) as conn:
            row = conn.execute(select(tasks).where(T.board == board, T.id == task_id)).first()
        return self._task(row) if row is not None else None

    def claim_ready(
        self,
        limit: int,
        *,
        assignee: str,
        lane: str,
        request_id: str | None = None,
        skip_boards: Sequence[str] = (),
    ) -> list[Claim]:
        validate.integer("limit", limit, 0, validate.INT32_MAX)
        if request_id is not None:
            validate.name("request_id", request_id, shapes.REQUEST_ID_CHARS)
        if len(skip_boards) > shapes.SKIP_BOARDS:
            raise InvalidInput("skip_boards", f"at most {shapes.SKIP_BOARDS} boards")
        now = time.time()
        with self._tx() as conn:
            if request_id is not None:
                made = conn.scalar(select(CR.claims).where(CR.request_id == request_id))
                if made is not None:  # a retry: the claims that request made, and nothing more
                    return [Claim(board, task_id, int(run_id)) for board, task_id, run_id in json.loads(made)]
            claims = self._claim(conn, limit, assignee, lane, now, skip_boards)
            if request_id is not None:
                self._remember(conn, request_id, claims, now)
        return claims

    def _claim(
        self, conn: Connection, limit: int, assignee: str, lane: str, now: float, skip_boards: Sequence[str]
    ) -> list[Claim]:
        claims: list[Claim] = []
        skipped: list[tuple[str, str]] = []  # tasks this claim could not take: not asked again
        while len(claims) < limit:
            candidates = (
                select(T.board, T.id, T.current_run_id)
                .join(boards, boards.c.name == T.board)
                .where(T.status == TaskStatus.READY.value, T.lane == lane, boards.c.archived.is_(False))
                .order_by(T.created_at, T.board, T.id)
                .limit(limit - len(claims))
                .with_for_update(of=tasks, skip_locked=True)
            )
            if skipped:
                candidates = candidates.where(tuple_(T.board, T.id).not_in(skipped))
            if skip_boards:
                candidates = candidates.where(T.board.not_in(list(skip_boards)))
            batch = conn.execute(candidates).all()
            if not batch:
                break
            for board, task_id, current in batch:
                try:
                    with conn.begin_nested():
                        run_id = self._claim_one(conn, board, task_id, current, assignee, now)
                except (exc.IntegrityError, exc.DataError, InvalidInput) as err:
                    self._report(board, task_id, f"cannot be claimed, left ready: {_short(err)}")
                    run_id = None
                if run_id is None:
                    skipped.append((board, task_id))
                else:
                    claims.append(Claim(board, task_id, run_id))
        return claims

    @staticmethod
    def _remember(conn: Connection, request_id: str, claims: list[Claim], now: float) -> None:
        """Record what ``request_id`` claimed, in the claim's transaction; prune old records."""
        expired = select(CR.request_id).where(CR.created_at < now - CLAIM_MEMORY_SECONDS).limit(100)
        conn.execute(delete(claim_requests).where(CR.request_id.in_(expired)))
        made = validate.canonical_json([[c.board, c.task_id, c.run_id] for c in claims])
        try:
            with conn.begin_nested():
                conn.execute(
                    insert(claim_requests).values(request_id=request_id, claims=made, created_at=now)
                )
        except exc.IntegrityError:  # the same request made concurrently (PostgreSQL): this one claims nothing
            raise TransientError(f"claim request {request_id} is under way concurrently; try again") from None

    def _claim_one(
        self, conn: Connection, board: str, task_id: str, current: int | None, assignee: str, now: float
    ) -> int | None:
        """Claim one ready task with a run id past every run it ever had; None if it moved."""
        high = conn.scalar(
            select(func.max(runs.c.run_id)).where(runs.c.board == board, runs.c.task_id == task_id)
        )
        run_id = validate.integer("run_id", max(current or 0, high or 0) + 1, *shapes.RUN_ID)
        claimed = conn.execute(
            update(tasks)
            .where(
                T.board == board,
                T.id == task_id,
                T.status == TaskStatus.READY.value,
                T.current_run_id.is_not_distinct_from(current),
            )
            .values(
                status=TaskStatus.RUNNING.value,
                assignee=assignee,
                current_run_id=run_id,
                block_reason=None,
                block_kind=None,
                updated_at=now,
            )
        ).rowcount
        if claimed != 1:
            return None  # another writer moved it between select and update
        self._open_run(conn, board, task_id, run_id, assignee, now)
        return run_id

    def block_task(self, board: str, task_id: str, reason: str, kind: str, expected_run_id: int) -> bool:
        return self._end_run(
            board, task_id, expected_run_id, TaskStatus.BLOCKED, block_reason=reason, block_kind=kind
        )

    def complete_task(self, board: str, task_id: str, expected_run_id: int, result: dict[str, Any]) -> bool:
        return self._end_run(
            board, task_id, expected_run_id, TaskStatus.DONE, result=validate.document("result", result)
        )

    def _end_run(self, board: str, task_id: str, run_id: int, status: TaskStatus, **values: Any) -> bool:
        validate.integer("expected_run_id", run_id, *shapes.RUN_ID)
        now = time.time()
        with self._tx() as conn:
            changed = conn.execute(
                update(tasks)
                .where(
                    T.board == board,
                    T.id == task_id,
                    T.current_run_id == run_id,
                    T.status == TaskStatus.RUNNING.value,
                )
                .values(status=status.value, updated_at=now, **values)
            ).rowcount
            if changed == 1:
                self._close_run(conn, board, task_id, run_id, status.value, now)
            return bool(changed == 1)

    @staticmethod
    def _open_run(
        conn: Connection, board: str, task_id: str, run_id: int, assignee: str | None, now: float
    ) -> None:
        conn.execute(
            insert(runs).values(
                board=board,
                task_id=task_id,
                run_id=run_id,
                assignee=assignee,
                outcome="running",
                started_at=now,
            )
        )

    @staticmethod
    def _close_run(
        conn: Connection, board: str, task_id: str, run_id: int | None, outcome: str, now: float
    ) -> None:
        if run_id is not None:
            conn.execute(
                update(runs)
                .where(
                    runs.c.board == board,
                    runs.c.task_id == task_id,
                    runs.c.run_id == run_id,
                    runs.c.outcome == "running",
                )
                .values(outcome=outcome, ended_at=now)
            )

    # --- operator moves ------------------------------------------------------

    def add_task(
        self,
        board: str,
        title: str,
        body: str = "",
        *,
        lane: str = default("lane"),
        task_id: str | None = None,
    ) -> str:
        [added] = self.add_tasks(board, [TaskSpec(title, body, lane, task_id)])
        return added

    def add_tasks(self, board: str, specs: Sequence[TaskSpec]) -> list[str]:
        """Every task of ``specs``, ready, in one transaction, or none: the first one that is refused
        (bad input, an id the board or the batch already has) names its place in the batch. An
        archived board takes none (the pool never claims from it, so they would wait for ever)."""
        validate.name("board", board, shapes.BOARD_CHARS)
        rows: list[dict[str, Any]] = []
        ids: set[str] = set()
        now = time.time()
        for n, spec in enumerate(specs):
            where = "" if len(specs) == 1 else f"task {n + 1}: "
            try:
                task_id = _checked(board, spec)
            except InvalidInput as err:
                raise InvalidInput(err.field, f"{where}{err.problem}") from None
            if task_id in ids:
                raise InvalidInput("task_id", f"{where}{board}/{task_id} is in the batch twice")
            ids.add(task_id)
            rows.append(
                {
                    "board": board,
                    "id": task_id,
                    "title": spec.title,
                    "body": spec.body,
                    "status": TaskStatus.READY.value,
                    "lane": spec.lane,
                    "ready_at": now,
                    "created_at": now,
                    "updated_at": now,
                }
            )
        if not rows:
            return []
        with self._tx() as conn:
            # the engine's own dialect module (loaded with it): postgresql's costs a SQLite `board add` ~20 ms
            dialect = importlib.import_module(f"sqlalchemy.dialects.{conn.dialect.name}")
            new_board = dialect.insert(boards).values(name=board, created_at=now)
            conn.execute(new_board.on_conflict_do_nothing(index_elements=["name"]))
            there = select(T.id).where(T.board == board, T.id.in_(sorted(ids))).limit(1).scalar_subquery()
            is_archived, taken = conn.execute(
                select(boards.c.archived, there).where(boards.c.name == board)
            ).one()
            if is_archived:  # read in the add's own transaction: an archive cannot slip in between
                raise archived(board)
            if taken is not None:
                raise InvalidInput("task_id", f"{board}/{taken} already exists")
            conn.execute(insert(tasks), rows)
        return [str(row["id"]) for row in rows]

    def unblock_task(self, board: str, task_id: str) -> BoardTask:
        """A parked task goes back to ``ready`` (its next claim gets a new run id)."""
        return self._operator_move(
            board,
            task_id,
            {TaskStatus.BLOCKED},
            status=TaskStatus.READY.value,
            block_reason=None,
            block_kind=None,
            readied=True,
        )

    def cancel_task(self, board: str, task_id: str) -> BoardTask:
        """End a task for good: it is ``done`` with result ``{"cancelled": true}``."""
        return self._operator_move(
            board,
            task_id,
            {TaskStatus.READY, TaskStatus.RUNNING, TaskStatus.BLOCKED},
            status=TaskStatus.DONE.value,
            result='{"cancelled":true}',
            run_outcome="cancelled",
        )

    def reassign_task(self, board: str, task_id: str, *, assignee: str, lane: str) -> BoardTask:
        """Hand a running task to someone else: a new run starts, the old one has moved on."""
        validate.name("lane", lane, shapes.LANE_CHARS)
        return self._operator_move(
            board,
            task_id,
            {TaskStatus.RUNNING},
            assignee=assignee,
            lane=lane,
            current_run_id=T.current_run_id + 1,
            run_outcome="moved",
            readied=True,
        )

    def _operator_move(
        self,
        board: str,
        task_id: str,
        allowed: set[TaskStatus],
        run_outcome: str | None = None,
        readied: bool = False,
        **values: Any,
    ) -> BoardTask:
        """One operator move; ``readied``: the task's wait starts again now (``ready_at``)."""
        now = time.time()
        if readied:
            values["ready_at"] = now
        with self._tx() as conn:
            row = conn.execute(select(tasks).where(T.board == board, T.id == task_id)).first()
            if row is None:
                raise NotFound(f"{board}/{task_id}: no such task")
            if TaskStatus(row.status) not in allowed:
                names = ", ".join(sorted(s.value for s in allowed))
                raise InvalidInput("status", f"{board}/{task_id} is {row.status}; expected {names}")
            changed = conn.execute(
                update(tasks)
                .where(
                    T.board == board,
                    T.id == task_id,
                    T.status == row.status,
                    T.current_run_id.is_not_distinct_from(row.current_run_id),
                )
                .values(updated_at=now, **values)
            ).rowcount
            if changed != 1:  # another writer moved it between our read and our write
                raise TransientError(f"{board}/{task_id} changed concurrently; nothing done, try again")
            if run_outcome is not None:
                self._close_run(conn, board, task_id, row.current_run_id, run_outcome, now)
            new = conn.execute(select(tasks).where(T.board == board, T.id == task_id)).one()
            if values.get("current_run_id") is not None:
                self._open_run(conn, board, task_id, new.current_run_id, new.assignee, now)
        return self._task(new)

    def delete_task(self, board: str, task_id: str) -> None:
        with self._tx() as conn:
            if conn.execute(tasks.delete().where(T.board == board, T.id == task_id)).rowcount != 1:
                raise NotFound(f"{board}/{task_id}: no such task")

    def archive_board(self, board: str) -> None:
        with self._tx() as conn:
            if conn.execute(update(boards).where(boards.c.name == board).values(archived=True)).rowcount != 1:
                raise NotFound(f"{board}: no such board")

    def list_tasks(
        self, board: str | None = None, status: TaskStatus | None = None, limit: int = 10_000
    ) -> list[BoardTask]:
        validate.integer("limit", limit, 1, validate.INT32_MAX)
        stmt = select(tasks).order_by(T.board, T.created_at, T.id).limit(limit)
        if board is not None:
            stmt = stmt.where(T.board == board)
        if status is not None:
            stmt = stmt.where(T.status == status.value)
        with self._tx(readonly=True) as conn:
            return [self._task(r) for r in conn.execute(stmt)]

    def counts_by_status(self) -> dict[str, int]:
        counts = {s.value: 0 for s in TaskStatus}
        with self._tx(readonly=True) as conn:
            for status, n in conn.execute(select(T.status, func.count()).group_by(T.status)):
                counts[status] = n
        return counts

    def pool_runs(self, assignee: str) -> list[tuple[str, str, int, str]]:
        """Every run ever claimed as ``assignee``: (board, task_id, run_id, outcome)."""
        stmt = select(runs.c.board, runs.c.task_id, runs.c.run_id, runs.c.outcome).where(
            runs.c.assignee == assignee
        )
        with self._tx(readonly=True) as conn:
            return [(b, t, int(r), o) for b, t, r, o in conn.execute(stmt)]

    def list_runs(self, board: str, task_ids: list[str]) -> list[dict[str, Any]]:
        """Every run of these tasks, oldest first, as dicts of the ``runs`` columns."""
        if not task_ids:
            return []
        r = runs.c
        stmt = (
            select(r.task_id, r.run_id, r.assignee, r.outcome, r.started_at, r.ended_at)
            .where(r.board == board, r.task_id.in_(task_ids))
            .order_by(r.task_id, r.run_id)
        )
        with self._tx(readonly=True) as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

    def search_tasks(self, text: str, *, limit: int = SEARCH_LIMIT) -> list[BoardTask]:
        """At most ``limit`` tasks whose title or body holds ``text`` (any case), newest first.

        Through board migration 0004's index: on SQLite its FTS5 trigram table, asked for ``text``
        as one quoted phrase (every character literal, a ``"`` doubled, so no text is query syntax);
        on PostgreSQL ``ILIKE`` with every wildcard escaped, which the ``pg_trgm`` indexes serve.
        Either answers "holds the text as a substring, any case" and stops at ``limit``.
        """
        text = search_text(text)
        validate.integer("limit", limit, 1, SEARCH_LIMIT)
        with self._tx(readonly=True) as conn:
            stmt = _search(conn.dialect.name, text).limit(limit)
            return [self._task(r) for r in conn.execute(stmt)]

    def has_board(self, board: str) -> bool:
        with self._tx(readonly=True) as conn:
            return conn.scalar(select(boards.c.name).where(boards.c.name == board)) is not None

    # --- reading tasks ----------------------------------------------------------

    def _task(self, row: Row[Any]) -> BoardTask:
        return BoardTask(
            board=row.board,
            id=row.id,
            title=row.title,
            body=row.body,
            status=TaskStatus(row.status),
            assignee=row.assignee,
            current_run_id=row.current_run_id,
            lane=row.lane,
            block_reason=row.block_reason,
            block_kind=row.block_kind,
            result=self._result(row),
            ready_at=row.ready_at,
        )

    def _result(self, row: Row[Any]) -> dict[str, Any] | None:
        """The stored result, decoded for this task alone: unreadable data reads as None, reported once."""
        if not row.result:
            return None
        try:
            value = json.loads(row.result)
        except (ValueError, RecursionError) as err:
            self._report(row.board, row.id, f"stored result is unreadable, read as none: {_short(err)}")
            return None
        if not isinstance(value, dict):
            self._report(row.board, row.id, "stored result is not a JSON object, read as none")
            return None
        return value

    def _report(self, board: str, task_id: str, problem: str) -> None:
        """Log a task's problem once per distinct detail, with bounded memory."""
        key = f"{board}/{task_id}"
        if self._reported.get(key) != problem:
            log.error("board task %s: %s", key, problem)
        self._reported[key] = problem
        self._reported.move_to_end(key)
        while len(self._reported) > REPORTED_MAX:
            self._reported.popitem(last=False)


REPORTED_MAX = 4096
INDEX = table("tasks_search", column("rowid"))  # SQLite's FTS5 table of board migration 0004


def _checked(board: str, spec: TaskSpec) -> str:
    """The task's id (made up when not given), once its fields are what the pool can run."""
    task_id = validate.name("task_id", spec.task_id or uuid.uuid4().hex[:12], shapes.TASK_ID_CHARS)
    validate.name("lane", spec.lane, shapes.LANE_CHARS)
    if not validate.text("title", spec.title).strip():
        raise InvalidInput("title", "must not be empty")
    # Materialize's own check, at the largest run id: a task the pool would park is refused now.
    validate.run_payload(
        board=board, task_id=task_id, run_id=shapes.RUN_ID.high, title=spec.title, body=spec.body
    )
    return task_id


def _search(dialect: str, text: str) -> Select[Any]:
    """The tasks holding ``text`` through the dialect's index, newest first (no limit yet)."""
    if dialect == "sqlite":
        phrase = '"' + text.replace('"', '""') + '"'
        return (
            select(tasks)
            .join(INDEX, literal_column("tasks.rowid") == INDEX.c.rowid)
            .where(literal_column("tasks_search").op("MATCH")(phrase))
            .order_by(INDEX.c.rowid.desc())
        )
    if dialect == "postgresql":
        pattern = "%" + text.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"
        held = or_(T.title.ilike(pattern, escape="/"), T.body.ilike(pattern, escape="/"))
        return select(tasks).where(held).order_by(T.created_at.desc())
    raise Unsupported(f"the Kanban on {dialect} has no task index to search")


def _short(err: BaseException) -> str:
    """An error's first line, bounded: database errors carry the whole statement."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
