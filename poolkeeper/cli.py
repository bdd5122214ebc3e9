"""``poolctl``: the operator's command line.

Every failure is one line on stderr and an exit code from ``core.errors.EXIT_CODES`` (the
table in ``EPILOG`` and README "Operate"), never a traceback unless
``POOLCTL_DEBUG=1``. Only ``init`` creates a database.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from board import Board, TaskStatus, open_board
from core import db, validate
from core.db import mask_url
from core.errors import InvalidInput, NotFound, SettingsError, exit_code
from core.settings import Settings
from poolkeeper import operator
from store import PoolStore, audit, lineage, queries, transitions
from store import rows as rows_
from store.models import RowState

if TYPE_CHECKING:
    from poolkeeper.client import ChildToken, PoolClient

# The first class that matches decides; anything else is an internal error (exit 1).
EPILOG = """Exit codes:

\b
   0  ok
   1  internal error (one line; POOLCTL_DEBUG=1 shows the traceback)
   2  usage or refused request: a bad argument or setting, an unknown row,
      a token the server refuses (401, 403)
  69  a server refuses connections (PostgreSQL, Redis); the URL is named
  75  busy or locked: try again
  78  a URL or file that cannot work: not a URL, no driver, missing directory,
      not a database, read-only, not initialised (run `poolctl init`)
