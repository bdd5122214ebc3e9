"""``poolctl worker`` end to end: a real command per grant, over a real ``poolctl serve``.

The worker and the server are subprocesses; the store is read back directly.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import ServeProc, wait_for
from store import PoolStore
from tests.factories import row_state
from tests.helpers import POOLCTL, SECRET, finished, given_run, python, state_dir, worker

ECHO = """
import json, os, sys, time
payload = json.load(sys.stdin)
time.sleep(3)  # two leases' worth: only heartbeats keep the grant
env = os.environ
print("title:", payload["title"], "task:", env["POOL_TASK_ID"])
names = ("POOL_ROW_ID", "POOL_ATTEMPT", "POOL_FENCE", "POOL_OWNER", "POOL_WORKER_URL", "POOL_CHILD_TOKEN")
print(json.dumps({name: env.get(name) for name in names}))
with open(sys.argv[1], "w") as f:  # all of it, to look for what must not be there
    json.dump(dict(env), f)
print("working", file=sys.stderr)
"""


def test_a_command_runs_with_the_payload_on_stdin_and_its_output_is_the_result(
    server: ServeProc, store: PoolStore, tmp_path: Path
) -> None:
    row = given_run(store, {"title": "hello"})
    seen = tmp_path / "env.json"
    log = finished(worker(server, f"{python(ECHO)} {shlex.quote(str(seen))}", "--once"))
    state = row_state(store, row)
    assert state["state"] == "result", log[-3000:]
    result = json.loads(state["result"])
    first, grant_env = result.pop("stdout_tail").splitlines()
    assert result == {"status": "done", "exit_code": 0, "stderr_tail": "working\n"}
    assert first == "title: hello task: t1"
    assert json.loads(grant_env) == {  # what `poolctl child` needs to register and report children
        "POOL_ROW_ID": str(row),
        "POOL_ATTEMPT": "1",
        "POOL_FENCE": str(state["fence"]),
        "POOL_OWNER": state["owner"],
        "POOL_WORKER_URL": server.url,
        "POOL_CHILD_TOKEN": tokens.child_token(SECRET, row, state["fence"]),  # this grant's children only
    }
    # The command is untrusted work: neither the ordinal's token nor the server's secret reaches it
    env = json.loads(seen.read_text())
    assert "POOL_WORKER_TOKEN" not in env and not any(k.startswith("POOL_SERVER_SECRET") for k in env)
    everything = json.dumps(env)
    assert tokens.ordinal_token(SECRET, 0) not in everything and SECRET not in everything


def test_a_failing_command_parks_its_run_with_the_exit_code_and_last_error_line(
    server: ServeProc, store: PoolStore
) -> None:
    row = given_run(store, {"title": "x"})
    script = "import sys; print('x' * 10000); sys.stderr.write('first\\nboom\\n'); sys.exit(3)"
    finished(worker(server, python(script), "--once"))
    result = json.loads(row_state(store, row)["result"])
    assert result["status"] == "blocked" and result["reason"] == "exit code 3: boom"
    assert result["exit_code"] == 3 and len(result["stdout_tail"]) == 4096  # the bounded tail


def test_sigterm_stops_the_command_and_releases_the_run(
    server: ServeProc, store: PoolStore, tmp_path: Path
) -> None:
    row = given_run(store, {"title": "long"})
    pidfile = tmp_path / "child.pid"
    script = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    proc = worker(server, python(script))
    wait_for("the command to start", lambda: pidfile.exists() and pidfile.read_text(), 60)
    child = int(pidfile.read_text())
    time.sleep(2)  # past its first lease: heartbeats are keeping it
    assert row_state(store, row)["state"] == "running"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    log = finished(proc, timeout=30)
    assert time.monotonic() - started < 15
    state = row_state(store, row)
    assert (state["state"], state["attempt"]) == ("assigned", 2), log[-3000:]  # re-offered at once
    assert "released (reoffered)" in log
    assert (
        not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()
    )


def test_a_command_that_cannot_start_is_a_blocked_result(server: ServeProc, store: PoolStore) -> None:
    row = given_run(store, {"title": "x"})
    finished(worker(server, "/nonexistent/program --flag", "--once"))
    result = json.loads(row_state(store, row)["result"])
    assert result["status"] == "blocked"
    assert result["reason"].startswith("cannot run the command: FileNotFoundError")


def test_a_token_of_another_ordinal_stops_the_worker_with_one_line(
    server: ServeProc, store: PoolStore
) -> None:
    given_run(store, {"title": "x"})
    proc = worker(server, "true", token=tokens.ordinal_token(SECRET, 1))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "403 Forbidden" in err and "Traceback" not in err  # refused: not retried
    assert err.strip().splitlines()[-1].startswith("poolctl: 403 Forbidden")


PEEK = """
import os
keeper = open(f"/proc/{os.getppid()}/stat").read()  # the command's keeper, a child of the worker
worker = int(keeper[keeper.rfind(")") + 2 :].split()[1])
try:
    seen = open(f"/proc/{worker}/environ", "rb").read()
