"""poolctl starts at once: each command imports only what it needs (issue 29, Deliver 5).

Structural, not timed: each case runs the real entry point in a fresh interpreter and reads
``sys.modules`` as the process exits, so it holds on a loaded machine too. The timings are
``bench/cli_start.py``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from board import TaskStatus
from tests.helpers import poolctl

# Modules whose import costs a command tens or hundreds of milliseconds.
SERVERS = {"fastapi", "starlette", "uvicorn", "jinja2", "celery", "kombu", "httpx", "prometheus_client"}
STORAGE = {"sqlalchemy", "alembic", "redis", "psycopg"}
OURS_BELOW = {"store", "board", "tasks"}

REPORT = (
    "import atexit, json, sys\n"
    "atexit.register(lambda: print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})),"
    " file=sys.stderr))\n"
)


def loaded(body: str, *args: str, env: dict[str, str] | None = None) -> set[str]:
    """The top-level packages in ``sys.modules`` when ``body`` (run with ``args``) exits."""
    done = subprocess.run(
        [sys.executable, "-c", REPORT + body, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def command(*args: str, env: dict[str, str] | None = None) -> set[str]:
    return loaded("from poolkeeper.cli import main; main()", *args, env=env)


def test_importing_the_cli_loads_nothing_but_the_standard_library() -> None:
    third_party = loaded("import poolkeeper.cli") - set(sys.stdlib_module_names)
    assert third_party <= {"__main__", "poolkeeper", "_distutils_hack"}, third_party


def test_version_is_answered_before_typer_loads() -> None:
    assert not command("--version") & {"typer", "rich", "core", *STORAGE, *SERVERS}


@pytest.mark.parametrize("args", [("--help",), ("board", "--help"), ("child", "--help"), ("rows", "--help")])
def test_help_loads_no_storage_server_or_lower_floor(args: tuple[str, ...]) -> None:
    assert not command(*args) & (STORAGE | SERVERS | OURS_BELOW)


@pytest.mark.parametrize("args", [("board", "list"), ("board", "add", "b", "a task")])
def test_board_commands_on_sqlite_load_no_server_no_redis_and_no_pool_store(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    assert poolctl(tmp_path, "init").returncode == 0
    files = {
        "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
    }
    got = command(*args, env={**os.environ, **files})
    assert "sqlalchemy" in got  # it did open the board
    # An add (or unblock) tells the plane at once: the events' producer and its Redis client, nothing more
    told = {"redis", "tasks"} if "add" in args else set()  # tasks: its events and coordination names
    assert not got & (SERVERS | {"store", "celery"})
    assert {m for m in got if m == "redis" or m.split(".")[0] == "tasks"} == told


def test_board_list_help_names_every_status(tmp_path: Path) -> None:
    """The help spells the statuses out (importing ``board`` for them would load SQLAlchemy)."""
    done = poolctl(tmp_path, "board", "list", "--help", env={"COLUMNS": "200"})
    for status in TaskStatus:
        assert status.value in done.stdout
