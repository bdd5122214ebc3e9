"""``poolctl``: the operator's command line.

A user mistake (a bad setting, an unknown row or board, malformed input) is
one clear line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from board import KanbanBoard, TaskStatus
from core.errors import InvalidInput, NotFound, PoolError, SettingsError, TransientError
from core.settings import Settings
from store import PoolStore, lineage, queries, transitions
from store import rows as rows_
from store.models import RowState

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
board_app = typer.Typer(no_args_is_help=True, help="The built-in Kanban board.")
app.add_typer(board_app, name="board")
out = Console()

JsonOpt = Annotated[bool, typer.Option("--json", help="Stable JSON for scripts.")]


def _settings() -> Settings:
    return Settings.from_env()


def _store() -> PoolStore:
    return PoolStore.from_settings(_settings())


def _kanban() -> KanbanBoard:
    return KanbanBoard(_settings().board_url)


def _emit(data: Any, table: Table | Tree | str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        out.print(table)


@app.command()
def init() -> None:
    """Create or migrate the pool store and the board (a no-op when current)."""
    store, kanban = _store(), _kanban()
    store.migrate()
    kanban.migrate()
    out.print(f"pool store ready: {store.url}")
    out.print(f"board ready:      {_settings().board_url}")


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Rows by state, free ordinals, oldest lease_failed, quarantined, board tasks by status."""
    store = _store()
    now = time.time()
    with store.session(readonly=True) as s:
        counts = queries.counts_by_state(s)
        free = queries.free_ordinals(s, store.pool_size)
        oldest = queries.oldest_in_state(s, RowState.LEASE_FAILED)
        quarantined = queries.quarantined_count(s)
    board_counts = _kanban().counts_by_status()
    data = {
        "rows": counts,
        "pool_size": store.pool_size,
        "free_ordinals": free,
        "oldest_lease_failed_seconds": None if oldest is None else round(now - oldest, 1),
        "quarantined": quarantined,
        "board": board_counts,
    }
    table = Table(title="poolkeeper", show_header=False)
    for state, n in counts.items():
        table.add_row(f"rows {state}", str(n))
    table.add_row("free ordinals", f"{len(free)}/{store.pool_size} {free}")
    table.add_row("oldest lease_failed", "-" if oldest is None else f"{now - oldest:.0f}s ago")
    table.add_row("quarantined", str(quarantined))
    for st, n in board_counts.items():
        table.add_row(f"board {st}", str(n))
    _emit(data, table, as_json)


def _row_dict(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "board": row.board,
        "task_id": row.task_id,
        "run_id": row.run_id,
        "ordinal": row.ordinal,
        "state": row.state,
        "attempt": row.attempt,
        "fence": row.fence,
        "lease_until": row.lease_until,
        "updated_at": row.updated_at,
        "failures": row.failures,
        "last_error": row.last_error,
        "next_attempt_at": row.next_attempt_at,
        "quarantined": bool(row.quarantined),
    }


