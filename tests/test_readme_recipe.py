"""The README's "A worker on another host" recipe, run as written: its tasks are done within a minute.

The two code blocks are taken from the README itself and run by bash, with only
what a reader would change for one machine: the server's address, the printed
token in place of ``o0.…``, and files under the test's folder. Three tasks on
the default three ordinals with one worker also show that dispatch fills only
ordinals with a worker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

from board import TaskStatus, open_board
from core.settings import Settings
from poolkeeper.embedded import RedisServer, free_port, wait_for

README = Path(__file__).resolve().parents[1] / "README.md"


def recipe() -> tuple[str, str]:
    """The server's block and the worker's block of the README's recipe."""
    section = README.read_text().split("**A worker on another host.**", 1)[1]
    server, worker = re.findall(r"```\n(.*?)```", section, re.S)[:2]
    return server, worker


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


def test_the_worker_recipe_gets_its_tasks_done_within_a_minute(tmp_path: Path) -> None:
    server_block, worker_block = recipe()
    port = free_port()
    redis = RedisServer(tmp_path).start()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("POOL_")},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
        "POOL_REDIS_URL": redis.url,
        "XDG_STATE_HOME": str(tmp_path / "state"),  # beat's schedule file
        "POOL_WORKER_STATE_DIR": str(tmp_path / "worker-state"),
    }
    server_block = server_block.replace("--port 8080", f"--port {port}")
    server = run(server_block, env, tmp_path, tmp_path / "server.log")
    worker: subprocess.Popen[bytes] | None = None
    try:
        assert server.wait(120) == 0, (tmp_path / "server.log").read_text()
        [token] = re.findall(r"\bo0\.[0-9a-f]{16,}", (tmp_path / "server.log").read_text())
        command = worker_block.replace("o0.…", token).replace(
            "http://server:8080", f"http://127.0.0.1:{port}"
        )
        worker = run(command, env, tmp_path, tmp_path / "worker.log")
        board = open_board(Settings(board_url=env["POOL_BOARD_URL"]))

        def done() -> bool:
            tasks = board.list_tasks("demo")
            return len(tasks) == 3 and all(t.status is TaskStatus.DONE for t in tasks)

        wait_for("the recipe's three tasks done", done, 60)
    finally:
        if worker is not None:
            end(worker)
        end(server)
        redis.stop()
