"""A run executes once through any process death of ``poolctl worker`` or ``poolctl serve`` (issue 17).

Real processes and real signals: a real ``serve`` over the test's store, real
workers (``tests.helpers``), SIGKILL. The command records each of
its executions in a file, from inside: ``start <pid> <fence>``, ``child <pid>``
for a grandchild it leaves running, ``end <pid>``, and ``overlap <pid>`` when it
starts while an earlier execution (or its grandchild) still lives.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core.errors import InvalidInput, NotFound, StaleHolder, TransientError
from poolkeeper.embedded import ServeProc, wait_for
from poolkeeper.workerhost.client import Grant, PoolClient
from poolkeeper.workerhost.state import RESULT
from poolkeeper.workerhost.worker import CommandWorker, Held, printable, storable
from store import PoolStore
from tests.factories import row_state
from tests.helpers import finished, given_run, python, worker
from tests.worker.conftest import Outage, gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

RECORD = r"""
import os, subprocess, sys, time
log, mode = sys.argv[1], sys.argv[2]


def alive(pid):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def write(line):
    with open(log, "a") as f:
        f.write(line + "\n")


seen = open(log).read().splitlines() if os.path.exists(log) else []
for words in map(str.split, seen):
    if words[0] in ("start", "child") and alive(int(words[1])):
        write(f"overlap {words[1]}")
first = not any(line.startswith("start") for line in seen)
write(f"start {os.getpid()} {os.environ['POOL_FENCE']}")
if mode == "hang" and first:  # a grandchild in the command's group (as nohup leaves it), then hang
    nohup = "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_IGN); time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", nohup])
    write(f"child {child.pid}")
    time.sleep(120)
if mode == "gate":  # finish once the test says so
    while not os.path.exists(log + ".go"):
        time.sleep(0.05)
if mode == "garbage":
    os.write(2, b"first\nbad \x00nul \x1b[31mred\x1b[0m \xff\xfe\xed\xa0\x80 \x07\n")
    write(f"end {os.getpid()}")
    sys.exit(3)
write(f"end {os.getpid()}")
"""


def recording(log: Path, mode: str) -> str:
    return f"{python(RECORD)} {log} {mode}"


def executions(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def started(log: Path, n: int = 1) -> Callable[[], bool]:
    return lambda: sum(w[0] == "start" for w in executions(log)) >= n


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids a test may leave alive when it fails (on code without the fix): killed afterwards."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_workers_command_and_its_grandchild_die_with_it(
    server: ServeProc, store: PoolStore, tmp_path: Path, leftovers: list[int]
) -> None:
    given_run(store, {"title": "hang"})
    log = tmp_path / "runs.log"
    proc = worker(server, recording(log, "hang"))
    wait_for("the command and its grandchild", lambda: any(w[0] == "child" for w in executions(log)), 60)
    pids = [int(w[1]) for w in executions(log) if w[0] in ("start", "child")]
    leftovers.extend(pids)
    proc.kill()  # SIGKILL: no handler, no atexit
    proc.wait(10)
    wait_for("the command's group to die with its worker", lambda: all(map(gone, pids)), 10)


def test_a_restarted_worker_never_starts_the_command_beside_a_live_copy(
    outage: Outage, store: PoolStore, tmp_path: Path, leftovers: list[int]
) -> None:
    """The worker and its command's keeper die at once: only the state directory names the grandchild."""
    row = given_run(store, {"title": "hang"})
    log = tmp_path / "runs.log"
    first = worker(outage.proc, recording(log, "hang"))
    wait_for("the command and its grandchild", lambda: any(w[0] == "child" for w in executions(log)), 60)
    command = int(executions(log)[0][1])
    leftovers.extend(int(w[1]) for w in executions(log) if w[0] in ("start", "child"))
    keeper = parent_of(command)
    if keeper != first.pid:  # a keeper between them: stopped, so it cannot clean up when the worker dies
        os.kill(keeper, signal.SIGSTOP)
    first.kill()
    first.wait(10)
    if keeper != first.pid:
        os.kill(keeper, signal.SIGKILL)
    err = finished(worker(outage.proc, recording(log, "hang"), "--once"))
    runs = executions(log)
    assert [w[0] for w in runs if w[0] in ("start", "overlap")] == ["start", "start"], (runs, err[-3000:])
    assert runs[0][2] != runs[-2][2]  # the second execution ran under a new fence
    assert "ending process group" in err  # the one the state directory named
    assert row_state(store, row)["state"] == "result"
    assert all(gone(int(w[1])) for w in runs if w[0] == "child")


def test_a_result_waits_out_a_serve_outage_longer_than_the_clients_retries(
    outage: Outage, store: PoolStore, tmp_path: Path
) -> None:
    row = given_run(store, {"title": "gate"})
    log = tmp_path / "runs.log"
    proc = worker(outage.proc, recording(log, "gate"), "--once")
    try:
        wait_for("the command to start", started(log), 60)
        outage.down()
        Path(f"{log}.go").touch()
        wait_for("the command to end", lambda: any(w[0] == "end" for w in executions(log)), 10)
        time.sleep(7)  # the outage: longer than the client's six tries (at most 6.2 s of backoff)
        outage.up()
        err = finished(proc, timeout=60)
    finally:
        proc.kill()
    state = row_state(store, row)
    assert state["state"] == "result", err[-3000:]
    assert json.loads(state["result"])["status"] == "done"
    assert [w[0] for w in executions(log)] == ["start", "end"]  # executed once
    assert str(state["fence"]) == executions(log)[0][2]


