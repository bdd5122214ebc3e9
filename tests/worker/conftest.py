"""A real ``poolctl serve`` over the test's store for the workers to talk to."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from core.settings import Settings
from poolkeeper.embedded import ServeProc, wait_for
from store import PoolStore
from tests.factories import serving
from tests.helpers import SECRET, state_dir


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


@pytest.fixture
def server(settings: Settings, store: PoolStore, tmp_path: Path) -> Iterator[ServeProc]:
    """A server whose leases last 1.5 s: a run outlives its lease only if the worker heartbeats."""
    with serving(settings, tmp_path, secret=SECRET, lease_seconds=1.5) as proc:
        yield proc


class Outage:
    """A ``serve`` with 30 s leases that a test takes down and brings back on the same port."""

    def __init__(self, settings: Settings, tmp: Path) -> None:
        self.env, self.tmp, self.n = replace(settings, lease_seconds=30).env(), tmp, 0
        self.proc = ServeProc(self.env, tmp, secret=SECRET).wait_ready()
        self.log, self.port, self.url = self.proc.log, self.proc.port, self.proc.url

    def down(self) -> None:
        self.proc.stop()

    def up(self) -> None:
        self.n += 1
        self.proc = ServeProc(self.env, self.tmp, secret=SECRET, port=self.port, name=f"serve{self.n}")
        self.proc.wait_ready()

    def spooled_then_killed(self, worker: subprocess.Popen[str], gate: Path) -> Path:
        """With serve away, ``gate`` lets the worker's run finish; once its result is spooled the
        worker is SIGKILLed while it retries the delivery, and serve comes back. The spool's path."""
        self.down()
        Path(f"{gate}.go").touch()
        spool = state_dir(self.proc) / "ordinal-0" / "result.json"
        try:
            wait_for("the result to be spooled", spool.exists, 10)
        finally:
            worker.kill()  # SIGKILL while it retries the delivery
            worker.wait(10)
        self.up()
        return spool


@pytest.fixture
def outage(settings: Settings, store: PoolStore, tmp_path: Path) -> Iterator[Outage]:
    serving = Outage(settings, tmp_path)
    yield serving
    serving.down()