"""

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Operate a poolkeeper pool: its store, its board and the maintenance passes.",
    epilog=EPILOG,
    pretty_exceptions_enable=False,
)
board_app = typer.Typer(no_args_is_help=True, help="The built-in Kanban board.")
app.add_typer(board_app, name="board")
out = Console()

JsonOpt = Annotated[bool, typer.Option("--json", help="Stable JSON for scripts.")]


def _settings() -> Settings:
    return Settings.from_env()


# "read" and "write" need a database `poolctl init` set up; "create" (init) one it can create.
# Else ConfigError, before anything is created.
Access = Literal["read", "write", "create"]


def _store(access: Access = "read") -> PoolStore:
    store = PoolStore.from_settings(_settings())
    if access == "create":
        db.require_creatable(store.engine, "pool store")
    else:
        store.require_schema(writable=access == "write")
    return store


def _kanban(access: Access = "read") -> Board:
    kanban = open_board(_settings())
    if access == "create":
        kanban.require_creatable()
    else:
        kanban.require_schema(writable=access == "write")
    return kanban


def _emit(data: Any, table: Table | Tree | Text | str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        out.print(table)


def _version(value: bool) -> None:
    if value:
        try:
            version = importlib.metadata.version("poolkeeper")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown (not installed)"
        out.print(f"poolctl {version}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    pass


@app.command()
def init() -> None:
    """Create or migrate the pool store and the board (a no-op when current)."""
    store, kanban = _store("create"), _kanban("create")
    store.migrate()
    kanban.migrate()
    out.print(f"pool store ready: {mask_url(store.engine.url)}")
    out.print(f"board ready:      {kanban.location()}")


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Rows by state, ordinals, quarantined, beat liveness and queue depth, board tasks by status."""
    from poolkeeper.status import redis_reader, snapshot

    settings, store, kanban = _settings(), _store(), _kanban()
    client, problem = redis_reader(settings)
    data = snapshot(store, kanban, settings, client, time.time(), redis_error=problem)
    free, counts = data["free_ordinals"], data["rows"]
    table = Table(title="poolkeeper", show_header=False)
    for state, n in counts.items():
        table.add_row(f"rows {state}", str(n))
    table.add_row("free ordinals", f"{len(free)}/{store.pool_size} {free}")
    oldest = data["oldest_lease_failed_seconds"]
    table.add_row("oldest lease_failed", "-" if oldest is None else f"{oldest:.0f}s ago")
    table.add_row("quarantined", str(data["quarantined"]))
    held_by_quarantined = data["held_by_quarantined"]
    stuck = f"{held_by_quarantined} (see `poolctl abandon`)" if held_by_quarantined else "-"
    table.add_row("ordinals held by quarantined rows", stuck)
    table.add_row("live child executions", str(data["live_children"]))
    table.add_row("audit events written", str(data["audit_events"]))
    unknown = f"unknown ({data['redis_error']})"
    depth = data["queue_depth"]
    table.add_row("queue depth", unknown if depth is None else str(depth))
    alive = data["beat_alive"]
    table.add_row("beat", unknown if alive is None else "alive" if alive else "NOT SCANNING")
    for name, scan in data["scans"].items():
        age = scan["age_seconds"]
        seen = "unknown" if scan["late"] is None else "never" if age is None else f"{age:.0f}s ago"
        table.add_row(f"last scan {name}", seen + (" (late)" if scan["late"] and age is not None else ""))
    for st, n in data["board"].items():
        table.add_row(f"board {st}", str(n))
    _emit(data, table, as_json)


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
    row: Annotated[int | None, typer.Argument(help="One row: show it with its child executions.")] = None,
    state: Annotated[str | None, typer.Option(help="Only rows in this state.")] = None,
    quarantined: Annotated[bool, typer.Option("--quarantined", help="Only quarantined rows.")] = False,
    history: Annotated[
        bool, typer.Option("--history", help="With ROW: its audit trail, oldest first (the newest --limit).")
    ] = False,
    limit: Annotated[int, typer.Option(min=1, max=validate.INT32_MAX)] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List pool rows, or show one row with its child executions as a tree, or its history."""
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


def _row_history(row_id: int, limit: int, as_json: bool) -> None:
    with _store().session(readonly=True) as s:
        data = {**_row_dict(rows_.get_row(s, row_id)), "history": audit.history(s, row_id, limit=limit)}
    title = f"row {row_id} {data['board']}/{data['task_id']} run {data['run_id']}: {data['state']}"
    if not data["history"]:
        _emit(data, Text(f"{title}\nno recorded events (none yet, or all older than the retention)"), as_json)
        return
    table = Table("time (UTC)", "kind", "from → to", "att", "fence", "actor", "detail", title=Text(title))
    for e in data["history"]:
        table.add_row(
            _utc(e["at"]),
            e["kind"],
            f"{e['from'] or '-'} → {e['to'] or '-'}",
            str(e["attempt"] or "-"),
            str(e["fence"] or "-"),
            Text(e["actor"]),
            Text(e["detail"] or ""),  # text, never markup: an error may hold brackets
        )
    _emit(data, table, as_json)


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))


@app.command()
def requeue(
    row: Annotated[int, typer.Argument(min=1, max=validate.MAX_ROW_ID, help="Row id (see `poolctl rows`).")],
) -> None:
    """Clear a row's backoff and quarantine so the next scan retries it now."""
    with _store("write").session() as s:
        got = transitions.requeue(s, row, now=time.time(), actor=audit.OPERATOR)
    out.print(f"row {row} ({got.board}/{got.task_id} run {got.run_id}, {got.state}) requeued")


@app.command()
def abandon(
    row: Annotated[int, typer.Argument(min=1, max=validate.MAX_ROW_ID, help="Row id (see `poolctl rows`).")],
    reason: Annotated[str, typer.Option(help="Why; it goes on the board.")] = operator.DEFAULT_ABANDON_REASON,
) -> None:
    """Give up on a row: park its exact run on the board, make the row stale, free its ordinal."""
    got = operator.abandon(_kanban("write"), _store("write"), row, reason, time.time())
    board = "parked" if got.parked else "had already moved the run on"
    pool = f"ordinal {got.settled.ordinal} free" if got.settled else "settled meanwhile by the plane"
    out.print(f"row {row} ({got.board}/{got.task_id} run {got.run_id}) abandoned: board {board}; {pool}")


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

    plane = Plane.from_settings(_settings(), _store("write"), _kanban("write"))
    plane.coord.ping()
    summary = maintain_once(plane, time.time())
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
    workdir: Annotated[
        Path | None,
        typer.Option(help="Keep the databases and logs here (a new or empty folder, or a past demo's)."),
    ] = None,
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


