"""The README's quickstart and docs/protocol.md's two-host recipe, run as written: their tasks are done.

The code blocks are taken from the pages themselves and run by bash, with only what a
reader would change for one machine: the server's port, the virtual environment on PATH
(what ``make install`` made), the printed token in place of ``o0.…``, and files under the
test's folder. Three tasks on the default three ordinals with one worker also show that
dispatch fills only ordinals with a worker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from board import TaskStatus, open_board
from core.settings import Settings
from poolkeeper.embedded import RedisServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)


def blocks(page: str, after: str) -> list[str]:
    """The code blocks of ``page`` (under the repository) that follow the text ``after``."""
    section = (ROOT / page).read_text().split(after, 1)[1]
    return re.findall(r"```\n(.*?)```", section, re.S)


def run(script: str, env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """``script`` under bash in a session of its own (what it leaves running is killed with it)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            ["bash", "-euc", script],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def living(group: int) -> bool:
    """Whether a process of ``group`` still runs (zombies no one reaps here do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def end(proc: subprocess.Popen[bytes]) -> None:
    """Stop what ``proc`` started, as an operator's Ctrl-C would; SIGKILL what is left after 20 s."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(AssertionError):
        wait_for("the recipe's processes to stop", lambda: not living(proc.pid), 20)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A reader's shell on one machine: the venv on PATH, files in the test's folder, a Redis."""
    redis = RedisServer(tmp_path).start()
    try:
        yield {
            **{k: v for k, v in os.environ.items() if not k.startswith("POOL_")},
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
            "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/pool.db",
            "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
            "POOL_REDIS_URL": redis.url,
            "XDG_STATE_HOME": str(tmp_path / "state"),  # beat's schedule file
            "POOL_WORKER_STATE_DIR": str(tmp_path / "worker-state"),
        }
    finally:
        redis.stop()


@contextmanager
def running(
    script: str, env: dict[str, str], folder: Path, name: str, *, ends: bool = True
) -> Iterator[Path]:
    """``script`` running (run to its end first if it ``ends``; what it leaves in the background
    keeps running); its log. Whatever it started is stopped on the way out."""
    log = folder / f"{name}.log"
    proc = run(script, env, folder, log)
    try:
        if ends:
            assert proc.wait(120) == 0, log.read_text()
        yield log
    finally:
        end(proc)


def three_tasks_done(env: dict[str, str]) -> None:
    """Wait for the recipe's three tasks to be done on its board."""
    board = open_board(Settings(board_url=env["POOL_BOARD_URL"]))

    def done() -> bool:
        tasks = board.list_tasks("demo")
        return len(tasks) == 3 and all(t.status is TaskStatus.DONE for t in tasks)

    # Events, not ticks: a deadline well inside beat's first ticks (they took 21-41 s by the ticks)
    wait_for("the recipe's three tasks done", done, 15)


def test_the_readme_quickstart_gets_its_tasks_done(tmp_path: Path, env: dict[str, str]) -> None:
    [quickstart] = blocks("README.md", "## Quickstart")[:1]
    port = str(free_port())
    assert quickstart.startswith("make install && export PATH=$PWD/.venv/bin:$PATH")
    script = quickstart.replace("make install && ", "", 1).replace("$PWD/.venv/bin", VENV_BIN, 1)
    script = script.replace("--port 8080", f"--port {port}").replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    with running(script, env, tmp_path, "quickstart") as log:
        three_tasks_done(env)
        [operator] = re.findall(r"^op\.[0-9a-f]{16,}$", log.read_text(), re.M)
        status = httpx.get(
            f"http://127.0.0.1:{port}/v1/status", headers={"authorization": f"Bearer {operator}"}
        )
        assert status.status_code == 200, status.text  # the token it printed is the operator's


def test_the_two_host_recipe_gets_its_tasks_done(tmp_path: Path, env: dict[str, str]) -> None:
    server_block, worker_block = blocks("docs/protocol.md", "## A worker on another host")[:2]
    port = free_port()
    with running(server_block.replace("--port 8080", f"--port {port}"), env, tmp_path, "server") as log:
        [token] = re.findall(r"\bo0\.[0-9a-f]{16,}", log.read_text())
        command = worker_block.replace("o0.…", token).replace(
            "http://server:8080", f"http://127.0.0.1:{port}"
        )
        with running(command, env, tmp_path, "worker", ends=False):
            three_tasks_done(env)
