"""The operator console at ``/ui``, in ``poolctl serve``'s process (docs/design.md, "Console").

Server-rendered pages (Jinja2, autoescaped) whose live parts are fragments that
htmx polls and swaps in place, without a reload: the overview (the numbers of
``poolctl status --json``, from the same ``poolkeeper.status.snapshot``, plus
each ordinal's row, quarantined rows and lease failures), a row (identity,
digests, errors, children, its audit history as a timeline), rows by state,
and a board (tasks, runs, their rows). Every asset ships in the package
(``static/``): no CDN, no build step.

Actions are a confirmation page (GET) and a form (POST) checked by
``console_auth`` before anything changes: requeue and abandon a row, cancel
and unblock a board task, each the same function ``poolctl`` calls. After one,
the browser is sent back to the page it acted on (POST, redirect, GET). Bad
input or a refusal is one page with one sentence, never a traceback.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote

import redis
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from board import open_board
from core import validate
from core.errors import InvalidInput, NotFound, PoolError, ProtocolError, TransientError
from core.settings import Settings
from poolkeeper.server import console_views as views
from poolkeeper.server.console_auth import CSRF_FIELD, ConsoleAuth
from poolkeeper.status import redis_reader
from store import PoolStore

log = logging.getLogger("poolkeeper.console")
POLL_SECONDS = 2
HEADERS = {
    # htmx runs from our own file with eval and its inline indicator styles off (base.html)
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer makes browsers send "Origin: null" on our own forms
    "Cache-Control": "no-store",
}
ROW_ACTIONS = ("requeue", "abandon")
TASK_ACTIONS = ("cancel", "unblock")
DONE = {
    "requeue": "Requeued: backoff and quarantine cleared; the next scan retries the row.",
    "abandon": "Abandoned: the run is parked on the board and the row is stale; its ordinal is free.",
    "cancel": "Cancelled: the task is done on the board and its live row, if any, is stale.",
    "unblock": "Unblocked: the task is ready again; its next claim gets a new run id.",
}
# What any path segment, query parameter or form field may hold: no control character (a NUL, an
# escape, a line break: nothing a console page takes, and never echoed back raw) and no lone
# surrogate, within a length. A form's free text (an abandon reason) may hold tabs and line breaks.
MAX_PARAM_CHARS = 500
MAX_FORM_CHARS = 4000
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_FORM_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def install(app: FastAPI, settings: Settings, store: PoolStore) -> None:
    """Mount the console on ``app``: its routes under ``/ui``, its assets under ``/ui/static``."""
    static = resources.files("poolkeeper.server") / "static"
    app.mount("/ui/static", StaticFiles(directory=str(static)), name="console-static")
    app.include_router(router(settings, store))


def router(settings: Settings, store: PoolStore) -> APIRouter:
    ui = APIRouter(prefix="/ui", include_in_schema=False)
    auth = ConsoleAuth(settings.server_secret)
    kanban = open_board(settings)
    client, redis_problem = redis_reader(settings)
    pages = views.Pages(settings, store, kanban, client, redis_problem)

    def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        context.update(
            request=request,
            csrf=auth.csrf(request),
            csrf_field=CSRF_FIELD,
            signed_in=not auth.local_only,
            poll=POLL_SECONDS,
        )
        return HTMLResponse(views.render(template, **context), status, headers=HEADERS)

    def failure(request: Request, status: int, message: str, fragment: bool = False) -> HTMLResponse:
        template = "_message.html" if fragment else "message.html"
        title = "Not found" if status == 404 else "Refused" if status < 500 else "Error"
        return render(request, template, status, title=title, message=message)

    def page(
        request: Request, template: str, build: Callable[[], dict[str, Any]], fragment: bool = False
    ) -> Response:
        """A guarded GET: sign in first; the store's refusals become one sentence, never a traceback."""
        if (why := _input_refusal(request)) is not None:
            return failure(request, 422, why, fragment)
        if not auth.signed_in(request):
            if fragment:  # htmx keeps the last good fragment; console.js says why
                return failure(request, 401, "signed out: sign in again", fragment=True)
            target = quote(request.url.path + ("?" + request.url.query if request.url.query else ""))
            return RedirectResponse(f"/ui/login?next={target}", 303, headers=HEADERS)
        try:
            return render(request, template, **build())
        except Refused as err:
            return failure(request, err.status, str(err), fragment)
        except (PoolError, SQLAlchemyError, redis.RedisError) as err:
            status, message = _classify(err)
            return failure(request, status, message, fragment)

    @ui.get("", response_class=HTMLResponse)
    def overview(request: Request) -> Response:
        return page(request, "overview.html", lambda: pages.overview(time.time()))

    @ui.get("/live/overview", response_class=HTMLResponse)
    def overview_live(request: Request) -> Response:
        return page(request, "_overview.html", lambda: pages.overview(time.time()), fragment=True)

    @ui.get("/rows", response_class=HTMLResponse)
    def rows(request: Request, state: str = "", quarantined: str = "") -> Response:
        return page(request, "rows.html", lambda: pages.rows(state, quarantined == "1", time.time()))

    @ui.get("/rows/{row}", response_class=HTMLResponse)
    def row(request: Request, row: str, done: str = "") -> Response:
        notice = DONE.get(done)
        return page(request, "row.html", lambda: {**pages.row(_row_id(row), time.time()), "notice": notice})

    @ui.get("/live/rows/{row}", response_class=HTMLResponse)
    def row_live(request: Request, row: str) -> Response:
        return page(request, "_row.html", lambda: pages.row(_row_id(row), time.time()), fragment=True)

    @ui.get("/board", response_class=HTMLResponse)
    def board(request: Request, board: str = "", done: str = "") -> Response:
        notice = DONE.get(done)
        return page(request, "board.html", lambda: {**pages.board(board, time.time()), "notice": notice})

    @ui.get("/live/board", response_class=HTMLResponse)
    def board_live(request: Request, board: str = "") -> Response:
        return page(request, "_board.html", lambda: pages.board(board, time.time()), fragment=True)

    # --- signing in ------------------------------------------------------------------

    @ui.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "/ui") -> Response:
        if (why := _input_refusal(request)) is not None:
            return failure(request, 422, why)
        return render(request, "login.html", next=_safe_next(next), message=None, local_only=auth.local_only)

    @ui.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        form = await _form(request)
        if (why := _input_refusal(request, form)) is not None:
            return failure(request, 422, why)
        target = _safe_next(form.get("next", "/ui"))
        why = None if auth.local_only else auth.check_token(form.get("token", ""))
        if why is not None:
            log.warning("console: sign-in refused from %s: %s", _client(request), why)
            context = {"next": target, "message": f"Refused: {why}.", "local_only": False}
            return render(request, "login.html", 401, **context)
        response = RedirectResponse(target, 303, headers=HEADERS)
        if not auth.local_only:
            auth.start_session(request, response)
        return response

    @ui.post("/logout")
    async def logout(request: Request) -> Response:
        form = await _form(request)
        # a checked form, like any other, so no other site signs the operator out; signed out, nothing to end
        if auth.signed_in(request) and (refused := _refused_form(request, form)) is not None:
            return refused
        response = RedirectResponse("/ui/login", 303, headers=HEADERS)
        auth.end_session(response)
        return response

    # --- actions: a confirmation, then a checked POST ------------------------------------

    @ui.get("/rows/{row}/{action}", response_class=HTMLResponse)
    def confirm_row(request: Request, row: str, action: str) -> Response:
        def build() -> dict[str, Any]:
            if action not in ROW_ACTIONS:
                raise Refused(404, f"no action {action!r} on a row; one of {', '.join(ROW_ACTIONS)}")
            return {**pages.row(_row_id(row), time.time()), "action": action}

        return page(request, "confirm_row.html", build)

    @ui.post("/rows/{row}/{action}", response_class=HTMLResponse)
    async def act_on_row(request: Request, row: str, action: str) -> Response:
        form = await _form(request)

        def act() -> str:
            row_id = _row_id(row)
            if action not in ROW_ACTIONS:
                raise Refused(404, f"no action {action!r} on a row")
            pages.act_on_row(action, row_id, form.get("reason", ""), time.time())
            log.warning("console: %s row %d by the operator from %s", action, row_id, _client(request))
            return f"/ui/rows/{row_id}?done={action}"

        return await _acting(request, form, act)

    @ui.get("/board/{board}/tasks/{task}/{action}", response_class=HTMLResponse)
    def confirm_task(request: Request, board: str, task: str, action: str) -> Response:
        def build() -> dict[str, Any]:
            if action not in TASK_ACTIONS:
                raise Refused(404, f"no action {action!r} on a task; one of {', '.join(TASK_ACTIONS)}")
            return {**pages.task(board, task), "action": action}

        return page(request, "confirm_task.html", build)

    @ui.post("/board/{board}/tasks/{task}/{action}", response_class=HTMLResponse)
    async def act_on_task(request: Request, board: str, task: str, action: str) -> Response:
        form = await _form(request)

        def act() -> str:
            if action not in TASK_ACTIONS:
                raise Refused(404, f"no action {action!r} on a task")
            pages.act_on_task(action, board, task, time.time())
            log.warning("console: %s %s/%s by the operator from %s", action, board, task, _client(request))
            return f"/ui/board?board={quote(board)}&done={action}"

        return await _acting(request, form, act)

    @ui.get("/{anything:path}", response_class=HTMLResponse)
    def unknown(request: Request, anything: str) -> Response:
        return page(request, "message.html", lambda: _no_page(anything))

    def _refused_form(request: Request, form: dict[str, str]) -> Response | None:
        """The refusal page of a POST that may not act (bad input, ``console_auth.form_refusal``), or None."""
        if (why := _input_refusal(request, form)) is not None:
            return failure(request, 422, f"{why} Nothing was changed.")
        refusal = auth.form_refusal(request, form)
        if refusal is None:
            return None
        status, why = refusal
        log.warning("console: action refused from %s: %s", _client(request), why)
        return failure(request, status, f"{why[0].upper()}{why[1:]}. Nothing was changed.")

    async def _acting(request: Request, form: dict[str, str], act: Callable[[], str]) -> Response:
        if (refused := _refused_form(request, form)) is not None:
            return refused
        try:
            target = await run_in_threadpool(act)
        except Refused as err:
            return failure(request, err.status, str(err))
        except (PoolError, SQLAlchemyError, redis.RedisError) as err:
            status, message = _classify(err)
            return failure(request, status, message)
        return RedirectResponse(target, 303, headers=HEADERS)

    return ui


