"""Engines, transactions and migrations, configured in one place for store and board.

SQLite gets WAL, ``synchronous=FULL``, a busy timeout, foreign keys and
``BEGIN IMMEDIATE`` (so a write transaction takes the write lock up front and
never fails half-way with "database is locked" on upgrade). Every engine is
disposed in a forked child, so no connection is ever shared across a fork.
Database failures surface by class (``translate``): "busy", "locked" and lost
connections as ``TransientError``, a server refusing connections as ``Unavailable``
(transient too), a URL, driver, directory or file that cannot work as ``ConfigError``.
Nothing but ``migrate`` creates a database: ``require_schema`` looks for a SQLite
file before connecting, since connecting would create it. A SQLite file this process
cannot write, with no write-ahead log beside it, is opened immutable, so reading it
creates nothing (``_sqlite_on_do_connect``).
"""

from __future__ import annotations

import ast
import errno
import functools
import itertools
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    URL,
    ClauseElement,
    Connection,
    Dialect,
    Engine,
    MetaData,
    column,
    create_engine,
    event,
    inspect,
    select,
    table,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql.compiler import SQLCompiler

from core.errors import ConfigError, PoolError, TransientError, Unavailable
from core.logs import mask_url

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.orm import Session

SQLITE_BUSY_TIMEOUT_MS = 5000
# SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20 ms... between tries, so a writer that
# finds the write lock taken for 3 ms sleeps 8, and writers taking turns (the plane's worker
# processes, a server) spent most of their wait asleep with the lock free (bench/storm.py).
# BEGIN IMMEDIATE is tried every WRITER_POLL_SECONDS instead, up to the busy timeout.
WRITER_POLL_SECONDS = 0.0002
_TRANSIENT_SQLITE_WORDS = ("locked", "busy", "disk i/o error", "unable to open")
# SQLite error names (extended codes; the first prefix that matches wins) that no retry can fix.
_PERMANENT_SQLITE = (
    (
        "SQLITE_READONLY_DIRECTORY",
        "read-only for this user, and SQLite (WAL mode) must create its -shm file in a directory "
        "this user cannot write: run as the database's owner",
    ),
    ("SQLITE_READONLY", "read-only for this user"),
    ("SQLITE_NOTADB", "not a SQLite database"),
    ("SQLITE_CORRUPT", "damaged or truncated"),
)
# A server that answers but refuses us: the URL is wrong, not the server down.
_CONFIG_AT_CONNECT = ("does not exist", "authentication failed", "password", "pg_hba.conf")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for the store or the board, with the SQLite durability settings applied.

    A URL that cannot work (not a URL, unknown dialect, driver not installed) is a
    ``ConfigError``; nothing connects yet.
    """
    try:
        if url.startswith("sqlite"):
            kwargs.setdefault("connect_args", {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
            engine = create_engine(url, **kwargs)
            event.listen(engine, "do_connect", _sqlite_on_do_connect)
            event.listen(engine, "connect", _sqlite_on_connect)
            event.listen(engine, "begin", _sqlite_on_begin)
        else:
            kwargs.setdefault("pool_pre_ping", True)
            engine = create_engine(url, **kwargs)
    except sa_exc.NoSuchModuleError as err:
        raise ConfigError(f"database URL {mask_url(url)!r}: unknown database kind ({err})") from None
    except sa_exc.ArgumentError:
        raise ConfigError(
            f"database URL {mask_url(url)!r}: not a database URL "
            "(e.g. sqlite:///pool.db or postgresql+psycopg://user@host/db)"
        ) from None
    except ImportError as err:
        raise ConfigError(
            f"database URL {mask_url(url)!r}: its driver is not installed ({err}); "
            "PostgreSQL is postgresql+psycopg://"
        ) from None
    ref = weakref.ref(engine)
    os.register_at_fork(after_in_child=lambda: _dispose_in_child(ref))
    return engine


def _dispose_in_child(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.dispose(close=False)  # forget the parent's connections without closing them


def _sqlite_on_do_connect(_dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
    """Open a SQLite file this process cannot write, and that has no ``-wal`` beside it, immutable.

    Reading a WAL database makes its ``-wal`` and ``-shm`` files; a reader that cannot
    write the database (read-only or immutable, or on a read-only file system) cannot
    checkpoint them away as it closes, so every ``poolctl status`` left them behind, owned
    by whoever ran it (and on a read-only file system could not make them at all). With no
    ``-wal`` there is nothing to read but the file itself, and no writer is connected (a
    WAL connection keeps its ``-wal`` until the last one closes): ``immutable=1`` reads it
    creating nothing. A write through such a connection fails as read-only (``translate``:
    ``ConfigError``). A ``-wal`` present means someone may be writing: opened as always.
    """
    if cparams.get("uri") or not cargs or not isinstance(cargs[0], str) or cargs[0] in ("", ":memory:"):
        return
    path = Path(cargs[0])
    if path.is_file() and not os.access(path, os.W_OK) and not Path(f"{path}-wal").exists():
        cargs[0] = f"{path.resolve().as_uri()}?mode=ro&immutable=1"
        cparams["uri"] = True


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
    if conn.get_execution_options().get("readonly"):
        conn.exec_driver_sql("BEGIN DEFERRED")
        return
    driver = conn.connection.driver_connection
    poller = _poller(conn.engine.url.database or "")
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    turn = False
    try:
        driver.execute("PRAGMA busy_timeout = 0")  # only while taking the write lock: WRITER_POLL_SECONDS
        turn = poller.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        while turn and time.monotonic() < deadline:
            try:
                driver.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.Error as err:
                code = getattr(err, "sqlite_errorcode", None)  # none on the driver's own errors
                if code is None or code & 0xFF != sqlite3.SQLITE_BUSY:  # the primary code
                    break  # not busy (a damaged file, say): the last try says what it is
            time.sleep(WRITER_POLL_SECONDS)
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # the last try fails as any statement does (translate)
    finally:
        if turn:
            poller.release()
        driver.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")


# One thread of a process polls for a database's write lock at a time; the others wait their
# turn on a lock of the process's, which wakes them at once. Sixty-four threads polling together
# spent the lock holder's time on the interpreter lock: 100 transactions/s instead of 2,100
# (bench/api_bench.py). One per database file, so a writer of one never waits on another's.
_pollers: dict[str, threading.Lock] = {}
_pollers_guard = threading.Lock()


def _poller(database: str) -> threading.Lock:
    with _pollers_guard:
        return _pollers.setdefault(database, threading.Lock())


def _new_pollers_after_fork() -> None:
    global _pollers_guard
    _pollers.clear()  # a thread of the parent may have held one at the fork
    _pollers_guard = threading.Lock()


os.register_at_fork(after_in_child=_new_pollers_after_fork)


def readonly(engine: Engine) -> Engine:
    """The same engine, beginning plain (shared) transactions: for reports that write nothing."""
    return engine.execution_options(readonly=True)


def translate(err: BaseException, what: str, url: URL | None = None) -> PoolError | None:
    """The class of a database failure, as an error naming ``what``; None if it is none of these.

    Busy, locked, lost connection: ``TransientError``. Cannot connect to the server:
    ``Unavailable`` (transient too). A file or URL that cannot work: ``ConfigError``.
    """
    where = what if url is None else f"{what} at {mask_url(url)}"
    if isinstance(err, OSError) and err.errno in _PERMANENT_ERRNOS:
        return ConfigError(f"{where}: {_short(err)}")
    if isinstance(err, OSError | sa_exc.TimeoutError):
        return TransientError(f"{what}: {_short(err)}")
    if not isinstance(err, sa_exc.DBAPIError):
        return None
    if "sqlite" in type(err.orig).__module__:
        name = getattr(err.orig, "sqlite_errorname", "")
        path = None if url is None else _sqlite_file(url)
        if path is not None and name.startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY")):
            reason = cannot_open(path)
            if reason is not None:  # else "unable to open" may pass (no file handles left, say)
                return ConfigError(f"{where}: {reason} ({_short(err)})")
        for prefix, problem in _PERMANENT_SQLITE:
            if name.startswith(prefix):
                return ConfigError(f"{where}: {problem} ({_short(err)})")
        text = str(err.orig).lower()
        if err.connection_invalidated or (
            isinstance(err, sa_exc.OperationalError) and any(w in text for w in _TRANSIENT_SQLITE_WORDS)
        ):
            return TransientError(f"{what}: {_short(err)}")
        return None
    if isinstance(err, sa_exc.OperationalError) and err.statement is None:  # failed to connect
        if any(word in _short(err).lower() for word in _CONFIG_AT_CONNECT):
            return ConfigError(f"{where}: {_short(err)}")
        return Unavailable(f"{where} is unavailable: {_short(err)}")
    if err.connection_invalidated or getattr(err.orig, "sqlstate", None) in _CONNECTION_LOST:
        return Unavailable(f"{where}: connection lost: {_short(err)}")
    if isinstance(err, sa_exc.OperationalError):  # serialization failure, deadlock, lock timeout
        return TransientError(f"{what}: {_short(err)}")
    return None


# A file system or file that refuses us: waiting does not change it.
_PERMANENT_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def cannot_open(path: Path) -> str | None:
    """Why SQLite cannot open ``path``, or make its ``-wal`` and ``-shm`` files beside it, for
    good (a setting, not a moment: ``ConfigError``); None when the file system shows no reason.
    """
    directory = path.parent
    if not directory.is_dir():
        return f"directory {directory} does not exist (create it, then run `poolctl init`)"
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"{directory} is on a read-only file system"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"directory {directory} is not writable by this user "
            "(SQLite in WAL mode creates the -wal and -shm files there)"
        )
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is read-only for this user"
    return None


# PostgreSQL SQLSTATEs of a lost connection: class 08, shutdowns, "cannot connect now".
_CONNECTION_LOST = frozenset({"08000", "08001", "08003", "08004", "08006", "57P01", "57P02", "57P03"})


def is_transient(err: BaseException) -> bool:
    return isinstance(err, TransientError) or isinstance(translate(err, "database"), TransientError)


@contextmanager
def transient_errors(what: str, url: URL | None = None) -> Iterator[None]:
    """Re-raise database failures by class (``translate``), naming ``what`` (and ``url``)."""
    try:
        yield
    except PoolError:
        raise
    except Exception as err:
        translated = translate(err, what, url)
        if translated is not None:
            raise translated from err
        raise


@contextmanager
def transaction(engine: Engine, what: str = "store") -> Iterator[Session]:
    """One short transaction: commit on success, roll back on any error."""
    from sqlalchemy.orm import Session  # the ORM: not for the board, which is Core only

    with (
        transient_errors(what, engine.url),
        Session(engine, expire_on_commit=False) as session,
        session.begin(),
    ):
        yield session


class Ran(NamedTuple):
    rowcount: int
    rows: list[tuple[Any, ...]]  # empty unless the statement returns rows


class Prepared:
    """A Core statement compiled once per dialect and run straight on the DB-API cursor.

    For one-row hot paths (the worker protocol), where SQLAlchemy's work per execute
    (cache key, result set-up, events) cost more than the database's
    (bench/store_bench.py). Parameters go to the driver as they are, so they must be
    plain ``str``, ``int``, ``float``, ``bool`` or ``None``. Driver errors surface as
    SQLAlchemy's ``DBAPIError`` classes, so ``translate`` classifies them as usual.
    """

    def __init__(self, statement: ClauseElement) -> None:
        self.statement = statement
        self._compiled: dict[tuple[str, str, str], SQLCompiler] = {}

    def run(self, conn: Connection, params: Mapping[str, Any] | None = None) -> Ran:
        with self._cursor(conn) as (cursor, sql, args):
            cursor.execute(sql, args(params))
            return Ran(cursor.rowcount, cursor.fetchall() if cursor.description else [])

    @contextmanager
    def _cursor(self, conn: Connection) -> Iterator[tuple[Any, str, Callable[[Any], Any]]]:
        dialect = conn.dialect
        key = (dialect.name, dialect.driver, dialect.paramstyle)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile(dialect)
        order = compiled.positiontup or []

        def args(params: Mapping[str, Any] | None) -> Any:
            values = compiled.construct_params(params)
            return tuple(values[name] for name in order) if dialect.positional else values

        with driver_cursor(conn, compiled.string) as cursor:
            yield cursor, compiled.string, args

    def _compile(self, dialect: Dialect) -> SQLCompiler:
        compiled = self.statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        if compiled.post_compile_params:  # ``in_()`` lists are expanded per execute: not here
            raise ValueError(f"cannot prepare a statement with an IN list: {compiled.string}")
        return compiled


def connection_of(s: Session | Connection) -> Connection:
    """The Core connection under ``s``: store functions take either, and write on this one."""
    return s if isinstance(s, Connection) else s.connection()


@contextmanager
def driver_cursor(conn: Connection, sql: str) -> Iterator[Any]:
    """The driver's own cursor in ``conn``'s transaction; its errors become SQLAlchemy's classes.

    So failures on the hot paths that bypass the SQL layer classify as usual (``translate``).
    """
    dialect = conn.dialect
    if not conn.in_transaction():
        conn.begin()  # as ``execute`` would: the statement belongs to the caller's transaction
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        yield cursor
    except dialect.loaded_dbapi.Error as err:
        raise sa_exc.DBAPIError.instance(sql, None, err, dialect.loaded_dbapi.Error) from None
    finally:
        cursor.close()


@contextmanager
def savepoint(conn: Connection) -> Iterator[None]:
    """A SAVEPOINT in ``conn``'s transaction, on the driver's cursor: undone if the block raises.

    What ``Connection.begin_nested`` does, without its bookkeeping, which cost more than
    SQLite's own savepoint: the runner opens one for every part of a split batch.
    """
    name = f"pk_{next(_savepoints)}"
    with driver_cursor(conn, f"SAVEPOINT {name}") as cursor:
        cursor.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException as err:
            driver = conn.connection.driver_connection
            if conn.dialect.name == "sqlite" and not driver.in_transaction:  # type: ignore[union-attr]
                # RAISE(ROLLBACK), ON CONFLICT ROLLBACK, a full disk: SQLite ended the whole
                # transaction, so nothing of it will commit and nothing after may run in it.
                raise TransientError(f"the database rolled the transaction back: {_short(err)}") from err
            cursor.execute(f"ROLLBACK TO SAVEPOINT {name}")  # if this fails too, its error goes up
            cursor.execute(f"RELEASE SAVEPOINT {name}")
            raise
        cursor.execute(f"RELEASE SAVEPOINT {name}")


_savepoints = itertools.count()


def intact(conn: Connection) -> bool:
    """Whether ``conn``'s transaction can go on after an error a ``savepoint`` undid.

    Not when the database ended it (SQLite's rollbacks) or marked it failed (PostgreSQL,
    when undoing the savepoint failed too): nothing of it will commit.
    """
    if not conn.in_transaction():
        return False
    driver: Any = conn.connection.driver_connection
    if conn.dialect.name == "sqlite":
        return bool(driver.in_transaction)
    status = getattr(getattr(driver, "info", None), "transaction_status", None)
    return status is None or status.name != "INERROR"


_PLACEHOLDER = {"qmark": "?", "format": "%s", "pyformat": "%s"}


def placeholder(conn: Connection) -> str:
    """The driver's positional placeholder, for the few statements written as SQL (``raw``)."""
    return _PLACEHOLDER[conn.dialect.paramstyle]


