"""Start ``poolctl serve``: check the auth precondition and the store, bind the port, run uvicorn.

A store ``poolctl init`` has not set up (no file, a mistyped path, not
migrated) is refused before anything is bound or created (``ConfigError``,
exit 78), as the worker and beat refuse it; a store that does not answer yet
(PostgreSQL starting) is not: the server starts and ``/readyz`` says when it
is usable. No maintenance runs at start-up. The socket is bound before the
app is built, so a port clash fails at once (exit 69, naming the address) and
the kernel queues early connections while the app loads. uvicorn runs with
``transport.GuardedH11``: a deadline on every request and caps on connections.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import TYPE_CHECKING

from starlette.types import ASGIApp

from core.errors import ConfigError, SettingsError, TransientError, Unavailable
from core.settings import Settings
from poolkeeper.server import transport
from poolkeeper.server.limits import is_loopback
from store import PoolStore

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


def check_store(settings: Settings) -> None:
    """``ConfigError`` (exit 78) for a store ``init`` has not set up; creates nothing.

    One that does not answer (``TransientError``) is logged and let be: it may be starting.
    """
    store = PoolStore.from_settings(settings)
    try:
        store.require_schema(writable=True)
    except TransientError as err:
        print(f"poolctl serve: {err.line()}; /readyz says when it is usable", file=sys.stderr, flush=True)
    finally:
        store.engine.dispose()


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


def run(
    settings: Settings,
    *,
    host: str,
    port: int,
    local_only: bool,
    access_log: bool,
    max_connections: int,
    max_per_client: int,
) -> None:
    unset = (
        "POOL_SERVER_SECRET (or POOL_SERVER_SECRET_FILE) is not set: serve refuses to start without"
        " auth; give --local-only to serve a loopback address without tokens"
    )
    check_auth(host, local_only, settings.server_secret, unset)
    check_store(settings)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    auth = "bearer tokens" if settings.server_secret else "none (--local-only)"
    print(f"poolctl serve: listening on {bound_host}:{bound_port}; auth: {auth}", file=sys.stderr, flush=True)

    from poolkeeper.server.app import create_app

    quiet_logs()
    app = create_app(settings, local_only=local_only)
    guarded(app, settings, access_log, max_connections, max_per_client).run(sockets=[sock])


def quiet_logs() -> None:
    """The servers' log: INFO lines with their time, without a line per schema read or board call."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # /readyz reads the schema version
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call of an http(s) board otherwise


def guarded(
    app: ASGIApp, settings: Settings, access_log: bool, max_connections: int, max_per_client: int
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
    return uvicorn.Server(config)
