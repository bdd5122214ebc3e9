"""The operator console at ``/ui``, in ``poolctl serve``'s process (docs/design.md, "Console").

Server-rendered pages (Jinja2, autoescaped) whose live parts are fragments that
htmx polls and swaps in place, without a reload: the overview (the numbers of
``poolctl status --json``, from the same ``poolkeeper.status.snapshot``, plus
each ordinal's row, quarantined rows and lease failures), the workers (each
ordinal's pool worker, the Celery workers and beats by their beacons), a row (identity,
digests, errors, children, its audit history as a timeline),
and a board (tasks, runs, their rows); search, the paged rows list and bulk actions
are ``console_search``'s. Every asset ships in the package
(``static/``): no CDN, no build step.

Actions are a confirmation page (GET) and a form (POST) checked by
``console_auth`` before anything changes: requeue and abandon a row, cancel
and unblock a board task, each the same function ``poolctl`` calls. After one,
the browser is sent back to the page it acted on (POST, redirect, GET). Pausing
and resuming dispatch (``/ui/dispatch``, a reason required to pause) are
``store.pause``'s, as ``poolctl pause`` and ``resume``. Bad
input or a refusal is one page with one sentence, never a traceback.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.
import inspect
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qsl, quote

import redis
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from board import open_board
from core import validate
from core.errors import InvalidInput, PoolError, ProtocolError
from core.settings import Settings
from poolkeeper.console import lists as console_lists
from poolkeeper.console import trends as console_trends
from poolkeeper.console import views as views
from poolkeeper.console.auth import CSRF_FIELD, VIEWER_REFUSED, ConsoleAuth, SignInRefused
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
TASK_BULK_ACTIONS = ("unblock", "requeue", "cancel")  # on many board tasks (``console_search``)
DISPATCH_ACTIONS = ("pause", "resume")
DONE = {
    "pause": "Paused: no new claims from the board; every claimed run goes on.",
    "pause-unsettled": "Paused, but a dispatch round in flight could not be seen to end (the console's"
    " log says why): its claims may still land. Every claimed run goes on.",
    "resume": "Resumed: the next tick claims ready tasks again.",
    "pause-board": "Paused this board alone: no new claims from it; the other boards go on, and every"
    " claimed run goes on.",
    "resume-board": "Resumed this board: the next tick claims its ready tasks again.",
    "add": "Added: the task is ready, and a dispatch was asked for.",
    "unchanged": "Unchanged: dispatch was already as asked.",
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


class Answer(Exception):
    """A dependency's answer in place of the route's: sign in first, or bad input (``install`` sends it)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass(frozen=True)
class Console:
    """What every console request shares, on ``app.state.console``: the session checks and the pages."""

    auth: ConsoleAuth
    pages: views.Pages


