"""An example board backend: each task one JSON document in a single SQLite table.

The built-in Kanban keeps boards, tasks and runs in three tables; this keeps a task with its
whole run history in one row of ``item(board, id, doc)``. A board's own row has id ``''``;
a deleted task stays as a tombstone (status ``deleted``) keeping its runs, so a task id added
again never gets a run id it had. Every write is one ``BEGIN IMMEDIATE`` transaction that
replaces a document only if it is still the one read (compare-and-set on the whole text);
SQLite's "locked" is ``TransientError``. ``pyproject.toml`` registers it as the ``jsonboard``
scheme (``jsonboard:///var/lib/board.db?timeout=5``). docs/board-backends.md walks through it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

from board.protocol import BoardTask, Claim, TaskStatus
from core import validate
from core.errors import ConfigError, InvalidInput, NotFound, TransientError, UnusableURL
from core.settings import Settings, default

Doc = dict[str, Any]  # a task: FIELDS, "status", "seq" (its place in line), "runs"
FIELDS = ("title", "body", "assignee", "current_run_id", "lane", "block_reason", "block_kind", "result")
STATUS = "json_extract(doc, '$.status')"
LIVE = f"id <> '' AND {STATUS} <> 'deleted'"  # a task's row, not a board's or a tombstone
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS item (board TEXT NOT NULL, id TEXT NOT NULL,"
    " doc TEXT NOT NULL CHECK (json_valid(doc)), PRIMARY KEY (board, id))",
    f"CREATE INDEX IF NOT EXISTS item_status ON item ({STATUS}, board)",  # running_tasks, claims
    # what each claim request (by its id) claimed, so a retry after a lost answer claims nothing more
    "CREATE TABLE IF NOT EXISTS claim_request (id TEXT PRIMARY KEY, claims TEXT NOT NULL)",
)
RUNS = "item, json_each(item.doc, '$.runs') AS r"  # r.value: [run, assignee, outcome, started, ended]


def open_jsonboard(url: str, settings: Settings) -> JsonBoard:
    """The entry point: ``jsonboard:`` + a file path; ``?timeout=`` seconds to wait for the write lock."""
    parts = urlsplit(url)
    if not parts.path:
        raise UnusableURL("POOL_BOARD_URL: a jsonboard URL names a file (jsonboard:///path/board.db)")
    return JsonBoard(parts.path, float(parse_qs(parts.query).get("timeout", ["5"])[0]))


class JsonBoard:
    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.path, self.timeout = path, timeout

    @contextmanager
    def _tx(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        try:
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                yield conn
                conn.execute("COMMIT")
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.close()
        except sqlite3.OperationalError as err:
            if "locked" in str(err) or "busy" in str(err):
                raise TransientError(f"jsonboard {self.path}: {err}") from None
            raise

    def _read(self, conn: sqlite3.Connection, board: str, task_id: str) -> tuple[str, Doc] | None:
        row = conn.execute(f"SELECT doc FROM item WHERE board = ? AND id = ? AND {LIVE}", (board, task_id))
        raw = row.fetchone()
        return (raw[0], json.loads(raw[0])) if raw else None

    @staticmethod
    def _replace(conn: sqlite3.Connection, board: str, task_id: str, old: str, doc: Doc) -> bool:
        """Write ``doc`` over the task only if its document is still ``old``: one guarded UPDATE."""
        sql = "UPDATE item SET doc = ? WHERE board = ? AND id = ? AND doc = ?"
        return conn.execute(sql, (json.dumps(doc), board, task_id, old)).rowcount == 1

    # --- setting up ------------------------------------------------------------------

    def migrate(self) -> None:
        with self._tx(write=True) as conn:
            for statement in SCHEMA:
                conn.execute(statement)

    def require_creatable(self) -> None:
        if not os.path.isdir(os.path.dirname(os.path.abspath(self.path))):
            raise ConfigError(f"jsonboard {self.path}: its directory does not exist")

    def require_schema(self, *, writable: bool = False) -> None:
        if not os.path.isfile(self.path) or (writable and not os.access(self.path, os.W_OK)):
            raise ConfigError(f"jsonboard {self.path}: no writable board here: run `poolctl init`")
        with closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)) as conn:
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'item'").fetchone():
                raise ConfigError(f"jsonboard {self.path}: no board schema: run `poolctl init`")

    def location(self) -> str:
        return f"jsonboard {self.path}"

    def close(self) -> None:
        """Nothing to let go of: each call has a connection of its own."""

    # --- the maintenance plane's calls -------------------------------------------------

    def list_boards(self, include_archived: bool = False) -> list[str]:
        sql = "SELECT board FROM item WHERE id = '' AND (? OR NOT doc ->> 'archived') ORDER BY board"
        with self._tx() as conn:
            return [b for (b,) in conn.execute(sql, (include_archived,))]

    def running_tasks(self, board: str) -> list[BoardTask]:
        return self.list_tasks(board, TaskStatus.RUNNING)

    def get_task(self, board: str, task_id: str) -> BoardTask | None:
        with self._tx() as conn:
            found = self._read(conn, board, task_id)
        return _task(board, task_id, found[1]) if found else None

    def claim_ready(
        self,
        limit: int,
        *,
        assignee: str,
        lane: str,
        request_id: str | None = None,
        skip_boards: Sequence[str] = (),
    ) -> list[Claim]:
        skipped = " AND board NOT IN (SELECT value FROM json_each(?))"
        sql = (
            f"SELECT board, id, doc FROM item WHERE {STATUS} = 'ready' AND doc ->> 'lane' = ?"
            " AND board NOT IN (SELECT board FROM item WHERE id = '' AND doc ->> 'archived')"
            f"{skipped} ORDER BY doc ->> 'seq' LIMIT ?"
        )
        claims, now = [], time.time()
        with self._tx(write=True) as conn:  # the write lock: no other claimer reads between
            asked = "SELECT claims FROM claim_request WHERE id = ?"
            if request_id and (done := conn.execute(asked, (request_id,)).fetchone()):
                return [Claim(*c) for c in json.loads(done[0])]
            for board, task_id, old in conn.execute(
                sql, (lane, json.dumps(list(skip_boards)), limit)
            ).fetchall():
                doc = json.loads(old)
                run = max((r[0] for r in doc["runs"]), default=0) + 1  # past every run it ever had
                doc.update(status="running", assignee=assignee, current_run_id=run)
                doc.update(block_reason=None, block_kind=None)
                doc["runs"].append([run, assignee, "running", now, None])
                if self._replace(conn, board, task_id, old, doc):
                    claims.append(Claim(board, task_id, run))
            if request_id:
                made = json.dumps([[c.board, c.task_id, c.run_id] for c in claims])
                conn.execute("INSERT INTO claim_request (id, claims) VALUES (?, ?)", (request_id, made))
        return claims

    def block_task(self, board: str, task_id: str, reason: str, kind: str, expected_run_id: int) -> bool:
        return self._end(board, task_id, expected_run_id, "blocked", block_reason=reason, block_kind=kind)

    def complete_task(self, board: str, task_id: str, expected_run_id: int, result: dict[str, Any]) -> bool:
        # the store's own rule for a document (no NUL, no lone surrogate, bounded), as the kit asks
        return self._end(
            board, task_id, expected_run_id, "done", result=json.loads(validate.document("result", result))
        )

    def _end(self, board: str, task_id: str, run: int, status: str, **fields: Any) -> bool:
        """Compare-and-set on the exact run: only a task still running ``run`` moves."""
        with self._tx(write=True) as conn:
            found = self._read(conn, board, task_id)
            if found is None or found[1]["status"] != "running" or found[1]["current_run_id"] != run:
                return False
            old, doc = found
            doc.update(status=status, **fields)
            _close_run(doc, status)
            return self._replace(conn, board, task_id, old, doc)

    # --- operator moves --------------------------------------------------------------

    def add_task(
        self,
        board: str,
        title: str,
        body: str = "",
        *,
        lane: str = default("lane"),
        task_id: str | None = None,
    ) -> str:
        if not title.strip():
            raise InvalidInput("title", "must not be empty")
        task_id = task_id or uuid.uuid4().hex[:12]
        with self._tx(write=True) as conn:
            conn.execute("INSERT OR IGNORE INTO item VALUES (?, '', '{\"archived\": false}')", (board,))
            if self._read(conn, board, task_id):
                raise InvalidInput("task_id", f"{board}/{task_id} already exists")
            # a deleted task's tombstone keeps its runs: their ids are never minted again
            tomb = "SELECT doc ->> 'runs' FROM item WHERE board = ? AND id = ?"
            runs = json.loads((conn.execute(tomb, (board, task_id)).fetchone() or ["[]"])[0])
            seq = conn.execute("SELECT coalesce(max(doc ->> 'seq'), 0) + 1 FROM item").fetchone()[0]
            doc = dict.fromkeys(FIELDS) | dict(title=title, body=body, lane=lane, status="ready")
            doc |= dict(seq=seq, runs=runs)
            conn.execute("INSERT OR REPLACE INTO item VALUES (?, ?, ?)", (board, task_id, json.dumps(doc)))
        return task_id

    def unblock_task(self, board: str, task_id: str) -> BoardTask:
        def unblock(doc: Doc) -> None:
            doc.update(status="ready", block_reason=None, block_kind=None)

        return _task(board, task_id, self._move(board, task_id, {"blocked"}, unblock))

    def cancel_task(self, board: str, task_id: str) -> BoardTask:
        def cancel(doc: Doc) -> None:
            _close_run(doc, "cancelled")
            doc.update(status="done", result={"cancelled": True})

        return _task(board, task_id, self._move(board, task_id, {"ready", "running", "blocked"}, cancel))

    def reassign_task(self, board: str, task_id: str, *, assignee: str, lane: str) -> BoardTask:
        def reassign(doc: Doc) -> None:
            _close_run(doc, "moved")
            doc.update(current_run_id=doc["current_run_id"] + 1, assignee=assignee, lane=lane)
            doc["runs"].append([doc["current_run_id"], assignee, "running", time.time(), None])

        return _task(board, task_id, self._move(board, task_id, {"running"}, reassign))

    def _move(self, board: str, task_id: str, allowed: set[str], change: Callable[[Doc], object]) -> Doc:
        """An operator move: ``change`` the task's document if its status is one of ``allowed``."""
        with self._tx(write=True) as conn:
            found = self._read(conn, board, task_id)
            if found is None:
                raise NotFound(f"{board}/{task_id}: no such task")
            old, doc = found
            if doc["status"] not in allowed:
                raise InvalidInput("status", f"{board}/{task_id} is {doc['status']}")
            change(doc)
            if not self._replace(conn, board, task_id, old, doc):
                raise TransientError(f"{board}/{task_id} changed concurrently; nothing done")
        return doc

    def delete_task(self, board: str, task_id: str) -> None:
        self._move(board, task_id, {s.value for s in TaskStatus}, lambda d: d.update(status="deleted"))

    def archive_board(self, board: str) -> None:
        sql = "UPDATE item SET doc = json_set(doc, '$.archived', json('true')) WHERE board = ? AND id = ''"
        with self._tx(write=True) as conn:
            if conn.execute(sql, (board,)).rowcount != 1:
                raise NotFound(f"{board}: no such board")

    # --- reads -------------------------------------------------------------------------

    def has_board(self, board: str) -> bool:
        with self._tx() as conn:
            found = conn.execute("SELECT 1 FROM item WHERE board = ? AND id = ''", (board,)).fetchone()
        return found is not None

    def list_tasks(
        self, board: str | None = None, status: TaskStatus | None = None, limit: int = 10_000
    ) -> list[BoardTask]:
        sql = (
            f"SELECT board, id, doc FROM item WHERE {LIVE} AND (?1 IS NULL OR board = ?1)"
            f" AND (?2 IS NULL OR {STATUS} = ?2) ORDER BY board, doc ->> 'seq' LIMIT ?3"
        )
        with self._tx() as conn:
            rows = conn.execute(sql, (board, status.value if status else None, limit)).fetchall()
        return [_task(b, i, json.loads(doc)) for b, i, doc in rows]

    def counts_by_status(self) -> dict[str, int]:
        with self._tx() as conn:
            found = dict(conn.execute(f"SELECT {STATUS}, count(*) FROM item WHERE {LIVE} GROUP BY 1"))
        return {s.value: found.get(s.value, 0) for s in TaskStatus}

    def pool_runs(self, assignee: str) -> list[tuple[str, str, int, str]]:
        sql = f"SELECT item.board, item.id, r.value ->> 0, r.value ->> 2 FROM {RUNS} WHERE r.value ->> 1 = ?"
        with self._tx() as conn:
            return list(conn.execute(sql, (assignee,)))

    def list_runs(self, board: str, task_ids: list[str]) -> list[dict[str, Any]]:
        keys = ("task_id", "run_id", "assignee", "outcome", "started_at", "ended_at")
        sql = (
            "SELECT item.id, r.value ->> 0, r.value ->> 1, r.value ->> 2, r.value ->> 3, r.value ->> 4"
            f" FROM {RUNS} WHERE item.board = ? AND item.id IN ({', '.join('?' * len(task_ids))})"
            " ORDER BY item.id, r.value ->> 0"
        )
        with self._tx() as conn:
            return [dict(zip(keys, run, strict=True)) for run in conn.execute(sql, (board, *task_ids))]


def _close_run(doc: Doc, outcome: str) -> None:
    """End the task's current run, if it is still running, with ``outcome``."""
    for run in doc["runs"]:
        if run[0] == doc["current_run_id"] and run[2] == "running":
            run[2], run[4] = outcome, time.time()


def _task(board: str, task_id: str, doc: Doc) -> BoardTask:
    return BoardTask(board, task_id, status=TaskStatus(doc["status"]), **{f: doc[f] for f in FIELDS})
