"""Engines, transactions and migrations, configured in one place for store and board.

SQLite gets WAL, ``synchronous=FULL``, a busy timeout, foreign keys and
``BEGIN IMMEDIATE`` (so a write transaction takes the write lock up front and
never fails half-way with "database is locked" on upgrade). Every engine is
disposed in a forked child, so no connection is ever shared across a fork.
Database "busy", "locked" and lost connections surface as ``TransientError``.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, MetaData, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from core.errors import TransientError

SQLITE_BUSY_TIMEOUT_MS = 5000
_TRANSIENT_SQLITE_WORDS = ("locked", "busy", "disk i/o error", "unable to open")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for the store or the board, with the SQLite durability settings applied."""
    if url.startswith("sqlite"):
        kwargs.setdefault("connect_args", {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
    else:
        kwargs.setdefault("pool_pre_ping", True)
        engine = create_engine(url, **kwargs)
    ref = weakref.ref(engine)
    os.register_at_fork(after_in_child=lambda: _dispose_in_child(ref))
    return engine


def _dispose_in_child(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.dispose(close=False)  # forget the parent's connections without closing them


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (below)
    cursor = dbapi_connection.cursor()
    for pragma in (
        "journal_mode=WAL",
        "synchronous=FULL",
        f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
        "foreign_keys=ON",
    ):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_on_begin(conn: Any) -> None:
    mode = "DEFERRED" if conn.get_execution_options().get("readonly") else "IMMEDIATE"
    conn.exec_driver_sql(f"BEGIN {mode}")


def readonly(engine: Engine) -> Engine:
    """The same engine, beginning plain (shared) transactions: for reports that write nothing."""
    return engine.execution_options(readonly=True)


def is_transient(err: BaseException) -> bool:
    if isinstance(err, TransientError | OSError | sa_exc.TimeoutError):
        return True
    if isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated:
        return True
    if isinstance(err, sa_exc.OperationalError):
        text = str(err.orig).lower()
        if "sqlite" in type(err.orig).__module__:
            return any(word in text for word in _TRANSIENT_SQLITE_WORDS)
        return True  # PostgreSQL: connection loss, serialization failure, deadlock, lock timeout
    return False


@contextmanager
def transient_errors(what: str) -> Iterator[None]:
    """Re-raise busy/locked/connection failures as ``TransientError`` naming ``what``."""
    try:
        yield
    except TransientError:
        raise
    except Exception as err:
        if is_transient(err):
            raise TransientError(f"{what}: {_short(err)}") from err
        raise


@contextmanager
def transaction(engine: Engine, what: str = "store") -> Iterator[Session]:
    """One short transaction: commit on success, roll back on any error."""
    with transient_errors(what), Session(engine, expire_on_commit=False) as session, session.begin():
        yield session


def _short(err: BaseException) -> str:
    orig = getattr(err, "orig", None)
    return str(orig if orig is not None else err).splitlines()[0][:200]


def migrate(engine: Engine, package: str, metadata: MetaData) -> None:
    """Bring ``package``'s schema (``store`` or ``board``) to head; a no-op when already there."""
    cfg = Config()
    cfg.set_main_option("script_location", f"{package}:migrations")
    cfg.attributes["version_table"] = f"{package}_alembic_version"
    cfg.attributes["target_metadata"] = metadata
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def schema_current(engine: Engine, package: str) -> bool:
    """Whether ``package``'s schema is at head: a read in a shared (deferred) transaction."""
    from alembic.runtime.migration import MigrationContext

    with transient_errors(package), readonly(engine).connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": f"{package}_alembic_version"})
        return set(context.get_current_heads()) == _heads(package)


@functools.cache
def _heads(package: str) -> set[str]:
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", f"{package}:migrations")
    return set(ScriptDirectory.from_config(cfg).get_heads())


def run_alembic_env() -> None:
    """The body of every ``migrations/env.py``: run online against the given connection."""
    from alembic import context

    cfg = context.config
    connection = cfg.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through `poolctl init` (core.db.migrate)")
    context.configure(
        connection=connection,
        target_metadata=cfg.attributes["target_metadata"],
        version_table=cfg.attributes["version_table"],
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
