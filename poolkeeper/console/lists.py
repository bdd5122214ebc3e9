"""What the console's search, paged rows list and bulk actions read and do (docs/design.md, "Console").

Every list is one page of an explicit size, with where it stands ("1-50 of 312",
"of more than 10,000", or "more…"), never cut silently. Every query is bounded: a
page is a ``LIMIT``, a count stops at ``COUNT_UPTO``, and the audit trail is searched
only among its newest ``AUDIT_WINDOW`` events (a primary-key range, no index added).

A bulk action names its rows: those ticked on a page (at most ``PAGE_SIZES[-1]``), or
every row matching a filter (the first ``BULK_CAP`` by id); or, on a board, its tasks
ticked, or all of them in a status (the first ``BULK_CAP``, oldest first). The
confirmation lists them and carries their digest; the POST resolves the same selection
again and acts only if it still names the same ones. Each then goes through
``Pages.act_on_row`` (what ``poolctl requeue`` and ``abandon`` call) or
``Pages.act_on_task`` (``poolctl board unblock`` and ``cancel``, and a task's requeue:
its running run's row requeued), one by one, so each is its own guarded move with the
operator's reason; a refusal is its own result, never its neighbours'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from board import BoardTask, TaskStatus, search_tasks
from board.protocol import SEARCH_LIMIT, SEARCH_MIN_CHARS
from core import shapes, validate
from core.errors import InvalidInput, PoolError
from poolkeeper import operator
from poolkeeper.console.views import Pages
from poolkeeper.status import row_view
from store import audit, queries
from store.models import Assignment, RowState

log = logging.getLogger("poolkeeper.console")
PAGE_SIZES = (25, 50, 100, 200)
PAGE_SIZE = 50
COUNT_UPTO = queries.SEARCH_COUNT_UPTO  # a list counts this far, then says "more than"
AUDIT_WINDOW = 50_000  # search reads the newest this many audit events
BULK_CAP = 1000  # rows one bulk action acts on at most
BULK_LISTED = 100  # rows a confirmation shows in full (every id is listed)


@dataclass(frozen=True)
class Paging:
    """One page of a list: which, how big, and what is beside it (``total`` None: not counted)."""

    page: int
    size: int
    shown: int
    total: int | None  # counted up to COUNT_UPTO
    more: bool  # a next page exists
    query: dict[str, str] = field(default_factory=dict)  # the list's other parameters, for the links
    param: str = "page"  # the query parameter that names this list's page

    @property
    def first(self) -> int:
        return (self.page - 1) * self.size + 1 if self.shown else 0

    @property
    def last(self) -> int:
        return self.first + self.shown - 1 if self.shown else 0

    @property
    def more_than(self) -> bool:
        return self.total is not None and self.total >= COUNT_UPTO

    def href(self, page: int) -> str:
        return "?" + urlencode({**self.query, self.param: page, "size": self.size})


def paging(page: str, size: str) -> tuple[int, int]:
    """The page number and size of a list's ``?page=&size=`` (422 for anything else)."""
    if size not in {str(n) for n in PAGE_SIZES}:
        raise InvalidInput("size", f"a page holds one of {', '.join(map(str, PAGE_SIZES))} rows")
    pages = COUNT_UPTO // int(size) + 1
    if not (page.isascii() and page.isdigit() and len(page) <= 6 and 1 <= int(page) <= pages):
        raise InvalidInput("page", f"a page is a whole number from 1 to {pages}")
    return int(page), int(size)


def row_filter(state: str, quarantined: str, error: str) -> queries.RowFilter:
    want = None
    if state:
        try:
            want = RowState(state)
        except ValueError:
            names = ", ".join(s.value for s in RowState)
            raise InvalidInput("state", f"unknown state {state[:40]!r}; one of {names}") from None
    return queries.RowFilter(want, quarantined == "1", error.strip())


def filter_query(where: queries.RowFilter) -> dict[str, str]:
    """The filter as the rows list's query parameters (only those set)."""
    found = {
        "state": where.state.value if where.state else "",
        "quarantined": "1" if where.quarantined else "",
    }
    return {k: v for k, v in {**found, "error": where.error}.items() if v}


def rows(
    pages: Pages, where: queries.RowFilter, sort: str, order: str, page: int, size: int, now: float
) -> dict[str, Any]:
    """The rows list: one page of the rows matching ``where``, sorted, and how many match."""
    if sort not in queries.ROW_SORTS or order not in ("asc", "desc"):
        raise InvalidInput("sort", f"sort by one of {', '.join(queries.ROW_SORTS)}, order asc or desc")
    with pages.store.session(readonly=True) as s:
        listed = queries.rows(
            s, where=where, sort=sort, descending=order == "desc", offset=(page - 1) * size, limit=size
        )
        found = [row_view(r) for r in listed]
        total = queries.count_upto(s, where.where(select(Assignment.id)), COUNT_UPTO)
    query = {**filter_query(where), "sort": sort, "order": order}
    sorts = {
        name: "?"
        + urlencode({**query, "sort": name, "order": "desc" if (sort, order) == (name, "asc") else "asc"})
        for name in queries.ROW_SORTS
    }
    shown = Paging(page, size, len(found), total, page * size < total, query)
    return {
        "rows": found,
        "where": where,
        "filter": filter_query(where),
        "bulk_query": urlencode({**filter_query(where), "all": "1"}),
        "sort": sort,
        "order": order,
        "sorts": sorts,
        "paging": shown,
        "bulk_cap": BULK_CAP,
        "now": now,
    }


