"""Shared helpers that run the real processes: ``poolctl`` commands, ``poolctl worker``s, the plane.

Fixtures live in ``conftest.py`` files (this folder's, or a floor's); the rows, envelopes
and the fixed clock in ``factories``. Test modules import these from here, never from each other.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from board import Board, TaskStatus
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.boardserver import app as board_api
from poolkeeper.embedded import CeleryProc, RedisServer, ServeProc, supervise, wait_for
from poolkeeper.http import serving
from store import PoolStore, presence, queries
from store.models import Call

POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]

# --- poolctl commands (tests/cli/, and wherever a test runs one) -------------------

USAGE, UNAVAILABLE, BUSY, CONFIG = 2, 69, 75, 78  # poolctl's exit codes (docs/operate.md, the exit codes)


def poolctl(
    tmp: Path, *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``poolctl args`` over the SQLite files in ``tmp``, with a pool of 2 and the caller's Redis."""
    return subprocess.run(
        [*POOLCTL, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=tmp,
        env=poolctl_env(tmp, env),
        timeout=600,
    )


def poolctl_env(tmp: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """What ``poolctl`` runs with: the SQLite files in ``tmp``, a pool of 2, and ``env`` on top."""
    base = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{tmp}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp}/board.db",
        "POOL_SIZE": "2",
    }
    return {**base, **(env or {})}


def run(
    cwd: Path, *args: str | bytes, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``poolctl args`` over the SQLite files in ``cwd``, with no Redis and no debugging, after ``prefix``."""
    base = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{cwd}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{cwd}/board.db",
        "POOL_REDIS_URL": "",
    }
    base.pop("POOLCTL_DEBUG", None)
    return subprocess.run(
        [*prefix, *POOLCTL, *args],
        capture_output=True,
        text=True,
        errors="replace",
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=120,
    )


def refused(done: subprocess.CompletedProcess[str], code: int, *words: str, who: str = "poolctl") -> str:
    """Exit ``code`` and exactly one line on stderr, holding every one of ``words``."""
    assert done.returncode == code, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{who}: "), done.stderr[-3000:]
    for word in words:
        assert word in lines[0]
    return lines[0]


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --- poolctl worker over a real serve (tests/worker/) ----------------------------------

SECRET = "worker-test-secret-" + "0123456789abcdef" * 3


def given_run(store: PoolStore, payload: dict[str, Any], ordinal: int = 0) -> int:
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=ordinal, payload=payload)
    with store.session(readonly=True) as s:
        return int(s.execute(text("SELECT id FROM assignments WHERE task_id = 't1'")).scalar_one())


def python(script: str) -> str:
    return shlex.join([sys.executable, "-c", script])


def state_dir(server: ServeProc) -> Path:
    """The workers' state directory of one test (its ordinals' locks, process groups, spooled results)."""
    return server.log.parent / "worker-state"


def worker(
    server: ServeProc,
    command: str,
    *extra: str,
    ordinal: int = 0,
    token: str | None = None,
    call: str | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[str]:
    """``poolctl worker`` running ``command``, or (``call``) the Python callable, from ``cwd``."""
    runs = ["--call", call] if call is not None else ["--command", command]
    return subprocess.Popen(
        [*POOLCTL, "worker", "--ordinal", str(ordinal), *runs, "--url", server.url, *extra],
        env={
            **os.environ,
            "POOL_WORKER_TOKEN": token or tokens.ordinal_token(SECRET, ordinal),
            "POOL_SERVER_SECRET": SECRET,  # as on a host that serves too: never handed to the command
            "POOL_WORKER_STATE_DIR": str(state_dir(server)),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


DAY = 86_400.0


def staff(store: PoolStore, ordinals: Iterable[int], at: float) -> None:
    """A worker called (offered) on each of ``ordinals`` at ``at``: dispatch fills only those.

    Tests that drive rows themselves, with no pool worker polling, stand a worker on each
    ordinal this way; ``at=time.time() + DAY`` keeps them present for the whole test, even
    while the test holds the store's write lock.
    """
    with store.engine.begin() as conn:
        for o in ordinals:
            presence.note(conn, o, Call.OFFER, at, owner=f"test-worker-{o}")


def staff_url(url: str, ordinals: Iterable[int]) -> None:
    """``staff`` for the store at ``url`` (a test driving ``poolctl``): present for a day."""
    store = PoolStore(url)
    staff(store, ordinals, time.time() + DAY)
    store.engine.dispose()


def finished(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return err


# --- the plane: a private redis-server, Celery processes, SQLite files (tests/plane/) ---


@dataclass
class PlaneEnv:
    tmp: Path
    redis: RedisServer
    settings: Settings
    store: PoolStore
    kanban: Board
    procs: list[CeleryProc] = field(default_factory=list)

    def worker(self, name: str = "w1") -> CeleryProc:
        proc = CeleryProc("worker", self.settings.env(), self.tmp, name)
        self.procs.append(proc)
        return proc.wait_ready()

    def beat(self, name: str = "beat") -> CeleryProc:
        proc = CeleryProc("beat", self.settings.env(), self.tmp, name)
        self.procs.append(proc)
        return proc.wait_ready()

    def supervise(self) -> bool:
        """Restart what crashed, as systemd's Restart=always does in production; always False."""
        self.procs = supervise(self.procs, self.settings.env(), self.tmp)
        return False

    def add_tasks(self, n: int, prefix: str = "t") -> list[str]:
        return [self.kanban.add_task("b", f"task {i}", task_id=f"{prefix}{i:03d}") for i in range(n)]

    def rows(self) -> dict[str, Any]:
        with self.store.session(readonly=True) as s:
            return {r.task_id: r for r in queries.rows(s, limit=100_000)}

    def board_done(self, ids: list[str]) -> bool:
        done = {t.id for t in self.kanban.list_tasks("b", TaskStatus.DONE)}
        return set(ids) <= done

    def board_settled(self, ids: list[str]) -> bool:
        """Every task done, or parked after its last fenced attempt."""
        ended = {
            t.id for t in self.kanban.list_tasks("b") if t.status in (TaskStatus.DONE, TaskStatus.BLOCKED)
        }
        return set(ids) <= ended