# --- wire protocol -------------------------------------------------------------

EX_CONFIG = 78  # sysexits.h: a configuration error; systemd's unit does not restart on it


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind [POOL_SERVE_HOST].")] = None,
    port: Annotated[int | None, typer.Option(min=0, max=65535, help="Port [POOL_SERVE_PORT].")] = None,
    local_only: Annotated[
        bool,
        typer.Option(
            "--local-only", help="Allow serving without POOL_SERVER_SECRET (loopback only; no auth)."
        ),
    ] = False,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log one line per request.")] = False,
) -> None:
    """Serve the worker protocol over HTTP/JSON (/v1, /healthz, /readyz, /metrics, /docs)."""
    from poolkeeper.server import serve as server

    try:
        settings = _settings()
        server.run(
            settings,
            host=host or settings.serve_host,
            port=settings.serve_port if port is None else port,
            local_only=local_only,
            access_log=access_log,
        )
    except SettingsError as e:
        _fail(str(e), EX_CONFIG)


@app.command()
def token(
    ordinal: Annotated[
        int | None, typer.Option(min=0, help="The ordinal whose worker token to print.")
    ] = None,
    operator: Annotated[bool, typer.Option("--operator", help="Print the operator token.")] = False,
) -> None:
    """Print a bearer token derived from POOL_SERVER_SECRET (a worker's, or the operator's)."""
    from poolkeeper import tokens

    try:
        settings = _settings()
    except SettingsError as e:
        _fail(str(e), EX_CONFIG)
    if (ordinal is None) == (not operator):
        raise InvalidInput("token", "give exactly one of --ordinal N and --operator")
    if not settings.server_secret:
        _fail("POOL_SERVER_SECRET (or POOL_SERVER_SECRET_FILE) is not set: no token to derive", EX_CONFIG)
    if ordinal is not None and ordinal >= settings.pool_size:
        raise InvalidInput("--ordinal", f"must be below POOL_SIZE ({settings.pool_size}), got {ordinal}")
    secret = settings.server_secret
    print(tokens.operator_token(secret) if ordinal is None else tokens.ordinal_token(secret, ordinal))


@app.command()
def worker(
    ordinal: Annotated[int, typer.Option(min=0, help="The ordinal this worker serves.")],
    command: Annotated[
        str, typer.Option(help="The command to run per grant (split like a shell, run without one).")
    ],
    url: Annotated[str, typer.Option(envvar="POOL_WORKER_URL", help="Where `poolctl serve` answers.")],
    token_: Annotated[
        str,
        typer.Option(
            "--token",
            envvar="POOL_WORKER_TOKEN",
            show_default=False,
            help="This ordinal's token (on the command line every user can read it: prefer --token-file).",
        ),
    ] = "",
    token_file: Annotated[
        str,
        typer.Option(
            "--token-file",
            envvar="POOL_WORKER_TOKEN_FILE",
            show_default=False,
            help="A file holding the token.",
        ),
    ] = "",
    owner: Annotated[str | None, typer.Option(help="Instance name (default: host:pid:random).")] = None,
    poll: Annotated[float, typer.Option(min=0.05, help="Seconds between offers while idle.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Exit after delivering one result.")] = False,
) -> None:
    """Run COMMAND for each grant of ORDINAL: payload on stdin, heartbeats, result; SIGTERM releases."""
    import logging
    import shlex

    from core.settings import read_secret_file
    from poolkeeper.worker import TOKEN_FILE_ENV, CommandWorker, forbid_inspection

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    forbid_inspection()  # first: the command, as this user, must not read the token from /proc
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise InvalidInput("--command", str(e)) from None
    if token_file:
        if token_:
            raise SettingsError(
                f"--token-file ({TOKEN_FILE_ENV}): give it or --token (POOL_WORKER_TOKEN), not both"
            )
        token_ = read_secret_file(f"--token-file ({TOKEN_FILE_ENV})", token_file)
    with _pool_client("--url (POOL_WORKER_URL)", url, "--token (POOL_WORKER_TOKEN)", token_) as client:
        runner = CommandWorker(client, ordinal, argv, owner=owner, poll_seconds=poll, once=once)
        runner.install_signal_handlers()
        raise typer.Exit(runner.run())


