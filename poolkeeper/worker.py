"""``poolctl worker``: a real pool worker that runs a command for each grant of its ordinal.

Loop: poll ``offer`` until the ordinal has a grant; run the command (argv from
``shlex.split``, never a shell) with the grant's payload as JSON on stdin and
``POOL_BOARD``, ``POOL_TASK_ID``, ``POOL_RUN_ID``, ``POOL_ATTEMPT`` in its
environment, and what registering and reporting child executions takes
(``grant_env``: ``POOL_ROW_ID``, ``POOL_FENCE``, ``POOL_OWNER``, the server's
``POOL_WORKER_URL`` and the grant's ``POOL_CHILD_TOKEN``, which acts only on
this grant's children; ``poolctl child`` reads them). The command never sees
the ordinal's token or the server secret: it is untrusted work, and must not
offer, heartbeat, release or deliver for the ordinal. Heartbeat every third of
the lease while it runs; deliver the result:

- exit 0: ``{"status": "done", "exit_code": 0, "stdout_tail": ..., "stderr_tail": ...}``
- exit N: ``{"status": "blocked", "reason": "exit code N: <last stderr line>", "exit_code": N, ...}``
  (killed by a signal: ``"killed by signal S"``; cannot start: ``"cannot run the command: ..."``)

Tails are the last ``tail_bytes`` (4 KiB) of each stream, decoded as UTF-8.
A refused heartbeat means the run is no longer ours (fenced by a restart or
expiry): the child is stopped and nothing is delivered. SIGTERM or SIGINT stops
the child, releases the run (re-offered at once) and exits 0.

The command runs as the worker's user, so it could read the worker's memory
and ``/proc/<pid>/environ``, where the ordinal's token is: ``forbid_inspection``
(called first by ``poolctl worker``) marks the worker undumpable on Linux, which
closes that to other processes of the user (not to root). The token can come
from a file (``--token-file``) rather than the command line, which every user
can read in ``/proc/<pid>/cmdline``. Real isolation needs the command to run as
another user (docs/design.md, "Worker").
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any

from core import validate
from core.errors import InvalidInput, NotFound, PoolError, ProtocolError, TransientError
from poolkeeper.client import Grant, GrantRef, PoolClient

log = logging.getLogger("poolkeeper.worker")
TAIL_BYTES = 4096
KILL_GRACE_SECONDS = 5.0
URL_ENV, TOKEN_ENV = "POOL_WORKER_URL", "POOL_WORKER_TOKEN"  # what `poolctl worker` reads
TOKEN_FILE_ENV = "POOL_WORKER_TOKEN_FILE"  # or the token in a file, off the command line
CHILD_TOKEN_ENV = "POOL_CHILD_TOKEN"  # the grant's child token: what `poolctl child` authenticates with
# Never passed on to the command (the child token is set anew for each grant).
SCRUBBED_ENV = (TOKEN_ENV, TOKEN_FILE_ENV, CHILD_TOKEN_ENV, "POOL_SERVER_SECRET", "POOL_SERVER_SECRET_FILE")
PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def forbid_inspection() -> bool:
    """Linux: make this process undumpable, so other processes of its user (its command) cannot read
    its memory or ``/proc/<pid>/environ`` (the token), nor ptrace it. Best effort: False, and one log
    line, where that is not available. ``execve`` resets it, so the command itself is unaffected.
    """
    if not sys.platform.startswith("linux"):
        log.info("not on Linux: the command, running as this user, may read this worker's token")
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as err:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed (%s): the command may read this worker's token", err)
        return False
    return True


def default_owner() -> str:
    """This process, as a name the store accepts: host, pid and a random suffix."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60] or "host"
    return f"{host.strip('-.') or 'host'}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class Outcome:
    exit_code: int | None  # None: the command could not start
    stdout: bytes
    stderr: bytes
    error: str = ""

    def result(self) -> dict[str, Any]:
        tails = {"stdout_tail": _text(self.stdout), "stderr_tail": _text(self.stderr)}
        if self.exit_code == 0:
            return {"status": "done", "exit_code": 0, **tails}
        if self.exit_code is None:
            reason = f"cannot run the command: {self.error}"
        elif self.exit_code < 0:
            reason = f"killed by signal {-self.exit_code}"
        else:
            last = next((ln for ln in reversed(tails["stderr_tail"].splitlines()) if ln.strip()), "")
            reason = f"exit code {self.exit_code}" + (f": {last.strip()[:300]}" if last else "")
        return {"status": "blocked", "reason": reason, "exit_code": self.exit_code, **tails}


def _text(data: bytes) -> str:
    return data[-TAIL_BYTES:].decode("utf-8", errors="replace")


class Tail(threading.Thread):
    """Drains one pipe, keeping only the last ``limit`` bytes."""

    def __init__(self, pipe: IO[bytes], limit: int) -> None:
        super().__init__(daemon=True)
        self.pipe, self.limit, self.data = pipe, limit, b""

    def run(self) -> None:
        while chunk := os.read(self.pipe.fileno(), 65536):
            self.data = (self.data + chunk)[-self.limit :]


