"""``poolctl worker --call package.module:function``: a Python callable per grant, in a long-lived runner.

The worker (``Worker``: offers, heartbeats, the spool, delivery, stop signals, as for a
command) starts one runner process (``poolkeeper.workerhost.runner``) that imports the
callable once, and hands it one grant at a time: no interpreter starts per run. The runner
runs under the command's keeper (``worker.KEEPER``): in a process group of its own, named in
the ordinal's state directory like a command's, with the parent-death signal, and the whole
group SIGKILLed once the worker's end of a pipe closes, so it and what it started die with
its worker.

The result is the command worker's for the same code run as ``python -c``: returned,
``{"status": "done", "exit_code": 0, "return": <value>, "stdout_tail": …, "stderr_tail": …}``;
raised, ``{"status": "blocked", "reason": "exit code 1: <the exception's line>", …}`` with the
traceback in ``stderr_tail``; a runner that died mid-call (``os._exit``, a signal) is that exit
code, and is replaced. A refused heartbeat (or a stop signal) cancels an async call (its
runner lives on, unless the call ignores it for ``KILL_GRACE_SECONDS``); a sync call cannot
be stopped inside its thread, so its runner is ended, and another started for the next grant.
A ``--call`` that does not import is ``InvalidInput`` before the first offer.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import InvalidInput
from poolkeeper.workerhost.client import Grant, PoolClient
from poolkeeper.workerhost.runner import parse_call
from poolkeeper.workerhost.state import GROUP, Group, end_predecessor
from poolkeeper.workerhost.worker import (
    KEEPER,
    KILL_GRACE_SECONDS,
    SCRUBBED_ENV,
    TAIL_BYTES,
    Outcome,
    Worker,
    grant_env,
    keeper_exit_code,
    log,
    storable,
)

RUNNER = "poolkeeper.workerhost.runner"
GONE: dict[str, Any] = {}  # what ``Runner.reply`` returns once the runner has exited


@dataclass
class Runner:
    """A live runner: its process, the write end of its calls and the read end of its replies."""

    proc: subprocess.Popen[bytes]  # its keeper
    calls: int
    replies: int
    reports: int  # the keeper's: ``started``, then the runner's wait status
    death: int  # closed: the keeper ends the group
    is_async: bool = False
    buffer: bytes = field(default=b"", repr=False)

    def send(self, message: dict[str, Any]) -> bool:
        try:
            os.write(self.calls, json.dumps(message).encode() + b"\n")
        except BrokenPipeError:
            return False
        return True

    def reply(self, seconds: float) -> dict[str, Any] | None:
        """The next reply within ``seconds``: None if none came, ``GONE`` if the runner exited."""
        deadline = time.monotonic() + seconds
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if not select.select([self.replies], [], [], max(left, 0.0))[0]:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                return GONE
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        found: dict[str, Any] = json.loads(line)
        return found

    def report(self) -> str:
        """What the keeper reported, once it has exited."""
        found = b""
        while chunk := os.read(self.reports, 4096):
            found += chunk
        return found.decode("utf-8", "replace")

    def close(self) -> None:
        for fd in (self.calls, self.replies, self.reports, self.death):
            with contextlib.suppress(OSError):
                os.close(fd)


class PythonWorker(Worker):
    """Runs ``call`` (``package.module:function``, sync or async) for each grant in its runner."""

    def __init__(self, client: PoolClient, ordinal: int, call: str, **options: Any) -> None:
        parse_call(call)
        super().__init__(client, ordinal, **options)
        self.call = call
        self.runner: Runner | None = None
        self.files = (self.state.path / "stdout", self.state.path / "stderr")

    def _run(self) -> int:
        # A predecessor's group may still hold a call: end it before the runner imports anything.
        if not end_predecessor(self.state, KILL_GRACE_SECONDS, self.stopping):
            return 0
        runner = self._start()  # a bad --call: InvalidInput, before the first offer
        if runner is None:
            return 0
        log.info(
            "ordinal %d: %s imported, runner in process group %d", self.ordinal, self.call, runner.proc.pid
        )
        return super()._run()

    def _start(self) -> Runner | None:
        """A new runner that imported the callable; None if stopped first; ``InvalidInput`` if it cannot.

        It runs under the command's keeper (``KEEPER``): the keeper leads the group, gives the
        runner the parent-death signal and SIGKILLs the group once this worker's end of
        ``death`` closes, however it died (a runner that got the signal itself could not).
        """
        death_r, death_w = os.pipe()
        report_r, report_w = os.pipe()
        calls_r, calls_w = os.pipe()
        replies_r, replies_w = os.pipe()
        given = (death_r, report_w, calls_r, replies_w)
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        runner_argv = [sys.executable, "-m", RUNNER, self.call, str(calls_r), str(replies_w)]
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", KEEPER, str(death_r), str(report_w), *runner_argv]
                + [str(f) for f in self.files],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),  # what importing prints goes to the worker's log
                env=env,
                start_new_session=True,
                pass_fds=given,
            )
        except OSError as err:
            for fd in (death_w, report_r, calls_w, replies_r):
                os.close(fd)
            raise InvalidInput("--call", f"cannot start its runner: {err}") from None
        finally:
            for fd in given:
                os.close(fd)
        runner = Runner(proc, calls_w, replies_r, report_r, death_w)
        self.group = Group.of(proc.pid)
        self.state.write(GROUP, self.group.record())
        ready = None
        while ready is None and not self.stopping.is_set():
            ready = runner.reply(0.05)
        if ready is GONE:
            proc.wait()
            ready = {"error": f"its runner did not start ({runner.report().strip() or 'no report'})"}
        if ready is None or "error" in ready:
            self._end_runner(runner)
            if ready is None:
                return None
            raise InvalidInput("--call", str(ready["error"]))
        runner.is_async = bool(ready.get("async"))
        self.runner = runner
        return runner

    def _execute(self, grant: Grant) -> tuple[dict[str, Any], bool, bool]:
        try:
            runner = self.runner or self._start()
        except InvalidInput as err:  # the module changed since the worker started
            return Outcome(None, b"", b"", err.problem, what="callable").result(), True, False
        if runner is None:
            return {}, True, True
        reply: dict[str, Any] | None = None

        def ended(seconds: float) -> bool:
            nonlocal reply
            reply = runner.reply(seconds)
            return reply is not None

        sent = runner.send({"payload": grant.payload, "env": grant_env(grant, self.client.url)})
        ours = self._watch(grant, ended) if sent else True
        if reply is None and not sent:
            reply = GONE
        if reply is None:  # refused heartbeat or a stop signal: the call must stop
            self._stop_call(runner)
            return {}, ours, ours
        if reply is GONE:
            runner.proc.wait()
            code = keeper_exit_code(runner.report().encode(), runner.proc)
            log.warning("the runner exited (%d) during a call: another takes the next grant", code)
            self._end_runner(runner)
            return self._outcome(code).result(), ours, False
        result = self._outcome(int(reply["exit"])).result()
        if result["status"] == "done" and reply.get("value") is not None:
            result = storable({**result, "return": reply["value"]})
        return result, ours, False

    def _outcome(self, exit_code: int) -> Outcome:
        stdout, stderr = (_tail(f) for f in self.files)
        return Outcome(exit_code, stdout, stderr, what="callable")

    def _stop_call(self, runner: Runner) -> None:
        """Cancel an async call (its runner lives on); end the runner of a sync one, or of one that
        ignores the cancellation for ``KILL_GRACE_SECONDS``."""
        if runner.is_async and runner.send({"cancel": True}):
            answer = runner.reply(KILL_GRACE_SECONDS)
            if answer is not None and answer is not GONE:
                return
        log.info("ending runner %d: its call cannot be stopped otherwise", runner.proc.pid)
        self._end_runner(runner)

    def _end_runner(self, runner: Runner) -> None:
        self._end_group(runner.proc)
        runner.close()
        if self.runner is runner:
            self.runner = None


def _tail(path: Path) -> bytes:
    """The last ``TAIL_BYTES`` of a call's output file (none if it was never written)."""
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - TAIL_BYTES, 0))
            return f.read()
    except FileNotFoundError:
        return b""
