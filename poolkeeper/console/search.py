"""The console's search, its paged and sortable rows list, and bulk actions on rows (``console_lists``).

- ``/ui/search?q=&page=&events_page=&size=``: rows and audit events that mention the text,
  each list paged on its own;
- ``/ui/rows?state=&quarantined=1&error=&sort=&order=&page=&size=``: the rows list;
- ``/ui/bulk/{requeue,abandon}``: the confirmation of rows ticked (``row=`` each) or of
  all matching a filter (``all=1`` with it), for the operator only; its checked POST acts
  on each row in turn and answers with each row's result;
- ``/ui/bulk/tasks/{unblock,requeue,cancel}?board=``: the same for a board's tasks, ticked
  (``task=`` each) or all in a status (``all=1&status=``).

Included before ``console.ui``, whose catch-all would answer these paths first.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from poolkeeper.console import lists as lists
from poolkeeper.console.pages import (
    ROW_ACTIONS,
    TASK_BULK_ACTIONS,
    AnyScreen,
    CheckedForm,
    OperatorScreen,
    Refused,
    Screen,
    SignedIn,
    _client,
)

log = logging.getLogger("poolkeeper.console")
router = APIRouter(prefix="/ui", include_in_schema=False)


@router.get("/search", response_class=HTMLResponse)
def search(
    screen: SignedIn, q: str = "", page: str = "1", events_page: str = "1", size: str = str(lists.PAGE_SIZE)
) -> Response:
    def build() -> dict[str, Any]:
        rows_page, per_page = lists.paging(page, size)
        events, _ = lists.paging(events_page, size)
        return lists.search(screen.pages, q, rows_page, events, per_page, time.time())

    return screen.page("search.html", build)


@router.get("/rows", response_class=HTMLResponse)
def rows(
    screen: SignedIn,
    state: str = "",
    quarantined: str = "",
    error: str = "",
    sort: str = "id",
    order: str = "asc",
    page: str = "1",
    size: str = str(lists.PAGE_SIZE),
) -> Response:
    def build() -> dict[str, Any]:
        where = lists.row_filter(state, quarantined, error)
        return lists.rows(screen.pages, where, sort, order, *lists.paging(page, size), time.time())

    return screen.page("rows.html", build)


@router.get("/bulk/{action}", response_class=HTMLResponse)
def confirm_bulk(screen: OperatorScreen, action: str) -> Response:
    query = screen.request.query_params
    return _confirm(screen, action, ROW_ACTIONS, lambda: lists.selection(dict(query), query.getlist("row")))


@router.get("/bulk/tasks/{action}", response_class=HTMLResponse)
def confirm_bulk_tasks(screen: OperatorScreen, action: str) -> Response:
    query = screen.request.query_params
    return _confirm(
        screen, action, TASK_BULK_ACTIONS, lambda: lists.task_selection(dict(query), query.getlist("task"))
    )


@router.post("/bulk/{action}", response_class=HTMLResponse)
async def act_in_bulk(screen: AnyScreen, action: str, form: CheckedForm) -> Response:
    def one(row: int, reason: str) -> None:
        screen.pages.act_on_row(action, row, reason, time.time())

    return await _act(screen, action, ROW_ACTIONS, lambda: lists.selection(form, []), one, form)


@router.post("/bulk/tasks/{action}", response_class=HTMLResponse)
async def act_on_tasks_in_bulk(screen: AnyScreen, action: str, form: CheckedForm) -> Response:
    def one(task: str, reason: str) -> None:
        screen.pages.act_on_task(action, form.get("board", ""), task, time.time(), reason)

    def chosen() -> lists.TaskSelection:
        return lists.task_selection(form, [])

    return await _act(screen, action, TASK_BULK_ACTIONS, chosen, one, form)


Chosen = Callable[[], lists.Selection | lists.TaskSelection]


def _confirm(screen: Screen, action: str, known: tuple[str, ...], chosen: Chosen) -> Response:
    """The confirmation of a bulk action: what ``chosen`` names, listed (``confirm_bulk.html``)."""

    def build() -> dict[str, Any]:
        _known(action, known)
        return {**lists.resolve(screen.pages, chosen(), time.time()), "action": action}

    return screen.page("confirm_bulk.html", build)


async def _act(
    screen: Screen,
    action: str,
    known: tuple[str, ...],
    chosen: Chosen,
    one: Callable[[Any, str], None],
    form: dict[str, str],
) -> Response:
    """A confirmed bulk action: what ``chosen`` names again, if its digest is the confirmation's,
    each through ``one``; its per-row or per-task report (``bulk_done.html``)."""

    def build() -> dict[str, Any]:
        _known(action, known)
        confirmed = lists.resolve(screen.pages, chosen(), time.time())
        if form.get("digest") != confirmed["digest"]:
            changed = f"the {confirmed['kind']} this names changed since the confirmation"
            raise Refused(409, f"{changed}: review them again. Nothing was changed")
        results = lists.act(one, action, confirmed["ids"], form.get("reason", ""))
        done = sum(r.done for r in results)
        log.warning(
            "console: bulk %s of %d %s by the operator from %s (reason: %s): %d done, %d refused",
            *(action, len(results), confirmed["kind"], _client(screen.request), form.get("reason", "")),
            *(done, len(results) - done),
        )
        return {**confirmed, "action": action, "results": results, "done": done}

    return await run_in_threadpool(screen.page, "bulk_done.html", build)


def _known(action: str, known: tuple[str, ...]) -> None:
    if action not in known:
        raise Refused(404, f"no bulk action {action[:40]!r}; one of {', '.join(known)}")
