"""``HttpBoard`` against the reference server (``poolctl board serve``'s app, on a real port).

The whole contract kit runs again here over HTTP (``TestHttpBoard``: a client, a
uvicorn server in a thread on a free loopback port, the Kanban on SQLite or
PostgreSQL behind it). Then what
only a network adds: retried claims, busy/slow/garbage answers, the token, the
schema file, and the demo with its board in another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from board import Board, BoardTask, TaskStatus, open_board, search_tasks
from board.http import BoardServerError, HttpBoard, open_http
from core import shapes
from core.errors import (
    CapabilityError,
    ConfigError,
    InvalidInput,
    NotFound,
    SettingsError,
    TransientError,
    Unauthenticated,
    Unsupported,
    UnusableURL,
)
from core.settings import Settings
from poolkeeper.api.app import create_app
from poolkeeper.boardserver import app as board_api
from poolkeeper.embedded import ROOT, wait_for
from poolkeeper.testing.board_contract import BoardContract
from tests.factories import WithoutSearch
from tests.helpers import BOARD_TOKEN as TOKEN
from tests.helpers import AppServer, BoardServer

SCHEMA_FILE = ROOT / "docs" / "board-api.openapi.json"


@pytest.fixture
def served(settings: Settings) -> Iterator[Callable[[Board], BoardServer]]:
    """Start servers over boards; all stopped at the end."""
    started: list[BoardServer] = []

    def start(board: Board) -> BoardServer:
        started.append(BoardServer(replace(settings, board_token=TOKEN), board))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def inner(settings: Settings) -> Iterator[Board]:
    """The Kanban behind the server."""
    board = open_board(settings)
    board.migrate()
    yield board
    board.close()


@pytest.fixture
def kanban(settings: Settings, inner: Board, served: Callable[[Board], BoardServer]) -> Iterator[Board]:
    """``HttpBoard`` → the reference server → the Kanban."""
    client = open_http(served(inner).url, replace(settings, board_token=TOKEN))
    yield client
    client.close()


class TestHttpBoard(BoardContract):
    """The whole contract kit over HTTP; the Kanban behind the server is migrated by its fixture."""

    @pytest.fixture
    def open_handle(
        self, settings: Settings, inner: Board, served: Callable[[Board], BoardServer]
    ) -> Callable[[], Board]:
        url = served(inner).url
        return lambda: open_http(url, replace(settings, board_token=TOKEN))

    def test_an_unmigrated_board_is_refused_before_anything_is_created(
        self, open_handle: Callable[[], Board]
    ) -> None:
        pytest.skip("the board server refuses an unmigrated board at start (test_board_serve_refuses_…)")


def test_a_retried_claim_gets_the_same_claims_even_from_a_restarted_server(
    inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    for i in range(4):
        inner.add_task("b", f"task {i}", task_id=f"t{i}")
    first = served(inner)
    client = HttpBoard(first.url, token=TOKEN)
    claimed = client.claim_ready(2, assignee="pool", lane="pool", request_id="req-1")
    assert [c.task_id for c in claimed] == ["t0", "t1"]
    first.stop()  # the answer was lost, say, and the server restarted before the retry
    again = HttpBoard(served(inner).url, token=TOKEN)
    assert again.claim_ready(2, assignee="pool", lane="pool", request_id="req-1") == claimed
    assert [t.id for t in inner.running_tasks("b")] == ["t0", "t1"]  # nothing claimed twice
    assert [c.task_id for c in again.claim_ready(2, assignee="pool", lane="pool")] == ["t2", "t3"]


class LosesTheFirstAnswer(httpx.HTTPTransport):
    """The first POST reaches the server and is done there; its answer never comes back."""

    lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST" and not self.lost:
            self.lost += 1
            response.close()
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def test_an_add_whose_answer_was_lost_is_added_once_and_said_so(
    inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    lossy = LosesTheFirstAnswer()
    client = HttpBoard(served(inner).url, token=TOKEN, transport=lossy, sleep=lambda _: None)
    task_id = client.add_task("b", "deploy", "step 1")  # the retry finds the first try's task
    assert lossy.lost == 1 and [(t.id, t.title) for t in inner.list_tasks("b")] == [(task_id, "deploy")]
    inner.add_task("b", "someone else's", task_id="mine")  # a caller's own id may be anyone's:
    lossy.lost = 0
    with pytest.raises(InvalidInput, match="b/mine already exists"):
        client.add_task("b", "someone else's", task_id="mine")


def test_the_board_api_refuses_an_archived_board_s_task_and_a_body_that_repeats_a_key(
    inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    inner.add_task("old", "done long ago", task_id="t1")
    inner.archive_board("old")
    url, auth = served(inner).url, {"authorization": f"Bearer {TOKEN}"}
    archived = httpx.post(f"{url}/v1/boards/old/tasks", json={"title": "late"}, headers=auth)
    assert archived.status_code == 422 and "old is archived" in archived.text, archived.text
    twice = b'{"title": "t", "body": "{\\"a\\": 1}", "body": "plain"}'
    headers = {**auth, "content-type": "application/json"}
    repeated = httpx.post(f"{url}/v1/boards/b/tasks", content=twice, headers=headers)
    assert repeated.status_code == 422 and "the key body appears twice" in repeated.text, repeated.text
    assert [t.id for t in inner.list_tasks()] == ["t1"]


def _answering(handler: Callable[[httpx.Request], httpx.Response]) -> HttpBoard:
    return HttpBoard(
        "http://board.test", token=TOKEN, transport=httpx.MockTransport(handler), sleep=lambda _: None
    )


TASK = BoardTask("b", "t2", "x", "", TaskStatus.RUNNING, "pool", 1, "pool")
GOOD = {"task": {**TASK.__dict__}}


def _one_task_fails(how: Callable[[], httpx.Response]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        return how() if request.url.path.endswith("/t1") else httpx.Response(200, json=GOOD)

    return handler


def _timeout() -> httpx.Response:
    raise httpx.ReadTimeout("timed out")


@pytest.mark.parametrize(
    "how",
    [
        lambda: httpx.Response(503, json={"error": "TransientError", "detail": "busy"}),
        lambda: httpx.Response(429, json={"error": "TooMany", "detail": "slow down"}),
        lambda: httpx.Response(200, content=b"<html>not json</html>"),
        lambda: httpx.Response(200, json={"task": {"id": 7}}),
        _timeout,
    ],
    ids=["503", "429", "not-json", "wrong-shape", "timeout"],
)
def test_a_busy_slow_or_garbled_answer_is_transient_and_only_that_tasks(
    how: Callable[[], httpx.Response],
) -> None:
    board = _answering(_one_task_fails(how))
    with pytest.raises(TransientError, match=r"board at http://board\.test"):
        board.get_task("b", "t1")
    assert board.get_task("b", "t2") == TASK


def test_a_refusal_about_a_task_is_its_capability_and_a_server_bug_is_no_pool_error() -> None:
    refused = _answering(
        lambda _: httpx.Response(422, json={"error": "InvalidInput", "detail": "result: bad"})
    )
    with pytest.raises(CapabilityError, match="b/t1: the board refused it"):
        refused.complete_task("b", "t1", 1, {"status": "done"})
    broken = _answering(lambda _: httpx.Response(500, json={"error": "InternalError", "detail": "bug"}))
    with pytest.raises(BoardServerError):
        broken.block_task("b", "t1", "r", "transient", 1)


def test_a_refused_compare_and_set_is_an_answer(kanban: Board, inner: Board) -> None:
    inner.add_task("b", "x", task_id="t1")
    [got] = kanban.claim_ready(1, assignee="pool", lane="pool")
    assert kanban.block_task("b", "t1", "late", "transient", got.run_id + 1) is False
    assert kanban.block_task("b", "t1", "lease expired", "transient", got.run_id) is True


class SlowOnOneTask:
    """A board whose ``get_task`` of t1 hangs until released (the rest is the Kanban's)."""

    def __init__(self, inner: Board) -> None:
        self.inner, self.release, self.waiting = inner, threading.Event(), False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_task(self, board: str, task_id: str) -> BoardTask | None:
        if task_id == "t1":
            self.waiting = True
            self.release.wait(10)
        return self.inner.get_task(board, task_id)


def test_a_task_the_server_hangs_on_times_out_and_never_blocks_another(
    inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    inner.add_task("b", "slow", task_id="t1")
    inner.add_task("b", "fine", task_id="t2")
    slow = SlowOnOneTask(inner)
    server = served(slow)
    client = HttpBoard(server.url, token=TOKEN, timeout=httpx.Timeout(2.0), tries=2, sleep=lambda _: None)
    failed: list[BaseException] = []
    hung = threading.Thread(target=lambda: _catch(failed, lambda: client.get_task("b", "t1")))
    hung.start()
    wait_for("the slow call to reach the server", lambda: slow.waiting, 10, every=0.01)
    other = client.get_task("b", "t2")
    assert other is not None and other.id == "t2"
    assert hung.is_alive(), "t2 was answered only after t1's call gave up"
    hung.join(15)
    slow.release.set()
    assert len(failed) == 1 and isinstance(failed[0], TransientError), failed


def _catch(into: list[BaseException], call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException as err:
        into.append(err)


def test_a_missing_or_wrong_token_is_refused_before_the_body_is_read(
    inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    url = served(inner).url
    with pytest.raises(
        Unauthenticated, match=r"401 Unauthenticated: an Authorization: Bearer token .* is required"
    ):
        HttpBoard(url, token=None).list_boards()
    with pytest.raises(Unauthenticated, match="401 Unauthenticated: the Bearer token given was refused"):
        HttpBoard(url, token="x" * 32).list_boards()
    answer = httpx.post(f"{url}/v1/claims", content=b"{not json")
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/healthz").status_code == 200  # probes ask no token
    assert httpx.get(f"{url}/readyz").json() == {"status": "ready"}


def test_a_url_that_is_no_board_server_names_what_answers_there(
    settings: Settings, inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    # Given the pool's wire protocol (poolctl serve) and a board server under a wrong path
    wire = AppServer(settings, create_app(settings, local_only=True))
    board_url = served(inner).url
    try:
        # When POOL_BOARD_URL names either, then one line says what answers there (exit 78)
        with pytest.raises(UnusableURL, match=r"`poolctl serve` \(the pool's wire protocol\) answers, not"):
            HttpBoard(wire.url, token=TOKEN).list_boards()
        with pytest.raises(
            UnusableURL, match=r"the board API answers at http://[^ ]+/, not at http://[^ ]+/wrong \(404"
        ):
            HttpBoard(f"{board_url}/wrong", token=TOKEN).list_boards()
    finally:
        wire.stop()
    # and the board API's own 404 is still a missing task
    with pytest.raises(NotFound, match="nope: no such board"):
        HttpBoard(board_url, token=TOKEN).archive_board("nope")


class OldClaim(BaseModel):
    """The claim body of a board API from before paused boards: it forbids what it does not know."""

    model_config = ConfigDict(extra="forbid")
    request_id: str
    limit: int
    assignee: str
    lane: str


def older_board_server() -> FastAPI:
    """A board API from before dispatch paused boards and before search (no ``/v1/search``)."""
    app = FastAPI(title=shapes.BOARD_API_TITLE)

    @app.post("/v1/claims")
    def claims(body: OldClaim) -> dict[str, Any]:
        return {"claims": []}

    return app


def test_a_pool_with_nothing_paused_still_claims_from_an_older_board_server(settings: Settings) -> None:
    old = AppServer(settings, older_board_server())
    try:
        board = HttpBoard(old.url, token=TOKEN)
        assert board.claim_ready(4, assignee="pool", lane="pool") == []  # skip_boards is not sent
        with pytest.raises(InvalidInput, match="skip_boards"):  # a pause needs the newer server, said so
            board.claim_ready(4, assignee="pool", lane="pool", skip_boards=["b"])
        with pytest.raises(Unsupported, match="cannot search"):  # exit 2, not "POOL_BOARD_URL" (78)
            search_tasks(board, "abc")
    finally:
        old.stop()


def test_a_forked_child_gets_a_client_of_its_own(kanban: Board, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(kanban, HttpBoard)
    kanban.list_boards()
    parents = kanban._http()
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a forked child
    assert kanban._http() is not parents and kanban.list_boards() == []
    assert not parents.is_closed  # the parent's sockets are left to the parent


def test_the_token_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert Settings.from_env({"POOL_BOARD_TOKEN_FILE": str(tmp_path / "token")}).board_token == TOKEN
    with pytest.raises(SettingsError, match="POOL_BOARD_TOKEN_FILE: give it or POOL_BOARD_TOKEN, not both"):
        Settings.from_env({"POOL_BOARD_TOKEN": TOKEN, "POOL_BOARD_TOKEN_FILE": str(tmp_path / "token")})
    with pytest.raises(SettingsError, match="POOL_BOARD_TOKEN: must be at least 32"):
        Settings.from_env({"POOL_BOARD_TOKEN": "short"})
    assert TOKEN not in repr(Settings(board_token=TOKEN)) and "POOL_BOARD_TOKEN" not in Settings().env()


def test_the_schema_file_is_the_servers() -> None:
    written = json.loads(SCHEMA_FILE.read_text())
    regenerate = "python -m poolkeeper.boardserver.app > docs/board-api.openapi.json"
    assert written == board_api.openapi(), f"the schema file is out of date: {regenerate}"


def _poolctl(
    tmp_path: Path, env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from poolkeeper.cli import main; main()", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_board_serve_refuses_an_unmigrated_board_and_a_server_without_auth(tmp_path: Path) -> None:
    board = {"POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db"}
    unmigrated = _poolctl(tmp_path, {**board, "POOL_BOARD_TOKEN": TOKEN}, "board", "serve", "--port", "0")
    assert unmigrated.returncode == ConfigError.exit_code and "poolctl init" in unmigrated.stderr
    assert len(unmigrated.stderr.strip().splitlines()) == 1
    open_auth = _poolctl(tmp_path, board, "board", "serve", "--host", "0.0.0.0", "--port", "0")
    assert open_auth.returncode == SettingsError.exit_code and "POOL_BOARD_TOKEN" in open_auth.stderr
    remote = {"POOL_BOARD_URL": "http://127.0.0.1:1", "POOL_BOARD_TOKEN": TOKEN}
    itself = _poolctl(tmp_path, remote, "board", "serve", "--port", "0")
    assert itself.returncode == SettingsError.exit_code and "not a server" in itself.stderr
    assert not (tmp_path / "board.db").exists()


def test_the_demo_with_its_board_behind_board_serve_loses_nothing(tmp_path: Path) -> None:
    args = ("demo", "--board", "http", "--tasks", "6", "--pool-size", "2", "--poison", "1")
    faults = ("--board-busy-rate", "0.2", "--crash-rate", "0.1", "--timeout", "200", "--seed", "7")
    done = _poolctl(tmp_path, {}, *args, *faults, "--workdir", str(tmp_path / "demo"), timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lost: 0" in done.stdout and "board API: http://127.0.0.1:" in done.stdout
    assert (tmp_path / "demo" / "board-serve.log").exists()


def test_a_poisoned_task_over_http_fails_with_the_boards_own_class_and_detail(
    settings: Settings, inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    from board.faults import FlakyBoard
    from tasks.failures import describe

    inner.add_task("b", "x", task_id="poison-0")
    direct = FlakyBoard(inner, poison=frozenset({"poison-0"}))
    client = open_http(served(direct).url, replace(settings, board_token=TOKEN))
    try:
        with pytest.raises(Exception) as over_sqlite:
            direct.get_task("b", "poison-0")
        with pytest.raises(BoardServerError) as over_http:
            client.get_task("b", "poison-0")
        assert describe(over_http.value) == describe(over_sqlite.value)
        assert describe(over_http.value) == "PoisonedTask: board: task poison-0 is poisoned (chaos)"
    finally:
        client.close()


def test_a_server_whose_board_cannot_search_says_so_in_one_line(
    inner: Board, served: Callable[[Board], BoardServer]
) -> None:
    inner.add_task("b", "findable title", task_id="t1")
    client = HttpBoard(served(WithoutSearch(inner)).url, token=TOKEN)
    with pytest.raises(Unsupported, match=r"^this board \(WithoutSearch\) cannot search its tasks$"):
        search_tasks(client, "findable")
    searching = HttpBoard(served(inner).url, token=TOKEN)
    assert [t.id for t in search_tasks(searching, "FINDABLE")] == ["t1"]
    with pytest.raises(InvalidInput, match=r"^q: too short"):  # the server refuses it alike
        searching.search_tasks("fi")
