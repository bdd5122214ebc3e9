"""``poolctl serve``: the worker protocol (``poolkeeper.api``) with the console (``poolkeeper.console``).

The one place the two wings meet: ``create_app`` builds the protocol's app and mounts
the console on it; ``run`` checks the auth precondition and the store, binds the port
and serves (``poolkeeper.http.serving``). A store ``poolctl init`` has not set up (no
file, a mistyped path, not migrated) is refused before anything is bound or created
(``ConfigError``, exit 78), as the worker and beat refuse it; a store that does not
answer yet (PostgreSQL starting) is not: the server starts and ``/readyz`` says when
it is usable.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from core.errors import TransientError
from core.settings import Settings
from poolkeeper.http import serving
from store import PoolStore

log = logging.getLogger("poolkeeper.server")

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app(settings: Settings, *, local_only: bool = False, store: PoolStore | None = None) -> FastAPI:
    """The protocol's app (``api.app.create_app``) with the console mounted on it."""
    # Imported here, not above: ``run`` binds the port before the framework and the app load.
    from poolkeeper.api.app import create_app as protocol_app
    from poolkeeper.console.mount import install

    app = protocol_app(settings, local_only=local_only, store=store)
    install(app, settings, app.state.pool)
    return app


def check_store(settings: Settings) -> None:
    """``ConfigError`` (exit 78) for a store ``init`` has not set up; creates nothing.

    One that does not answer (``TransientError``) is logged and let be: it may be starting.
    """
    store = PoolStore.from_settings(settings)
    try:
        store.require_schema(writable=True)
    except TransientError as err:
        log.warning("%s; /readyz says when it is usable", err.line())
    finally:
        store.engine.dispose()


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
    serving.check_auth(host, local_only, settings.server_secret, unset)
    serving.quiet_logs(settings)  # from here on, every line is a log line in POOL_LOG_FORMAT
    check_store(settings)
    sock = serving.bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    auth = "bearer tokens" if settings.server_secret else "none (--local-only)"
    log.info("poolctl serve: listening on %s:%d; auth: %s", bound_host, bound_port, auth)
    app = create_app(settings, local_only=local_only)
    serving.run(
        app,
        settings,
        sock,
        access_log=access_log,
        max_connections=max_connections,
        max_per_client=max_per_client,
        on_exit=app.state.offer_waits.stop,  # waiting offers answer at once: the stop is not held
    )
