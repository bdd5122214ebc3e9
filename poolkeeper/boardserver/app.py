"""``poolctl board serve``: the reference server of the board API (docs/board-api.md), over the Kanban.

Every route is one ``Board`` call on the board at the server's ``POOL_BOARD_URL``
(a database: the built-in Kanban), with the chaos faults of the server's
``POOL_CHAOS_*`` settings (``board.with_faults``): a busy board answers 503 with
``Retry-After``, a poisoned task 500 ``PoisonedTask``. The bodies are ``board.http``'s models, the
client's own. ``errors.install`` answers every refusal by its class
(``http_status``); a refused compare-and-set is 200 ``{"applied": false}``.

Auth mirrors ``poolctl serve``: every ``/v1`` request carries ``Authorization:
Bearer <POOL_BOARD_TOKEN>`` (compared in constant time, before the body is read;
401 otherwise). Without a token the server starts only with ``--local-only`` on
a loopback address, and then answers only requests addressed to loopback
(``limits.LoopbackHost``). ``/healthz``, ``/readyz`` and ``/openapi.json`` ask
no token. A board ``poolctl init`` has not set up is refused before the port is
bound (exit 78). An unexpected failure answers 500 with its class and message
(``BoardServerError.named`` raises it again on the client's side).
It runs under ``serving.guarded``: the same deadlines, connection caps and body
limit as ``poolctl serve``.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.
import hmac
import json
import logging
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from board import Board, TaskStatus, open_board, with_faults
from board.http import (
    NAME_PATTERN,
    Applied,
    BlockRequest,
    Boards,
    ClaimRequest,
    Claims,
    CompleteRequest,
    Counts,
    Done,
    Exists,
    NewTask,
    PoolRuns,
    Reassign,
    Runs,
    RunsRequest,
    TaskAnswer,
    TaskId,
    Tasks,
)
from board.protocol import SEARCH_LIMIT, SEARCH_MAX_CHARS, SEARCH_MIN_CHARS, search_tasks
from core import shapes, tracing, validate
from core.errors import PoolError, SettingsError, TransientError
from core.fields import Text
from core.settings import Settings
from poolkeeper.events import events_for, task_ready
from poolkeeper.http import errors, serving
from poolkeeper.http import middleware as limits
from poolkeeper.http.errors import ErrorBody, Health, refusals
from tasks.events import Events

log = logging.getLogger("poolkeeper.server")
API_VERSION = "1"
bearer = HTTPBearer(auto_error=False, description="POOL_BOARD_TOKEN, the token the server was started with.")


async def _board(request: Request) -> Board:
    board: Board = request.app.state.board
    return board


Kanban = Annotated[Board, Depends(_board)]


async def _events(request: Request) -> Events:
    events: Events = request.app.state.events
    return events


PlaneEvents = Annotated[Events, Depends(_events)]
router = APIRouter(prefix="/v1", tags=["board"], responses=refusals(404, 408, 503))
# the store's rules (core.validate, core.fields), so a read never hands a store what it cannot hold
BoardName = Annotated[str, Path(min_length=1, max_length=shapes.BOARD_CHARS, pattern=NAME_PATTERN)]
TaskName = Annotated[str, Path(min_length=1, max_length=shapes.TASK_ID_CHARS, pattern=NAME_PATTERN)]
Assignee = Annotated[Text, Query(min_length=1, max_length=shapes.ASSIGNEE_CHARS)]


# --- the maintenance plane's calls ---------------------------------------------------------------


@router.get("/boards", response_model=Boards)
def list_boards(board: Kanban, include_archived: bool = False) -> Boards:
    """The boards' names, sorted; archived ones too when asked."""
    return Boards(boards=board.list_boards(include_archived))


@router.get("/boards/{name}/running", response_model=Tasks)
def running_tasks(board: Kanban, name: BoardName) -> Tasks:
    """The running tasks of one board (none for an unknown board)."""
    return Tasks(tasks=board.running_tasks(name))


@router.get("/boards/{name}/tasks/{task_id}", response_model=TaskAnswer)
def get_task(board: Kanban, name: BoardName, task_id: TaskName) -> TaskAnswer:
    """One task; ``task: null`` when there is none."""
    return TaskAnswer(task=board.get_task(name, task_id))


@router.post("/claims", response_model=Claims)
def claim_ready(board: Kanban, body: ClaimRequest) -> Claims:
    """Atomically claim up to ``limit`` ready tasks of ``lane``, none of ``skip_boards``; a request id
    already used answers the claims that request made, and claims nothing more."""
    got = board.claim_ready(
        body.limit,
        assignee=body.assignee,
        lane=body.lane,
        request_id=body.request_id,
        skip_boards=body.skip_boards,
    )
    return Claims(claims=got)


