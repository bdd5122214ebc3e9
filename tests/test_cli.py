"""poolctl against real store and board files: table and --json output, clear refusals, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from poolkeeper.embedded import RedisServer, wait_for
from store import PoolStore


def poolctl(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{tmp}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp}/board.db",
        "POOL_SIZE": "2",
    }
    return subprocess.run(
        [sys.executable, "-c", "from poolkeeper.cli import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env={**base, **(env or {})},
        timeout=600,
    )


def ok(tmp: Path, *args: str) -> str:
    done = poolctl(tmp, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def as_json(tmp: Path, *args: str) -> Any:
    return json.loads(ok(tmp, *args, "--json"))


def test_init_is_idempotent_and_status_has_a_stable_json_shape(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    ok(tmp_path, "init")
    status = as_json(tmp_path, "status")
    assert set(status) == {
        "rows",
        "pool_size",
        "free_ordinals",
        "oldest_lease_failed_seconds",
        "quarantined",
        "board",
    }
    assert status["free_ordinals"] == [0, 1] and status["rows"]["assigned"] == 0


def test_board_commands_and_maintain_once_drive_a_task(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    ok(tmp_path, "board", "add", "b1", "first task", "--id", "t1")
    ok(tmp_path, "board", "add", "b1", "second task", "--id", "t2")
    summary = as_json(tmp_path, "maintain", "--once")
    assert summary["materialize"] == {"added": 2}
    rows = as_json(tmp_path, "rows", "--state", "assigned")
    assert [(r["task_id"], r["ordinal"], r["attempt"]) for r in rows] == [("t1", 0, 1), ("t2", 1, 1)]
    tasks = {t["id"]: t for t in as_json(tmp_path, "board", "list", "b1")}
    assert tasks["t1"]["status"] == "running" and tasks["t1"]["run_id"] == 1
    ok(tmp_path, "board", "cancel", "b1", "t1")
    assert as_json(tmp_path, "maintain", "--once")["reconcile"] == {"stale": 1}
    assert "requeued" in ok(tmp_path, "requeue", str(rows[1]["id"]))
    assert as_json(tmp_path, "status")["board"]["done"] == 1


def test_rows_shows_one_row_with_its_children_as_a_tree(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2)
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={})
    offer = store.offer(0, owner="w-1")
    assert offer is not None
    held = {"row_id": offer.row_id, "attempt": offer.attempt, "fence": offer.fence, "owner": offer.owner}
    parent = store.register_child(held)
    nested = store.register_child({**held, "under": parent.id})
    store.child_result({**parent.token(), "payload": {"ok": True}})
    store.engine.dispose()

    shown = as_json(tmp_path, "rows", str(offer.row_id))
    assert (shown["id"], shown["state"]) == (offer.row_id, "running")
    [child] = shown["children"]
    assert (child["id"], child["status"], child["outcome"]) == (parent.id, "terminal", "done")
    assert [(c["id"], c["outcome"]) for c in child["children"]] == [(nested.id, "retired")]
    tree = ok(tmp_path, "rows", str(offer.row_id))
    assert f"row {offer.row_id} b/t1 run 1: running" in tree
    assert f"child:{nested.id[-12:]} terminal (retired) epoch {offer.fence}" in tree


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("requeue", "42"), "row 42: no such row"),
        (("rows", "42"), "row 42: no such row"),
        (("board", "list", "nosuch"), "nosuch: no such board"),
        (("board", "unblock", "b1", "t9"), "b1/t9: no such task"),
        (("rows", "--state", "zombie"), "--state: unknown state 'zombie'"),
        (("board", "add", "b 1", "x"), "board: may hold only"),
    ],
)
def test_user_mistakes_are_one_clear_line_and_exit_2(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    ok(tmp_path, "init")
    done = poolctl(tmp_path, *args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"poolctl: {done.stderr.strip().removeprefix('poolctl: ')}"]
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_bad_setting_names_the_variable(tmp_path: Path) -> None:
    done = poolctl(tmp_path, "status", env={"POOL_LEASE_SECONDS": "soon"})
    assert done.returncode == 2
    assert done.stderr.strip() == "poolctl: POOL_LEASE_SECONDS: expected a number, got 'soon'"


DEMO_ARGS = (
    "demo",
    "--tasks",
    "30",
    "--pool-size",
    "4",
    "--crash-rate",
    "0.1",
    "--hang-rate",
    "0.05",
    "--poison",
    "1",
    "--board-busy-rate",
    "0.05",
    "--lease",
    "2",
    "--seed",
    "7",
    "--timeout",
    "240",
)


@pytest.mark.integration
def test_demo_runs_to_its_summary_with_the_embedded_redis(tmp_path: Path) -> None:
    done = poolctl(tmp_path, *DEMO_ARGS, "--workdir", str(tmp_path / "demo"), env={"POOL_REDIS_URL": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "embedded redis-server" in done.stdout
    assert "\nlost: 0\n" in done.stdout and "INVARIANT FAILED" not in done.stdout
    assert "quarantined: 1" in done.stdout


@pytest.mark.integration
def test_demo_uses_the_redis_it_is_given(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        done = poolctl(
            tmp_path, *DEMO_ARGS, "--workdir", str(tmp_path / "demo"), env={"POOL_REDIS_URL": server.url}
        )
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert server.url in done.stdout and "\nlost: 0\n" in done.stdout


@pytest.mark.integration
def test_ctrl_c_stops_everything_the_demo_started(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    base = {**os.environ, "POOL_REDIS_URL": ""}
    demo = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from poolkeeper.cli import main; main()",
            "demo",
            "--tasks",
            "500",
            "--workdir",
            str(workdir),
        ],
        cwd=tmp_path,
        env=base,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for("the demo's beat to start", lambda: "Starting..." in _read(workdir / "beat.log"), 60)
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=90)
    assert demo.returncode == 130 and "interrupted" in err
    assert _processes_mentioning(str(workdir)) == []


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # the process ended while we looked
        if text in args:
            found.append(args)
    return found
