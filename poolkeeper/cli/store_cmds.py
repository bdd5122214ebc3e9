"""The pool store's commands: init, status, rows, requeue, abandon, pause, resume, maintain, demo."""

from __future__ import annotations

import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from core import validate
from core.errors import InvalidInput, NotFound
from poolkeeper.cli import render
from poolkeeper.cli.base import (
    JsonOpt,
    _board,
    _emit,
    _settings,
    _store,
    app,
    out,
)

# The store's modules are imported by the commands that use them, so `--help` loads none.
ABANDON_REASON = "no reason given"


@app.command()
def init() -> None:
    """Create or migrate the pool store and the board (a no-op when current)."""
    from core.logs import mask_url

    store, board = _store("create"), _board("create")
    store.migrate()
    board.migrate()
    out.print(render.line("pool store ready: {}", mask_url(store.engine.url)))
    out.print(render.line("board ready:      {}", board.location()))


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Rows by state, ordinals, quarantined, beat liveness and queue depth, board tasks by status."""
    from board import open_board
    from poolkeeper.status import redis_reader, snapshot

    settings, store = _settings(), _store()
    board = open_board(settings)  # not _board(): a board that does not answer is a part unknown
    client, problem = redis_reader(settings)
    data = snapshot(store, board, settings, client, time.time(), redis_error=problem)
    _emit(data, render.status(data, store.pool_size), as_json)


ROW_FIELDS = (
    "id",
    "board",
    "task_id",
    "run_id",
    "ordinal",
    "state",
    "attempt",
    "fence",
    "lease_until",
    "updated_at",
    "failures",
    "last_error",
    "next_attempt_at",
    "quarantined",
)


def _row_dict(row: Any) -> dict[str, Any]:
    from poolkeeper.status import row_view

    view = row_view(row)
    return {key: view[key] for key in ROW_FIELDS}


@app.command()
def rows(
    row: Annotated[
        int | None,
        typer.Argument(min=1, max=validate.MAX_ROW_ID, help="One row: show it with its child executions."),
    ] = None,
    state: Annotated[str | None, typer.Option(help="Only rows in this state.")] = None,
    quarantined: Annotated[bool, typer.Option("--quarantined", help="Only quarantined rows.")] = False,
    search: Annotated[
        str | None,
        typer.Option(
            help="Only rows whose id or run is TEXT, or whose task, owner, board or error holds it."
        ),
    ] = None,
    history: Annotated[
        bool, typer.Option("--history", help="With ROW: its audit trail, oldest first (the newest --limit).")
    ] = False,
    limit: Annotated[int, typer.Option(min=1, max=validate.INT32_MAX)] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List pool rows, or show one row with its child executions as a tree, or its history."""
    from store import queries
    from store.models import RowState

    if history:
        if row is None:
            raise InvalidInput("--history", "needs a ROW: `poolctl rows ROW --history`")
        _row_history(row, limit, as_json)
        return
    if row is not None:
        _row_with_children(row, as_json)
        return
    want = None
    if state is not None:
        try:
            want = RowState(state)
        except ValueError:
            raise InvalidInput(
                "--state", f"unknown state {state!r}; one of " + ", ".join(s.value for s in RowState)
            ) from None
    with _store().session(readonly=True) as s:
        if search is None:
            listed = queries.rows(s, state=want, quarantined=quarantined, limit=limit)
        else:  # as the console's search: newest first
            where = queries.RowFilter(want, quarantined)
            listed, _ = queries.search_rows(s, search, offset=0, limit=limit, where=where)
        found = [_row_dict(r) for r in listed]
    _emit(found, render.rows(found, out.width), as_json)


def _row_with_children(row_id: int, as_json: bool) -> None:
    from poolkeeper.status import row_detail
    from store import audit, lineage
    from store import rows as rows_

    store, board = _store(), _board()
    with store.session(readonly=True) as s:
        row = rows_.get_row(s, row_id)
        data = {**_row_dict(row), "children": lineage.tree(s, row_id)}
        detail = row_detail(row, audit.history(s, row_id), board.get_task(row.board, row.task_id))
    data["detail"] = {**detail, "max_attempts": store.max_attempts}
    _emit(data, render.row_tree(row_id, data), as_json)


def _row_history(row_id: int, limit: int, as_json: bool) -> None:
    from store import audit
    from store import rows as rows_

    with _store().session(readonly=True) as s:
        data = {**_row_dict(rows_.get_row(s, row_id)), "history": audit.history(s, row_id, limit=limit)}
    _emit(data, render.history(row_id, data, out.width), as_json)


@app.command()
def requeue(
    row: Annotated[int, typer.Argument(min=1, max=validate.MAX_ROW_ID, help="Row id (see `poolctl rows`).")],
) -> None:
    """Clear a row's backoff and quarantine so the next scan retries it now."""
    from store import audit, transitions

    with _store("write").session() as s:
        got = transitions.requeue(s, row, now=time.time(), actor=audit.OPERATOR)
    out.print(
        render.line("row {} ({}/{} run {}, {}) requeued", row, got.board, got.task_id, got.run_id, got.state)
    )


@app.command()
def abandon(
    row: Annotated[int, typer.Argument(min=1, max=validate.MAX_ROW_ID, help="Row id (see `poolctl rows`).")],
    reason: Annotated[str, typer.Option(help="Why; it goes on the board.")] = ABANDON_REASON,
) -> None:
    """Give up on a row: park its exact run on the board, make the row stale, free its ordinal."""
    from poolkeeper import operator

    got = operator.abandon(_board("write"), _store("write"), row, reason, time.time())
    board = "parked" if got.parked else "had already moved the run on"
    pool = f"ordinal {got.settled.ordinal} free" if got.settled else "settled meanwhile by the plane"
    out.print(
        render.line(
            "row {} ({}/{} run {}) abandoned: board {}; {}",
            row,
            got.board,
            got.task_id,
            got.run_id,
            board,
            pool,
        )
    )


