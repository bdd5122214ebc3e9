"""Serving either server (``poolctl serve``, ``poolctl board serve``): auth precondition, bind, run uvicorn.

No maintenance runs at start-up. The socket is bound before the app is built,
so a port clash fails at once (exit 69, naming the address) and the kernel
queues early connections while the app loads. uvicorn runs with
``transport.GuardedH11``: a deadline on every request and caps on connections.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from starlette.types import ASGIApp

from core import logs
from core.errors import ConfigError, SettingsError, Unavailable
from core.settings import Settings
from poolkeeper.http import transport
from poolkeeper.http.middleware import is_loopback

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("poolkeeper.server")


def check_auth(host: str, local_only: bool, secret: str, unset: str) -> None:
    """No ``secret``: only ``--local-only`` on a loopback address (else ``SettingsError``, ``unset`` if none).

    For ``serve`` (the server secret) and ``board serve`` (the board token) alike.
    """
    if local_only and not is_loopback(host):
        raise SettingsError(f"--local-only: {host} is not a loopback address (127.0.0.1, ::1, localhost)")
    if not secret and not local_only:
        raise SettingsError(unset)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; a host that names no address is ``ConfigError``, a taken one ``Unavailable``."""
    where = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError(f"--host {host!a}: not an address this machine can listen on ({err})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise Unavailable(f"{where}: address already in use (another server listens there)") from None
        if err.errno == errno.EACCES:
            raise ConfigError(f"{where}: permission denied (a port below 1024 needs privileges)") from None
        raise ConfigError(f"{where}: cannot listen there ({err.strerror or err})") from None
    sock.set_inheritable(True)
    return sock


UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")  # their handlers are uvicorn's own


def quiet_logs(settings: Settings) -> None:
    """The servers' log: INFO lines with their time (POOL_LOG_FORMAT), without a line per schema read
    or board call."""
    logs.basic(settings.log_format, secrets=_secrets(settings))
    logging.getLogger("alembic").setLevel(logging.WARNING)  # /readyz reads the schema version
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call of an http(s) board otherwise


def _secrets(settings: Settings) -> tuple[str, str]:
    return settings.server_secret, settings.board_token


def guarded(
    app: ASGIApp,
    settings: Settings,
    access_log: bool,
    max_connections: int,
    max_per_client: int,
    on_exit: Callable[[], None] | None = None,
) -> uvicorn.Server:
    """uvicorn serving ``app`` under ``transport.GuardedH11`` (``serve`` and ``board serve``)."""
    import uvicorn

    guard = transport.Guard(
        timeout=settings.body_timeout_seconds, max_connections=max_connections, max_per_client=max_per_client
    )
    config = uvicorn.Config(
        app,
        http=transport.protocol(guard),  # the deadline and the caps (uvicorn's limit_concurrency: none)
        lifespan="off",  # nothing to start: the store is reached on demand
        access_log=access_log,
        server_header=False,
        proxy_headers=False,  # a peer is its socket's address: no client names itself (transport.py)
        timeout_keep_alive=15,
        timeout_graceful_shutdown=10,
        log_level="info",
    )
    server = uvicorn.Server(config)  # the Config has set up uvicorn's loggers: now they write our format
    logs.install(settings.log_format, *UVICORN_LOGGERS, secrets=_secrets(settings))
    if (
        on_exit is not None
    ):  # told first, so that requests waiting for news answer before the stop waits on them
        handle_exit = server.handle_exit

        def exiting(sig: int, frame: FrameType | None) -> None:
            on_exit()
            handle_exit(sig, frame)

        server.handle_exit = exiting  # type: ignore[method-assign]
    return server


def run(
    app: ASGIApp,
    settings: Settings,
    sock: socket.socket,
    *,
    access_log: bool,
    max_connections: int,
    max_per_client: int,
    on_exit: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` on the bound ``sock`` until stopped (``on_exit`` is told of a stop signal first).

    The caller has set up its log (``quiet_logs``) before its first line."""
    guarded(app, settings, access_log, max_connections, max_per_client, on_exit).run(sockets=[sock])
