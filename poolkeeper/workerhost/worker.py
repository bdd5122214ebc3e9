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

Tails are the last 4 KiB of each stream, decoded as UTF-8 with every byte that is not
printable text escaped (``\\xNN``: invalid UTF-8, NUL and other control characters but
tab, newline and carriage return).
While the server does not answer, offers go on at the poll's pace; ``once``, the worker gives
up (the last error: ``poolctl`` exits 69 or 75) after ``give_up_seconds`` without an answer,
so a mistyped port fails. The first answer after an outage is logged, once.
A refused heartbeat means the run is no longer ours (fenced by a restart or
expiry): the child is stopped and nothing is delivered. SIGTERM or SIGINT stops
the child, releases the run (re-offered at once) and exits 0.

Execution once, through any process death (docs/design.md, "Worker"):

- The command runs under a small keeper (``KEEPER``, ``python -I -S``) that leads a process
  group of its own: it forks the command with the parent-death signal set (Linux:
  ``PR_SET_PDEATHSIG``, SIGKILL: the command dies with the keeper) and, when the worker dies
  (its end of a pipe closes, however it died), SIGKILLs the whole group, grandchildren too.
  The worker ends the group itself on every way out (the command's end, a refused
  heartbeat, a stop signal, an exception, ``atexit``).
- The ordinal's state directory (``poolkeeper.workerhost.state``) names the group; a worker
  starting there first ends what a predecessor left running, and takes no grant while it lives.
