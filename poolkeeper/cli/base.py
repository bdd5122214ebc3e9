"""What every command group shares: the app, the console, the settings, the store and the board.

One place to open them, so each group module holds only its commands. What costs to import
(SQLAlchemy, the store, the board, a server) waits for the command that needs it, so
``poolctl --help`` starts at once (tests/cli/test_cli_start.py holds every group module to it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console

from poolkeeper import __version__

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text
    from rich.tree import Tree

    from board import Board
    from core.settings import Settings
    from store import PoolStore

# Each error class carries its code (core.errors); anything else is an internal error (exit 1).
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
# A pipe has no width: Rich would fold every long value at 80 columns, so a pipe gets lines as long
# as they are (COLUMNS still sets a width). Tables are no wider than their cells.
PIPE_WIDTH = 1 << 14
out = Console()
if not out.is_terminal and not os.environ.get("COLUMNS"):
    out.width = PIPE_WIDTH

JsonOpt = Annotated[bool, typer.Option("--json", help="Stable JSON for scripts.")]
# The options of both servers (`serve`, `board serve`).
AccessLogOpt = Annotated[bool, typer.Option("--access-log", help="Log one line per request.")]
MaxConnectionsOpt = Annotated[int, typer.Option(min=1, max=65536, help="Connections held at once, in all.")]
MaxPerClientOpt = Annotated[
    int,
    typer.Option(
        min=1,
        max=65536,
        help="Connections held at once per client address (behind a proxy, every worker is one"
        " client: raise it to --max-connections).",
    ),
]


def _settings() -> Settings:
    from core.settings import Settings

    return Settings.from_env()


# "read" and "write" need a database `poolctl init` set up; "create" (init) one it can create.
# Else ConfigError, before anything is created.
Access = Literal["read", "write", "create"]


def _store(access: Access = "read") -> PoolStore:
    from core import db
    from store import PoolStore

    store = PoolStore.from_settings(_settings())
    if access == "create":
        db.require_creatable(store.engine, "pool store")
    else:
        store.require_schema(writable=access == "write")
    return store


def _board(access: Access = "read") -> Board:
    from board import open_board

    board = open_board(_settings())
    if access == "create":
        board.require_creatable()
    else:
        board.require_schema(writable=access == "write")
    return board


def _emit(data: Any, table: Table | Tree | Text | str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        out.print(table)


def _version(value: bool) -> None:
    if value:
        out.print(f"poolctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    pass


def _fail(message: str, code: int) -> NoReturn:
    one_line = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    print(f"poolctl: {one_line}", file=sys.stderr)
    sys.exit(code)
