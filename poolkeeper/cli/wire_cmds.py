"""The wire protocol's commands: serve, token, worker, and `child` inside a worker's command."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from core import shapes, validate
from core.errors import InvalidInput, SettingsError

if TYPE_CHECKING:
    from poolkeeper.workerhost.client import ChildToken, PoolClient
from poolkeeper.cli.base import (
    AccessLogOpt,
    JsonOpt,
    MaxConnectionsOpt,
    MaxPerClientOpt,
    _emit,
    _settings,
    app,
)

# --- wire protocol -------------------------------------------------------------


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
    access_log: AccessLogOpt = False,
    max_connections: MaxConnectionsOpt = 1024,
    max_connections_per_client: MaxPerClientOpt = 256,
) -> None:
    """Serve the worker protocol over HTTP/JSON (/v1, /healthz, /readyz, /metrics, /docs)."""
    from core import tracing
    from poolkeeper import serve as server

    tracing.setup("poolkeeper-serve")
    settings = _settings()
    server.run(
        settings,
        host=host or settings.serve_host,
        port=settings.serve_port if port is None else port,
        local_only=local_only,
        access_log=access_log,
        max_connections=max_connections,
        max_per_client=max_connections_per_client,
    )


@app.command()
def token(
    ordinal: Annotated[
        int | None,
        typer.Option(min=0, max=validate.MAX_POOL_SIZE - 1, help="The ordinal whose worker token to print."),
    ] = None,
    operator: Annotated[bool, typer.Option("--operator", help="Print the operator token.")] = False,
    viewer: Annotated[
        bool, typer.Option("--viewer", help="Print the viewer token (reads everything, changes nothing).")
    ] = False,
    board: Annotated[
        bool, typer.Option("--board", help="Print a board's token (only POST /v1/board-events).")
    ] = False,
) -> None:
    """Print a token derived from POOL_SERVER_SECRET: a worker's, the operator's, a viewer's or a board's."""
    from poolkeeper import tokens

    settings = _settings()
    if [ordinal is not None, operator, viewer, board].count(True) != 1:
        raise InvalidInput("token", "give exactly one of --ordinal N, --operator, --viewer and --board")
    if not settings.server_secret:
        raise SettingsError("POOL_SERVER_SECRET (or POOL_SERVER_SECRET_FILE) is not set: no token to derive")
    if ordinal is not None and ordinal >= settings.pool_size:
        raise InvalidInput("--ordinal", f"must be below POOL_SIZE ({settings.pool_size}), got {ordinal}")
    secret = settings.server_secret
    if ordinal is not None:
        print(tokens.ordinal_token(secret, ordinal))
    elif board:
        print(tokens.board_token(secret))
    else:
        print(tokens.operator_token(secret) if operator else tokens.viewer_token(secret))


@app.command()
def worker(
    ordinal: Annotated[
        int, typer.Option(min=0, max=validate.MAX_POOL_SIZE - 1, help="The ordinal this worker serves.")
    ],
    url: Annotated[str, typer.Option(envvar="POOL_WORKER_URL", help="Where `poolctl serve` answers.")],
    command: Annotated[
        str | None,
        typer.Option(
            help="The command to run per grant (split like a shell, run without one).", show_default=False
        ),
    ] = None,
    call: Annotated[
        str | None,
        typer.Option(
            help="Instead of --command: package.module:function, a Python callable (sync or async) run per"
            " grant in one long-lived process.",
            show_default=False,
        ),
    ] = None,
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
    poll: Annotated[
        float,
        typer.Option(
            min=0.05, max=3600, help="Seconds between offers when the server did not wait for a run."
        ),
    ] = 1.0,
    wait: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=validate.MAX_OFFER_WAIT_SECONDS,
            show_default=False,
            help="Seconds an idle offer waits on the server for a run, answered as soon as one is assigned"
            " (default: the worker's OFFER_WAIT_SECONDS, 30); 0 polls every --poll seconds.",
        ),
    ] = None,
    once: Annotated[
        bool,
        typer.Option("--once", help="Exit after delivering one result, or on --give-up without an answer."),
    ] = False,
    give_up: Annotated[
        float,
        typer.Option(
            "--give-up",
            min=0,
            max=86400,
            help="With --once: seconds the server may go without answering before the worker gives up"
            " (exit 69 nothing listens, 75 busy). Without --once the worker waits out any outage.",
        ),
    ] = 60.0,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="POOL_WORKER_STATE_DIR",
            show_default=False,
            help="Where each ordinal's lock, command's process group and spooled result are kept"
            " (default: $XDG_RUNTIME_DIR/poolkeeper, /run/poolkeeper for root, else under the tmp dir;"
            " then a folder per --url).",
        ),
    ] = None,
) -> None:
    """Run COMMAND (or the Python CALL) for each grant of ORDINAL: heartbeats, result; SIGTERM releases."""
    import logging
    import shlex

    from core import logs, tracing
    from core.settings import read_one, read_secret_file
    from poolkeeper.workerhost.worker import TOKEN_FILE_ENV, CommandWorker, Worker, forbid_inspection

    if (command is None) == (call is None):
        raise InvalidInput("--command", "give exactly one of --command and --call")
    if owner is not None:  # refused here, before the ordinal's lock is taken, not by the server
        validate.name("--owner", owner, shapes.OWNER_CHARS)
    logs.basic(read_one("log_format"))  # the token's MAC is masked whatever the format
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    forbid_inspection()  # first: the command, as this user, must not read the token from /proc
    tracing.setup("poolkeeper-worker")  # this process's service name, if OTEL_* turns tracing on
    argv: list[str] = []
    if command is not None:
        try:
            argv = shlex.split(command)
        except ValueError as e:
            raise InvalidInput("--command", str(e)) from None
    elif call is not None:
        from poolkeeper.workerhost.runner import parse_call

        parse_call(call)  # its shape, at once; the runner imports it before the first offer
    if token_file:
        if token_:
            raise SettingsError(
                f"--token-file ({TOKEN_FILE_ENV}): give it or --token (POOL_WORKER_TOKEN), not both"
            )
        token_ = read_secret_file(f"--token-file ({TOKEN_FILE_ENV})", token_file)
    with _pool_client("--url (POOL_WORKER_URL)", url, "--token (POOL_WORKER_TOKEN)", token_) as client:
        options: dict[str, Any] = {
            "owner": owner,
            "poll_seconds": poll,
            **({} if wait is None else {"wait_seconds": wait}),
            "once": once,
            "give_up_seconds": give_up,
            "state_dir": state_dir,
        }
        runner: Worker
        if call is not None:
            from poolkeeper.workerhost.python import PythonWorker

            runner = PythonWorker(client, ordinal, call, **options)
        else:
            runner = CommandWorker(client, ordinal, argv, **options)
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
    from poolkeeper.workerhost.client import PoolClient, check_url

    check_url(url_name, url)
    if token and not tokens.well_formed(token):  # not echoed: it is a secret, or most of one
        raise InvalidInput(
            token_name, "not a token of the form `poolctl token` or `poolctl worker` gives (a stray space?)"
        )
    return PoolClient(url, token or None)


def _child_client() -> PoolClient:
    from poolkeeper.workerhost.worker import CHILD_TOKEN_ENV, URL_ENV

    url = os.environ.get(URL_ENV, "")
    if not url:
        raise InvalidInput(URL_ENV, "not set: run this inside a `poolctl worker` command, or set it")
    return _pool_client(URL_ENV, url, CHILD_TOKEN_ENV, os.environ.get(CHILD_TOKEN_ENV, ""))


def _child_id(child_id: str) -> str:
    if not child_id:
        raise InvalidInput("--child", "missing: give --child or set POOL_CHILD_ID")
    return child_id


def _child_token(child_id: str) -> ChildToken:
    from poolkeeper.workerhost.client import ChildToken
    from poolkeeper.workerhost.worker import fence_from_env

    return ChildToken(_child_id(child_id), fence_from_env(os.environ))


def _json_object(option: str, value: str) -> dict[str, Any]:
    """A JSON object the server would take as a document; else ``InvalidInput`` naming ``option``."""
    found = validate.loads(option, value)
    if not isinstance(found, dict):
        raise InvalidInput(option, f"expected a JSON object, got {type(found).__name__}")
    validate.document(option, found)  # 1e999 (infinite), depth, size, credential-like keys
    return found


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
    from poolkeeper.workerhost.worker import grant_from_env

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
    from poolkeeper.workerhost.worker import grant_from_env

    holder = grant_from_env(os.environ)
    with _child_client() as client:
        print(client.child_vanished(holder, _child_id(child)))
