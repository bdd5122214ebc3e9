"""Child executions with real processes: a ``poolctl worker`` command spawns children, the worker dies.

The server, the worker, its command and the children are subprocesses; the
children register and heartbeat with ``poolctl child`` and the environment the
worker gave the command. After SIGKILL nothing heartbeats the run: its lease
ends, the expire pass's own code re-offers the row, and every child must be
retired, its late writes refused as stale with nothing changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import ServeProc, wait_for
from store import PoolStore, queries
from tasks import expire
from tasks.plane import Plane
from tests.factories import row_state, serving

SECRET = "children-test-secret-" + "0123456789abcdef" * 3
POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]
CHILDREN = 3

# Each child heartbeats through the CLI until it is refused, logging every answer; it runs in a
# session of its own, so killing the worker and its command leaves it running, as a stray would.
CHILD = """
import json, subprocess, sys, time
poolctl = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]
deadline = time.monotonic() + 120
with open(sys.argv[1], "a") as log:
    while time.monotonic() < deadline:
        done = subprocess.run(poolctl + ["child", "heartbeat"], capture_output=True, text=True)
        log.write(json.dumps({"rc": done.returncode, "err": done.stderr}) + "\\n")
        log.flush()
        if done.returncode != 0:
            break
        time.sleep(0.5)
"""

# The worker's command: registers the children with `poolctl child register` and starts them.
COMMAND = """
import os, subprocess, sys, time
work = sys.argv[1]
with open(os.path.join(work, "command.pid"), "w") as f:
    f.write(str(os.getpid()))