@app.command()
def rows(
    row: Annotated[int | None, typer.Argument(help="One row: show it with its child executions.")] = None,
    state: Annotated[str | None, typer.Option(help="Only rows in this state.")] = None,
    quarantined: Annotated[bool, typer.Option("--quarantined", help="Only quarantined rows.")] = False,
    limit: Annotated[int, typer.Option(min=1)] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List pool rows, or show one row with its child executions as a tree."""
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
        found = [_row_dict(r) for r in queries.rows(s, state=want, quarantined=quarantined, limit=limit)]
    table = Table("id", "board/task", "run", "ord", "state", "att", "fence", "failures", "last error")
    for r in found:
        table.add_row(
            str(r["id"]),
            f"{r['board']}/{r['task_id']}",
            str(r["run_id"]),
            str(r["ordinal"]),
            r["state"] + (" (Q)" if r["quarantined"] else ""),
            str(r["attempt"]),
            str(r["fence"] or "-"),
            str(r["failures"]),
            (r["last_error"] or "")[:60],
        )
    _emit(found, table, as_json)


def _row_with_children(row_id: int, as_json: bool) -> None:
    with _store().session(readonly=True) as s:
        data = {**_row_dict(rows_.get_row(s, row_id)), "children": lineage.tree(s, row_id)}
    root = Tree(f"row {row_id} {data['board']}/{data['task_id']} run {data['run_id']}: {data['state']}")

    def add(branch: Tree, children: list[dict[str, Any]]) -> None:
        for c in children:
            outcome = f" ({c['outcome']})" if c["outcome"] else ""
            label = f"{c['id'].rsplit('/', 1)[1]} {c['status']}{outcome} epoch {c['epoch']}"
            add(branch.add(label), c["children"])

    add(root, data["children"])
    _emit(data, root, as_json)


@app.command()
def requeue(row: Annotated[int, typer.Argument(help="Row id (see `poolctl rows`).")]) -> None:
    """Clear a row's backoff and quarantine so the next scan retries it now."""
    with _store().session() as s:
        got = transitions.requeue(s, row, now=time.time())
    out.print(f"row {row} ({got.board}/{got.task_id} run {got.run_id}, {got.state}) requeued")


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

    summary = maintain_once(Plane.from_settings(_settings()), time.time())
    data = {name: dict(outcomes) for name, outcomes in summary.items()}
    table = Table("pass", "outcomes")
    for name, outcomes in data.items():
        table.add_row(name, " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "-")
    _emit(data, table, as_json)


@app.command()
def demo(
    tasks: Annotated[int, typer.Option(min=1, help="Board tasks to seed.")] = 200,
    pool_size: Annotated[int, typer.Option(min=1, max=64, help="Worker ordinals.")] = 6,
    crash_rate: Annotated[float, typer.Option(min=0, max=1, help="Workers dying on a run.")] = 0.05,
    hang_rate: Annotated[float, typer.Option(min=0, max=1, help="Workers hanging past their lease.")] = 0.02,
    poison: Annotated[int, typer.Option(min=0, help="Tasks the board fails on, every time.")] = 2,
    board_busy_rate: Annotated[float, typer.Option(min=0, max=0.9, help="Board calls failing busy.")] = 0.02,
    lease: Annotated[float, typer.Option(min=0.5, help="Lease seconds.")] = 3.0,
    timeout: Annotated[float, typer.Option(min=10, help="Give up after this many seconds.")] = 600,
    workdir: Annotated[Path | None, typer.Option(help="Keep the databases and logs here.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for the injected faults.")] = None,
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
    )
    try:
        code = Demo(opts, out).run()
    except KeyboardInterrupt:
        print("poolctl demo: interrupted; everything it started is stopped", file=sys.stderr)
        raise typer.Exit(130) from None
    raise typer.Exit(code)


# --- board ---------------------------------------------------------------------


@board_app.command("add")
def board_add(
    board: str,
    title: str,
    body: Annotated[str, typer.Option(help="Task body.")] = "",
    lane: Annotated[str, typer.Option(help="Lane; only 'pool' tasks are claimed.")] = "pool",
    task_id: Annotated[str | None, typer.Option("--id", help="Task id (default: generated).")] = None,
) -> None:
    """Add a ready task."""
    out.print(_kanban().add_task(board, title, body, lane=lane, task_id=task_id))


@board_app.command("list")
def board_list(
    board: Annotated[str | None, typer.Argument()] = None,
    status_: Annotated[str | None, typer.Option("--status")] = None,
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
            raise InvalidInput("--status", f"unknown status {status_!r}") from None
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
    table = Table("board", "id", "title", "status", "lane", "run", "block reason")
    for t in found:
        table.add_row(
            t.board,
            t.id,
            t.title[:40],
            t.status.value,
            t.lane,
            str(t.current_run_id or "-"),
            t.block_reason or "",
        )
    _emit(data, table, as_json)


@board_app.command("cancel")
def board_cancel(board: str, task_id: str) -> None:
    """End a task for good (done, result {"cancelled": true})."""
    task = _kanban().cancel_task(board, task_id)
    out.print(f"{board}/{task_id} cancelled ({task.status.value})")


@board_app.command("unblock")
def board_unblock(board: str, task_id: str) -> None:
    """Put a parked task back to ready."""
    _kanban().unblock_task(board, task_id)
    out.print(f"{board}/{task_id} ready")


def main() -> None:
    """Entry point: user mistakes become one line and exit code 2."""
    try:
        app()  # standalone: click reports usage errors itself (exit 2)
    except (SettingsError, InvalidInput, NotFound) as e:
        _fail(str(e), 2)
    except TransientError as e:
        _fail(f"busy, try again: {e}", 75)
    except PoolError as e:
        _fail(str(e), 1)


def _fail(message: str, code: int) -> None:
    print(f"poolctl: {message}", file=sys.stderr)
    sys.exit(code)