def search(pages: Pages, text: str, page: int, events_page: int, size: int, now: float) -> dict[str, Any]:
    """Board tasks (by title or body, through the board's index), rows (by id, run, task id, owner,
    board, last error, or a task found: its payload) and audit events (by detail) holding ``text``.

    Rows and events each have their own page (``page``, ``events_page``) of ``size``; tasks are the
    newest ``SEARCH_LIMIT``. A board that cannot search, is away, or text too short for its index
    leaves the tasks out with one sentence saying why (``tasks_note``); rows and events still answer.
    """
    if not text.strip():
        empty = Paging(1, size, 0, 0, False)
        return {
            **{"q": "", "rows": [], "events": [], "rows_paging": empty, "events_paging": empty},
            **{"min_chars": SEARCH_MIN_CHARS, "now": now},
        }
    # Rows and events are searched by any text a query parameter holds (an error pasted whole, a
    # one-digit row id); what the task index cannot take (too short, too long) leaves only the
    # tasks out (``_tasks``).
    text = validate.text("q", text).strip()
    tasks, note = _tasks(pages, text)
    offset, events_offset = (page - 1) * size, (events_page - 1) * size
    with pages.store.session(readonly=True) as s:
        runs = [(t.board, t.id) for t in tasks]
        found, total = queries.search_rows(s, text, offset=offset, limit=size, tasks=runs)
        listed = [row_view(r) for r in found]
        events = audit.search(s, text, window=AUDIT_WINDOW, offset=events_offset, limit=size + 1)
    rows_query, events_query = {"q": text, "events_page": str(events_page)}, {"q": text, "page": str(page)}
    return {
        "q": text,
        "tasks": tasks,
        "tasks_note": note,
        "tasks_limit": SEARCH_LIMIT,
        "rows": listed,
        "events": events[:size],
        "rows_paging": Paging(page, size, len(listed), total, offset + len(listed) < total, rows_query),
        "events_paging": Paging(
            events_page, size, len(events[:size]), None, len(events) > size, events_query, "events_page"
        ),
        "audit_window": AUDIT_WINDOW,
        "now": now,
    }


def _tasks(pages: Pages, text: str) -> tuple[list[BoardTask], str]:
    """The board's tasks holding ``text``, or none and the one sentence saying why none were looked for."""
    try:
        return search_tasks(pages.board, text), ""
    except InvalidInput as err:
        return [], f"Tasks are not searched: {err.problem}."
    except PoolError as err:  # the board cannot search, or cannot be read right now
        return [], f"Tasks are not searched: {err.line()}."


# --- bulk actions ------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The rows a bulk action names: ticked by id (``ids``), or all matching ``where``."""

    ids: tuple[int, ...] = ()
    where: queries.RowFilter | None = None

    def fields(self) -> dict[str, str]:
        """The selection as the confirmation form's hidden fields (read back by ``selection``)."""
        if self.where is None:
            return {"rows": ",".join(map(str, self.ids))}
        return {**filter_query(self.where), "all": "1"}


@dataclass(frozen=True)
class TaskSelection:
    """The tasks of one board a bulk action names: ticked by id (``ids``), or all (``every``) in
    ``status`` (any status when None)."""

    board: str
    ids: tuple[str, ...] = ()
    every: bool = False
    status: TaskStatus | None = None

    def fields(self) -> dict[str, str]:
        """The selection as the confirmation form's hidden fields (read back by ``task_selection``)."""
        if not self.every:
            return {"board": self.board, "tasks": ",".join(self.ids)}
        return {"board": self.board, "all": "1", **({"status": self.status.value} if self.status else {})}


def selection(fields: dict[str, str], ticked: list[str]) -> Selection:
    """The selection of a query (``row=`` each, or ``all=1`` with the filter) or of a confirmation form."""
    if fields.get("all") == "1":
        return Selection(
            where=row_filter(fields.get("state", ""), fields.get("quarantined", ""), fields.get("error", ""))
        )
    raw = _ticked("rows", "row", ticked or [r for r in fields.get("rows", "").split(",") if r])
    if not all(
        r.isascii() and r.isdigit() and len(r) <= 10 and 1 <= int(r) <= validate.MAX_ROW_ID for r in raw
    ):
        raise InvalidInput("rows", "a row id is a whole number from 1")
    return Selection(ids=tuple(sorted({int(r) for r in raw})))


