"""What poolctl writes to a terminal: no control characters from the board, ids never cut, plain help."""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from core.retry import RetryPolicy
from store import PoolStore, bookkeeping
from tests.factories import NOW


def _poolctl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{cwd}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{cwd}/board.db",
        "POOL_REDIS_URL": "",
        "COLUMNS": "80",
        "TERM": "xterm-256color",
    }
    code = "from poolkeeper.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.fixture
def initialised(tmp_path: Path) -> Path:
    assert _poolctl(tmp_path, "init").returncode == 0
    return tmp_path


LONG_ID = "task-2f9c1e7a-5b3d-4c8e-9f0a-7b6c5d4e3f2a"


def test_board_text_never_reaches_the_terminal_as_control_characters(initialised: Path) -> None:
    title = "\x1b[2J\x1b[Hcleared \x07\u202egnp.exe [bold]x[/bold]"
    added = _poolctl(initialised, "board", "add", "b", title, "--body", "\x1b]0;owned\x07")
    listed = _poolctl(initialised, "board", "list")
    for done in (added, listed):
        assert done.returncode == 0, done.stderr
        assert not [c for c in done.stdout if unicodedata.category(c) == "Cc" and c != "\n"], done.stdout
        assert "\u202e" not in done.stdout
    assert "\\x1b[2J" in listed.stdout and "[bold]x[/bold]" in listed.stdout  # shown, not obeyed


def test_ids_are_never_cut_at_80_columns(initialised: Path) -> None:
    store = PoolStore(f"sqlite:///{initialised}/pool.db")
    store.add_run(board="engineering", task_id=LONG_ID, run_id=987654321, ordinal=2, payload={}, now=NOW)
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={}, now=NOW)
    with store.session() as s:
        bookkeeping.record_failure(
            s,
            1,
            "TransientError: board: the board database is locked " * 3,
            policy=RetryPolicy(),
            now=NOW,
            actor="pass:materialize",
        )
    store.engine.dispose()
    listed = _poolctl(initialised, "rows")
    assert listed.returncode == 0, listed.stderr
    assert f"engineering/{LONG_ID}" in listed.stdout and "987654321" in listed.stdout
    assert max(len(line) for line in listed.stdout.splitlines()) <= 80
    history = _poolctl(initialised, "rows", "1", "--history")
    assert history.returncode == 0 and "pass:materialize" in history.stdout, history.stdout
    assert "…" not in listed.stdout + history.stdout


def test_help_shows_no_type_after_a_flag_and_a_bad_status_lists_the_good_ones(initialised: Path) -> None:
    helped = _poolctl(initialised, "rows", "--help")
    assert "--quarantined" in helped.stdout and "<bool>" not in helped.stdout
    bogus = _poolctl(initialised, "board", "list", "--status", "bogus")
    assert bogus.returncode == 2
    assert "ready, running, blocked, done" in bogus.stderr, bogus.stderr
