"""``poolctl worker --call``: a Python callable per grant in a long-lived runner, over a real ``serve``.

Real processes and signals: the server, the worker and its runner are subprocesses; the store
is read back directly. The example's callables (examples/pyworker/jobs.py) complete runs;
``HANG`` (a module written per test) records each call from inside (``start <pid> <attempt>``,
``child <pid>``, ``cancelled <pid> <ctx.cancelled()>``) and hangs on the first attempt, exits mid-call, or
waits for a gate file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from poolkeeper import tokens
from poolkeeper.embedded import ServeProc, wait_for
from poolkeeper.worker import serve
from store import PoolStore
from tests.factories import holder_envelope, row_state
from tests.helpers import POOLCTL, SECRET, finished, given_run, state_dir, worker
from tests.worker.conftest import Outage, gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pyworker"

HANG = r"""
import asyncio, os, subprocess, sys, time


def record(ctx, line):
    with open(ctx.payload["log"], "a") as f:
        f.write(line + "\n")


def sync_hang(ctx):
    record(ctx, f"start {os.getpid()} {ctx.attempt}")
    if ctx.attempt == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record(ctx, f"child {child.pid}")
        time.sleep(120)
    return {"runner": os.getpid()}


async def async_hang(ctx):
    record(ctx, f"start {os.getpid()} {ctx.attempt}")
    if ctx.attempt == 1:
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            record(ctx, f"cancelled {os.getpid()} {ctx.cancelled()}")
            raise
    return {"runner": os.getpid()}


def dies(ctx):
    record(ctx, f"start {os.getpid()} {ctx.attempt}")
    print("about to go", flush=True)
    os._exit(7)


def gate(ctx):
    record(ctx, f"start {os.getpid()} {ctx.attempt}")
    while not os.path.exists(ctx.payload["log"] + ".go"):
        time.sleep(0.05)
    record(ctx, f"end {os.getpid()}")
    return "through"
"""


@pytest.fixture
def hang(tmp_path: Path) -> Iterator[Path]:
    """A directory holding ``hang.py``; pids a test records there are killed afterwards if alive."""
    home = tmp_path / "jobs"
    home.mkdir()
    (home / "hang.py").write_text(HANG)
    yield home
    for words in calls(home / "calls.log"):
        if words[0] in ("start", "child") and not gone(int(words[1])):
            os.kill(int(words[1]), signal.SIGKILL)


def calls(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def result(store: PoolStore, row: int, log: str = "") -> dict[str, Any]:
    state = row_state(store, row)
    assert state["state"] == "result", log[-3000:]
    found: dict[str, Any] = json.loads(state["result"])
    return found


def released(store: PoolStore, row: int) -> str:
    """The run handed back under its current grant, as its worker would: attempt+1 is offered, and
    the worker's next heartbeat for the old grant is refused (stale)."""
    return store.release(holder_envelope(store, row, uuid.uuid4().hex))


def test_a_sync_callable_completes_a_run_with_its_return_and_output(
    server: ServeProc, store: PoolStore
) -> None:
    row = given_run(store, {"title": "three little words"})
    log = finished(worker(server, "", "--once", call="jobs:count_words", cwd=EXAMPLE))
    got = result(store, row, log)
    runner = got["return"].pop("runner")
    assert got == {
        "status": "done",
        "exit_code": 0,
        "return": {"words": 3},
        "stdout_tail": "b/t1 attempt 1: 3 words\n",
        "stderr_tail": "",
    }
    assert runner != 0 and "jobs:count_words imported, runner in process group" in log
    assert gone(runner)  # ended with its worker


def test_a_raising_callable_parks_its_run_with_the_exceptions_line(
    server: ServeProc, store: PoolStore
) -> None:
    row = given_run(store, {"title": ""})
    log = finished(worker(server, "", "--once", call="jobs:count_words", cwd=EXAMPLE))
    got = result(store, row, log)
    assert got["status"] == "blocked" and got["exit_code"] == 1
    assert got["reason"] == "exit code 1: ValueError: task t1 has no words to count"
    assert got["stderr_tail"].startswith("Traceback (most recent call last):")


def test_an_async_callable_completes_a_run_with_its_children(server: ServeProc, store: PoolStore) -> None:
    row = given_run(store, {"title": "steps", "steps": 2, "seconds": 0.1})
    log = finished(worker(server, "", "--once", call="jobs:steps", cwd=EXAMPLE))
    got = result(store, row, log)
    assert got["status"] == "done" and got["return"]["steps"] == 2
    with store.session(readonly=True) as s:
        children = s.execute(
            text("SELECT status, outcome, depth FROM child_executions WHERE row_id = :r"), {"r": row}
        )
        assert sorted(map(tuple, children)) == [("terminal", "done", 1)] * 2


def test_a_refused_heartbeat_cancels_an_async_call_and_its_runner_serves_the_next_grant(
    server: ServeProc, store: PoolStore, hang: Path
) -> None:
    # Given an async call hanging on attempt 1
    row = given_run(store, {"title": "hang", "log": str(hang / "calls.log")})
    proc = worker(server, "", "--once", call="hang:async_hang", cwd=hang)
    try:
        wait_for("the call to start", lambda: calls(hang / "calls.log"), 60)
        first = int(calls(hang / "calls.log")[0][1])
        # When its run is handed back under it, so its next heartbeat is refused as stale
        assert released(store, row) == "reoffered"
        log = finished(proc, timeout=60)
    finally:
        proc.kill()
    # Then the call was cancelled (and saw it), and the same runner ran attempt 2 to its result
    assert calls(hang / "calls.log") == [
        ["start", str(first), "1"],
        ["cancelled", str(first), "True"],
        ["start", str(first), "2"],
    ], log[-3000:]
    assert "heartbeat refused" in log
    assert result(store, row, log)["return"] == {"runner": first}


