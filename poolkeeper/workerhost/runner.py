"""The Python worker's runner: a long-lived process that imports the callable once, then runs a call a grant.

``PythonWorker`` starts it as ``python -m poolkeeper.workerhost.runner CALL CALLS REPLIES OUT ERR``
(``CALLS``/``REPLIES``: pipe descriptors; ``OUT``/``ERR``: the files a call's output goes to)
under the command's keeper (``worker.KEEPER``: a process group of its own, the parent-death
signal, the group SIGKILLed when the worker goes), with the command's scrubbed environment (no
ordinal token, no server secret). When ``CALLS`` reads end of file (the worker closed it, or
is gone) it SIGKILLs its group too.

One JSON object a line on each pipe. The first reply is ``{"ready": true, "async": bool}``,
or ``{"error": "<one line>"}`` for a ``CALL`` that cannot be imported (then it exits 2).
Then for each ``{"payload": …, "env": {…}}`` (``env``: ``worker.grant_env``, set in
``os.environ`` for the call, so ``poolctl child`` works from what it starts) it calls the
callable with a ``Context``, awaiting what an async one returns, with fds 1 and 2 on ``OUT``
and ``ERR`` (truncated first), and replies ``{"exit": 0, "value": …}`` (the return value,
JSON) or ``{"exit": N}`` after printing the traceback on stderr, as ``python -c`` would
(``SystemExit`` keeps its code). ``{"cancel": true}`` sets the call's cancellation flag and
cancels an async call's task (reply ``{"exit": 1, "cancelled": true}``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import IO, Any

from core.errors import InvalidInput
from poolkeeper.workerhost.context import Context


def parse_call(spec: str) -> tuple[str, str]:
    """``package.module:function`` as (module, attribute path); ``InvalidInput`` naming ``--call``."""
    module, colon, attr = spec.partition(":")
    if not colon or not module.strip() or not attr.strip():
        raise InvalidInput("--call", f"expected package.module:function, got {spec[:80]!r}")
    return module, attr


def resolve(spec: str) -> Callable[[Context], Any]:
    """Import the callable ``spec`` names; ``InvalidInput`` saying in one line what was wrong."""
    module_name, attr = parse_call(spec)
    try:
        target: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:
        raise InvalidInput("--call", f"cannot import {module_name}: {_line(err)}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInput("--call", f"module {module_name} has no attribute {attr}") from None
    if not callable(target):
        raise InvalidInput("--call", f"{spec} is not callable (a {type(target).__name__})")
    return target  # type: ignore[no-any-return]


def is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)


class Current:
    """The call in progress, for the reader thread's ``cancel``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock = loop, threading.Lock()
        self.event: threading.Event | None = None
        self.task: asyncio.Future[Any] | None = None

    def cancel(self) -> None:
        with self.lock:
            if self.event is not None:
                self.event.set()
            if self.task is not None:
                self.loop.call_soon_threadsafe(self.task.cancel)


def read_calls(calls: IO[bytes], queued: queue.Queue[dict[str, Any]], current: Current) -> None:
    """Hand calls to the main thread, cancel on ``cancel``; at end of file end the whole group."""
    for line in calls:
        message = json.loads(line)
        if message.get("cancel"):
            current.cancel()
        else:
            queued.put(message)
    os.killpg(0, signal.SIGKILL)  # the worker is gone, however it went: so is everything of ours


def call(
    fn: Callable[[Context], Any], message: dict[str, Any], current: Current, files: tuple[str, str]
) -> dict[str, Any]:
    """One call with its output on ``files``; the reply."""
    for fd, path in zip((1, 2), files, strict=True):
        (sys.stdout if fd == 1 else sys.stderr).flush()
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    env = {str(k): str(v) for k, v in message["env"].items()}
    os.environ.update(env)
    event = threading.Event()
    ctx = Context.of(message["payload"], env, event)
    with current.lock:
        current.event = event
    try:
        value = fn(ctx)
        if inspect.isawaitable(value):
            with current.lock:
                current.task = task = asyncio.ensure_future(value, loop=current.loop)
                if event.is_set():  # a cancel that came while the call started
                    task.cancel()
            value = current.loop.run_until_complete(task)
        reply = {"exit": 0, "value": json.loads(json.dumps(value, allow_nan=False))}
    except asyncio.CancelledError:
        print("cancelled: the run is no longer this worker's", file=sys.stderr)
        reply = {"exit": 1, "cancelled": True}
    except SystemExit as err:  # as ``python -c`` exits
        code = err.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        reply = {"exit": 0 if code is None else code if isinstance(code, int) else 1}
    except BaseException:  # the callable's own failure, a return value that is not JSON included
        traceback.print_exc()
        reply = {"exit": 1}
    finally:
        with current.lock:
            current.event, current.task = None, None
        ctx.close()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for name in env:
            os.environ.pop(name, None)
    return reply


def main(argv: list[str]) -> int:
    spec, calls_fd, replies_fd, out, err = argv
    for fd in (int(calls_fd), int(replies_fd)):
        os.set_inheritable(fd, False)  # the callable's own children get neither
    calls, replies = os.fdopen(int(calls_fd), "rb"), os.fdopen(int(replies_fd), "wb", buffering=0)
    loop = asyncio.new_event_loop()
    current, queued = Current(loop), queue.Queue[dict[str, Any]]()
    threading.Thread(target=read_calls, args=(calls, queued, current), daemon=True).start()

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message).encode() + b"\n")

    try:
        fn = resolve(spec)
    except InvalidInput as bad:
        reply({"error": bad.problem})
        return 2
    reply({"ready": True, "async": is_async(fn)})
    while True:
        reply(call(fn, queued.get(), current, (out, err)))


def _line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