except PermissionError:
    print("denied")
else:
    print("read", len(seen))
"""


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="no /proc here")
def test_the_command_cannot_read_the_workers_token_from_proc(
    server: ServeProc, store: PoolStore, tmp_path: Path
) -> None:
    """Same user, so only the worker being undumpable keeps its environment (the token) from the command."""
    prefix: list[str] = []
    if os.geteuid() == 0:  # root reads any process; without its capabilities it is any same-user process
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root, and no setpriv to drop root's capabilities")
        prefix = [setpriv, "--bounding-set", "-all", "--inh-caps", "-all"]
    row = given_run(store, {"title": "peek"})
    secret_file = tmp_path / "token"
    secret_file.write_text(tokens.ordinal_token(SECRET, 0) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_WORKER_TOKEN")}
    proc = subprocess.Popen(
        [
            *prefix,
            *POOLCTL,
            "worker",
            "--ordinal",
            "0",
            "--command",
            python(PEEK),
            "--url",
            server.url,
            "--once",
        ],
        env={
            **env,
            "POOL_WORKER_TOKEN_FILE": str(secret_file),
            "POOL_WORKER_STATE_DIR": str(state_dir(server)),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    finished(proc)
    result = json.loads(row_state(store, row)["result"])
    assert result["stdout_tail"] == "denied\n", result


def test_the_token_file_and_a_token_are_one_or_the_other(server: ServeProc, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(tokens.ordinal_token(SECRET, 0))
    for extra, env, words in (
        (["--token-file", str(tmp_path / "token")], {"POOL_WORKER_TOKEN": "x"}, "not both"),
        (
            ["--token-file", str(tmp_path / "missing")],
            {},
            "--token-file (POOL_WORKER_TOKEN_FILE): cannot read",
        ),
    ):
        done = subprocess.run(
            [*POOLCTL, "worker", "--ordinal", "0", "--command", "true", "--url", server.url, *extra],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and last.startswith("poolctl: ") and words in last, done.stderr


def test_once_against_a_port_where_nothing_listens_gives_up_within_its_bound(server: ServeProc) -> None:
    # Given a port where nothing listens (a mistyped one)
    server.stop()
    # When a worker is told to serve once there, giving up after 2 s without an answer
    started = time.monotonic()
    proc = worker(server, "true", "--once", "--give-up", "2", "--poll", "0.1")
    try:
        _, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("poolctl worker --once still polling a port where nothing listens after 40 s")
    took = time.monotonic() - started
    # Then it exits 69 (nothing listens), its last line naming where, within the bound and one offer's tries
    assert proc.returncode == 69, err[-2000:]
    assert f"127.0.0.1:{server.port}" in err.strip().splitlines()[-1]
    assert took <= 2 + 15, f"gave up after {took:.1f}s"


def test_the_help_says_once_gives_up() -> None:
    done = subprocess.run([*POOLCTL, "worker", "--help"], capture_output=True, text=True, timeout=60)
    assert "--give-up" in done.stdout and "gives up" in " ".join(done.stdout.split())


def test_a_long_running_worker_says_once_when_its_server_is_back(
    server: ServeProc, settings: Settings, tmp_path: Path
) -> None:
    # Given a worker polling its server
    proc = worker(server, "true", "--poll", "0.1", "--wait", "0")  # its offers answered at once
    again = None
    try:
        time.sleep(1.5)
        # When the server goes away for a while and comes back on the same port
        server.stop()
        time.sleep(8)  # longer than the client's own retries of one call (about 3 to 6 s)
        env = replace(settings, lease_seconds=1.5).env()
        again = ServeProc(env, tmp_path, secret=SECRET, name="serve-again", port=server.port).wait_ready()
        time.sleep(2)  # a few offers answered
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        if again is not None:
            again.stop()
    # Then its log says so, once
    back = [line for line in err.splitlines() if "answers again" in line]
    assert len(back) == 1, err[-3000:]
    assert f"the server at {server.url} answers again, after" in back[0]