class Screen:
    """One request's view of the console: renders its pages, fragments (``/ui/live/...``) and refusals."""

    def __init__(self, request: Request, console: Console) -> None:
        self.request, self.auth, self.pages = request, console.auth, console.pages
        self.fragment = request.url.path.startswith("/ui/live/")  # htmx keeps the last good one

    def render(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        role = self.auth.role(self.request)
        context.update(
            request=self.request,
            csrf=self.auth.csrf(self.request),
            csrf_field=CSRF_FIELD,
            signed_in=not self.auth.local_only,
            poll=POLL_SECONDS,
            role=role,
            can_act=role == "operator",  # a viewer's pages show no action (and its forms are refused)
        )
        return HTMLResponse(views.render(template, **context), status, headers=HEADERS)

    def failure(self, status: int, message: str) -> HTMLResponse:
        template = "_message.html" if self.fragment else "message.html"
        title = "Not found" if status == 404 else "Refused" if status < 500 else "Error"
        return self.render(template, status, title=title, message=message)

    def page(self, template: str, build: Callable[[], dict[str, Any]]) -> Response:
        """A page whose refusals (the store's, ``Refused``) become one sentence, never a traceback."""
        try:
            return self.render(template, **build())
        except Refused as err:
            return self.failure(err.status, str(err))
        except (PoolError, SQLAlchemyError, redis.RedisError) as err:
            return self.failure(*_classify(err))

    async def act(self, act: Callable[[], str]) -> Response:
        """Run a checked form's action in the thread pool; then back to the page it acted on."""
        try:
            target = await run_in_threadpool(act)
        except Refused as err:
            return self.failure(err.status, str(err))
        except (PoolError, SQLAlchemyError, redis.RedisError) as err:
            return self.failure(*_classify(err))
        return RedirectResponse(target, 303, headers=HEADERS)

    def refused_form(self, form: dict[str, str], *, acts: bool = True) -> Response | None:
        """The refusal page of a POST that may not act (bad input, ``console_auth.form_refusal``), or None."""
        if (why := _input_refusal(self.request, form)) is not None:
            return self.failure(422, f"{why} Nothing was changed.")
        refusal = self.auth.form_refusal(self.request, form, acts=acts)
        if refusal is None:
            return None
        status, why = refusal
        log.warning("console: action refused from %s: %s", _client(self.request), why)
        return self.failure(status, f"{why[0].upper()}{why[1:]}. Nothing was changed.")


async def _screen(request: Request) -> Screen:
    return Screen(request, request.app.state.console)


AnyScreen = Annotated[Screen, Depends(_screen)]


async def _visitor(screen: AnyScreen) -> Screen:
    """Anyone, signed in or not, whose address holds nothing a console page refuses."""
    if (why := _input_refusal(screen.request)) is not None:
        raise Answer(screen.failure(422, why))
    return screen


Visitor = Annotated[Screen, Depends(_visitor)]


async def _signed_in(screen: Visitor) -> Screen:
    """The operator, signed in (or a --local-only server); else to the sign-in form and back."""
    request = screen.request
    if not screen.auth.signed_in(request):
        if screen.fragment:  # htmx keeps the last good fragment; console.js says why
            raise Answer(screen.failure(401, "signed out: sign in again"))
        target = quote(request.url.path + ("?" + request.url.query if request.url.query else ""))
        raise Answer(RedirectResponse(f"/ui/login?next={target}", 303, headers=HEADERS))
    return screen


SignedIn = Annotated[Screen, Depends(_signed_in)]


async def _operator(screen: SignedIn) -> Screen:
    """The operator, signed in: a viewer reads every page but no action's (403, one sentence)."""
    if screen.auth.role(screen.request) != "operator":
        raise Answer(screen.failure(403, f"{VIEWER_REFUSED[0].upper()}{VIEWER_REFUSED[1:]}."))
    return screen


OperatorScreen = Annotated[Screen, Depends(_operator)]


async def _posted(request: Request) -> dict[str, str]:
    return await _form(request)


Form = Annotated[dict[str, str], Depends(_posted)]


async def _checked(screen: AnyScreen, form: Form) -> dict[str, str]:
    """A form that may act: a live session, its check value, this site's ``Origin`` (else one page)."""
    if (refused := screen.refused_form(form)) is not None:
        raise Answer(refused)
    return form


CheckedForm = Annotated[dict[str, str], Depends(_checked)]
ui = APIRouter(prefix="/ui", include_in_schema=False)


def install(app: FastAPI, settings: Settings, store: PoolStore) -> None:
    """Mount the console on ``app``: its routes under ``/ui``, its assets under ``/ui/static``."""
    client, redis_problem = redis_reader(settings)
    pages = views.Pages(settings, store, open_board(settings), client, redis_problem)
    app.state.console = Console(ConsoleAuth(settings.server_secret, store), pages)
    static = resources.files("poolkeeper.console") / "static"
    app.mount("/ui/static", StaticFiles(directory=str(static)), name="console-static")
    app.include_router(ui)
    app.add_exception_handler(Answer, _answer)


def _answer(_: Request, err: Exception) -> Response:
    assert isinstance(err, Answer)
    return err.response


def page(name: str, build: Callable[..., dict[str, Any]], path: str | None = None) -> None:
    """Register a console page and its live partial at once: ``GET /ui{path}`` renders
    ``{name}.html`` (with the notice a ``?done=`` names), ``GET /ui/live{path}`` renders
    ``_{name}.html``, which the page's htmx polls. ``path`` is ``/{name}`` unless given; the
    page's own parameters (path and query) are ``build``'s after the screen. A new page is
    its template, its partial, and one line here."""
    path = f"/{name}" if path is None else path
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    own = list(inspect.signature(build).parameters.values())[1:]  # after the screen
    signed_in = inspect.Parameter("screen", kind, annotation=SignedIn)
    done = inspect.Parameter("done", inspect.Parameter.KEYWORD_ONLY, default="", annotation=str)

    def full(screen: SignedIn, done: str = "", **params: Any) -> Response:
        notice = DONE.get(done)
        return screen.page(f"{name}.html", lambda: {**build(screen, **params), "notice": notice})

    def live(screen: SignedIn, **params: Any) -> Response:
        return screen.page(f"_{name}.html", lambda: build(screen, **params))

    # What FastAPI reads for the parameters: the screen, the page's own, and (the page only) done
    full.__signature__ = inspect.Signature([signed_in, *own, done], return_annotation=Response)  # type: ignore[attr-defined]
    live.__signature__ = inspect.Signature([signed_in, *own], return_annotation=Response)  # type: ignore[attr-defined]
    full.__name__, live.__name__ = name, f"{name}_live"
    ui.get(path, response_class=HTMLResponse)(full)
    ui.get(f"/live{path or '/' + name}", response_class=HTMLResponse)(live)


def _trends(screen: Screen, window: str = "hour") -> dict[str, Any]:
    return console_trends.page(screen.pages, window, time.time())


def _row(screen: Screen, row: str) -> dict[str, Any]:
    return screen.pages.row(_row_id(row), time.time())


def _board(screen: Screen, board: str = "", status: str = "") -> dict[str, Any]:
    return screen.pages.board_page(board, time.time(), console_lists.task_status(status))


# One line per page (its template, ``_``-prefixed for its live partial, and what it shows)
page("overview", lambda screen: screen.pages.overview(time.time()), path="")
page("workers", lambda screen: screen.pages.workers(time.time()))
page("row", _row, path="/rows/{row}")
page("board", _board)
page("trends", _trends)


@ui.get("/board/{board}")
def board_at_path(board: str) -> Response:
    """``/ui/board/NAME``, the address an operator types: the board page is ``/ui/board?board=NAME``."""
    return RedirectResponse(f"/ui/board?board={quote(board, safe='')}", 308, headers=HEADERS)


@ui.get("/dispatch", response_class=HTMLResponse)
def dispatch(screen: SignedIn, done: str = "") -> Response:
    notice = DONE.get(done)
    return screen.page("dispatch.html", lambda: {**screen.pages.dispatch(time.time()), "notice": notice})


@ui.post("/dispatch/{action}", response_class=HTMLResponse)
async def act_on_dispatch(screen: AnyScreen, action: str, form: CheckedForm) -> Response:
    request = screen.request

    def act() -> str:
        if action not in DISPATCH_ACTIONS:
            raise Refused(404, f"no action {action!r} on dispatch; one of {', '.join(DISPATCH_ACTIONS)}")
        board = form.get("board", "")
        done = screen.pages.act_on_dispatch(action, form.get("reason", ""), time.time(), board)
        what = f"dispatch of board {board}" if board else "dispatch"
        log.warning("console: %s %s by the operator from %s", what, action, _client(request))
        return f"/ui/board?board={quote(board)}&done={done}" if board else f"/ui/dispatch?done={done}"

    return await screen.act(act)


# --- signing in ------------------------------------------------------------------


@ui.get("/login", response_class=HTMLResponse)
def login_form(screen: Visitor, next: str = "/ui") -> Response:
    local_only = screen.auth.local_only
    return screen.render("login.html", next=_safe_next(next), message=None, local_only=local_only)


@ui.post("/login", response_class=HTMLResponse)
async def login(screen: AnyScreen, form: Form) -> Response:
    request = screen.request
    if (why := _input_refusal(request, form)) is not None:
        return screen.failure(422, why)
    target = _safe_next(form.get("next", "/ui"))
    auth = screen.auth
    response = RedirectResponse(target, 303, headers=HEADERS)
    if auth.local_only:
        return response
    try:
        role = auth.role_of(form.get("token", ""))
    except SignInRefused as why:
        log.warning("console: sign-in refused from %s: %s", _client(request), why)
        context = {"next": target, "message": f"Refused: {why}.", "local_only": False}
        return screen.render("login.html", 401, **context)
    auth.start_session(request, response, role)
    return response


@ui.post("/logout")
async def logout(screen: AnyScreen, form: Form) -> Response:
    # a checked form, like any other, so no other site signs the operator out, even past the session's
    # expiry; only a request with no cookie of ours has nothing to end
    if (
        screen.auth.carries_session(screen.request)
        and (refused := screen.refused_form(form, acts=False)) is not None
    ):
        return refused
    response = RedirectResponse("/ui/login", 303, headers=HEADERS)
    screen.auth.end_session(screen.request, response)
    return response


# --- actions: a confirmation, then a checked POST ------------------------------------


@ui.get("/rows/{row}/{action}", response_class=HTMLResponse)
def confirm_row(screen: OperatorScreen, row: str, action: str) -> Response:
    def build() -> dict[str, Any]:
        if action not in ROW_ACTIONS:
            raise Refused(404, f"no action {action!r} on a row; one of {', '.join(ROW_ACTIONS)}")
        return {**screen.pages.row(_row_id(row), time.time()), "action": action}

    return screen.page("confirm_row.html", build)


@ui.post("/rows/{row}/{action}", response_class=HTMLResponse)
async def act_on_row(screen: AnyScreen, row: str, action: str, form: CheckedForm) -> Response:
    request = screen.request

    def act() -> str:
        row_id = _row_id(row)
        if action not in ROW_ACTIONS:
            raise Refused(404, f"no action {action!r} on a row")
        screen.pages.act_on_row(action, row_id, form.get("reason", ""), time.time())
        log.warning("console: %s row %d by the operator from %s", action, row_id, _client(request))
        return f"/ui/rows/{row_id}?done={action}"

    return await screen.act(act)


@ui.get("/board/{board}/tasks/{task}/{action}", response_class=HTMLResponse)
def confirm_task(screen: OperatorScreen, board: str, task: str, action: str) -> Response:
    def build() -> dict[str, Any]:
        if action not in TASK_ACTIONS:
            raise Refused(404, f"no action {action!r} on a task; one of {', '.join(TASK_ACTIONS)}")
        return {**screen.pages.task(board, task), "action": action}

    return screen.page("confirm_task.html", build)


@ui.post("/board/{board}/tasks/{task}/{action}", response_class=HTMLResponse)
async def act_on_task(screen: AnyScreen, board: str, task: str, action: str, form: CheckedForm) -> Response:
    request = screen.request

    def act() -> str:
        if action not in TASK_ACTIONS:
            raise Refused(404, f"no action {action!r} on a task")
        screen.pages.act_on_task(action, board, task, time.time())
        log.warning("console: %s %s/%s by the operator from %s", action, board, task, _client(request))
        return f"/ui/board?board={quote(board)}&done={action}"

    return await screen.act(act)


@ui.post("/board/tasks", response_class=HTMLResponse)
async def add_task(screen: AnyScreen, form: CheckedForm) -> Response:
    """A new task from the board page's form (board, title, body), as ``poolctl board add``."""
    request = screen.request

    def act() -> str:
        board = form.get("board", "").strip()
        task_id = screen.pages.add_task(board, form.get("title", ""), form.get("body", ""))
        log.warning("console: added %s/%s by the operator from %s", board, task_id, _client(request))
        return f"/ui/board?board={quote(board)}&done=add"

    return await screen.act(act)


@ui.get("/{anything:path}", response_class=HTMLResponse)
def unknown(screen: SignedIn, anything: str) -> Response:
    return screen.page("message.html", lambda: _no_page(anything))


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
    """The status (the one the error's class carries) and the sentence of a refused page or action."""
    if isinstance(err, SQLAlchemyError):
        log.error("console: unclassified database error", exc_info=err)
        return 503, "The pool store failed (the server logged it). Try again."
    status = err.http_status if isinstance(err, PoolError) else 503  # else: Redis did not answer
    if status == 503:
        return 503, f"Busy or unreachable: {err}. Try again."
    if status == 404:
        return 404, f"Not found: {err}."
    # a refusal of the request itself (bad input, a stale or conflicting state) is checked before any write
    unchanged = " Nothing was changed." if isinstance(err, InvalidInput | ProtocolError) else ""
    return status, f"Refused: {err}.{unchanged}"
