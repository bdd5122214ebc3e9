"""Start ``poolctl serve``: check the auth precondition, bind the port, then build the app and run uvicorn.

The socket is bound before anything else is built, so a port clash fails at
once and the kernel queues early connections while the app loads. Nothing
touches the store at start-up; ``/readyz`` tells when it is usable.
"""

from __future__ import annotations

import logging
import socket
import sys

from core.errors import SettingsError
from core.settings import Settings
from poolkeeper.server.limits import is_loopback

log = logging.getLogger("poolkeeper.server")


def check_auth(settings: Settings, host: str, local_only: bool) -> None:
    """No secret: only ``--local-only`` on a loopback address (raises ``SettingsError`` otherwise)."""
    if local_only and not is_loopback(host):
        raise SettingsError(f"--local-only: {host} is not a loopback address (127.0.0.1, ::1, localhost)")
    if not settings.server_secret and not local_only:
        raise SettingsError(
            "POOL_SERVER_SECRET (or POOL_SERVER_SECRET_FILE) is not set: serve refuses to start without"
            " auth; give --local-only to serve a loopback address without tokens"
        )


def bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(settings: Settings, *, host: str, port: int, local_only: bool, access_log: bool) -> None:
    check_auth(settings, host, local_only)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    auth = "bearer tokens" if settings.server_secret else "none (--local-only)"
    print(f"poolctl serve: listening on {bound_host}:{bound_port}; auth: {auth}", file=sys.stderr, flush=True)

    import uvicorn

    from poolkeeper.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # /readyz reads the schema version
    app = create_app(settings, local_only=local_only)
    config = uvicorn.Config(
        app,
        lifespan="off",  # nothing to start: the store is reached on demand
        access_log=access_log,
        server_header=False,
        timeout_keep_alive=15,
        timeout_graceful_shutdown=10,
        limit_concurrency=2048,  # past it: 503, not an unbounded queue
        log_level="info",
    )
    uvicorn.Server(config).run(sockets=[sock])