def _no_page(path: str) -> dict[str, Any]:
    raise Refused(404, f"the console has no page /ui/{path[:80]}")


def _row_id(raw: str) -> int:
    # ASCII digits only: "²".isdigit() holds but int() refuses it, and int() reads an Arabic-Indic one as 1
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10) or not 1 <= int(raw) <= validate.MAX_ROW_ID:
        raise Refused(404, f"no row {raw[:40]!r}: a row id is a whole number from 1 (see the overview)")
    return int(raw)


def _input_refusal(request: Request, form: dict[str, str] | None = None) -> str | None:
    """Why the request's path, query or form holds what no console page takes (one sentence); None if not."""
    fields = [
        (f"the address's {name}", v, MAX_PARAM_CHARS, _CONTROL) for name, v in request.path_params.items()
    ]
    for key, value in request.query_params.multi_items():
        fields += [("a query parameter's name", key, MAX_PARAM_CHARS, _CONTROL)]
        fields += [(f"the query parameter {validate.label(key, 40)}", value, MAX_PARAM_CHARS, _CONTROL)]
    for key, value in (form or {}).items():
        fields += [("a form field's name", key, MAX_PARAM_CHARS, _CONTROL)]
        fields += [(f"the form field {validate.label(key, 40)}", value, MAX_FORM_CHARS, _FORM_CONTROL)]
    for where, value, longest, forbidden in fields:
        if forbidden.search(value):
            return f"Refused: {where} holds a control character (such as NUL) or a lone surrogate."
        if len(value) > longest:
            return f"Refused: {where} is longer than {longest} characters."
    return None


