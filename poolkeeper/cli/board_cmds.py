"""`poolctl board`: add, list, search, cancel and unblock tasks on the board."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from board import BoardTask, TaskSpec

from core import validate
from core.errors import InvalidInput, NotFound
from poolkeeper.cli import render
from poolkeeper.cli.base import (
    AccessLogOpt,
    JsonOpt,
    MaxConnectionsOpt,
    MaxPerClientOpt,
    _board,
    _emit,
    _settings,
    _store,
    board_app,
    out,
)

FROM_CHARS = 64 << 20  # a --from file of tasks: thousands of them, never without end

# --- board ---------------------------------------------------------------------


@board_app.command("add")
def board_add(
    board: str,
    title: Annotated[str | None, typer.Argument(show_default=False)] = None,
    body: Annotated[str, typer.Option(help="Task body.")] = "",
    lane: Annotated[
        str | None, typer.Option(help="Lane (default: the pool's, POOL_LANE); the pool claims no other.")
    ] = None,
    task_id: Annotated[str | None, typer.Option("--id", help="Task id (default: generated).")] = None,
    from_: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Add many tasks in one transaction: a JSON-lines file ('-': standard input), one task a"
            ' line: {"title": ..., "body": ..., "lane": ..., "id": ...}; only "title" is needed.',
        ),
    ] = None,
) -> None:
    """Add a ready task (or, with --from, many); prints each new task's id, one a line."""
    from board import TaskSpec, add_tasks
    from poolkeeper.events import events_for, task_ready

    settings = _settings()
    pool_lane = settings.lane
    if (title is None) == (from_ is None):
        raise InvalidInput("title", "give a TITLE, or --from FILE for many tasks, not both")
    if from_ is None:
        assert title is not None
        specs = [TaskSpec(title, body, pool_lane if lane is None else lane, task_id)]
    else:
        if body or task_id is not None:
            raise InvalidInput("--from", "--body and --id are per task there: give them in each line")
        specs = _specs(from_, pool_lane if lane is None else lane)
    added = add_tasks(_board("write"), board, specs)
    task_ready(events_for(settings))
    for task in added:
        out.print(render.line("{}", task))
    for other in sorted({s.lane for s in specs} - {pool_lane}):
        note = render.line(
            "lane '{}' is not the pool's lane ('{}'): the pool will never claim it", other, pool_lane
        )
        print(f"poolctl: note: {note.plain}", file=sys.stderr)


def _specs(path: str, lane: str) -> list[TaskSpec]:
    """The tasks of a JSON-lines file (``-``: standard input); a bad line is refused by its number."""
    from board import TaskSpec

    try:
        text = sys.stdin.read(FROM_CHARS + 1) if path == "-" else validate.read_file(path, FROM_CHARS)
    except (OSError, ValueError) as err:  # UnicodeDecodeError too
        raise InvalidInput("--from", f"cannot read {path}: {err}") from None
    if len(text) > FROM_CHARS:
        raise InvalidInput("--from", f"cannot read {path}: larger than {FROM_CHARS} characters")
    specs = []
    # "\n" only: splitlines() also cuts at U+2028, U+0085 and others, legal inside a JSON string
    for n, line in enumerate((ln.removesuffix("\r") for ln in text.split("\n")), 1):
        if not line.strip():
            continue
        item = validate.loads(f"--from line {n}", line)
        if not isinstance(item, dict) or not isinstance(item.get("title"), str):
            raise InvalidInput("--from", f'line {n}: an object with a "title" string is needed')
        unknown = sorted(set(item) - {"title", "body", "lane", "id"})
        if unknown:
            raise InvalidInput("--from", f"line {n}: unknown field(s) {', '.join(unknown)}")
        fields = {k: item.get(k) for k in ("body", "lane", "id")}
        if not all(v is None or isinstance(v, str) for v in fields.values()):
            raise InvalidInput("--from", f"line {n}: body, lane and id are strings")
        specs.append(TaskSpec(item["title"], fields["body"] or "", fields["lane"] or lane, fields["id"]))
    return specs


@board_app.command("list")
def board_list(
    board: Annotated[str | None, typer.Argument()] = None,
    status_: Annotated[
        str | None, typer.Option("--status", help="Only tasks in this status: ready, running, blocked, done.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List tasks."""
    from board import TaskStatus

    backend = _board()
    if board is not None and not backend.has_board(board):
        raise NotFound(f"{board}: no such board")
    want = None
    if status_ is not None:
        try:
            want = TaskStatus(status_)
        except ValueError:
            valid = ", ".join(s.value for s in TaskStatus)
            raise InvalidInput("--status", f"unknown status {status_!r}; one of {valid}") from None
    found = backend.list_tasks(board, want)
    _emit([_listed(t) for t in found], render.tasks(found, out.width), as_json)


@board_app.command("search")
def board_search(
    text: Annotated[str, typer.Argument(help="A piece of a task's title or body (3 to 200 characters).")],
    limit: Annotated[
        int | None,
        # 50: board.protocol.SEARCH_LIMIT (tests/cli/test_cli.py holds them equal), not imported here:
        # --help loads nothing of the board
        typer.Option(min=1, max=50, help="Tasks to list at most (1 to 50, all 50 unless given)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Tasks whose title or body holds TEXT (any case, every character as typed), newest first."""
    from board import search_tasks
    from board.protocol import SEARCH_LIMIT

    found = search_tasks(_board(), text, SEARCH_LIMIT if limit is None else limit)
    _emit([_listed(t) for t in found], render.tasks(found, out.width), as_json)


def _listed(t: BoardTask) -> dict[str, object]:
    """A task as `board list --json` and `board search --json` print it."""
    return {
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


@board_app.command("show")
def board_show(board: str, task_id: str, as_json: JsonOpt = False) -> None:
    """One task: its body, its result (exit code, output tails), and each run with its pool row."""
    from store import queries

    backend = _board()
    task = backend.get_task(board, task_id)
    if task is None:
        raise NotFound(f"{board}/{task_id}: no such task")
    runs = backend.list_runs(board, [task_id])
    with _store().session(readonly=True) as s:
        rows = {r.run_id: r.id for r in queries.rows_of_tasks(s, board, [task_id])}
    data = {
        "board": task.board,
        "id": task.id,
        "title": task.title,
        "status": task.status.value,
        "lane": task.lane,
        "body": task.body,
        "block_reason": task.block_reason,
        "result": task.result,
        "runs": [{**run, "row": rows.get(run["run_id"])} for run in runs],
    }
    _emit(data, render.task_detail(data), as_json)


@board_app.command("cancel")
def board_cancel(board: str, task_id: str) -> None:
    """End a task for good (done, result {"cancelled": true}); its pool row goes stale at once."""
    from poolkeeper import operator

    got = operator.cancel(_board("write"), _store("write"), board, task_id, time.time())
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
    from poolkeeper.events import events_for, task_ready

    _board("write").unblock_task(board, task_id)
    task_ready(events_for(_settings()))
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
    from core import tracing
    from poolkeeper.boardserver import app as board_api

    tracing.setup("poolkeeper-board")
    board_api.run(
        _settings(),
        host=host,
        port=port,
        local_only=local_only,
        access_log=access_log,
        max_connections=max_connections,
        max_per_client=max_connections_per_client,
    )