poolctl = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]
for n in range(int(sys.argv[2])):
    got = subprocess.run(poolctl + ["child", "register", "--key", f"c{n}"], capture_output=True, text=True)
    if got.returncode != 0:
        sys.exit(f"register: {got.stderr}")
    child = subprocess.Popen(
        [sys.executable, os.path.join(work, "child.py"), os.path.join(work, f"child{n}.log")],
        env={**os.environ, "POOL_CHILD_ID": got.stdout.strip()},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    with open(os.path.join(work, f"child{n}.pid"), "w") as f:
        f.write(str(child.pid))
time.sleep(600)
"""


@pytest.fixture
def server(settings: Settings, store: PoolStore, tmp_path: Path) -> Iterator[ServeProc]:
    """Leases of 2 s: the run outlives one only while its worker heartbeats."""
    with serving(settings, tmp_path, secret=SECRET, lease_seconds=2.0) as proc:
        yield proc


def children(store: PoolStore) -> dict[str, dict[str, Any]]:
    with store.session(readonly=True) as s:
        found = s.execute(text("SELECT * FROM child_executions ORDER BY id")).mappings()
        return {r["id"]: dict(r) for r in found}


def poolctl_child(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("POOL_WORKER_", "POOL_CHILD_"))}
    return subprocess.run(
        [*POOLCTL, "child", *args], capture_output=True, text=True, env={**base, **env}, timeout=60
    )


def _kill(pid: int | None, group: bool = False) -> None:
    """SIGKILL a process this test started (or its group), if it ever started: never pid 0, us."""
    if pid is None or pid <= 0:
        return
    with contextlib.suppress(ProcessLookupError):
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)


def _pid(path: Path) -> int | None:
    return int(path.read_text()) if path.exists() and path.read_text() else None


def test_a_killed_workers_children_are_retired_after_expiry_and_refused_after(
    server: ServeProc, store: PoolStore, plane: Plane, tmp_path: Path
) -> None:
    # Given a worker whose command registered three children, each heartbeating from its own process
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={"title": "spawns"})
    with store.session(readonly=True) as s:
        [row] = [r.id for r in queries.rows(s, limit=5)]
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "command.py").write_text(COMMAND)
    command = shlex.join([sys.executable, str(tmp_path / "command.py"), str(tmp_path), str(CHILDREN)])
    token = tokens.ordinal_token(SECRET, 0)
    worker = subprocess.Popen(
        [*POOLCTL, "worker", "--ordinal", "0", "--command", command, "--url", server.url, "--poll", "0.1"],
        env={**os.environ, "POOL_WORKER_TOKEN": token, "POOL_WORKER_STATE_DIR": str(tmp_path / "state")},
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "worker.log").open("wb"),
    )
    pids = [tmp_path / f"child{n}.pid" for n in range(CHILDREN)]
    try:
        wait_for(
            "every child to register and heartbeat",
            lambda: (
                len(got := children(store)) == CHILDREN and {c["status"] for c in got.values()} == {"running"}
            ),
            90,
        )
        wait_for("the command to start every child", lambda: all(_pid(path) for path in pids), 30)
        held = row_state(store, row)
        assert (held["state"], held["attempt"]) == ("running", 1)

        # When the worker and its command are SIGKILLed, and the expire pass runs once the lease ended
        worker.kill()
        worker.wait(30)
        _kill(_pid(tmp_path / "command.pid"), group=True)  # the command leads its own session
        wait_for(
            "the lease to end",
            lambda: row in _due(store),
            30,
        )
        assert {c["status"] for c in children(store).values()} == {
            "running"
        }  # the lease ends them, not the kill
        with store.connection() as conn:
            assert expire.run_in(conn, plane, [row], time.time()) == {row: "reoffered"}

        # Then every child is retired with the grant, its receipt compacted
        again = row_state(store, row)
        assert (again["state"], again["attempt"]) == ("assigned", 2)
        retired = children(store)
        assert len(retired) == CHILDREN
        for child in retired.values():
            assert (child["status"], child["outcome"], child["receipt"]) == ("terminal", "retired", None)
            assert child["epoch"] == held["fence"]

        # And each stray child process was refused as stale, in one line, and stopped
        for n in range(CHILDREN):
            log = tmp_path / f"child{n}.log"
            wait_for(f"child {n} to be refused", _refused(log), 60)
            answers = [json.loads(line) for line in log.read_text().splitlines()]
            assert answers[0]["rc"] == 0 and answers[-1]["rc"] == 1, answers
            err = answers[-1]["err"].strip()
            assert err.startswith("poolctl: ") and "stale child refused" in err and "\n" not in err, err

        # And a late heartbeat or result of a retired child, with its grant's child token, changes nothing
        before = (row_state(store, row), children(store))
        some = next(iter(retired))
        env = {
            "POOL_WORKER_URL": server.url,
            "POOL_CHILD_TOKEN": tokens.child_token(SECRET, row, held["fence"]),
            "POOL_FENCE": str(held["fence"]),
            "POOL_CHILD_ID": some,
        }
        for args in (("heartbeat",), ("result", "--payload", '{"late": true}')):
            late = poolctl_child(*args, env=env)
            assert late.returncode == 1, late.stderr
            assert (
                late.stderr.strip().splitlines() == [late.stderr.strip()] and "Traceback" not in late.stderr
            )
            assert "stale child refused" in late.stderr, late.stderr
        assert (row_state(store, row), children(store)) == before
    finally:
        _kill(worker.pid)
        _kill(_pid(tmp_path / "command.pid"), group=True)
        for path in pids:
            _kill(_pid(path))
    assert "Traceback" not in server.text()


def _refused(log: Path) -> Callable[[], bool]:
    return lambda: log.exists() and '"rc": 1' in log.read_text()


def _due(store: PoolStore) -> list[int]:
    with store.session(readonly=True) as s:
        return [d.id for d in queries.due_expired(s, now=time.time(), limit=10)]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("heartbeat", "--child", "run:1/child:" + "0" * 12), {}, "POOL_WORKER_URL: not set"),
        (("heartbeat",), {"POOL_WORKER_URL": "http://127.0.0.1:9"}, "--child: missing"),
        (
            ("heartbeat", "--child", "run:1/child:" + "0" * 12),
            {"POOL_WORKER_URL": "http://127.0.0.1:9", "POOL_FENCE": "x1"},
            "POOL_FENCE: expected a positive integer",
        ),
        (("result", "--payload", "[1]"), {}, "--payload: expected a JSON object, got list"),
        (("result", "--payload", "{"), {}, "--payload: not JSON"),
        (("register",), {"POOL_ROW_ID": "1", "POOL_ATTEMPT": "1", "POOL_FENCE": "1"}, "POOL_OWNER: not set"),
        (
            ("register",),
            {"POOL_ROW_ID": "9" * 30, "POOL_ATTEMPT": "1", "POOL_FENCE": "1", "POOL_OWNER": "w"},
            "POOL_ROW_ID: expected a positive integer",
        ),
    ],
)
def test_poolctl_child_refuses_a_missing_or_bad_setting_in_one_line(
    args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    done = poolctl_child(*args, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"poolctl: {done.stderr.strip().removeprefix('poolctl: ')}"
    assert message in done.stderr and "\n" not in done.stderr.strip() and "Traceback" not in done.stderr


def test_a_token_the_server_refuses_is_a_refused_request_not_stale(
    server: ServeProc, store: PoolStore
) -> None:
    """401 (not this server's token) and 403 (another grant's) exit 2, as in `poolctl worker`; stale is 1."""
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={"title": "x"})
    grant = store.offer(0, owner="w")
    assert grant is not None
    env = {
        "POOL_WORKER_URL": server.url,
        "POOL_ROW_ID": str(grant.row_id),
        "POOL_ATTEMPT": str(grant.attempt),
        "POOL_FENCE": str(grant.fence),
        "POOL_OWNER": grant.owner,
    }
    for token, status in (
        (tokens.child_token("another-secret-" + "0" * 32, grant.row_id, grant.fence), "401"),
        (tokens.child_token(SECRET, grant.row_id, grant.fence + 1), "403"),
        (tokens.ordinal_token(SECRET, 1), "403"),
    ):
        done = poolctl_child("register", env={**env, "POOL_CHILD_TOKEN": token})
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"poolctl: {status} "), (
            done.stderr
        )
    assert children(store) == {}