def test_a_refused_heartbeat_ends_a_sync_calls_runner_and_a_new_one_serves_the_next_grant(
    server: ServeProc, store: PoolStore, hang: Path
) -> None:
    row = given_run(store, {"title": "hang", "log": str(hang / "calls.log")})
    proc = worker(server, "", "--once", call="hang:sync_hang", cwd=hang)
    try:
        wait_for("the call and its child", lambda: len(calls(hang / "calls.log")) >= 2, 60)
        (_, first, _), (_, child) = calls(hang / "calls.log")
        assert released(store, row) == "reoffered"
        log = finished(proc, timeout=60)
    finally:
        proc.kill()
    # a thread cannot be stopped: its runner (and what the call started) was ended, another took over
    assert gone(int(first)) and gone(int(child))
    [*_, (start, second, attempt)] = calls(hang / "calls.log")
    assert (start, attempt) == ("start", "2") and second != first, log[-3000:]
    assert result(store, row, log)["return"] == {"runner": int(second)}


def test_a_killed_worker_leaves_no_runner_behind(server: ServeProc, store: PoolStore, hang: Path) -> None:
    given_run(store, {"title": "hang", "log": str(hang / "calls.log")})
    proc = worker(server, "", call="hang:sync_hang", cwd=hang)
    wait_for("the call and its child", lambda: len(calls(hang / "calls.log")) >= 2, 60)
    pids = [int(w[1]) for w in calls(hang / "calls.log")]
    proc.kill()  # SIGKILL: no handler, no atexit
    proc.wait(10)
    wait_for("the runner and its child to die with their worker", lambda: all(map(gone, pids)), 10)


def test_a_result_spooled_before_a_kill_is_delivered_by_the_restarted_worker(
    outage: Outage, store: PoolStore, hang: Path
) -> None:
    row = given_run(store, {"title": "gate", "log": str(hang / "calls.log")})
    first = worker(outage.proc, "", call="hang:gate", cwd=hang)
    wait_for("the call to start", lambda: calls(hang / "calls.log"), 60)
    spool = outage.spooled_then_killed(first, hang / "calls.log")
    log = finished(worker(outage.proc, "", "--once", call="hang:gate", cwd=hang))
    assert result(store, row, log)["return"] == "through"
    assert [w[0] for w in calls(hang / "calls.log")] == ["start", "end"]  # executed once
    assert "delivering the result spooled under fence" in log and "starting" not in log
    assert not spool.exists()


@pytest.mark.parametrize(
    ("call", "line"),
    [
        ("jobs.count_words", "poolctl: --call: expected package.module:function, got 'jobs.count_words'"),
        ("nosuch:f", "poolctl: --call: cannot import nosuch: ModuleNotFoundError: No module named 'nosuch'"),
        ("jobs:nosuch", "poolctl: --call: module jobs has no attribute nosuch"),
        ("jobs:__doc__", "poolctl: --call: jobs:__doc__ is not callable (a str)"),
    ],
)
def test_a_bad_call_is_refused_with_one_line_before_the_first_offer(
    server: ServeProc, store: PoolStore, call: str, line: str
) -> None:
    row = given_run(store, {"title": "x"})
    proc = worker(server, "", "--once", call=call, cwd=EXAMPLE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err
    assert "polling" not in err and row_state(store, row)["state"] == "assigned"  # never offered


def test_a_command_and_a_call_are_one_or_the_other(server: ServeProc) -> None:
    done = subprocess.run(
        [*POOLCTL, "worker", "--ordinal", "0", "--url", server.url, "--command", "true", "--call", "jobs:f"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last == "poolctl: --command: give exactly one of --command and --call"


def test_a_module_that_fails_to_import_is_named_in_one_line(server: ServeProc, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import json\nraise RuntimeError('no config here')\n")
    proc = worker(server, "", "--once", call="broken:f", cwd=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last == "poolctl: --call: cannot import broken: RuntimeError: no config here", err[-3000:]


def test_a_runner_that_dies_mid_call_is_that_exit_code_with_its_output(
    server: ServeProc, store: PoolStore, hang: Path
) -> None:
    row = given_run(store, {"title": "dies", "log": str(hang / "calls.log")})
    log = finished(worker(server, "", "--once", call="hang:dies", cwd=hang))
    got = result(store, row, log)
    assert (got["status"], got["reason"], got["stdout_tail"]) == ("blocked", "exit code 7", "about to go\n")
    assert "another takes the next grant" in log


def test_sigterm_cancels_an_async_call_and_releases_its_run(
    server: ServeProc, store: PoolStore, hang: Path
) -> None:
    row = given_run(store, {"title": "hang", "log": str(hang / "calls.log")})
    proc = worker(server, "", call="hang:async_hang", cwd=hang)
    try:
        wait_for("the call to start", lambda: calls(hang / "calls.log"), 60)
        proc.send_signal(signal.SIGTERM)
        log = finished(proc, timeout=30)
    finally:
        proc.kill()
    state = row_state(store, row)
    assert (state["state"], state["attempt"]) == ("assigned", 2), log[-3000:]  # re-offered at once
    assert [w[0] for w in calls(hang / "calls.log")] == ["start", "cancelled"]
    assert "released (reoffered)" in log


def test_the_python_api_serves_a_grant(
    server: ServeProc, store: PoolStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = given_run(store, {"title": "two words"})
    monkeypatch.chdir(EXAMPLE)
    token = tokens.ordinal_token(SECRET, 0)
    code = serve(
        "jobs:count_words", url=server.url, token=token, ordinal=0, once=True, state_dir=state_dir(server)
    )
    assert code == 0
    assert result(store, row)["return"]["words"] == 2
