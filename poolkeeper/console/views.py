"""What each console page shows, read in one short read-only transaction, and the templates that show it.

Every row is turned into a plain dict inside its transaction, so templates
never touch the database. The actions call what ``poolctl`` calls:
``store.transitions.requeue``, ``poolkeeper.operator.abandon`` and ``cancel``,
``Board.unblock_task`` and ``add_task``, ``store.pause``. Each row action is recorded in the row's audit
trail as the operator's (``audit.OPERATOR``), as ``poolctl``'s are.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import redis
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from board import Board, BoardTask, TaskSpec, TaskStatus, add_tasks
from core import shapes, validate
from core.errors import InvalidInput, NotFound
from core.settings import Settings
from poolkeeper import operator
from poolkeeper.events import dispatch_settled, events_for, task_ready
from poolkeeper.status import dispatch_view, row_detail, row_view, snapshot
from store import PoolStore, audit, lineage, pause, queries, transitions
from store import rows as rows_
from store.models import RowState
from store.numbers import WorkerState

log = logging.getLogger("poolkeeper.console")

LIST_LIMIT = 200  # rows or tasks one page lists
ALL_ORDINALS_UP_TO = 256  # a larger pool lists only its held ordinals


def _when(ts: float | None, digits: int = 0) -> str:
    """``ts`` in UTC to the second, or to ``digits`` (at most 6) decimals of it (a row's timeline)."""
    if not ts:
        return "-"
    at = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    fraction = at.strftime(".%f")[: digits + 1] if digits else ""
    return at.strftime("%Y-%m-%d %H:%M:%S") + fraction + " UTC"


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "never"
    delta = now - ts
    words = _span(abs(delta))
    return f"{words} ago" if delta >= 0 else f"in {words}"


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


_ENV = Environment(
    loader=PackageLoader("poolkeeper.console", "templates"),
    autoescape=select_autoescape(default=True),
    undefined=StrictUndefined,  # a misspelt name fails the test that renders it, not silently blank
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters["when"] = _when
_ENV.filters["shown"] = validate.shown  # control characters escaped, as poolctl shows them
_ENV.filters["json"] = lambda value: json.dumps(value, sort_keys=True, ensure_ascii=False)
_ENV.globals["ago"] = _ago


def render(template: str, **context: Any) -> str:
    return _ENV.get_template(template).render(**context)


def worker_counts(numbers: dict[str, Any]) -> dict[str, dict[str, int | None]]:
    """The overview's block: pool workers by state, Celery processes online and gone (None: unknown)."""
    states = [p["state"] for p in numbers["presence"]]
    pool: dict[str, int | None] = {state.value: states.count(state.value) for state in WorkerState}
    found = numbers["processes"]
    online = None if found is None else sum(1 for p in found if p["online"])
    gone = None if found is None else len(found) - (online or 0)
    return {"pool": pool, "celery": {"online": online, "gone": gone}}


class Pages:
    def __init__(
        self,
        settings: Settings,
        store: PoolStore,
        board: Board,
        client: redis.Redis | None,
        redis_problem: str,
    ) -> None:
        self.settings, self.store, self.board = settings, store, board
        self.client, self.redis_problem = client, redis_problem
        self.events = events_for(settings)

    def overview(self, now: float) -> dict[str, Any]:
        numbers = snapshot(
            self.store, self.board, self.settings, self.client, now, redis_error=self.redis_problem
        )
        with self.store.session(readonly=True) as s:
            live = {r.ordinal: row_view(r) for r in queries.live_rows(s)}
            quarantined = [row_view(r) for r in queries.rows(s, quarantined=True, limit=LIST_LIMIT)]
            failed = [row_view(r) for r in queries.rows(s, state=RowState.LEASE_FAILED, limit=LIST_LIMIT)]
        size = self.store.pool_size
        shown = range(size) if size <= ALL_ORDINALS_UP_TO else sorted(live)
        ordinals = [{"ordinal": o, "row": live.get(o)} for o in shown]
        return {
            "numbers": numbers,
            "workers": worker_counts(numbers),
            "ordinals": ordinals,
            "all_ordinals": size <= ALL_ORDINALS_UP_TO,
            "quarantined_rows": quarantined,
            "limit": LIST_LIMIT,
            "lease_failed_rows": failed,
            "now": now,
            "max_attempts": self.store.max_attempts,
        }

    def workers(self, now: float) -> dict[str, Any]:
        """Each ordinal's pool worker and the namespace's Celery workers and beats (``snapshot``)."""
        numbers = snapshot(
            self.store, self.board, self.settings, self.client, now, redis_error=self.redis_problem
        )
        return {"numbers": numbers, "now": now, "namespace": self.settings.namespace}

    def dispatch(self, now: float) -> dict[str, Any]:
        """Whether dispatch is paused, and its pauses and resumes (the pool-wide audit events)."""
        with self.store.session(readonly=True) as s:
            found, boards = pause.read(s), pause.boards(s)
            history = audit.history(s, audit.POOL, limit=LIST_LIMIT)
        return {
            "dispatch": dispatch_view(found, boards, now),
            "boards": self.board.list_boards(),
            "history": history[::-1],
            "now": now,
        }

    def row(self, row_id: int, now: float) -> dict[str, Any]:
        with self.store.session(readonly=True) as s:
            found = rows_.get_row(s, row_id)
            row = row_view(found)
            children = lineage.tree(s, row_id)
            history = audit.history(s, row_id, limit=LIST_LIMIT)
            detail = row_detail(found, history, self.board.get_task(found.board, found.task_id))
        return {
            "row": row,
            "detail": detail,
            "children": children,
            "history": history,
            "now": now,
            "max_attempts": self.store.max_attempts,
        }

    def board_page(self, name: str, now: float, status: TaskStatus | None = None) -> dict[str, Any]:
        """A board's first tasks (in ``status`` only, if given), their runs and rows, and its pause."""
        boards = self.board.list_boards()
        if name and name not in boards:
            raise NotFound(f"{name[: shapes.BOARD_CHARS]}: no such board")
        name = name or (boards[0] if boards else "")
        tasks = self.board.list_tasks(name, status, limit=LIST_LIMIT) if name else []
        ids = [t.id for t in tasks]
        runs: dict[str, list[dict[str, Any]]] = {}
        for run in self.board.list_runs(name, ids):
            runs.setdefault(run["task_id"], []).append(run)
        with self.store.session(readonly=True) as s:
            found = queries.rows_of_tasks(s, name, ids)
            by_run = {(r.task_id, r.run_id): row_view(r) for r in found}
            paused = pause.boards(s).get(name)
        listed = [
            {
                "task": t,
                "runs": [{**run, "row": by_run.get((t.id, run["run_id"]))} for run in runs.get(t.id, [])],
            }
            for t in tasks
        ]
        return {
            "boards": boards,
            "board": name,
            "status_filter": status.value if status else "",  # not "status": the response's own
            "statuses": [s.value for s in TaskStatus],
            "tasks": listed,
            "board_paused": None if paused is None else dispatch_view(paused, {}, now),
            "now": now,
            "limit": LIST_LIMIT,
        }

    def task(self, board: str, task_id: str) -> dict[str, Any]:
        try:
            validate.name("board", board, shapes.BOARD_CHARS)
            validate.name("task", task_id, shapes.TASK_ID_CHARS)
        except InvalidInput:
            raise NotFound(
                f"{board[: shapes.BOARD_CHARS]}/{task_id[: shapes.TASK_ID_CHARS]}: no such task"
            ) from None
        task = self.board.get_task(board, task_id)
        if task is None:
            raise NotFound(f"{board}/{task_id}: no such task")
        return {"task": task}

    # --- actions ---------------------------------------------------------------------

    def act_on_row(self, action: str, row_id: int, reason: str, now: float) -> None:
        if action == "requeue":
            with self.store.session() as s:
                transitions.requeue(s, row_id, now=now, actor=audit.OPERATOR, reason=reason)
        else:
            operator.abandon(self.board, self.store, row_id, reason, now)

    def act_on_dispatch(self, action: str, reason: str, now: float, board: str = "") -> str:
        """Pause (with ``reason``) or resume dispatch, or one board's, as ``poolctl``: the ``pages.DONE``
        key to show."""
        named = board or None
        if action == "pause":
            if named is not None and not self.board.has_board(named):  # a misspelt name pauses nothing
                raise NotFound(f"{validate.label(named)}: no such board")
            with self.store.session() as s:
                paused = pause.pause(s, reason, now=now, actor=audit.OPERATOR, board=named)
            if not paused:
                return "unchanged"
            unsettled = dispatch_settled(self.settings)
            if unsettled:
                log.warning("dispatch paused, but %s", unsettled)
            return "pause-unsettled" if unsettled else "pause-board" if named else "pause"
        with self.store.session() as s:
            resumed = pause.resume(s, now=now, actor=audit.OPERATOR, board=named)
        task_ready(self.events)  # claims resume now, not at the next tick
        return ("resume-board" if named else "resume") if resumed else "unchanged"

    def add_task(self, board: str, title: str, body: str) -> str:
        """A new ready task on ``board`` (the pool's lane), as ``poolctl board add``: its id.

        The board refuses what the pool could not run (an empty title, a body too long or not
        JSON where it looks like it); a dispatch is asked for, so it is claimed at once.
        """
        [task_id] = add_tasks(self.board, board, [TaskSpec(title, body, self.settings.lane)])
        task_ready(self.events)
        return task_id

    def act_on_task(self, action: str, board: str, task_id: str, now: float, reason: str = "") -> None:
        """Cancel, unblock or requeue a board task as ``poolctl board`` does (``reason``: on its row).

        Requeue is the pool's retry of a running task's run (``transitions.requeue`` of its live
        row); the board has no move that runs a ready, blocked or done task again but unblock.
        """
        task = self.task(board, task_id)["task"]  # a name that cannot exist is "no such task"
        if action == "cancel":
            operator.cancel(self.board, self.store, board, task_id, now, reason=reason)
        elif action == "unblock":
            self.board.unblock_task(board, task_id)
            task_ready(self.events)
        else:
            with self.store.session() as s:
                run = task.current_run_id
                row = None if run is None else queries.row_of_run(s, board, task_id, run)
                if task.status is not TaskStatus.RUNNING or row is None:
                    raise InvalidInput("task", _not_requeued(task))
                transitions.requeue(s, row, now=now, actor=audit.OPERATOR, reason=reason)


def _not_requeued(task: BoardTask) -> str:
    why = {
        TaskStatus.READY: "it is ready already: the pool claims it at its turn",
        TaskStatus.BLOCKED: "it is blocked: unblock it to run it again",
        TaskStatus.DONE: "it is done: the board has no move out of done (add it again as a new task)",
        TaskStatus.RUNNING: "its run has no live pool row yet",
    }[task.status]
    return f"{task.board}/{task.id} is not requeued: {why}"