# --- child executions, from inside a worker's command ---------------------------

CHILD_EPILOG = """Exit codes (a refusal is one line on stderr):

\b
   0  ok
   1  stale: the child or its grant has ended; the child must stop
   2  bad input or a refused request: a bad option (JSON with NaN),
      a missing or malformed POOL_* variable (POOL_CHILD_TOKEN),
      or the server refused the token (401, 403)
  69  the server refuses connections
  75  busy: try again
  78  POOL_WORKER_URL cannot work: not an http:// or https:// URL
"""

child_app = typer.Typer(
    no_args_is_help=True,
    help="Register and report child executions from inside a `poolctl worker` command: its"
    " POOL_WORKER_URL, POOL_CHILD_TOKEN, POOL_ROW_ID, POOL_ATTEMPT, POOL_FENCE and POOL_OWNER say"
    " which grant.",
    epilog=CHILD_EPILOG,
)
app.add_typer(child_app, name="child")
ChildOpt = Annotated[
    str,
    typer.Option("--child", envvar="POOL_CHILD_ID", show_default=False, help="The id `register` printed."),
]


def _pool_client(url_name: str, url: str, token_name: str, token: str) -> PoolClient:
    """A client of `poolctl serve` whose URL can work (else exit 78) and whose token is one (else 2)."""
    from poolkeeper import tokens
    from poolkeeper.client import PoolClient, check_url

    check_url(url_name, url)
    if token and not tokens.well_formed(token):  # not echoed: it is a secret, or most of one
        raise InvalidInput(
            token_name, "not a token of the form `poolctl token` or `poolctl worker` gives (a stray space?)"
        )
    return PoolClient(url, token or None)


def _child_client() -> PoolClient:
    from poolkeeper.worker import CHILD_TOKEN_ENV, URL_ENV

    url = os.environ.get(URL_ENV, "")
    if not url:
        raise InvalidInput(URL_ENV, "not set: run this inside a `poolctl worker` command, or set it")
    return _pool_client(URL_ENV, url, CHILD_TOKEN_ENV, os.environ.get(CHILD_TOKEN_ENV, ""))


def _child_id(child_id: str) -> str:
    if not child_id:
        raise InvalidInput("--child", "missing: give --child or set POOL_CHILD_ID")
    return child_id


def _child_token(child_id: str) -> ChildToken:
    from poolkeeper.client import ChildToken
    from poolkeeper.worker import fence_from_env

    return ChildToken(_child_id(child_id), fence_from_env(os.environ))


def _json_object(option: str, value: str) -> dict[str, Any]:
    """A JSON object the server would take as a document; else ``InvalidInput`` naming ``option``."""
    try:
        found = json.loads(value, parse_constant=_no_constant)
    except ValueError as err:
        raise InvalidInput(option, f"not JSON: {err}") from None
    except RecursionError:
        raise InvalidInput(option, f"JSON nested deeper than {validate.MAX_DEPTH} levels") from None
    if not isinstance(found, dict):
        raise InvalidInput(option, f"expected a JSON object, got {type(found).__name__}")
    validate.document(option, found)  # 1e999 (infinite), depth, size, credential-like keys
    return found


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (NaN and Infinity have no JSON form)")