def task_selection(fields: dict[str, str], ticked: list[str]) -> TaskSelection:
    """The tasks of a query (``board=`` and ``task=`` each, or ``all=1`` with a ``status``) or of a
    confirmation form."""
    board = validate.name("board", fields.get("board", ""), shapes.BOARD_CHARS)
    if fields.get("all") == "1":
        return TaskSelection(board, every=True, status=task_status(fields.get("status", "")))
    raw = _ticked("tasks", "task", ticked or [t for t in fields.get("tasks", "").split(",") if t])
    ids = {validate.name("task", t, shapes.TASK_ID_CHARS) for t in raw}
    return TaskSelection(board, ids=tuple(sorted(ids)))


def task_status(raw: str) -> TaskStatus | None:
    """A board page's ``?status=`` (empty: any), or 422 naming the statuses."""
    try:
        return TaskStatus(raw) if raw else None
    except ValueError:
        names = ", ".join(s.value for s in TaskStatus)
        raise InvalidInput("status", f"unknown status {raw[:40]!r}; one of {names}") from None


def _ticked(field: str, noun: str, raw: list[str]) -> list[str]:
    if not raw:
        raise InvalidInput(field, f"no {noun} selected: tick {field} on its list, or act on all matching")
    if len(raw) > PAGE_SIZES[-1]:
        raise InvalidInput(field, f"at most {PAGE_SIZES[-1]} {field} by hand; act on all matching for more")
    return raw


def resolve(pages: Pages, chosen: Selection | TaskSelection, now: float) -> dict[str, Any]:
    """The confirmation: what the selection names (at most ``BULK_CAP``), how many match, their digest."""
    if isinstance(chosen, TaskSelection):
        ids, listed, matching, more_than = _tasks_named(pages, chosen)
    else:
        ids, listed, matching, more_than = _rows_named(pages, chosen)
    return {
        "kind": "tasks" if isinstance(chosen, TaskSelection) else "rows",
        "ids": ids,
        "listed": listed,
        "matching": matching,
        "more_than": more_than,
        "capped": more_than or matching > len(ids),
        "digest": validate.sha256(",".join(map(str, [*chosen.fields().values(), *ids]))),
        "fields": chosen.fields(),
        "where": chosen.where if isinstance(chosen, Selection) else None,
        "chosen": chosen,
        "bulk_cap": BULK_CAP,
        "now": now,
    }


Named = tuple[list[Any], list[dict[str, Any]], int, bool]  # ids, the first listed, matching, more than


def _rows_named(pages: Pages, chosen: Selection) -> Named:
    with pages.store.session(readonly=True) as s:
        if chosen.where is None:
            ids, matching = list(chosen.ids), len(chosen.ids)
        else:
            ids = queries.row_ids(s, chosen.where, limit=BULK_CAP)
            matching = queries.count_upto(s, chosen.where.where(select(Assignment.id)), COUNT_UPTO)
        shown = ids[:BULK_LISTED]
        found = {r.id: row_view(r) for r in s.scalars(select(Assignment).where(Assignment.id.in_(shown)))}
    return ids, [found.get(i, {"id": i, "missing": True}) for i in shown], matching, matching >= COUNT_UPTO


def _tasks_named(pages: Pages, chosen: TaskSelection) -> Named:
    """The ticked tasks, or the board's first ``BULK_CAP`` in the status (oldest first); more than
    that is counted as "more than" (the board counts no further)."""
    if not chosen.every:
        ids = list(chosen.ids)
        shown = [_task_view(pages.board.get_task(chosen.board, t), t) for t in ids[:BULK_LISTED]]
        return ids, shown, len(ids), False
    matching = pages.board.list_tasks(chosen.board, chosen.status, limit=BULK_CAP + 1)
    tasks = matching[:BULK_CAP]
    listed = [_task_view(t, t.id) for t in tasks[:BULK_LISTED]]
    return [t.id for t in tasks], listed, len(tasks), len(matching) > BULK_CAP


def _task_view(task: BoardTask | None, task_id: str) -> dict[str, Any]:
    if task is None:
        return {"id": task_id, "missing": True}
    return {
        "id": task.id,
        "title": task.title,
        "status": task.status.value,
        "run": task.current_run_id,
        "block_reason": task.block_reason,
    }


@dataclass(frozen=True)
class Result:
    id: int | str  # the row's id, or the task's
    done: bool
    why: str = ""  # the refusal, one sentence


def act(one: Callable[[Any, str], None], action: str, ids: list[Any], reason: str) -> list[Result]:
    """``one(id, reason)`` for each row or task in turn (``Pages.act_on_row``, ``Pages.act_on_task``,
    what ``poolctl`` calls); a refusal is its own result, never its neighbours'."""
    reason = reason.strip()
    if not reason or len(reason) > operator.MAX_REASON_CHARS:
        raise InvalidInput(
            "reason", f"a bulk action needs a reason of 1 to {operator.MAX_REASON_CHARS} characters"
        )
    results = []
    for key in ids:
        try:
            one(key, reason)
        except PoolError as err:
            results.append(Result(key, False, str(err)))
        except SQLAlchemyError as err:
            log.error("console: bulk %s of %s failed in the store", action, key, exc_info=err)
            results.append(Result(key, False, "the pool store failed (the server logged it)"))
        else:
            results.append(Result(key, True))
    return results