- A result is spooled there (with its grant and delivery id) before it is delivered, and
  delivered until the store accepts or refuses it: transient failures are retried, with
  heartbeats, while the lease can still hold. A restarted worker delivers a spooled result
  (under the old grant's fence) before it asks for a grant; a grant whose result it holds
  is never run again. Output is escaped (``printable``) and bounded so the store accepts it;
  should it still refuse the result as invalid, a result without the output is sent instead.

The command runs as the worker's user, so it could read the worker's memory
and ``/proc/<pid>/environ``, where the ordinal's token is: ``forbid_inspection``
(called first by ``poolctl worker``) marks the worker undumpable on Linux, which
closes that to other processes of the user (not to root). The token can come
from a file (``--token-file``) rather than the command line, which every user
can read in ``/proc/<pid>/cmdline``. Real isolation needs the command to run as
another user (docs/design.md, "Worker").
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import FrameType
from typing import IO, Any

from core import logs, shapes, tracing, validate
from core.errors import InvalidInput, NotFound, PoolError, ProtocolError, TransientError
from core.retry import RetryPolicy
from poolkeeper.workerhost.client import Grant, GrantRef, PoolClient, Refused, new_delivery_id
from poolkeeper.workerhost.state import GROUP, RESULT, Group, StateDir, default_dir, end_predecessor

log = logging.getLogger("poolkeeper.workerhost.worker")
TAIL_BYTES = 4096
KILL_GRACE_SECONDS = 5.0
# An idle worker's offer waits this long on the server for a run (answered the moment one is
# assigned), then asks again: one cheap open request per idle worker instead of a poll a second.
OFFER_WAIT_SECONDS = 30.0
DELIVERY_RETRY = RetryPolicy(base_seconds=0.5, max_seconds=5.0)  # between rounds of the client's tries
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


# The keeper: runs the command in a process group it leads
# (``python -I -S -c KEEPER DEATH_FD REPORT_FD ARGV...``). It forks the command with the
# parent-death signal (Linux), so the command dies with it, and SIGKILLs its whole group once
# the worker's end of the ``DEATH_FD`` pipe closes. On ``REPORT_FD`` it writes ``started`` (or
# ``failed <error>`` when the command cannot be executed), then ``status <wait status>``. Stop
# signals reach the command (same group); the keeper outlives it to report.
KEEPER = r"""
import ctypes, os, select, signal, sys, threading
death, report, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
os.set_inheritable(death, False)
os.set_inheritable(report, False)


def say(line):
    os.write(report, line.encode("utf-8", "backslashreplace") + b"\n")


def stand_by(signum, frame):
    pass  # the same signal reached the command (this group's): report how it ends


if select.select([death], [], [], 0)[0]:
    sys.exit(0)  # the worker is gone already
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, stand_by)
libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # before the fork
failed_r, failed_w = os.pipe()
keeper = os.getpid()
pid = os.fork()
if pid == 0:
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        if libc is not None:
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != keeper:
            os._exit(137)
        os.execvp(argv[0], argv)
    except BaseException as err:
        os.write(failed_w, f"{type(err).__name__}: {err}".encode("utf-8", "backslashreplace"))
    os._exit(127)
os.close(failed_w)
failed = os.read(failed_r, 4096)
if failed:
    say("failed " + failed.decode("utf-8", "replace"))
    os.waitpid(pid, 0)
    sys.exit(127)
say("started")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)  # the command's pipes end when it and what it started are done


def watch():
    select.select([death], [], [])  # end of file: the worker died, however it died
    os.killpg(0, signal.SIGKILL)


threading.Thread(target=watch, daemon=True).start()
say("status %d" % os.waitpid(pid, 0)[1])
"""

_UNPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def printable(data: bytes, limit: int = TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``data`` as text the store takes, in at most ``limit`` characters.

    Invalid UTF-8 and control characters (but tab, newline and carriage return) become
    ``\\xNN``; a character cut at the start is dropped.
    """
    tail, cut = data[-limit:], 0
    if len(data) > limit:
        while cut < min(3, len(tail)) and 0x80 <= tail[cut] < 0xC0:
            cut += 1
    text = tail[cut:].decode("utf-8", "backslashreplace")
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)[-limit:]


def storable(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` if it passes the store's checks of a result, else ``without_output(result)``."""
    try:
        validate.document("payload", result)
        if "reason" in result:
            validate.text("payload.reason", result["reason"])
    except InvalidInput as err:
        return without_output(result, err)
    return result


def without_output(result: Mapping[str, Any], err: Exception) -> dict[str, Any]:
    """What replaces a result the store refused as invalid: its status and exit code, and why."""
    why = printable(str(err).encode("utf-8", "backslashreplace"), 300)
    code = result.get("exit_code")
    if result.get("status") == "done":
        return {"status": "done", "exit_code": code, "output_refused": why}
    reason = f"exit code {code}: the store refused the command's output ({why})"
    return {"status": "blocked", "reason": reason, "exit_code": code}


@dataclass
class Outcome:
    exit_code: int | None  # None: the command could not start
    stdout: bytes
    stderr: bytes
    error: str = ""
    what: str = "command"  # what ran, as the reason names it (the Python worker's: "callable")

    def result(self) -> dict[str, Any]:
        tails = {"stdout_tail": printable(self.stdout), "stderr_tail": printable(self.stderr)}
        if self.exit_code == 0:
            return storable({"status": "done", "exit_code": 0, **tails})
        if self.exit_code is None:
            why = printable(self.error.encode("utf-8", "backslashreplace"), 300)
            reason = f"cannot run the {self.what}: {why}"
        elif self.exit_code < 0:
            reason = f"killed by signal {-self.exit_code}"
        else:
            last = next((ln for ln in reversed(tails["stderr_tail"].splitlines()) if ln.strip()), "")
            reason = f"exit code {self.exit_code}" + (f": {last.strip()[:300]}" if last else "")
        return storable({"status": "blocked", "reason": reason, "exit_code": self.exit_code, **tails})


@dataclass(frozen=True)
class Held:
    """A result this worker holds for a grant, as spooled in the state directory until answered."""

    grant: Grant
    result: dict[str, Any]
    delivery_id: str  # the same on every try and after a restart: a replay is a duplicate
    lease_end: float  # wall clock: when the lease ends unless a heartbeat lands (the store decides)
    fallback: bool = False  # the result without the output, after the store refused it as invalid

    def record(self) -> dict[str, Any]:
        grant = {f.name: getattr(self.grant, f.name) for f in fields(Grant)}
        del grant["payload"], grant["child_token"]  # not needed to deliver; not kept on disk
        return {
            "grant": grant,
            "result": self.result,
            "delivery_id": self.delivery_id,
            "lease_end": self.lease_end,
            "fallback": self.fallback,
        }

    @classmethod
    def load(cls, record: dict[str, Any] | None) -> Held | None:
        if record is None:
            return None
        try:
            grant = Grant(**record["grant"], payload={})
            result, delivery_id = dict(record["result"]), str(record["delivery_id"])
            return cls(grant, result, delivery_id, float(record["lease_end"]), bool(record["fallback"]))
        except (KeyError, TypeError, ValueError) as err:
            log.warning("a spooled result does not parse, dropped: %s", err)
            return None


class Tail(threading.Thread):
    """Drains one pipe, keeping only the last ``limit`` bytes."""

    def __init__(self, pipe: IO[bytes], limit: int) -> None:
        super().__init__(daemon=True)
        self.pipe, self.limit, self.data = pipe, limit, b""

    def run(self) -> None:
        while chunk := os.read(self.pipe.fileno(), 65536):
            self.data = (self.data + chunk)[-self.limit :]


class _Stopped(Exception):
    """A stop signal that came while the worker waited, idle, for the server's answer to an offer."""


class Worker:
    """What every pool worker does around a run: offers, heartbeats, the spool, delivery, stop signals.

    A subclass says how one grant runs (``_execute``); its processes are one group at a time
    (``self.group``, named in the state directory), which every way out ends.
    """

    def __init__(
        self,
        client: PoolClient,
        ordinal: int,
        *,
        owner: str | None = None,
        poll_seconds: float = 1.0,
        wait_seconds: float = OFFER_WAIT_SECONDS,
        once: bool = False,
        give_up_seconds: float = 60.0,
        state_dir: Path | None = None,
    ) -> None:
        self.client, self.ordinal = client, ordinal
        self.owner = owner or default_owner()
        self.poll, self.wait, self.once, self.give_up = poll_seconds, wait_seconds, once, give_up_seconds
        self.away_since: float | None = None  # the first unanswered offer of an outage
        self.stopping = threading.Event()
        self._offering = False  # inside a waiting offer: a stop signal cuts it short
        self.state = StateDir(state_dir or default_dir(client.url), ordinal)
        self.group: Group | None = None  # the running command's (or runner's), until it is gone
        self.lease_end = 0.0  # the current grant's, by this host's clock
        self.answered: collections.deque[int] = collections.deque(maxlen=64)  # fences never to run again

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.stopping.set()
            if self._offering:  # idle, waiting on the server: no run to hand back, stop now
                raise _Stopped()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def run(self) -> int:
        """Serve grants until stopped (or, ``once``, after one delivered result); the exit code.

        Holds the ordinal's state directory throughout, and ends the command's group on every
        way out.
        """
        self.state.lock()
        if not sys.platform.startswith("linux"):
            log.info(
                "not on Linux: no parent-death signal, so a command whose keeper is killed may outlive it"
            )
        atexit.register(self._end_group)
        try:
            return self._run()
        finally:
            self._end_group()
            atexit.unregister(self._end_group)
            self.state.unlock()

    def _run(self) -> int:
        log.info("ordinal %d: worker %s polling (state in %s)", self.ordinal, self.owner, self.state.path)
        held = Held.load(self.state.read(RESULT))
        if held is not None:
            g = held.grant
            log.info("%s/%s: delivering the result spooled under fence %d", g.board, g.task_id, g.fence)
            with tracing.span("deliver", g.traceparent, {"pool.row_id": g.row_id}):  # in its grant's trace
                delivered = self._deliver(held)
            if delivered and self.once:
                return 0
        while not self.stopping.is_set():
            # a group named there that is not this worker's own live one: a predecessor's, or ours
            # that outlived SIGKILL
            if self.group is None and not end_predecessor(self.state, KILL_GRACE_SECONDS, self.stopping):
                break  # stopped while an earlier command's group lived on
            asked, failed = time.monotonic(), False
            try:
                grant = self._offer()
            except _Stopped:
                break
            except TransientError as err:
                log.warning("offer: %s", err)
                grant, failed = None, True
                self.away_since = self.away_since or asked
                if self.once and time.monotonic() - self.away_since >= self.give_up:
                    raise
            else:
                self._answered()
            if grant is not None and grant.fence in self.answered:
                grant = None  # its result was held: never run again (its lease ends; expiry re-offers it)
            if grant is None:
                idle = self.poll * random.uniform(0.75, 1.25)  # spread the polls of many workers
                if failed or self.wait <= 0 or time.monotonic() - asked < min(self.wait, idle):
                    self.stopping.wait(idle)  # the server did not wait: do not ask again at once
                continue
            delivered = self.serve(grant)
            if self.once and delivered:
                break
        return 0

    def _offer(self) -> Grant | None:
        """Ask for the ordinal's grant, waiting on the server up to ``wait`` seconds for one."""
        self._offering = True
        try:
            if self.stopping.is_set():
                raise _Stopped()
            return self.client.offer(self.ordinal, self.owner, wait=self.wait)
        finally:
            self._offering = False

    def _answered(self) -> None:
        if self.away_since is not None:
            away = time.monotonic() - self.away_since
            log.info(
                "ordinal %d: the server at %s answers again, after %.0f s",
                self.ordinal,
                self.client.url,
                away,
            )
            self.away_since = None

    def serve(self, grant: Grant) -> bool:
        """Run one grant, in a span of the grant's trace; whether its result was delivered."""
        ids = {"pool.row_id": grant.row_id, "pool.attempt": grant.attempt, "pool.ordinal": self.ordinal}
        with logs.bound(**logs.grant_ids(grant)), tracing.span("run", grant.traceparent, ids):
            return self._serve(grant)

    def _serve(self, grant: Grant) -> bool:
        log.info("%s/%s run %d attempt %d: starting", grant.board, grant.task_id, grant.run_id, grant.attempt)
        self.lease_end = time.time() + grant.lease_seconds
        result, ours, stopped = self._execute(grant)
        if not ours:
            return False
        if stopped:
            self._release(grant)
            return False
        held = Held(grant, result, new_delivery_id(), self.lease_end)
        self.state.write(RESULT, held.record())
        with tracing.span("deliver"):  # a child of the run's span
            return self._deliver(held)

    def _deliver(self, held: Held) -> bool:
        """Deliver a spooled result until the store accepts (True) or refuses it; then drop the spool.

        Transient failures are retried, with heartbeats, until the lease has surely ended; a
        stop signal leaves the spool for the next worker on this ordinal.
        """
        with logs.bound(**logs.grant_ids(held.grant)):
            return self._deliver_held(held)

    def _deliver_held(self, held: Held) -> bool:
        grant, tries = held.grant, 0
        self.answered.append(grant.fence)
        while True:
            try:
                got = self.client.deliver(grant, held.result, held.delivery_id)
            except (InvalidInput, Refused) as err:
                if isinstance(err, Refused) and err.status != 413:
                    raise  # the token or the request itself: retrying cannot help; the spool stays
                if held.fallback:
                    return self._drop(held, f"result refused as invalid even without the output: {err}")
                log.warning(
                    "%s/%s: result refused as invalid, sent without the output: %s", *_name(grant), err
                )
                held = replace(
                    held,
                    result=without_output(held.result, err),
                    delivery_id=new_delivery_id(),
                    fallback=True,
                )
                self.state.write(RESULT, held.record())
                continue
            except (ProtocolError, NotFound) as err:
                return self._drop(held, f"result refused, the grant is no longer current: {err}")
            except TransientError as err:
                tries += 1
                if time.time() > held.lease_end:
                    return self._drop(held, f"the lease ended before the result could be delivered: {err}")
                if tries == 1:
                    log.warning(
                        "%s/%s: result not delivered yet, retrying while the lease holds: %s",
                        *_name(grant),
                        err,
                    )
                held = self._beat(held)
                if self.stopping.wait(DELIVERY_RETRY.backoff(tries)):
                    log.info("stopping: the result stays in %s for the next worker", self.state.path)
                    return False
                continue
            log.info("%s/%s: %s (%s)", *_name(grant), held.result["status"], got)
            self.state.remove(RESULT)
            return True

    def _drop(self, held: Held, why: str) -> bool:
        log.warning("%s/%s: %s; dropped", *_name(held.grant), why)
        self.state.remove(RESULT)
        return False

    def _beat(self, held: Held) -> Held:
        """A heartbeat for a held result, when one is due, so the lease holds while delivery waits."""
        grant = held.grant
        if time.time() < held.lease_end - grant.lease_seconds * 2 / 3:
            return held
        try:
            self.client.heartbeat(grant)
        except PoolError:
            return held  # stale: the next delivery is refused and says so; busy: the next round tries
        held = replace(held, lease_end=time.time() + grant.lease_seconds)
        self.state.write(RESULT, held.record())
        return held

    def _end_group(self, keeper: subprocess.Popen[bytes] | None = None) -> None:
        """End the running command's process group, if any: every way out of a run comes here."""
        group, self.group = self.group, None
        if group is None:
            return
        if group.end(KILL_GRACE_SECONDS, reap=keeper.poll if keeper else lambda: None):
            self.state.remove(GROUP)
        else:  # the record stays: the next worker here waits for it
            log.warning("process group %d outlived SIGKILL", group.pgid)

    def _execute(self, grant: Grant) -> tuple[dict[str, Any], bool, bool]:
        """The run's result, whether the grant is still ours, and whether a stop signal ended it."""
        raise NotImplementedError

    def _watch(self, grant: Grant, ended: Callable[[float], bool]) -> bool:
        """Heartbeat until ``ended`` (waits up to its seconds for the run's end); False as soon as the
        store says the run is not ours."""
        every = max(grant.lease_seconds / 3, 0.05)
        while True:
            if self._wait(ended, every):
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
            else:
                self.lease_end = time.time() + grant.lease_seconds

    def _wait(self, ended: Callable[[float], bool], seconds: float) -> bool:
        """Wait up to ``seconds`` for ``ended``; True once it has. Wakes within 50 ms of a stop signal."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if ended(min(0.05, max(left, 0.0))):
                return True
            if self.stopping.is_set() or left <= 0:
                return False

    def _release(self, grant: Grant) -> None:
        try:
            got = self.client.release(grant)
            log.info("%s/%s: released (%s)", grant.board, grant.task_id, got)
        except PoolError as err:
            log.warning(
                "%s/%s: release failed (the lease will end on its own): %s", grant.board, grant.task_id, err
            )


class CommandWorker(Worker):
    """Runs a command for each grant, under its keeper (``KEEPER``), in a process group of its own."""

    def __init__(self, client: PoolClient, ordinal: int, argv: Sequence[str], **options: Any) -> None:
        if not argv:
            raise InvalidInput("--command", "empty command")
        super().__init__(client, ordinal, **options)
        self.argv = list(argv)

    def _execute(self, grant: Grant) -> tuple[dict[str, Any], bool, bool]:
        outcome, ours, stopped = self._command(grant)
        return outcome.result(), ours, stopped

    def _command(self, grant: Grant) -> tuple[Outcome, bool, bool]:
        """The command's outcome, whether the grant is still ours, and whether a stop signal ended it."""
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        env.update(grant_env(grant, self.client.url))
        if traced := tracing.current():  # the command's parent: the run's span (W3C env propagation)
            env[tracing.ENV] = traced
        death_r, death_w = os.pipe()  # the keeper reads end of file here once this process is gone
        report_r, report_w = os.pipe()
        try:
            keeper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", KEEPER, str(death_r), str(report_w), *self.argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # its group; a terminal's Ctrl-C reaches the worker, which decides
                pass_fds=(death_r, report_w),
            )
        except OSError as err:
            for fd in (death_w, report_r):
                os.close(fd)
            return Outcome(None, b"", b"", f"{type(err).__name__}: {err}"), True, False
        finally:
            os.close(death_r)
            os.close(report_w)
        report = os.fdopen(report_r, "rb")
        try:
            self.group = Group.of(keeper.pid)
            self.state.write(GROUP, self.group.record())
            assert keeper.stdin is not None and keeper.stdout is not None and keeper.stderr is not None
            tails = [Tail(keeper.stdout, TAIL_BYTES), Tail(keeper.stderr, TAIL_BYTES)]
            payload = json.dumps(grant.payload).encode()
            feeder = threading.Thread(target=_feed, args=(keeper.stdin, payload), daemon=True)
            for t in (*tails, feeder):
                t.start()
            first = report.readline()  # "started", or "failed <error>", or nothing
            started = first.startswith(b"started")
            ours = self._watch(grant, lambda seconds: exited(keeper, seconds)) if started else True
            stopped = started and self.stopping.is_set() and keeper.poll() is None
            self._end_group(keeper)
            for t in tails:
                t.join(timeout=5)
            rest = report.read()
            if not started:
                error = first.partition(b" ")[2].decode("utf-8", "replace").strip()
                return Outcome(None, b"", b"", error or "its keeper did not start it"), True, False
            return Outcome(keeper_exit_code(rest, keeper), tails[0].data, tails[1].data), ours, stopped
        finally:
            self._end_group(keeper)
            report.close()
            os.close(death_w)


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
        owner=validate.name("POOL_OWNER", _env(env, "POOL_OWNER"), shapes.OWNER_CHARS),
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


def exited(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    """Wait up to ``seconds`` for ``proc`` to exit; whether it has."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass  # the command does not read its stdin: fine


def keeper_exit_code(report: bytes, keeper: subprocess.Popen[bytes]) -> int:
    """The command's exit code as its keeper reported it (negative: the signal that ended it)."""
    for line in report.splitlines():
        if line.startswith(b"status ") and line[7:].isdigit():
            return os.waitstatus_to_exitcode(int(line[7:]))
    return keeper.returncode if keeper.returncode is not None else -signal.SIGKILL  # the keeper was killed


def _name(grant: Grant) -> tuple[str, str]:
    return grant.board, grant.task_id
