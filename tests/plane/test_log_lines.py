"""The log lines of the real processes one run crosses: the Celery worker and beat, ``poolctl serve``
and ``poolctl worker``. With POOL_LOG_FORMAT=json every line is one JSON object carrying the ids of
the run it is about; in either format no token, secret or password appears."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.logs import IDS
from poolkeeper import tokens
from poolkeeper.embedded import ServeProc, wait_for
from tests.helpers import POOLCTL, SECRET, PlaneEnv, poolctl, python

pytestmark = pytest.mark.integration

DONE = python("import sys; sys.stdin.read(); print('done')")


def run_one_task(env: PlaneEnv) -> tuple[dict[str, str], Any]:
    """One task through every process; each process's log text and the run's row."""
    server = ServeProc({**env.settings.env()}, env.tmp, secret=SECRET, command=("serve", "--access-log"))
    env.worker("w1")
    env.beat()
    server.wait_ready()
    # A token in a URL (a console link pasted with its token): the access line must not show it.
    httpx.get(f"{server.url}/ui/?token={tokens.operator_token(SECRET)}", timeout=5)
    worker = subprocess.Popen(
        [*POOLCTL, "worker", "--ordinal", "0", "--command", DONE, "--url", server.url, "--once"],
        env={
            **os.environ,
            **env.settings.env(),
            "POOL_WORKER_TOKEN": tokens.ordinal_token(SECRET, 0),
            "POOL_WORKER_STATE_DIR": str(env.tmp / "worker-state"),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        [task] = env.add_tasks(1)
        wait_for("the task done", lambda: env.board_done([task]), 60)
        wait_for("its row finalized", lambda: env.rows()[task].state == "finalized", 30)
        _, worker_log = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop()
        for proc in env.procs:
            proc.stop()
    logs = {"celery worker": env.procs[0].text(), "beat": env.procs[1].text(), "serve": server.text()}
    return {**logs, "poolctl worker": worker_log}, env.rows()[task]


def secrets_of(row: Any) -> list[str]:
    """The server secret and the MACs of the tokens the run was served with (the child's is its command's)."""
    macs = [
        tokens.ordinal_token(SECRET, 0),
        tokens.operator_token(SECRET),
        tokens.child_token(SECRET, row.id, row.fence),
    ]
    return [SECRET, *(token.rsplit(".", 1)[1] for token in macs)]


def grant_of(row: Any) -> dict[str, Any]:
    return {"row_id": row.id, "run_id": row.run_id, "task_id": row.task_id, "ordinal": 0, "fence": row.fence}


@pytest.mark.plane_settings(pool_size=1, log_format="json")
def test_every_line_of_every_process_is_a_json_object_with_the_ids_of_its_run(env: PlaneEnv) -> None:
    logs, row = run_one_task(env)
    lines = {name: [json.loads(line) for line in text.splitlines() if line] for name, text in logs.items()}
    for name, parsed in lines.items():
        assert parsed, f"{name} logged nothing"
        for line in parsed:
            assert {"time", "level", "logger", "message"} <= set(line) <= {*line_keys()}, (name, line)

    def about_the_run(name: str) -> list[dict[str, Any]]:
        return [line for line in lines[name] if "task_id" in line or "row_id" in line]

    grant = grant_of(row)
    worker = about_the_run("poolctl worker")
    assert worker and all({k: line[k] for k in grant} == grant for line in worker)  # every grant line
    assert any("starting" in line["message"] for line in worker)
    served = about_the_run("serve")
    offer = [line for line in served if "/v1/offer" in line["message"]]
    assert offer and {k: offer[0][k] for k in grant} == grant  # the access line of the offer that granted it
    assert any("/v1/result" in line["message"] and line["fence"] == row.fence for line in served)
    plane = about_the_run("celery worker")
    materialized = [line for line in plane if line["message"].startswith("materialize")]
    assert materialized and materialized[0]["task_id"] == row.task_id and materialized[0]["ordinal"] == 0
    assert any(line.get("row_id") == row.id and "finalized" in line["message"] for line in plane)
    everything = "\n".join(logs.values())
    assert not [s for s in secrets_of(row) if s in everything]
    assert "token=op.***" in logs["serve"]


@pytest.mark.plane_settings(pool_size=1)
def test_text_lines_keep_today_s_layout_and_show_no_token(env: PlaneEnv) -> None:
    logs, row = run_one_task(env)
    everything = "\n".join(logs.values())
    assert not [s for s in secrets_of(row) if s in everything]
    assert "token=op.***" in logs["serve"]
    assert ": INFO/MainProcess] " in logs["celery worker"]  # Celery's own layout
    assert " INFO poolkeeper.workerhost.worker: " in logs["poolctl worker"]  # core.logs.TEXT_FORMAT
    for text in logs.values():
        assert not text.lstrip().startswith("{")


def line_keys() -> tuple[str, ...]:
    return ("time", "level", "logger", "message", *IDS, "trace_id", "span_id", "exception", "stack")


def test_the_demo_s_processes_log_json_lines_when_asked(tmp_path: Path) -> None:
    """The demo hands POOL_LOG_FORMAT to its worker, beat, serve and board serve (its one other variable)."""
    workdir = tmp_path / "demo"
    args = (
        "demo",
        "--tasks",
        "3",
        "--poison",
        "0",
        "--pool-size",
        "2",
        "--board",
        "http",
        "--timeout",
        "240",
    )
    done = poolctl(
        tmp_path, *args, "--workdir", str(workdir), env={"POOL_REDIS_URL": "", "POOL_LOG_FORMAT": "json"}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = {p.name: p.read_text().splitlines() for p in sorted(workdir.glob("*.log"))}
    assert set(logged) == {"worker.log", "beat.log", "serve.log", "board-serve.log"}
    for name, text in logged.items():
        lines = [json.loads(line) for line in text if line]
        assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines), name
    finalized = [json.loads(line) for line in logged["worker.log"] if "finalized" in line]
    assert finalized and all("row_id" in line or "," in line["message"] for line in finalized)


BILLIARD_LINE = """
from tasks.celery import app
from billiard.util import get_logger
app.log.setup_logging_subsystem(loglevel="INFO")
get_logger().error("Process %r pid:%r exited with %r", "ForkPoolWorker-1", 1, "signal 15 (SIGTERM)")
"""


def test_a_pool_child_s_exit_is_a_json_line_too() -> None:
    """Celery gives billiard's logger a handler of its own: a pool child's exit, at shutdown, goes there."""
    env = {**os.environ, "POOL_LOG_FORMAT": "json", "POOL_REDIS_URL": "memory://"}
    script = [sys.executable, "-c", BILLIARD_LINE]
    done = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line]
    assert [line["message"] for line in lines if "exited with" in line["message"]], done.stderr