def _safe_next(target: str) -> str:
    """Only a path of the console itself: never another site (an open redirect)."""
    ok = target.startswith("/ui") and not target.startswith("//") and "\\" not in target
    return target if ok and len(target) <= 500 else "/ui"


async def _form(request: Request) -> dict[str, str]:
    """An url-encoded form; anything else (or bytes that are not UTF-8) reads as an empty one."""
    if not request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        return {}
    try:
        return dict(parse_qsl((await request.body()).decode(), max_num_fields=20))
    except (UnicodeDecodeError, ValueError):
        return {}


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _classify(err: Exception) -> tuple[int, str]:
    if isinstance(err, InvalidInput):
        return 422, f"Refused: {err}. Nothing was changed."
    if isinstance(err, NotFound):
        return 404, f"Not found: {err}."
    if isinstance(err, ProtocolError):
        return 409, f"Refused: {err}. Nothing was changed."
    if isinstance(err, TransientError | redis.RedisError):
        return 503, f"Busy or unreachable: {err}. Try again."
    if isinstance(err, SQLAlchemyError):
        log.error("console: unclassified database error", exc_info=err)
        return 503, "The pool store failed (the server logged it). Try again."
    return 409, f"Refused: {err}."


def plane_gauges(settings: Settings) -> Any:
    """Serve's /metrics collector for each pass's last scan and the queue depth (``tasks.metrics``)."""
    from tasks.metrics import PlaneCollector

    client, _ = redis_reader(settings)
    return PlaneCollector(settings, client)