@router.post("/boards/{name}/tasks/{task_id}/block", response_model=Applied)
def block_task(board: Kanban, name: BoardName, task_id: TaskName, body: BlockRequest) -> Applied:
    """Park exactly the expected run; ``applied: false`` if the task's current run is another one."""
    return Applied(applied=board.block_task(name, task_id, body.reason, body.kind, body.expected_run_id))


@router.post("/boards/{name}/tasks/{task_id}/complete", response_model=Applied)
def complete_task(board: Kanban, name: BoardName, task_id: TaskName, body: CompleteRequest) -> Applied:
    """Complete exactly the expected run with ``result``; ``applied: false`` if the run moved on."""
    return Applied(applied=board.complete_task(name, task_id, body.expected_run_id, body.result))


# --- operator moves (a move the status does not allow: 422; an unknown task: 404) ----------------


@router.post("/boards/{name}/tasks", response_model=TaskId)
def add_task(board: Kanban, name: BoardName, body: NewTask, events: PlaneEvents) -> TaskId:
    """A new ready task (its board is created on first use)."""
    added = board.add_task(name, body.title, body.body, lane=body.lane, task_id=body.task_id)
    task_ready(events)
    return TaskId(task_id=added)


@router.post("/boards/{name}/tasks/{task_id}/unblock", response_model=TaskAnswer)
def unblock_task(board: Kanban, name: BoardName, task_id: TaskName, events: PlaneEvents) -> TaskAnswer:
    """A parked task goes back to ready."""
    task = board.unblock_task(name, task_id)
    task_ready(events)
    return TaskAnswer(task=task)


@router.post("/boards/{name}/tasks/{task_id}/cancel", response_model=TaskAnswer)
def cancel_task(board: Kanban, name: BoardName, task_id: TaskName) -> TaskAnswer:
    """End a task for good: done, result ``{"cancelled": true}``."""
    return TaskAnswer(task=board.cancel_task(name, task_id))


@router.post("/boards/{name}/tasks/{task_id}/reassign", response_model=TaskAnswer)
def reassign_task(board: Kanban, name: BoardName, task_id: TaskName, body: Reassign) -> TaskAnswer:
    """Hand a running task to someone else: a new run starts."""
    return TaskAnswer(task=board.reassign_task(name, task_id, assignee=body.assignee, lane=body.lane))


@router.delete("/boards/{name}/tasks/{task_id}", response_model=Done)
def delete_task(board: Kanban, name: BoardName, task_id: TaskName) -> Done:
    board.delete_task(name, task_id)
    return Done()


@router.post("/boards/{name}/archive", response_model=Done)
def archive_board(board: Kanban, name: BoardName) -> Done:
    board.archive_board(name)
    return Done()


# --- reads ------------------------------------------------------------------------------------


@router.get("/boards/{name}", response_model=Exists)
def has_board(board: Kanban, name: BoardName) -> Exists:
    return Exists(exists=board.has_board(name))


@router.get("/tasks", response_model=Tasks)
def list_tasks(
    board: Kanban,
    name: Annotated[
        str | None, Query(alias="board", max_length=shapes.BOARD_CHARS, pattern=NAME_PATTERN)
    ] = None,
    status: TaskStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=validate.INT32_MAX)] = 10_000,
) -> Tasks:
    return Tasks(tasks=board.list_tasks(name, status, limit))


@router.get("/search", response_model=Tasks, responses=refusals(501))
def search(
    board: Kanban,
    q: Annotated[
        Text,
        Query(
            max_length=SEARCH_MAX_CHARS,
            description=f"A piece of a title or body, {SEARCH_MIN_CHARS} to {SEARCH_MAX_CHARS} characters.",
        ),
    ],
    limit: Annotated[int, Query(ge=1, le=SEARCH_LIMIT)] = SEARCH_LIMIT,
) -> Tasks:
    """Tasks whose title or body holds ``q`` (any case), newest first; 501 ``Unsupported`` when this
    server's board cannot search."""
    return Tasks(tasks=search_tasks(board, q, limit))


@router.get("/counts", response_model=Counts)
def counts_by_status(board: Kanban) -> Counts:
    """Tasks per status, every status present."""
    return Counts(counts=board.counts_by_status())


@router.get("/pool-runs", response_model=PoolRuns)
def pool_runs(board: Kanban, assignee: Assignee) -> PoolRuns:
    """Every run ever claimed as ``assignee``: [board, task_id, run_id, outcome]."""
    return PoolRuns(runs=board.pool_runs(assignee))


@router.post("/boards/{name}/runs", response_model=Runs)
def list_runs(board: Kanban, name: BoardName, body: RunsRequest) -> Runs:
    """Every run of these tasks, oldest first."""
    return Runs(runs=board.list_runs(name, body.task_ids))


