"""Workers in Python: a callable run per grant in a long-lived process (``poolctl worker --call``).

A callable takes one argument, the grant's ``Context``, and returns a JSON value (or raises)::

    from poolkeeper.worker import Context

    def resize(ctx: Context) -> dict[str, int]:
        return {"pixels": ctx.payload["width"] * ctx.payload["height"]}

    async def fetch(ctx: Context) -> str: ...

It is named ``package.module:function`` (importable from the worker's directory or the
installed packages: it runs in a process of its own, so it is named, never passed):
``poolctl worker --ordinal 0 --call jobs:resize --url …``, or from Python ``serve("jobs:resize",
url=…, token=…, ordinal=0)``. ``StaleHolder`` is what a child's report raises once the child or
its grant has ended. docs/protocol.md, "Workers in Python", has the promises.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import StaleHolder
from poolkeeper.workerhost.client import PoolClient
from poolkeeper.workerhost.context import Child, Context
from poolkeeper.workerhost.python import PythonWorker

__all__ = ["Child", "Context", "PythonWorker", "StaleHolder", "serve"]


def serve(
    call: str,
    *,
    url: str,
    token: str | None,
    ordinal: int,
    once: bool = False,
    state_dir: Path | None = None,
    signals: bool = True,
) -> int:
    """Serve ``ordinal``'s grants with ``call`` until stopped (``once``: one delivered result); the exit code.

    ``signals``: SIGTERM and SIGINT stop it and release a run in progress (the main thread only).
    """
    with PoolClient(url, token) as client:
        worker = PythonWorker(client, ordinal, call, once=once, state_dir=state_dir)
        if signals:
            worker.install_signal_handlers()
        return worker.run()
