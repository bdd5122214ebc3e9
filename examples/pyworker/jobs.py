"""Example callables for ``poolctl worker --call`` (docs/protocol.md, "Workers in Python").

From this directory: ``poolctl worker --ordinal 0 --call jobs:count_words --url …``. Each is called
with the grant's ``Context``; what it returns (JSON) is the result's ``return``, what it prints
its ``stdout_tail``, and an exception parks the run (``blocked``) with its line as the reason.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from poolkeeper.worker import Context


def count_words(ctx: Context) -> dict[str, Any]:
    """Sync: counts the words of the task's body; raises on a task with none."""
    words = str(ctx.payload.get("body") or ctx.payload.get("title") or "").split()
    if not words:
        raise ValueError(f"task {ctx.task_id} has no words to count")
    print(f"{ctx.board}/{ctx.task_id} attempt {ctx.attempt}: {len(words)} words")
    return {"words": len(words), "runner": os.getpid()}


async def steps(ctx: Context) -> dict[str, Any]:
    """Async: works through ``payload["steps"]`` steps of ``payload["seconds"]`` each, one child
    execution a step, stopping early (cancelled) when the run is no longer this worker's."""
    done = 0
    for n in range(int(ctx.payload.get("steps", 1))):
        child = ctx.child(key=f"step-{n}")
        child.heartbeat()
        await asyncio.sleep(float(ctx.payload.get("seconds", 0)))
        child.result({"step": n})
        done += 1
    return {"steps": done, "runner": os.getpid()}
