"""``poolctl serve`` under hostile clients and bad start-up input (issue 18, findings 8-10 and 16-19).

The transport findings (idle and dripping connections, floods, overload) run a real
``poolctl serve`` process over real sockets; the others drive the app in-process or run
the command and read its one line and exit code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from board import open_board
from core.errors import ConfigError
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import free_port
from poolkeeper.http.errors import pool_error
from poolkeeper.serve import create_app
from store import PoolStore

SECRET = "hostile-test-secret-" + "0123456789abcdef" * 3
ROOT = Path(__file__).resolve().parents[2]
POSTS = (
    "/v1/offer",
    "/v1/heartbeat",
    "/v1/result",
    "/v1/release",
    "/v1/children",
    "/v1/children/heartbeat",
    "/v1/children/result",
    "/v1/children/vanished",
)


def pool_env(tmp: Path) -> dict[str, str]:
    return {"POOL_DATABASE_URL": f"sqlite:///{tmp}/pool.db", "POOL_BOARD_URL": f"sqlite:///{tmp}/board.db"}


def initialised(tmp: Path) -> Settings:
    env = pool_env(tmp)
    settings = Settings(database_url=env["POOL_DATABASE_URL"], board_url=env["POOL_BOARD_URL"], pool_size=3)
    store = PoolStore.from_settings(settings)
    store.migrate()
    store.engine.dispose()
    kanban = open_board(settings)
    kanban.migrate()
    kanban.close()
    return settings


def poolctl(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    return subprocess.run(
        [sys.executable, "-c", "from poolkeeper.cli import main; main()", *args],
        env={**base, **pool_env(tmp), "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=60,
    )


class Serve:
    """A real ``poolctl serve`` on a free loopback port with a secret and the given options."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = tmp / "serve.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
        cmd = [sys.executable, "-c", "from poolkeeper.cli import main; main()", "serve"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--host", "127.0.0.1", "--port", str(self.port), *args],
                env={
                    **base,
                    **pool_env(tmp),
                    "PYTHONPATH": str(ROOT),
                    "POOL_SERVER_SECRET": SECRET,
                    **(env or {}),
                },
                cwd=tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def offer(self) -> httpx.Response:
        headers = {"Authorization": f"Bearer {tokens.ordinal_token(SECRET, 0)}"}
        return httpx.post(
            f"{self.url}/v1/offer", json={"ordinal": 0, "owner": "w"}, headers=headers, timeout=30
        )

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def serve_args() -> tuple[str, ...]:
    return ()


@pytest.fixture
def served(tmp_path: Path, serve_args: tuple[str, ...]) -> Iterator[Serve]:
    """A server whose deadline (``POOL_BODY_TIMEOUT_SECONDS``) is 2 s."""
    initialised(tmp_path)
    server = Serve(tmp_path, *serve_args, env={"POOL_BODY_TIMEOUT_SECONDS": "2"})
    yield server
    server.stop()


def read_answer(sock: socket.socket, within: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``within`` runs out)."""
    sock.settimeout(within)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return got + b"<still open>"
    return got


# --- 16. idle and slow connections, floods, overload --------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(served: Serve) -> None:
    with served.connect() as sock:
        started = time.monotonic()
        assert read_answer(sock, 10) == b""  # closed, nothing asked so nothing answered
        assert time.monotonic() - started < 5


def test_a_head_dripped_line_by_line_is_cut_with_a_json_408(served: Serve) -> None:
    with served.connect() as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/offer HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for i in range(20):
                sock.sendall(f"X-Drip-{i}: x\r\n".encode())
                time.sleep(0.25)
        except OSError:
            pass  # the server closed it
        answer = read_answer(sock, 10)
    assert answer.startswith(b"HTTP/1.1 408") and b"application/json" in answer
    assert b'"error": "RequestTimeout"' in answer
    assert time.monotonic() - started < 6  # the deadline (2 s) ran from the accept, not per line


def test_the_body_shares_the_deadline_that_began_at_the_accept(served: Serve) -> None:
    with served.connect() as sock:
        time.sleep(1.2)
        sock.sendall(b"POST /v1/offer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 40\r\n\r\n{")
        started = time.monotonic()
        answer = read_answer(sock, 10)
    assert answer.startswith(b"HTTP/1.1 408") and b"RequestTimeout" in answer
    assert time.monotonic() - started < 1.9  # what was left of 2 s, not 2 s more


def test_two_thousand_idle_sockets_do_not_lock_a_holder_out(served: Serve) -> None:
    """The issue's flood: 2,100 idle sockets from one client, then the holder's own valid offer."""
    flood = []
    try:
        for _ in range(2100):
            flood.append(served.connect())
        answer = served.offer()
    finally:
        for sock in flood:
            sock.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["grant"] is None


@pytest.mark.parametrize("serve_args", [("--max-connections-per-client", "4")])
def test_when_every_connection_is_busy_the_refusal_is_json_with_retry_after(served: Serve) -> None:
    busy = []
    try:
        for _ in range(4):  # heads in, bodies still to come: each one is a request under way
            sock = served.connect()
            sock.sendall(b"POST /v1/offer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
            busy.append(sock)
        time.sleep(0.3)
        answer = served.offer()
    finally:
        for sock in busy:
            sock.close()
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["error"] == "Overloaded"
    time.sleep(0.3)  # the busy ones gone: the next offer is served
    assert served.offer().status_code == 200


def test_a_request_h11_cannot_parse_is_answered_in_json(served: Serve) -> None:
    with served.connect() as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = read_answer(sock, 10)
    assert answer.startswith(b"HTTP/1.1 400") and b"application/json" in answer


# --- 17. authentication before the body --------------------------------------------------------


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[TestClient]:
    settings = initialised(tmp_path)
    app = create_app(Settings(**{**settings.__dict__, "server_secret": SECRET}))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client
    app.state.pool.engine.dispose()


@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b""])
def test_an_unauthenticated_body_that_is_not_json_is_401(
    app_client: TestClient, path: str, body: bytes
) -> None:
    answer = app_client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 401 and answer.json()["error"] == "Unauthenticated"
    wrong = app_client.post(path, content=body, headers={"Authorization": "Bearer o0." + "0" * 64})
    assert wrong.status_code == 401


def test_an_authenticated_bad_body_is_still_422(app_client: TestClient) -> None:
    token = tokens.ordinal_token(SECRET, 0)
    answer = app_client.post("/v1/offer", content=b"{not json", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 422


@pytest.mark.parametrize("sent", ["text/plain", "application/x-www-form-urlencoded"])
def test_json_sent_under_another_content_type_is_told_which_one(app_client: TestClient, sent: str) -> None:
    token = tokens.ordinal_token(SECRET, 0)
    answer = app_client.post(
        "/v1/offer",
        content=b'{"owner": "w1"}',
        headers={"Authorization": f"Bearer {token}", "Content-Type": sent},
    )
    assert answer.status_code == 422
    [issue] = answer.json()["detail"]
    assert issue["loc"] == ["body"]
    assert issue["msg"] == f"a JSON body needs Content-Type: application/json, not {sent}"


# --- 18. the loopback Host check --------------------------------------------------------------


@pytest.fixture
def local_client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(initialised(tmp_path), local_only=True)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client
    app.state.pool.engine.dispose()


@pytest.mark.parametrize(
    "host",
    [
        *("[::1].evil.example", "[::1]:8080.evil.example", "[::1]evil", "127.0.0.1.evil.example"),
        *("localhost.evil", "::1", "[::1]:99999", "[::1] ", "evil.example", "[fe80::1]"),
    ],
)
def test_a_local_only_server_refuses_a_host_that_only_starts_like_loopback(
    local_client: TestClient, host: str
) -> None:
    answer = local_client.post("/v1/offer", json={"ordinal": 0, "owner": "w"}, headers={"Host": host})
    assert answer.status_code == 403 and answer.json()["error"] == "NotLoopback"


@pytest.mark.parametrize(
    "host", ["[::1]", "[::1]:8080", "127.0.0.1", "127.0.0.1:8080", "127.9.9.9", "localhost:1"]
)
def test_a_local_only_server_answers_loopback_hosts(local_client: TestClient, host: str) -> None:
    answer = local_client.post("/v1/offer", json={"ordinal": 0, "owner": "w"}, headers={"Host": host})
    assert answer.status_code == 200


# --- 19. signing out ends the session on the server --------------------------------------------


def test_a_signed_out_cookie_no_longer_opens_the_console(app_client: TestClient) -> None:
    app_client.post("/ui/login", data={"token": tokens.operator_token(SECRET)}, follow_redirects=False)
    cookie = app_client.cookies.get("poolkeeper_console")
    assert cookie and app_client.get("/ui").status_code == 200
    page = app_client.get("/ui").text
    csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    app_client.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
    app_client.cookies.set("poolkeeper_console", cookie, path="/ui")  # the stolen or kept value
    replayed = app_client.get("/ui", follow_redirects=False)
    assert replayed.status_code != 200 and "/ui/login" in replayed.headers.get("location", "")
    app_client.post("/ui/login", data={"token": tokens.operator_token(SECRET)}, follow_redirects=False)
    assert app_client.get("/ui").status_code == 200  # a new sign-in is a new session


def test_a_session_signed_out_on_one_replica_is_refused_by_another(tmp_path: Path) -> None:
    settings = Settings(**{**initialised(tmp_path).__dict__, "server_secret": SECRET})
    apps = [create_app(settings), create_app(settings)]  # two `serve` replicas over one store
    with (
        TestClient(apps[0], base_url="http://127.0.0.1") as one,
        TestClient(apps[1], base_url="http://127.0.0.1") as two,
    ):
        one.post("/ui/login", data={"token": tokens.operator_token(SECRET)}, follow_redirects=False)
        cookie = one.cookies.get("poolkeeper_console")
        assert cookie
        two.cookies.set("poolkeeper_console", cookie, path="/ui")
        assert two.get("/ui").status_code == 200  # one session, taken by either replica
        csrf = one.get("/ui").text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        one.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
        replayed = two.get("/ui", follow_redirects=False)
        assert replayed.status_code != 200 and "/ui/login" in replayed.headers.get("location", "")
    for app in apps:
        app.state.pool.engine.dispose()


# --- 8. serve on a store `init` has not set up; a ConfigError mid-request --------------------


@pytest.mark.parametrize("where", ["fresh", "mistyped directory"])
def test_serve_refuses_a_store_init_has_not_set_up_and_creates_nothing(tmp_path: Path, where: str) -> None:
    url = f"sqlite:///{tmp_path}/pool.db" if where == "fresh" else f"sqlite:///{tmp_path}/nope/pool.db"
    before = set(tmp_path.iterdir())
    done = poolctl(
        tmp_path,
        "serve",
        "--port",
        str(free_port()),
        env={"POOL_SERVER_SECRET": SECRET, "POOL_DATABASE_URL": url},
    )
    assert done.returncode == 78, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "poolctl init" in done.stderr
    assert set(tmp_path.iterdir()) == before  # no pool.db, -wal or -shm


def test_a_config_error_during_a_request_is_503_not_ready() -> None:
    answer = pool_error(None, ConfigError("no pool store at sqlite:///x.db: run `poolctl init`"))  # type: ignore[arg-type]
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"


# --- 9. placeholder and guessable secrets ----------------------------------------------------


def example_secret(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("POOL_SERVER_SECRET="):
            return line.split("=", 1)[1]
    raise AssertionError(f"{path}: no POOL_SERVER_SECRET")


@pytest.mark.parametrize(
    "secret",
    [
        example_secret(ROOT / "deploy" / ".env.example"),
        "change-me-" + "a1b2c3d4e5f6" * 3,
        "s" * 40,
        "0123456789abcdef" * 4,
        "abababababababababababababababababababab",
    ],
)
def test_serve_refuses_a_placeholder_or_guessable_secret(tmp_path: Path, secret: str) -> None:
    initialised(tmp_path)
    done = poolctl(tmp_path, "serve", "--port", str(free_port()), env={"POOL_SERVER_SECRET": secret})
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert (
        len(line.splitlines()) == 1 and line.startswith("poolctl: POOL_SERVER_SECRET:") and secret not in line
    )


def test_a_generated_secret_is_taken() -> None:
    assert Settings(server_secret=os.urandom(32).hex()).server_secret


# --- 10. a taken port, a bad host name, bytes that are not UTF-8 --------------------------------


def test_a_taken_port_names_the_address_and_exits_69(tmp_path: Path) -> None:
    initialised(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = poolctl(
            tmp_path, "serve", "--host", "127.0.0.1", "--port", str(port), env={"POOL_SERVER_SECRET": SECRET}
        )
    assert done.returncode == 69, done.stderr
    assert (
        f"127.0.0.1:{port}" in done.stderr and "in use" in done.stderr and "internal error" not in done.stderr
    )


@pytest.mark.parametrize("host", ["999.1.1.1", "no-such-host.invalid"])
def test_a_bad_host_name_is_named_and_exits_78(tmp_path: Path, host: str) -> None:
    initialised(tmp_path)
    done = poolctl(tmp_path, "serve", "--host", host, "--port", "0", env={"POOL_SERVER_SECRET": SECRET})
    assert done.returncode == 78, done.stderr
    assert host in done.stderr and "internal error" not in done.stderr


@pytest.mark.parametrize("var", ["POOL_LANE", "POOL_SERVE_HOST", "POOL_SERVER_SECRET", "POOL_NAMESPACE"])
def test_bytes_that_are_not_utf8_in_a_variable_exit_2_naming_it(tmp_path: Path, var: str) -> None:
    initialised(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    environb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    environb.update({os.fsencode(k): os.fsencode(v) for k, v in pool_env(tmp_path).items()})
    environb.update({b"PYTHONPATH": os.fsencode(str(ROOT)), b"POOL_SERVER_SECRET": SECRET.encode()})
    environb[var.encode()] = b"abc\xff\xfe" + b"0123456789abcdef" * 3
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from poolkeeper.cli import main; main()",
            "serve",
            "--port",
            str(free_port()),
        ],
        env=environb,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    line = done.stderr.decode(errors="replace").strip()
    assert done.returncode == 2, line
    assert line.startswith(f"poolctl: {var}:") and len(line.splitlines()) == 1
