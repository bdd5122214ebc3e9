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
    "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
)


def modules(body: str, *args: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules in ``sys.modules`` when ``body`` (run with ``args``) exits."""
    done = subprocess.run(
        [sys.executable, "-c", REPORT + body, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def loaded(body: str, *args: str, env: dict[str, str] | None = None) -> set[str]:
    """The top-level packages in ``sys.modules`` when ``body`` (run with ``args``) exits."""
    return {m.split(".")[0] for m in modules(body, *args, env=env)}


POOLCTL_MAIN = "from poolkeeper.cli import main; main()"


def command(*args: str, env: dict[str, str] | None = None) -> set[str]:
    return loaded(POOLCTL_MAIN, *args, env=env)


def initialised(tmp_path: Path) -> dict[str, str]:
    """The environment of a pool `poolctl init` set up on SQLite files in ``tmp_path``."""
    assert poolctl(tmp_path, "init").returncode == 0
    return {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
    }


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
    every = modules(POOLCTL_MAIN, *args, env=initialised(tmp_path))
    got = {m.split(".")[0] for m in every}
    assert "sqlalchemy" in got  # it did open the board
    # An add (or unblock) tells the plane at once: the events' producer and its Redis client, nothing more
    told = {"redis", "tasks"} if "add" in args else set()  # tasks: its events and coordination names
    heavy = got & (SERVERS | {"store", "celery", "alembic"})
    assert not heavy, heavy
    assert {m for m in got if m == "redis" or m.split(".")[0] == "tasks"} == told
    # the board is SQLAlchemy Core on SQLite: neither the ORM nor PostgreSQL's dialect
    unused = every & {"sqlalchemy.orm", "sqlalchemy.dialects.postgresql"}
    assert not unused, unused


def test_status_reads_store_board_and_redis_but_loads_no_server_celery_or_migrations(tmp_path: Path) -> None:
    """Status opens what it reports on; the passes' list it reads brings no counters or Celery."""
    env = {**initialised(tmp_path), "POOL_REDIS_URL": "redis://127.0.0.1:1/0"}  # nothing listens
    got = command("status", env=env)
    assert {"sqlalchemy", "redis", "store", "board"} <= got  # it did read them
    heavy = got & (SERVERS | {"alembic"})  # SERVERS holds celery, kombu and prometheus_client
    assert not heavy, heavy


def test_board_list_help_names_every_status(tmp_path: Path) -> None:
    """The help spells the statuses out (importing ``board`` for them would load SQLAlchemy)."""
    done = poolctl(tmp_path, "board", "list", "--help", env={"COLUMNS": "200"})
    for status in TaskStatus:
        assert status.value in done.stdout
