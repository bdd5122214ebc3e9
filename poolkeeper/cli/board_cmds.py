"""`poolctl board`: add, list, cancel and unblock tasks on the board."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from board import TaskStatus
from core.errors import InvalidInput, NotFound
from poolkeeper import operator
from poolkeeper.cli import render
from poolkeeper.cli.base import (
    AccessLogOpt,
    JsonOpt,
    MaxConnectionsOpt,
    MaxPerClientOpt,
    _emit,
    _kanban,
    _settings,
    _store,
    board_app,
    out,
)

# --- board ---------------------------------------------------------------------


@board_app.command("add")
def board_add(
    board: str,
    title: str,
    body: Annotated[str, typer.Option(help="Task body.")] = "",
    lane: Annotated[
        str | None, typer.Option(help="Lane (default: the pool's, POOL_LANE); the pool claims no other.")
    ] = None,
    task_id: Annotated[str | None, typer.Option("--id", help="Task id (default: generated).")] = None,
) -> None:
    """Add a ready task."""
    pool_lane = _settings().lane
    lane = pool_lane if lane is None else lane
    out.print(render.line("{}", _kanban("write").add_task(board, title, body, lane=lane, task_id=task_id)))
    if lane != pool_lane:
        note = render.line(
            "lane '{}' is not the pool's lane ('{}'): the pool will never claim it", lane, pool_lane
        )
        print(f"poolctl: note: {note.plain}", file=sys.stderr)


@board_app.command("list")
def board_list(
    board: Annotated[str | None, typer.Argument()] = None,
    status_: Annotated[
        str | None, typer.Option("--status", help="Only tasks in this status: " + ", ".join(TaskStatus))
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List tasks."""
    kanban = _kanban()
    if board is not None and not kanban.has_board(board):
        raise NotFound(f"{board}: no such board")
    want = None
    if status_ is not None:
        try:
            want = TaskStatus(status_)
        except ValueError:
            valid = ", ".join(s.value for s in TaskStatus)
            raise InvalidInput("--status", f"unknown status {status_!r}; one of {valid}") from None
    found = kanban.list_tasks(board, want)
    data = [
        {
            "board": t.board,
            "id": t.id,
            "title": t.title,
            "status": t.status.value,
            "lane": t.lane,
            "assignee": t.assignee,
            "run_id": t.current_run_id,
            "block_reason": t.block_reason,
            "result": t.result,
        }
        for t in found
    ]
    _emit(data, render.tasks(found, out.width), as_json)


@board_app.command("cancel")
def board_cancel(board: str, task_id: str) -> None:
    """End a task for good (done, result {"cancelled": true}); its pool row goes stale at once."""
    got = operator.cancel(_kanban("write"), _store("write"), board, task_id, time.time())
    if got.settled is not None:
        pool = f"row {got.settled.row_id} ({got.settled.was}) is stale: its worker is fenced out"
    elif got.left_to_reconcile is not None:
        pool = f"its pool row is left to reconcile ({got.left_to_reconcile})"
    else:
        pool = "no live pool row"
    out.print(render.line("{}/{} cancelled ({}); {}", board, task_id, got.task.status.value, pool))


@board_app.command("unblock")
def board_unblock(board: str, task_id: str) -> None:
    """Put a parked task back to ready."""
    _kanban("write").unblock_task(board, task_id)
    out.print(render.line("{}/{} ready", board, task_id))


@board_app.command("serve")
def board_serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: any free one).")] = 8090,
    local_only: Annotated[
        bool,
        typer.Option("--local-only", help="Allow serving without POOL_BOARD_TOKEN (loopback only; no auth)."),
    ] = False,
    access_log: AccessLogOpt = False,
    max_connections: MaxConnectionsOpt = 1024,
    max_connections_per_client: MaxPerClientOpt = 256,
) -> None:
    """Serve the board at POOL_BOARD_URL over the board API (docs/board-api.md): /v1, /healthz, /readyz."""
    from poolkeeper.server import board_api

    board_api.run(
        _settings(),
        host=host,
        port=port,
        local_only=local_only,
        access_log=access_log,
        max_connections=max_connections,
        max_per_client=max_connections_per_client,
    )