def among(conn: Connection, ids: Sequence[int | str]) -> tuple[str, list[Any]]:
    """``ids`` as the right-hand side of a membership test, and its parameters, for ``raw``:
    ``IN (?, ?, ...)`` on SQLite; on PostgreSQL ``= ANY(%s)``, one array parameter, so
    psycopg does not parse a thousand placeholders in Python for every statement (a
    quarter of a worker's CPU in a storm) and the server does not either."""
    if conn.dialect.name == "postgresql":
        return "= ANY(%s)", [list(ids)]
    p = placeholder(conn)
    return f"IN ({','.join([p] * len(ids))})", list(ids)


def raw(conn: Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    """Run ``sql`` (written with ``placeholder``) on the driver's cursor; the rows it returns, if any.

    For the storm's set statements, whose 1,000-id IN lists ``Prepared`` cannot take:
    through the SQL layer, the per-value processing of the list and the wrapping of
    every statement cost several times the database's own work.

    On PostgreSQL the statement is never prepared: its ids are one array (``among``),
    and the generic plan of ``= ANY($n)`` cost the server twice the custom plan's CPU
    (a storm's batch of 1,000: 44 ms against 22 ms).
    """
    with driver_cursor(conn, sql) as cursor:
        if conn.dialect.name == "postgresql":
            cursor.execute(sql, params, prepare=False)
        else:
            cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def raw_alone(conn: Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    """``raw`` under a savepoint of its own (``savepoint``): undone whole if it raises.

    On PostgreSQL the SAVEPOINT, the statement and the RELEASE go in one round trip
    (psycopg's pipeline mode), and a refusal's ROLLBACK TO and RELEASE in one more:
    a split batch's search is a few dozen such statements on small parts, each of
    which otherwise waited three round trips for one statement's work.
    """
    if conn.dialect.name != "postgresql":
        with savepoint(conn):
            return raw(conn, sql, params)
    name = f"pk_{next(_savepoints)}"
    with driver_cursor(conn, sql) as cursor:
        driver = conn.connection.driver_connection
        assert driver is not None
        statement = driver.cursor()
        try:
            try:
                with driver.pipeline():
                    cursor.execute(f"SAVEPOINT {name}")
                    statement.execute(sql, params, prepare=False)
                    cursor.execute(f"RELEASE SAVEPOINT {name}")
            except BaseException:
                with driver.pipeline():  # if this fails too, its error goes up
                    cursor.execute(f"ROLLBACK TO SAVEPOINT {name}")
                    cursor.execute(f"RELEASE SAVEPOINT {name}")
                raise
            return statement.fetchall() if statement.description else []
        finally:
            statement.close()


def _short(err: BaseException) -> str:
    orig = getattr(err, "orig", None)
    return str(orig if orig is not None else err).splitlines()[0][:200]


def migrate(engine: Engine, package: str, metadata: MetaData, what: str = "database") -> None:
    """Bring ``package``'s schema (``store`` or ``board``) to head; a no-op when already there."""
    from alembic import command

    require_creatable(engine, what)
    cfg = _alembic_config(package)
    cfg.attributes["target_metadata"] = metadata
    with transient_errors(what, engine.url), engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def require_creatable(engine: Engine, what: str) -> None:
    """``ConfigError`` unless ``migrate`` can create or open the SQLite file (other databases: no check)."""
    path = _sqlite_file(engine.url)
    if path is None:
        return
    where = f"{what} at {mask_url(engine.url)}"
    _require_a_place_for(path, where)
    reason = cannot_open(path)
    if reason is not None:  # `init` writes: a store it cannot write is no store for the plane
        raise ConfigError(f"{where}: cannot {'migrate' if path.exists() else 'create'} it: {reason}")


def _require_a_place_for(path: Path, where: str) -> None:
    if not path.parent.is_dir():
        raise ConfigError(
            f"{where}: directory {path.parent} does not exist (create it, then run `poolctl init`)"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"{where}: not a file")


def require_schema(engine: Engine, package: str, what: str, *, writable: bool = False) -> None:
    """``ConfigError`` unless ``migrate`` has brought ``package``'s schema to head (and, if
    asked, the SQLite file is writable); creates nothing. A server that does not answer is
    ``Unavailable`` (or ``TransientError`` when busy): worth waiting for, not a setting.

    A SQLite file is looked for before connecting, since connecting would create it.
    """
    where = f"{what} at {mask_url(engine.url)}"
    missing = ConfigError(f"no {where}: run `poolctl init`")
    path = _sqlite_file(engine.url)
    if path is not None:
        _require_a_place_for(path, where)
        if not path.exists() or path.stat().st_size == 0:  # an empty file is what connecting creates
            raise missing
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{where}: not readable by this user")
        if writable and not os.access(path, os.W_OK):
            raise ConfigError(f"{where}: read-only for this user")
    versions = table(_version_table(package), column("version_num"))
    with transient_errors(what, engine.url), readonly(engine).connect() as conn:
        found = inspect(conn).has_table(versions.name)
        current = set(conn.scalars(select(versions.c.version_num))) if found else set()
    if not current:
        raise missing
    heads = _heads(package)
    if current != heads:
        at, head = ", ".join(sorted(current)), ", ".join(sorted(heads))
        raise ConfigError(f"{where}: not migrated (at {at}, head {head}): run `poolctl init`")


def _version_table(package: str) -> str:
    return f"{package}_alembic_version"


@functools.cache
def _heads(package: str) -> frozenset[str]:
    """The migration heads a package ships: the revisions no script names as its
    ``down_revision``, read from the scripts once per process (``/readyz`` and every command
    ask). Parsed, not imported: alembic costs a command tens of milliseconds (bench/cli_start.py)."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for script in (resources.files(package) / "migrations" / "versions").iterdir():
        if script.name.endswith(".py"):
            found = dict(_literals(ast.parse(script.read_text()), {"revision", "down_revision"}))
            revisions.add(found["revision"])
            down = found.get("down_revision")
            parents.update([] if down is None else [down] if isinstance(down, str) else down)
    return frozenset(revisions - parents)


def _literals(module: ast.Module, names: set[str]) -> Iterator[tuple[str, Any]]:
    """The module-level ``name = <literal>`` (or ``name: T = <literal>``) of ``names``."""
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in names:
            yield target.id, ast.literal_eval(value)


def _alembic_config(package: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", f"{package}:migrations")
    cfg.attributes["version_table"] = _version_table(package)
    return cfg


def _sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names; None for other databases, memory and ``uri=true`` names."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:") or "uri" in url.query:
        return None
    return Path(url.database)


def schema_current(engine: Engine, package: str) -> bool:
    """Whether ``package``'s schema is at head (readiness); a database that does not answer
    raises ``Unavailable``/``TransientError``, as everywhere."""
    try:
        require_schema(engine, package, package)
    except ConfigError:
        return False
    return True


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
