"""The console's search, its paged and sortable rows list, and bulk actions on rows (``console_lists``).

- ``/ui/search?q=&page=&events_page=&size=``: rows and audit events that mention the text,
  each list paged on its own;
- ``/ui/rows?state=&quarantined=1&error=&sort=&order=&page=&size=``: the rows list;
- ``/ui/bulk/{requeue,abandon}``: the confirmation of rows ticked (``row=`` each) or of
  all matching a filter (``all=1`` with it), for the operator only; its checked POST acts
  on each row in turn and answers with each row's result.

Included before ``console.ui``, whose catch-all would answer these paths first.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.
import logging
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from poolkeeper.console import lists as lists
from poolkeeper.console.pages import (
    ROW_ACTIONS,
    AnyScreen,
    CheckedForm,
    OperatorScreen,
    Refused,
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

    def build() -> dict[str, Any]:
        _known(action)
        chosen = lists.selection(dict(query), query.getlist("row"))
        return {**lists.resolve(screen.pages, chosen, time.time()), "action": action}

    return screen.page("confirm_bulk.html", build)


@router.post("/bulk/{action}", response_class=HTMLResponse)
async def act_in_bulk(screen: AnyScreen, action: str, form: CheckedForm) -> Response:
    def build() -> dict[str, Any]:
        _known(action)
        now = time.time()
        confirmed = lists.resolve(screen.pages, lists.selection(form, []), now)
        if form.get("digest") != confirmed["digest"]:
            raise Refused(
                409,
                "the rows this names changed since the confirmation: review them again. Nothing was changed",
            )
        results = lists.act(screen.pages, action, confirmed["ids"], form.get("reason", ""), now)
        done = sum(r.done for r in results)
        log.warning(
            "console: bulk %s of %d row(s) by the operator from %s: %d done, %d refused",
            *(action, len(results), _client(screen.request), done, len(results) - done),
        )
        return {**confirmed, "action": action, "results": results, "done": done}

    return await run_in_threadpool(screen.page, "bulk_done.html", build)


def _known(action: str) -> None:
    if action not in ROW_ACTIONS:
        raise Refused(404, f"no bulk action {action[:40]!r}; one of {', '.join(ROW_ACTIONS)}")
