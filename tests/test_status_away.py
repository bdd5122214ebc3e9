"""While the board or Redis is away, ``poolctl status`` and the console show what they can read.

Real processes: ``poolctl board serve`` (then stopped), ``poolctl serve`` with the console,
``poolctl status``; Redis is a port where nothing listens.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from board import open_board
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import ROOT, ServeProc, free_port
from store import PoolStore
from tests.helpers import POOLCTL, SECRET, make_settings


@dataclass
class Away:
    env: dict[str, str]  # the board at a stopped `poolctl board serve`, Redis at a port nobody serves
    serve: ServeProc


@pytest.fixture
def away(tmp_path: Path) -> Iterator[Away]:
    settings = make_settings(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    PoolStore.from_settings(settings).migrate()
    kanban = open_board(settings)
    kanban.migrate()
    kanban.add_task("b", "one task")
    token = secrets.token_hex(32)
    board = ServeProc(
        {**settings.env(), "POOL_BOARD_TOKEN": token}, tmp_path, name="board", command=("board", "serve")
    )
    over_http: Settings = replace(settings, board_url=board.wait_ready().url, board_token=token)
    env = {**over_http.env(), "POOL_BOARD_TOKEN": token}
    serve = ServeProc(env, tmp_path, secret=SECRET).wait_ready()
    board.stop()  # Given the board server gone, and Redis too
    try:
        yield Away(env, serve)
    finally:
        serve.stop()


def poolctl(a: Away, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **a.env, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*POOLCTL, *args], env=env, capture_output=True, text=True, timeout=120)


def test_status_json_shows_rows_ordinals_and_beat_and_names_the_parts_it_could_not_read(away: Away) -> None:
    done = poolctl(away, "status", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["rows"]["assigned"] == 0 and data["pool_size"] == 4 and len(data["free_ordinals"]) == 4
    assert data["beat_alive"] is None and data["board"] is None
    assert set(data["unknown"]) == {"board", "redis"}
    assert (
        "Connection refused" in data["unknown"]["board"] and data["board_error"] == data["unknown"]["board"]
    )


def test_status_table_marks_the_board_unknown_with_its_error_and_exits_0(away: Away) -> None:
    done = poolctl(away, "status")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "free ordinals" in text and "unknown (Unavailable: board at" in text
    assert "not read │ board, redis" in text


def test_the_consoles_overview_and_workers_pages_render_with_the_board_unknown(away: Away) -> None:
    with httpx.Client(base_url=away.serve.url, timeout=30) as ui:
        signed = ui.post("/ui/login", data={"token": tokens.viewer_token(SECRET), "next": "/ui"})
        assert signed.status_code == 303, signed.text
        overview = ui.get("/ui")
        assert overview.status_code == 200, overview.text[-2000:]
        assert 'id="board-error"' in overview.text and "Connection refused" in overview.text
        assert 'id="redis-error"' in overview.text
        workers = ui.get("/ui/workers")
        assert workers.status_code == 200, workers.text[-2000:]
        assert 'id="celery-unknown"' in workers.text