class CommandWorker:
    def __init__(
        self,
        client: PoolClient,
        ordinal: int,
        argv: Sequence[str],
        *,
        owner: str | None = None,
        poll_seconds: float = 1.0,
        once: bool = False,
    ) -> None:
        if not argv:
            raise InvalidInput("--command", "empty command")
        self.client, self.ordinal, self.argv = client, ordinal, list(argv)
        self.owner = owner or default_owner()
        self.poll, self.once = poll_seconds, once
        self.stopping = threading.Event()

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def run(self) -> int:
        """Serve grants until stopped (or, ``once``, after one delivered result); the exit code."""
        log.info("ordinal %d: worker %s polling", self.ordinal, self.owner)
        while not self.stopping.is_set():
            try:
                grant = self.client.offer(self.ordinal, self.owner)
            except TransientError as err:
                log.warning("offer: %s", err)
                grant = None
            if grant is None:
                self.stopping.wait(self.poll * random.uniform(0.75, 1.25))  # spread the polls of many workers
                continue
            delivered = self.serve(grant)
            if self.once and delivered:
                break
        return 0

    def serve(self, grant: Grant) -> bool:
        """Run the command for one grant; whether its result was delivered."""
        log.info("%s/%s run %d attempt %d: starting", grant.board, grant.task_id, grant.run_id, grant.attempt)
        outcome, ours = self._execute(grant)
        if self.stopping.is_set():
            if ours:
                self._release(grant)
            return False
        if not ours:
            return False
        result = outcome.result()
        try:
            got = self.client.deliver(grant, result)
        except PoolError as err:
            log.warning("%s/%s: result refused: %s", grant.board, grant.task_id, err)
            return False
        log.info("%s/%s: %s (%s)", grant.board, grant.task_id, result["status"], got)
        return True

    def _execute(self, grant: Grant) -> tuple[Outcome, bool]:
        """The command's outcome, and whether the grant is still ours."""
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        env.update(grant_env(grant, self.client.url))
        try:
            child = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the worker, which decides
            )
        except OSError as err:
            return Outcome(None, b"", b"", f"{type(err).__name__}: {err}"), True
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        tails = [Tail(child.stdout, TAIL_BYTES), Tail(child.stderr, TAIL_BYTES)]
        feeder = threading.Thread(
            target=_feed, args=(child.stdin, json.dumps(grant.payload).encode()), daemon=True
        )
        for t in (*tails, feeder):
            t.start()
        ours = self._watch(child, grant)
        if child.poll() is None:
            _stop(child)
        for t in tails:
            t.join(timeout=5)
        return Outcome(child.returncode, tails[0].data, tails[1].data), ours

    def _watch(self, child: subprocess.Popen[bytes], grant: Grant) -> bool:
        """Heartbeat until the child exits; False as soon as the store says the run is not ours."""
        every = max(grant.lease_seconds / 3, 0.05)
        while True:
            if self._wait_child(child, every):
                return True
            if self.stopping.is_set():
                return True
            try:
                self.client.heartbeat(grant)
            except (ProtocolError, NotFound) as err:
                log.warning(
                    "%s/%s: heartbeat refused, run no longer ours: %s", grant.board, grant.task_id, err
                )
                return False
            except PoolError as err:  # busy beyond the client's retries: the next beat may land
                log.warning("%s/%s: heartbeat failed: %s", grant.board, grant.task_id, err)

    def _wait_child(self, child: subprocess.Popen[bytes], seconds: float) -> bool:
        """Wait up to ``seconds`` for the child; True if it exited. Wakes early on a stop signal."""
        deadline = seconds
        step = 0.05
        while deadline > 0:
            if child.poll() is not None:
                return True
            if self.stopping.wait(min(step, deadline)):
                return child.poll() is not None
            deadline -= step
        return child.poll() is not None

    def _release(self, grant: Grant) -> None:
        try:
            got = self.client.release(grant)
            log.info("%s/%s: released (%s)", grant.board, grant.task_id, got)
        except PoolError as err:
            log.warning(
                "%s/%s: release failed (the lease will end on its own): %s", grant.board, grant.task_id, err
            )


def grant_env(grant: Grant, url: str) -> dict[str, str]:
    """The command's view of its grant: enough to register children and for them to report."""
    env = {
        "POOL_BOARD": grant.board,
        "POOL_TASK_ID": grant.task_id,
        "POOL_RUN_ID": str(grant.run_id),
        "POOL_ROW_ID": str(grant.row_id),
        "POOL_ATTEMPT": str(grant.attempt),
        "POOL_FENCE": str(grant.fence),
        "POOL_OWNER": grant.owner,
        URL_ENV: url,
    }
    return env if grant.child_token is None else {**env, CHILD_TOKEN_ENV: grant.child_token}


def grant_from_env(env: Mapping[str, str]) -> GrantRef:
    """The grant ``grant_env`` described; ``InvalidInput`` naming a variable that is missing or bad."""
    return GrantRef(
        row_id=_int_env(env, "POOL_ROW_ID", validate.INT32_MAX),
        attempt=_int_env(env, "POOL_ATTEMPT", validate.INT32_MAX),
        fence=fence_from_env(env),
        owner=validate.name("POOL_OWNER", _env(env, "POOL_OWNER"), 128),
    )


def fence_from_env(env: Mapping[str, str]) -> int:
    """The grant's fence: every child registered under it reports with it as its epoch."""
    return _int_env(env, "POOL_FENCE", validate.INT64_MAX)


def _env(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise InvalidInput(name, "not set: run this inside a `poolctl worker` command, or set it")
    return value


def _int_env(env: Mapping[str, str], name: str, high: int) -> int:
    value = _env(env, name)
    if not (value.isascii() and value.isdigit() and len(value) <= 19):  # 19 digits hold an int64
        raise InvalidInput(name, f"expected a positive integer, got {value[:40]!r}")
    return validate.integer(name, int(value), 1, high)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass  # the command does not read its stdin: fine


def _stop(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM the command's process group, then SIGKILL after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            child.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