@child_app.command("register")
def child_register(
    under: Annotated[str | None, typer.Option(help="Nest under this live child (its id).")] = None,
    key: Annotated[
        str | None,
        typer.Option(help="Idempotency key: the same key (same grant and parent) is the same child."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a child under this command's grant; print its id (POOL_CHILD_ID for the child)."""
    from poolkeeper.worker import grant_from_env

    holder = grant_from_env(os.environ)
    with _child_client() as client:
        child = client.register_child(holder, under=under, key=key)
    if as_json:
        _emit(dataclasses.asdict(child), "", True)
    else:
        print(child.child_id)


@child_app.command("heartbeat")
def child_heartbeat(
    child: ChildOpt = "",
    receipt: Annotated[str | None, typer.Option(help="A JSON object: the child's latest receipt.")] = None,
) -> None:
    """The child is alive (registered → running); refused (exit 1) once it or its grant ended."""
    document = None if receipt is None else _json_object("--receipt", receipt)
    with _child_client() as client:
        print(client.child_heartbeat(_child_token(child), document))


@child_app.command("result")
def child_result(
    child: ChildOpt = "",
    payload: Annotated[str, typer.Option(help="The child's result, a JSON object.")] = "{}",
) -> None:
    """Deliver the child's result: it turns terminal (with its own children); prints applied or duplicate."""
    document = _json_object("--payload", payload)
    with _child_client() as client:
        print(client.child_result(_child_token(child), document))


@child_app.command("vanished")
def child_vanished(child: ChildOpt = "") -> None:
    """The holder lost a live child's process: it and its live descendants turn unknown."""
    from poolkeeper.worker import grant_from_env

    holder = grant_from_env(os.environ)
    with _child_client() as client:
        print(client.child_vanished(holder, _child_id(child)))


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
    out.print(_kanban("write").add_task(board, title, body, lane=lane, task_id=task_id))
    if lane != pool_lane:
        note = f"lane {lane!r} is not the pool's lane ({pool_lane!r}): the pool will never claim it"
        print(f"poolctl: note: {note}", file=sys.stderr)


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
    """End a task for good (done, result {"cancelled": true}); its pool row goes stale at once."""
    got = operator.cancel(_kanban("write"), _store("write"), board, task_id, time.time())
    if got.settled is not None:
        pool = f"row {got.settled.row_id} ({got.settled.was}) is stale: its worker is fenced out"
    elif got.left_to_reconcile is not None:
        pool = f"its pool row is left to reconcile ({got.left_to_reconcile})"
    else:
        pool = "no live pool row"
    out.print(f"{board}/{task_id} cancelled ({got.task.status.value}); {pool}")


@board_app.command("unblock")
def board_unblock(board: str, task_id: str) -> None:
    """Put a parked task back to ready."""
    _kanban("write").unblock_task(board, task_id)
    out.print(f"{board}/{task_id} ready")


def main() -> None:
    """Entry point: every failure is one line on stderr and its exit code (``core.errors.EXIT_CODES``)."""
    try:
        _require_utf8(sys.argv[1:])
        code = app(prog_name="poolctl", standalone_mode=False)
    except typer.TyperException as e:  # a usage error: one line, not click's framed panel
        # typer itself recognises this one by name; its help is already printed
        if type(e).__name__ != "NoArgsIsHelpError":
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _fail(f"{e.format_message()}{hint}", e.exit_code)
        code = e.exit_code
    except Exception as e:
        code, message = _exit_code(e)
        _fail(message, code)
    sys.exit(code if isinstance(code, int) else 0)


def _exit_code(err: Exception) -> tuple[int, str]:
    if os.environ.get("POOLCTL_DEBUG"):
        traceback.print_exc()
    if (ours := exit_code(err)) is not None:
        return ours
    return 1, f"internal error: {type(err).__name__}: {err} (run with POOLCTL_DEBUG=1 for the traceback)"


def _require_utf8(args: list[str]) -> None:
    """Arguments the databases can hold: a non-UTF-8 byte arrives as a lone surrogate."""
    for i, arg in enumerate(args):
        try:
            validate.text("argument", arg)
        except InvalidInput as err:
            if arg.startswith("--") and "=" in arg:
                name = arg.split("=", 1)[0]
            elif i and args[i - 1].startswith("-"):
                name = f"the value of {args[i - 1]}"
            else:
                name = f"argument {i + 1}"
            raise InvalidInput(name, f"{err.problem}: {arg!a}") from None


def _fail(message: str, code: int) -> NoReturn:
    one_line = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    print(f"poolctl: {one_line}", file=sys.stderr)
    sys.exit(code)