def test_a_restarted_worker_delivers_the_spooled_result_before_asking_for_a_grant(
    outage: Outage, store: PoolStore, tmp_path: Path
) -> None:
    row = given_run(store, {"title": "gate"})
    log = tmp_path / "runs.log"
    first = worker(outage.proc, recording(log, "gate"))
    wait_for("the command to start", started(log), 60)
    spool = outage.spooled_then_killed(first, log)
    err = finished(worker(outage.proc, recording(log, "gate"), "--once"))
    state = row_state(store, row)
    assert state["state"] == "result", err[-3000:]
    assert str(state["fence"]) == executions(log)[0][2]  # delivered under the old grant's fence
    assert [w[0] for w in executions(log)] == ["start", "end"]  # executed once
    assert "delivering the result spooled under fence" in err and "starting" not in err
    assert not spool.exists()


def test_a_command_whose_stderr_the_store_would_refuse_is_parked_with_its_exit_code(
    server: ServeProc, store: PoolStore, tmp_path: Path
) -> None:
    row = given_run(store, {"title": "garbage"})
    log = tmp_path / "runs.log"
    proc = worker(server, recording(log, "garbage"), "--once")
    try:
        err = finished(proc, timeout=30)
    finally:
        proc.kill()
    state = row_state(store, row)
    assert state["state"] == "result", err[-3000:]
    result = json.loads(state["result"])
    assert result["status"] == "blocked" and result["exit_code"] == 3
    reason = r"exit code 3: bad \x00nul \x1b[31mred\x1b[0m \xff\xfe\xed\xa0\x80 \x07"
    assert result["reason"] == reason
    assert [w[0] for w in executions(log)] == ["start", "end"]  # executed once


def test_output_is_escaped_and_bounded_to_what_the_store_takes() -> None:
    noise = bytes(range(256)) * 40 + "ü€😀".encode()
    text = printable(noise)
    assert len(text) <= 4096 and text.endswith("ü€😀")
    assert "\x00" not in text and "\x1b" not in text and "\\x00" in text
    huge = {"status": "blocked", "reason": "x", "exit_code": 1, "stdout_tail": "y" * 70_000}
    assert storable(huge) == {
        "status": "blocked",
        "reason": "exit code 1: the store refused the command's output (payload: larger than 65536 bytes)",
        "exit_code": 1,
    }
    nul = {"status": "blocked", "reason": "x\x00", "exit_code": 1}  # the first refusal is the one named
    assert storable(nul) == {
        "status": "blocked",
        "reason": "exit code 1: the store refused the command's output"
        " (payload.reason: must not contain a NUL character)",
        "exit_code": 1,
    }


class Answers(PoolClient):
    """A client whose deliveries get the given answers in turn (an exception is raised)."""

    def __init__(self, *answers: str | Exception) -> None:
        super().__init__("http://127.0.0.1:1")
        self.answers, self.beats = list(answers), 0
        self.sent: list[tuple[dict[str, Any], str | None]] = []

    def deliver(self, grant: Grant, result: Mapping[str, Any], delivery_id: str | None = None) -> str:
        self.sent.append((dict(result), delivery_id))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def heartbeat(self, grant: Grant, delivery_id: str | None = None) -> str:
        self.beats += 1
        return "accepted"


def held_result(tmp_path: Path, client: Answers) -> tuple[CommandWorker, Held]:
    runner = CommandWorker(client, 0, ["true"], state_dir=tmp_path)
    runner.state.lock()
    grant = Grant(1, "b", "t1", 1, 0, "w:1:a", 1, 7, 0.0, {}, "0" * 64, 1, lease_seconds=3)
    held = Held(grant, {"status": "blocked", "reason": "exit code 3", "exit_code": 3}, "d1", time.time() + 3)
    runner.state.write(RESULT, held.record())
    return runner, held


def test_a_result_refused_as_invalid_is_sent_without_its_output_under_a_new_delivery_id(
    tmp_path: Path,
) -> None:
    client = Answers(InvalidInput("payload.reason", "must not contain a NUL character"), "applied")
    runner, held = held_result(tmp_path, client)
    assert runner._deliver(held)
    (_, first_id), (second, second_id) = client.sent
    assert first_id == "d1" and second_id not in (None, "d1")
    assert second == {
        "status": "blocked",
        "reason": "exit code 3: the store refused the command's output"
        " (payload.reason: must not contain a NUL character)",
        "exit_code": 3,
    }
    assert runner.state.read(RESULT) is None


@pytest.mark.parametrize("refusal", [StaleHolder("fence: current fence is 8"), NotFound("no assignment")])
def test_a_stale_refusal_drops_the_spool_and_the_grant_is_never_run_again(
    tmp_path: Path, refusal: Exception
) -> None:
    runner, held = held_result(tmp_path, Answers(refusal))
    assert not runner._deliver(held)
    assert runner.state.read(RESULT) is None and held.grant.fence in runner.answered


def test_a_transient_failure_is_retried_with_the_same_delivery_id_and_heartbeats(tmp_path: Path) -> None:
    busy = TransientError("/v1/result: 503 busy (after 6 tries)")
    client = Answers(busy, busy, busy, "applied")
    runner, held = held_result(tmp_path, client)
    assert runner._deliver(replace(held, lease_end=time.time() + 1))  # a heartbeat is due at once
    assert [d for _, d in client.sent] == ["d1"] * 4 and client.beats >= 1
    assert runner.state.read(RESULT) is None