# --- probes -----------------------------------------------------------------------------------

probes = APIRouter(tags=["probes"])


@probes.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up (no board access)."""
    return Health(status="ok")


@probes.get("/readyz", response_model=Health, responses={503: {"model": ErrorBody}})
def readyz(board: Kanban) -> Health | JSONResponse:
    """The board answers and its schema is at head."""
    try:
        board.require_schema()
    except PoolError as err:
        return errors.error_response(503, "NotReady", str(err), {"Retry-After": "1"})
    return Health(status="ready")


class BearerToken:
    """401 for a ``/v1`` request without the server's token, compared in constant time, before its body."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.token):
                detail = (
                    "the Bearer token given was refused: it is not the board server's POOL_BOARD_TOKEN"
                    if scheme.lower() == b"bearer" and token.strip()
                    else "an Authorization: Bearer token (the board server's POOL_BOARD_TOKEN) is required"
                )
                refusal = errors.error_response(
                    401, "Unauthenticated", detail, {"WWW-Authenticate": "Bearer"}
                )
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _failure(_: Request, err: Exception) -> JSONResponse:
    """An unexpected failure of the board (a bug, corrupt data): 500 with its class and message, so the
    plane records on the row what a database board would have raised (the traceback is logged here)."""
    return errors.error_response(500, type(err).__name__, validate.storable(str(err), 500))


def create_board_app(settings: Settings, board: Board, *, local_only: bool = False) -> FastAPI:
    """The board API over ``board``. Without ``POOL_BOARD_TOKEN`` only a ``local_only`` app exists."""
    if not settings.board_token and not local_only:
        raise SettingsError(
            "POOL_BOARD_TOKEN: not set; board serve only with --local-only on a loopback address"
        )
    app = FastAPI(
        title=shapes.BOARD_API_TITLE,
        version=API_VERSION,
        summary="The Board protocol over HTTP/JSON: what an http(s) POOL_BOARD_URL reaches.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.board = board
    app.state.events = events_for(settings)  # the plane's Redis: a dispatch goes at once
    secured = [Depends(bearer)] if settings.board_token else []  # declares the scheme; BearerToken checks
    app.include_router(router, dependencies=secured)
    app.include_router(probes)
    errors.install(app)
    app.add_exception_handler(Exception, _failure)  # in place of install's opaque InternalError
    app.add_middleware(
        limits.BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout_seconds
    )
    if settings.board_token:
        app.add_middleware(BearerToken, token=settings.board_token)
    else:
        app.add_middleware(limits.LoopbackHost)
    if tracing.enabled():  # a call from a traced pass (finalize, park) is a span of its run
        app.add_middleware(limits.TraceRequests)
    return app


def served_board(settings: Settings) -> Board:
    """The board this server exposes, with the server's chaos faults: a database, never another server."""
    if settings.board_url.partition(":")[0].lower() in ("http", "https"):
        raise SettingsError(
            "POOL_BOARD_URL: board serve exposes a database (sqlite: or postgresql:), not a server"
        )
    board = with_faults(open_board(settings), settings)
    try:
        board.require_schema(writable=True)  # ConfigError (exit 78): `poolctl init` has not set it up
    except TransientError as err:  # not answering yet (PostgreSQL starting): /readyz says when
        log.warning("%s; /readyz says when it is usable", err.line())
    return board


def run(
    settings: Settings,
    *,
    host: str,
    port: int,
    local_only: bool,
    access_log: bool,
    max_connections: int,
    max_per_client: int,
) -> None:
    unset = (
        "POOL_BOARD_TOKEN (or POOL_BOARD_TOKEN_FILE) is not set: board serve refuses to start without"
        " auth; give --local-only to serve a loopback address without a token"
    )
    serving.check_auth(host, local_only, settings.board_token, unset)
    serving.quiet_logs(settings)  # from here on, every line is a log line in POOL_LOG_FORMAT
    board = served_board(settings)
    sock = serving.bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    auth = "bearer token" if settings.board_token else "none (--local-only)"
    log.info("poolctl board serve: %s on %s:%d; auth: %s", board.location(), bound_host, bound_port, auth)
    app = create_board_app(settings, board, local_only=local_only)
    serving.run(
        app,
        settings,
        sock,
        access_log=access_log,
        max_connections=max_connections,
        max_per_client=max_per_client,
    )


def openapi() -> dict[str, Any]:
    """The API's schema as a server with a token states it: docs/board-api.openapi.json, written by
    ``python -m poolkeeper.boardserver.app`` (a test checks the file is current)."""
    settings = Settings(board_token=secrets.token_hex(32), board_url="sqlite://")  # never connected
    return create_board_app(settings, open_board(settings)).openapi()


if __name__ == "__main__":
    print(json.dumps(openapi(), indent=2, sort_keys=True))