@app.command(name="pause")
def pause_dispatch(
    reason: Annotated[str, typer.Option(help="Why (kept in the audit trail and shown by `status`).")],
    board: Annotated[
        str | None, typer.Option(help="Pause this board alone: no claims from it, the others go on.")
    ] = None,
) -> None:
    """Pause dispatch (drain mode), or one board's: no new claims; every claimed run still runs."""
    from poolkeeper.events import dispatch_settled
    from store import audit, pause

    if board is not None and not _board().has_board(board):  # a misspelt name would pause nothing
        raise NotFound(f"{validate.label(board, 64)}: no such board")
    with _store("write").session() as s:
        changed = pause.pause(s, reason, now=time.time(), actor=audit.OPERATOR, board=board)
        now = pause.read(s) if board is None else pause.boards(s)[board]
    what = "dispatch" if board is None else f"dispatch of board {board}"
    if changed:
        settled = dispatch_settled(_settings()) or "no claim follows"
        resume = "`poolctl resume`" if board is None else f"`poolctl resume --board {board}`"
        told = "{} paused: {} ({}; claimed runs go on; {} ends it)"
        out.print(render.line(told, what, now.reason, settled, resume))
    else:
        out.print(render.line("{} was already paused: {} (unchanged)", what, now.reason))


@app.command(name="resume")
def resume_dispatch(
    board: Annotated[str | None, typer.Option(help="Resume this board alone (paused with --board).")] = None,
) -> None:
    """Resume dispatch after `poolctl pause` (or one board's): ready tasks are claimed again at once."""
    from poolkeeper.events import events_for, task_ready
    from store import audit, pause

    with _store("write").session() as s:
        changed = pause.resume(s, now=time.time(), actor=audit.OPERATOR, board=board)
    if changed:
        task_ready(events_for(_settings()))
    elif board is not None and not _board().has_board(board):  # a misspelt name: not "unchanged"
        raise NotFound(f"{validate.label(board, 64)}: no such board")
    what = "dispatch" if board is None else f"dispatch of board {board}"
    out.print(render.line("{} resumed" if changed else "{} was not paused (unchanged)", what))


@app.command()
def maintain(
    once: Annotated[bool, typer.Option("--once", help="Run every pass once, in-process.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run every maintenance pass once, synchronously, with the plane's per-row code."""
    if not once:
        raise InvalidInput(
            "maintain",
            "only --once is supported here; run `celery -A tasks worker -B` for the continuous plane",
        )
    from tasks.maintain import maintain_once
    from tasks.plane import Plane

    plane = Plane.from_settings(_settings(), _store("write"), _board("write"))
    plane.coord.ping()
    summary = maintain_once(plane, time.time())
    data = {name: dict(outcomes) for name, outcomes in summary.items()}
    _emit(data, render.outcomes(data), as_json)


class DemoBoard(StrEnum):
    SQLITE = "sqlite"
    HTTP = "http"


@app.command()
def demo(
    tasks: Annotated[int, typer.Option(min=1, max=100_000, help="Board tasks to seed.")] = 200,
    pool_size: Annotated[int, typer.Option(min=1, max=64, help="Worker ordinals.")] = 6,
    crash_rate: Annotated[float, typer.Option(min=0, max=1, help="Workers dying on a run.")] = 0.05,
    hang_rate: Annotated[float, typer.Option(min=0, max=1, help="Workers hanging past their lease.")] = 0.02,
    poison: Annotated[int, typer.Option(min=0, max=10_000, help="Tasks the board fails on, every time.")] = 2,
    board_busy_rate: Annotated[float, typer.Option(min=0, max=0.9, help="Board calls failing busy.")] = 0.02,
    lease: Annotated[float, typer.Option(min=0.5, max=3600, help="Lease seconds.")] = 3.0,
    timeout: Annotated[float, typer.Option(min=10, max=86400, help="Give up after this many seconds.")] = 600,
    workdir: Annotated[
        Path | None,
        typer.Option(help="Keep the databases and logs here (a new or empty folder, or a past demo's)."),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(min=0, max=2**32 - 1, help="Seed for the injected faults.")
    ] = None,
    board: Annotated[
        DemoBoard,
        typer.Option(
            help="How the plane reaches the board: its SQLite file, or http (behind `poolctl board serve`,"
            " whose busy board answers 503)."
        ),
    ] = DemoBoard.SQLITE,
) -> None:
    """Run the embedded end-to-end demo (no Redis or database to install)."""
    from poolkeeper.demo import Demo, DemoOptions

    if crash_rate + hang_rate >= 1:
        raise InvalidInput("--crash-rate/--hang-rate", "together they must stay below 1")
    if poison > tasks:
        raise InvalidInput("--poison", f"cannot exceed --tasks ({tasks})")
    opts = DemoOptions(
        tasks=tasks,
        pool_size=pool_size,
        crash_rate=crash_rate,
        hang_rate=hang_rate,
        poison=poison,
        board_busy_rate=board_busy_rate,
        lease_seconds=lease,
        timeout=timeout,
        workdir=workdir,
        seed=seed,
        board=board.value,
    )
    try:
        code = Demo(opts, out).run()
    except KeyboardInterrupt:
        print("poolctl demo: interrupted; everything it started is stopped", file=sys.stderr)
        raise typer.Exit(130) from None
    raise typer.Exit(code)
