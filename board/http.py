"""The board over HTTP: ``HttpBoard``, a client of the board API (docs/board-api.md).

``open_http`` opens it for an ``http:``/``https:`` ``POOL_BOARD_URL`` (the
reference server is ``poolctl board serve``). The bodies of that API are the
models below, which the server's routes take and answer with, so the two ends
share one vocabulary; an answer that does not fit them (garbage) is a
``TransientError``, like a board that cannot be read right now.

Statuses: 429, 502, 503, 504, 408, a timeout or a dropped connection are
retried (``TRIES`` tries, backoff with jitter, at least as long as
``Retry-After`` asks, capped) and then ``TransientError`` (``Unavailable`` when
nothing listened). A refused compare-and-set is an answer, ``{"applied":
false}``. 401/403 are ``Unauthenticated``/``Forbidden``; 404 ``NotFound``; any
other 4xx about one task (get, block, complete) is that task's own
``CapabilityError``; elsewhere 422 is ``InvalidInput``. A 500 is
``BoardServerError``, named after the server's exception class and carrying its
message: a bug on the board's side, recorded on the row like any unexpected
error. A retried claim sends the same request id, so the server answers
with the claims it already made and claims nothing twice. Requests are
checked by the server (its 422s), not here, so both ends refuse alike.

One pooled ``httpx.Client`` per board per process: a forked child (Celery's
prefork workers) opens its own on first use rather than share the parent's
sockets. TLS is verified (httpx's default, the system's or certifi's CAs); the
token is sent as ``Authorization: Bearer`` and never put in a message.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from board.protocol import SEARCH_LIMIT, Board, BoardTask, Claim, TaskStatus
from core import shapes, tracing, validate
from core.errors import (
    CapabilityError,
    Forbidden,
    InvalidInput,
    NotFound,
    PoolError,
    TransientError,
    Unauthenticated,
    Unavailable,
    Unsupported,
    UnusableURL,
)
from core.fields import Document, Text
from core.retry import RetryPolicy
from core.settings import Settings, default

TIMEOUT = httpx.Timeout(5.0, connect=3.0)  # per try; a board call takes at most ~TRIES times this
TRIES = 3
RETRY = RetryPolicy(base_seconds=0.2, max_seconds=2.0)
RETRY_AFTER_MAX_SECONDS = 5.0
RETRIED = frozenset({408, 429, 502, 503, 504})


# --- the API's bodies (the server's routes take and answer these) -------------------------------


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


NAME_PATTERN = f"^{validate.NAME_RE.pattern}$"
TaskName = Annotated[str, Field(min_length=1, max_length=shapes.TASK_ID_CHARS, pattern=NAME_PATTERN)]
BoardNamed = Annotated[str, Field(min_length=1, max_length=shapes.BOARD_CHARS, pattern=NAME_PATTERN)]


def _name(max_length: int, description: str, *default: Any) -> Any:
    return Field(*default, min_length=1, max_length=max_length, pattern=NAME_PATTERN, description=description)


class ClaimRequest(Body):
    request_id: str = _name(
        shapes.REQUEST_ID_CHARS, "Made by the client, one per claim; a retry of the claim sends it again."
    )
    limit: int = Field(ge=0, le=validate.INT32_MAX)
    assignee: Text = Field(min_length=1, max_length=shapes.ASSIGNEE_CHARS)
    lane: Text = Field(min_length=1, max_length=shapes.LANE_CHARS)
    skip_boards: list[BoardNamed] = Field(
        default_factory=list, max_length=shapes.SKIP_BOARDS, description="Boards to claim nothing from."
    )


class BlockRequest(Body):
    reason: Text = Field(max_length=shapes.REASON_CHARS)
    kind: Text = Field(max_length=shapes.BLOCK_KIND_CHARS)
    expected_run_id: int = Field(
        ge=shapes.RUN_ID.low, le=shapes.RUN_ID.high, description="Parks only this run."
    )


class CompleteRequest(Body):
    expected_run_id: int = Field(
        ge=shapes.RUN_ID.low, le=shapes.RUN_ID.high, description="Completes only this run."
    )
    result: Document


class NewTask(Body):
    title: Text = Field(max_length=validate.MAX_DOCUMENT_BYTES)  # the run's payload bounds them together
    body: Text = Field(default="", max_length=validate.MAX_DOCUMENT_BYTES)
    lane: str = _name(shapes.LANE_CHARS, "The lane the task waits in.", default("lane"))
    task_id: str | None = _name(shapes.TASK_ID_CHARS, "Made by the board when none is given.", None)


class Reassign(Body):
    assignee: Text = Field(min_length=1, max_length=shapes.ASSIGNEE_CHARS)
    lane: str = _name(shapes.LANE_CHARS, "The lane the new run is in.")


class RunsRequest(Body):
    task_ids: list[TaskName] = Field(max_length=10_000)


class Boards(Body):
    boards: list[str]


class Tasks(Body):
    tasks: list[BoardTask]


class TaskAnswer(Body):
    task: BoardTask | None


class Claims(Body):
    claims: list[Claim]


class Applied(Body):
    applied: bool = Field(description="False: the task's current run is not the expected one (nothing done).")


class TaskId(Body):
    task_id: str


class Exists(Body):
    exists: bool


class Counts(Body):
    counts: dict[str, int]


class PoolRuns(Body):
    runs: list[tuple[str, str, int, str]]


class Runs(Body):
    runs: list[dict[str, Any]]


class Done(Body):
    done: bool = True


Answer = TypeVar("Answer", bound=BaseModel)


class BoardServerError(RuntimeError):
    """Not a PoolError on purpose: the board server failed unexpectedly (500), a bug on its side.

    ``named`` gives the subclass named after the server's own exception class, so the row records
    ``PoisonedTask: board: task … is poisoned`` as a database board would, not the transport's words.
    """

    @staticmethod
    @functools.cache
    def named(error: str) -> type[BoardServerError]:
        if not (error.isidentifier() and error.isascii()) or error == "InternalError":
            return BoardServerError
        return type(error, (BoardServerError,), {"__module__": __name__})


def open_http(url: str, settings: Settings) -> Board:
    """The board behind the board API at ``url``, with ``POOL_BOARD_TOKEN`` (``board.open_board``)."""
    return HttpBoard(url, token=settings.board_token or None)


class HttpBoard:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: httpx.Timeout = TIMEOUT,
        tries: int = TRIES,
        retry: RetryPolicy = RETRY,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        try:
            base = httpx.URL(url)
            base.port  # noqa: B018 - a port out of range raises here
        except (httpx.InvalidURL, ValueError, TypeError) as err:
            raise UnusableURL(f"POOL_BOARD_URL: not a URL ({str(err)[:80]})") from None
        if base.scheme not in ("http", "https") or not base.host:
            raise UnusableURL("POOL_BOARD_URL: expected http(s)://HOST[:PORT] of a board API")
        host = f"[{base.host}]" if ":" in base.host else base.host
        self._where = (
            f"{base.scheme}://{host}{'' if base.port is None else f':{base.port}'}{base.path.rstrip('/')}"
        )
        self._base = str(base.copy_with(query=None, fragment=None)).rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout, self._transport = timeout, transport
        self.tries, self.retry, self.sleep = max(tries, 1), retry, sleep
        self._client: httpx.Client | None = None
        self._pid = 0
        self._lock = threading.Lock()

    # --- setting up: the server's owner migrates its board; here we can only look ------------------

    def migrate(self) -> None:
        """Nothing to create from here (``poolctl init`` runs beside the board server): checks it answers."""
        self.require_schema(writable=True)

    def require_creatable(self) -> None:
        self.require_schema(writable=True)

    def require_schema(self, *, writable: bool = False) -> None:
        """The server answers the API with this token (it serves only a migrated board)."""
        self._call("GET", "/v1/boards", Boards, params={"include_archived": "true"})

    def location(self) -> str:
        return self._where

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            client.close()

    # --- the maintenance plane's calls ---------------------------------------------------------

    def list_boards(self, include_archived: bool = False) -> list[str]:
        params = {"include_archived": "true" if include_archived else "false"}
        return self._call("GET", "/v1/boards", Boards, params=params).boards

    def running_tasks(self, board: str) -> list[BoardTask]:
        return self._call("GET", f"{_board(board)}/running", Tasks).tasks

    def get_task(self, board: str, task_id: str) -> BoardTask | None:
        return self._call("GET", _task(board, task_id), TaskAnswer, task=f"{board}/{task_id}").task

    def claim_ready(
        self,
        limit: int,
        *,
        assignee: str,
        lane: str,
        request_id: str | None = None,
        skip_boards: Sequence[str] = (),
    ) -> list[Claim]:
        # skip_boards only when a board is paused: a board server older than the field still claims
        fields: dict[str, Any] = {"request_id": request_id or uuid.uuid4().hex, "limit": limit}
        fields.update(assignee=assignee, lane=lane)
        if skip_boards:
            fields["skip_boards"] = list(skip_boards)
        asked = ClaimRequest.model_construct(**fields)
        return self._call("POST", "/v1/claims", Claims, body=asked).claims

    def block_task(self, board: str, task_id: str, reason: str, kind: str, expected_run_id: int) -> bool:
        asked = BlockRequest.model_construct(reason=reason, kind=kind, expected_run_id=expected_run_id)
        path, task = f"{_task(board, task_id)}/block", f"{board}/{task_id}"
        return self._call("POST", path, Applied, body=asked, task=task).applied

    def complete_task(self, board: str, task_id: str, expected_run_id: int, result: dict[str, Any]) -> bool:
        asked = CompleteRequest.model_construct(expected_run_id=expected_run_id, result=result)
        path, task = f"{_task(board, task_id)}/complete", f"{board}/{task_id}"
        return self._call("POST", path, Applied, body=asked, task=task).applied

    # --- operator moves ------------------------------------------------------------------------

    def add_task(
        self,
        board: str,
        title: str,
        body: str = "",
        *,
        lane: str = default("lane"),
        task_id: str | None = None,
    ) -> str:
        # the id is made here, so a retry after a lost answer cannot add the task twice
        made = task_id or uuid.uuid4().hex[:12]
        asked = NewTask.model_construct(title=title, body=body, lane=lane, task_id=made)
        try:
            return self._call("POST", f"{_board(board)}/tasks", TaskId, body=asked).task_id
        except InvalidInput as err:
            # A fresh id "already exists" only if an earlier try of this call added it (its answer
            # lost): the task is there, so the add succeeded. A caller's own id may be anyone's.
            if task_id is None and "already exists" in str(err) and self._is(board, made, asked):
                return made
            raise

    def _is(self, board: str, task_id: str, asked: NewTask) -> bool:
        task = self.get_task(board, task_id)
        return task is not None and (task.title, task.body, task.lane) == (
            asked.title,
            asked.body,
            asked.lane,
        )

    def unblock_task(self, board: str, task_id: str) -> BoardTask:
        return self._move(board, task_id, "unblock")

    def cancel_task(self, board: str, task_id: str) -> BoardTask:
        return self._move(board, task_id, "cancel")

    def reassign_task(self, board: str, task_id: str, *, assignee: str, lane: str) -> BoardTask:
        return self._move(board, task_id, "reassign", Reassign.model_construct(assignee=assignee, lane=lane))

    def _move(self, board: str, task_id: str, move: str, body: BaseModel | None = None) -> BoardTask:
        found = self._call("POST", f"{_task(board, task_id)}/{move}", TaskAnswer, body=body).task
        if found is None:
            raise TransientError(f"board at {self._where}: a {move} answered no task")
        return found

    def delete_task(self, board: str, task_id: str) -> None:
        self._call("DELETE", _task(board, task_id), Done)

    def archive_board(self, board: str) -> None:
        self._call("POST", f"{_board(board)}/archive", Done)

    # --- reads ---------------------------------------------------------------------------------

    def has_board(self, board: str) -> bool:
        return self._call("GET", _board(board), Exists).exists

    def list_tasks(
        self, board: str | None = None, status: TaskStatus | None = None, limit: int = 10_000
    ) -> list[BoardTask]:
        params: dict[str, str] = {"limit": str(limit)}
        if board is not None:
            params["board"] = board
        if status is not None:
            params["status"] = status.value
        return self._call("GET", "/v1/tasks", Tasks, params=params).tasks

    def counts_by_status(self) -> dict[str, int]:
        return self._call("GET", "/v1/counts", Counts).counts

    def pool_runs(self, assignee: str) -> list[tuple[str, str, int, str]]:
        return self._call("GET", "/v1/pool-runs", PoolRuns, params={"assignee": assignee}).runs

    def list_runs(self, board: str, task_ids: list[str]) -> list[dict[str, Any]]:
        if not task_ids:
            return []
        return self._call(
            "POST", f"{_board(board)}/runs", Runs, body=RunsRequest.model_construct(task_ids=task_ids)
        ).runs

    def search_tasks(self, text: str, *, limit: int = SEARCH_LIMIT) -> list[BoardTask]:
        """The server's board's search; its ``Unsupported`` (501) when that board has none."""
        return self._call("GET", SEARCH_PATH, Tasks, params={"q": text, "limit": str(limit)}).tasks

    # --- transport -----------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        """This process's client; a forked child makes its own (the parent's sockets stay the parent's)."""
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = httpx.Client(
                    base_url=self._base,
                    headers=self._headers,
                    timeout=self._timeout,
                    transport=self._transport,
                )
                self._pid = os.getpid()
            return self._client

    def _call(
        self,
        method: str,
        path: str,
        answer: type[Answer],
        *,
        body: BaseModel | None = None,
        params: dict[str, str] | None = None,
        task: str | None = None,
    ) -> Answer:
        """One call, retried while transient: its answer as ``answer``, or the error its status means."""
        try:
            content = None if body is None else body.model_dump_json(exclude_unset=True).encode()
        except ValueError as err:  # text JSON cannot carry (a lone surrogate), NaN: as the Kanban refuses it
            raise InvalidInput("request", f"cannot be sent as JSON: {str(err)[:200]}") from None
        # A call from inside a run's span (finalize, park) carries its trace to the board server.
        headers = tracing.headers()
        if content is not None:
            headers["content-type"] = "application/json"
        problem, refused = "", False
        for n in range(1, self.tries + 1):
            wait = self.retry.backoff(n)
            try:
                response = self._http().request(
                    method, path, content=content, params=params, headers=headers or None
                )
            except httpx.TransportError as err:
                problem, refused = f"{type(err).__name__}: {err}", isinstance(err, httpx.ConnectError)
            else:
                if response.status_code < 300:
                    return self._decoded(response, path, answer)
                if response.status_code not in RETRIED:
                    raise self._refusal(response, path, task)
                problem, refused = f"{response.status_code} {_said(response)[1]}", False
                wait = max(wait, _retry_after(response))
            if n < self.tries:
                self.sleep(wait)
        where = f"board at {self._where}{path}"
        raise (Unavailable if refused else TransientError)(f"{where}: {problem} (after {self.tries} tries)")

    def _decoded(self, response: httpx.Response, path: str, answer: type[Answer]) -> Answer:
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as err:
            raise TransientError(
                f"board at {self._where}{path}: an answer that is not the board API's"
                f" ({err.error_count()} problems, first: {err.errors()[0]['msg']})"
            ) from None

    def _refusal(self, response: httpx.Response, path: str, task: str | None) -> Exception:
        status = response.status_code
        error, detail = _said(response)
        said = f"board at {self._where}: {status} {error}: {detail}"
        if status == Unauthenticated.http_status:
            return Unauthenticated(said)
        if status == Forbidden.http_status:
            return Forbidden(said)
        if status == Unsupported.http_status and error == "Unsupported":
            return Unsupported(detail)
        if status == NotFound.http_status and error == "NotFound" and detail != UNROUTED:
            return NotFound(detail)  # the board API's own: no such board or task
        if path == SEARCH_PATH and status == NotFound.http_status and self._title() == shapes.BOARD_API_TITLE:
            # a board server from before search: its board has no search here, as a backend without it
            return Unsupported(f"the board server at {self._where} cannot search (it is older than search)")
        if status in (NotFound.http_status, 405):  # no route there: POOL_BOARD_URL is not a board server
            answers = self._what_answers()
            return UnusableURL(f"POOL_BOARD_URL: {answers} at {self._where} ({status} on {path})")
        if task is not None and status < 500:
            return CapabilityError(f"{task}: the board refused it ({status} {error}: {detail})")
        if status == InvalidInput.http_status:
            field, _, problem = detail.partition(": ")
            return InvalidInput(field, problem) if problem else InvalidInput("request", detail)
        if status < 500:
            return PoolError(said)
        named = BoardServerError.named(error)
        return named(said) if named is BoardServerError else named(detail)

    def _title(self) -> object:
        """The OpenAPI title of what serves POOL_BOARD_URL's host (one try); None when it names none."""
        try:
            return self._http().get(self._root("/openapi.json"), timeout=2.0).json()["info"]["title"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def _root(self, path: str) -> httpx.URL:
        return httpx.URL(self._base).copy_with(path=path)

    def _what_answers(self) -> str:
        """What serves POOL_BOARD_URL's host, by its OpenAPI title where it has one (one try)."""
        title = self._title()
        if title == shapes.BOARD_API_TITLE:
            return f"the board API answers at {self._root('/')}, not"
        if title == shapes.WIRE_API_TITLE:
            return "`poolctl serve` (the pool's wire protocol) answers, not `poolctl board serve`,"
        if isinstance(title, str):
            return f"{title[:80]!r} answers, not the board API of `poolctl board serve`,"
        return "no board API (`poolctl board serve`) answers"


# Starlette's detail for a path no route serves (the board API's own 404s name the board or task).
UNROUTED = "Not Found"
SEARCH_PATH = "/v1/search"  # optional: a board server from before search has no such route


def _board(board: str) -> str:
    return f"/v1/boards/{quote(board, safe='')}"


def _task(board: str, task_id: str) -> str:
    return f"{_board(board)}/tasks/{quote(task_id, safe='')}"


def _said(response: httpx.Response) -> tuple[str, str]:
    """The ``{"error", "detail"}`` of a refusal, as text (a validation error's list joined), bounded."""
    try:
        found = response.json()
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return "HTTPError", response.text[:200]
    detail = found.get("detail", "")
    if isinstance(detail, list):
        detail = "; ".join(
            f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg', '')}"
            for d in detail
            if isinstance(d, dict)
        )
    return str(found.get("error", "HTTPError"))[:80], str(detail)[:500]


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", "0")), RETRY_AFTER_MAX_SECONDS)
    except ValueError:
        return 0.0