def make_settings(tmp: Path, redis_url: str, **over: Any) -> Settings:
    """The plane's settings for an integration test: short leases and ticks, ``over`` on top."""
    base: dict[str, Any] = dict(
        database_url=f"sqlite:///{tmp}/pool.db",
        board_url=f"sqlite:///{tmp}/board.db",
        redis_url=redis_url,
        pool_size=4,
        lease_seconds=2.0,
        max_attempts=2,
        tick_seconds=0.3,
        reconcile_seconds=1.0,
        gc_seconds=5.0,
        quarantine_after=3,
        backoff_base_seconds=0.2,
        backoff_max_seconds=1.0,
        quarantine_retry_seconds=3.0,
        transient_retries=3,
        task_time_limit=10.0,
        visibility_timeout=15.0,
        batch_size=10,
    )
    base.update(over)
    return Settings(**base)


# --- a board over HTTP: the reference server in a thread (tests/board/, tests/passes/) ---------

BOARD_TOKEN = "b7d1e0c4a9f3568e2d7c1b0a4f9e3d8c"


class AppServer:
    """An ASGI app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, settings: Settings, app: Any) -> None:
        sock = serving.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = serving.guarded(app, settings, False, 64, 64)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for("the server to start", lambda: self.server.started, 10, every=0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the server did not stop"


class BoardServer(AppServer):
    """The board API over ``board`` (``poolctl board serve``'s app)."""

    def __init__(self, settings: Settings, board: Board) -> None:
        super().__init__(
            settings, board_api.create_board_app(settings, board, local_only=not settings.board_token)
        )
