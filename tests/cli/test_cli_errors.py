"""poolctl refuses bad input and broken setups in one line with a documented exit code, creating nothing.

Every case runs the real entry point (``poolkeeper.cli.main``) in a subprocess and checks
the exit code, that stderr is exactly one line naming the problem, and that no file (SQLite)
or table (PostgreSQL) appeared. Exit codes: 2 usage, 69 unavailable, 75 busy, 78 config.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sqlite3
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, inspect

from board import Board
from core.errors import ConfigError, InvalidInput, Unavailable
from core.settings import Settings
from store import PoolStore
from tasks import failures
from tasks.failures import ErrorClass
from tasks.redis_coordination import RedisCoordination
from tests.helpers import BUSY, CONFIG, UNAVAILABLE, USAGE, files, refused, run, staff_url

ROOT = Path(__file__).resolve().parents[2]
REFUSED_PG = "postgresql+psycopg://postgres:secret@127.0.0.1:1/test"  # nothing listens on port 1


def init(path: Path) -> None:
    done = run(path, "init")
    assert done.returncode == 0, done.stderr


def board_tasks(path: Path) -> list[str]:
    """Task ids on the board, read without writing (or creating) anything."""
    with sqlite3.connect(f"file:{path}/board.db?mode=ro", uri=True) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM tasks")]


# --- before `poolctl init`: nothing to open, and nothing is created -----------------

BEFORE_INIT = [
    (("status",), "no pool store at"),
    (("rows",), "no pool store at"),
    (("requeue", "1"), "no pool store at"),
    (("maintain", "--once"), "no pool store at"),
    (("board", "add", "b", "t"), "no board at"),
    (("board", "list"), "no board at"),
    (("board", "cancel", "b", "t"), "no board at"),
    (("board", "unblock", "b", "t"), "no board at"),
]


@pytest.mark.parametrize(("args", "words"), BEFORE_INIT)
def test_every_command_before_init_says_so_and_creates_nothing(
    tmp_path: Path, args: tuple[str, ...], words: str
) -> None:
    done = run(tmp_path, *args)
    refused(done, CONFIG, words, "sqlite:///", "run `poolctl init`")
    assert files(tmp_path) == []


def pg_tables(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        return sorted(inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize(("args", "words"), BEFORE_INIT)
def test_every_command_before_init_on_postgres_creates_no_table(
    tmp_path: Path, postgres_url: str, args: tuple[str, ...], words: str
) -> None:
    before = pg_tables(postgres_url)
    done = run(tmp_path, *args, env={"POOL_DATABASE_URL": postgres_url, "POOL_BOARD_URL": postgres_url})
    refused(done, CONFIG, words, "postgresql+psycopg://", "run `poolctl init`")
    assert pg_tables(postgres_url) == before
    assert "store_alembic_version" not in before and "board_alembic_version" not in before
    assert files(tmp_path) == []


@pytest.mark.postgres
def test_an_unknown_postgres_database_is_a_configuration_error(tmp_path: Path, postgres_url: str) -> None:
    url = postgres_url.rsplit("/", 1)[0] + "/poolkeeper_no_such_database"
    refused(run(tmp_path, "status", env={"POOL_DATABASE_URL": url}), CONFIG, "does not exist")


# --- URLs and files that cannot work ------------------------------------------------


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        (path / name).write_bytes(data)

    return write


def _truncated(path: Path) -> None:
    init(path)
    store = path / "pool.db"
    store.write_bytes(store.read_bytes()[:5000])


def _initialised(path: Path) -> None:
    init(path)


def _nothing(path: Path) -> None:
    return None


CONFIG_CASES = [
    pytest.param(
        _nothing, {"POOL_DATABASE_URL": "garbage"}, ("status",), CONFIG,
        ("POOL_DATABASE_URL", "not a database URL"), id="garbage-url",
    ),
    pytest.param(
        _nothing, {"POOL_BOARD_URL": "garbage"}, ("board", "list"), CONFIG,
        ("POOL_BOARD_URL", "not a board URL"), id="garbage-board-url",
    ),
    pytest.param(
        _nothing, {"POOL_DATABASE_URL": "mysql://u:secret@localhost/db"}, ("status",), CONFIG,
        ("mysql://u:***@localhost/db", "driver is not installed"), id="missing-driver",
    ),
    pytest.param(
        _write("pool.db", b"this is not a database, it is a text file\n" * 100), {}, ("status",), CONFIG,
        ("pool store at sqlite:///", "not a SQLite database"), id="not-a-database",
    ),
    pytest.param(_truncated, {}, ("rows",), CONFIG, ("damaged or truncated",), id="truncated-database"),
    pytest.param(
        _nothing, {"POOL_DATABASE_URL": "sqlite:///{tmp}/nosuch/pool.db"}, ("status",), CONFIG,
        ("pool store at", "nosuch does not exist"), id="missing-directory",
    ),
    pytest.param(
        _nothing, {"POOL_DATABASE_URL": "sqlite:///{tmp}/nosuch/pool.db"}, ("init",), CONFIG,
        ("pool store at", "nosuch does not exist"), id="init-in-a-missing-directory",
    ),
    pytest.param(
        _nothing, {"POOL_BOARD_URL": "sqlite:///{tmp}/nosuch/board.db"}, ("init",), CONFIG,
        ("board at", "nosuch does not exist"), id="init-board-in-a-missing-directory",
    ),
    pytest.param(
        _initialised, {"POOL_REDIS_URL": "garbage"}, ("maintain", "--once"), CONFIG,
        ("redis URL 'garbage'",), id="garbage-redis-url",
    ),
    pytest.param(
        _initialised, {"POOL_REDIS_URL": "redis://:secret@127.0.0.1:1/0"}, ("maintain", "--once"),
        UNAVAILABLE, ("redis at redis://:***@127.0.0.1:1/0 is unavailable",), id="redis-refuses",
    ),
    pytest.param(
        _nothing, {"POOL_DATABASE_URL": REFUSED_PG}, ("status",), UNAVAILABLE,
        ("postgresql+psycopg://postgres:***@127.0.0.1:1/test is unavailable", "refused"),
        id="postgres-wrong-port",
    ),
    pytest.param(
        _nothing, {"POOL_DATABASE_URL": REFUSED_PG}, ("init",), UNAVAILABLE,
        ("postgresql+psycopg://postgres:***@127.0.0.1:1/test is unavailable",), id="init-postgres-wrong-port",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("given", "env", "args", "code", "words"), CONFIG_CASES)
def test_a_setup_that_cannot_work_is_one_line_and_creates_nothing(
    tmp_path: Path,
    given: Callable[[Path], None],
    env: dict[str, str],
    args: tuple[str, ...],
    code: int,
    words: tuple[str, ...],
) -> None:
    given(tmp_path)
    before = files(tmp_path)
    done = run(tmp_path, *args, env={k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()})
    refused(done, code, *words)
    assert "secret" not in done.stderr
    assert files(tmp_path) == before


# --- usage mistakes and refused requests: exit 2, nothing written -------------------


def _terminal_row(path: Path) -> None:
    """Row 1 is stale: its task was claimed, then cancelled on the board."""
    init(path)
    staff_url(f"sqlite:///{path}/pool.db", range(3))
    for args in (
        ("board", "add", "b", "t", "--id", "t"),
        ("maintain", "--once"),
        ("board", "cancel", "b", "t"),
        ("maintain", "--once"),
    ):
        assert run(path, *args).returncode == 0


USAGE_CASES = [
    pytest.param(
        ("requeue", "99999999999999999999"), ("'row'", "2147483647"), id="row-id-overflows"
    ),
    pytest.param(("requeue", "2147483647"), ("no such row",), id="largest-row-id"),
    pytest.param(("requeue", "abc"), ("'row'", "poolctl requeue --help"), id="row-id-not-a-number"),
    pytest.param(("rows", "--limit", "99999999999999999999"), ("'--limit'",), id="limit-overflows"),
    pytest.param(("rows", "--state", "zombie"), ("--state: unknown state",), id="unknown-state"),
    pytest.param(("nosuch",), ("No such command",), id="unknown-command"),
    pytest.param(("board", "add", "b", b"caf\xe9"), ("argument 4", "not valid UTF-8"), id="non-utf8-title"),
    pytest.param(
        ("board", "add", "b", "t", "--body", b"caf\xe9"), ("--body", "not valid UTF-8"), id="non-utf8-body"
    ),
    pytest.param(
        ("board", "add", "b", "t", "--body", "x" * 100_000), ("body: too long",), id="100kB-body"
    ),
    pytest.param(("board", "add", "b", "x" * 120_000), ("title: too long",), id="120kB-title"),
    pytest.param(
        ("board", "add", "b", "t", "--body", '{"api_key": "k"}'), ("body.api_key", "credential"),
        id="credential-in-body",
    ),
    pytest.param(
        ("board", "add", "b", "t", "--body", "{draft"), ("body: not JSON",), id="bad-json-body"
    ),
    pytest.param(
        ("board", "add", "b", "t", "--body", '{"a": 1, "a": 2}'), ("the key a appears twice",),
        id="repeated-key-body",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("args", "words"), USAGE_CASES)
def test_a_usage_mistake_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, args: tuple[str | bytes, ...], words: tuple[str, ...]
) -> None:
    init(tmp_path)
    before = files(tmp_path)
    refused(run(tmp_path, *args), USAGE, *words)
    assert files(tmp_path) == before
    assert board_tasks(tmp_path) == []


# --- poolctl child and poolctl worker: a grant's environment that cannot work -----------------

GRANT = {
    "POOL_ROW_ID": "1",
    "POOL_ATTEMPT": "1",
    "POOL_FENCE": "1",
    "POOL_OWNER": "w",
    "POOL_CHILD_ID": "run:1/child:" + "0" * 12,
    "POOL_WORKER_URL": "http://127.0.0.1:9",  # nothing listens on port 9
    "POOL_CHILD_TOKEN": "c1.1." + "0" * 64,
}
CHILD_COMMANDS = [("child", "register"), ("child", "heartbeat"), ("child", "result"), ("child", "vanished")]
WORKER = ("worker", "--ordinal", "0", "--command", "true")

NON_FINITE = ("NaN", "Infinity", "-Infinity")
BAD_TOKENS = {"newline": "c1.1." + "0" * 64 + "\n", "non-ascii": "c1.1.é", "space": "c1.1. " + "0" * 63}
BAD_URLS = {
    "ftp": "ftp://x",
    "unclosed-ipv6": "http://[::1",
    "no-scheme": "not a url",
    "no-host": "http://",
    "no-such-port": "http://x:99999",
    "newline": "http://x\n",
}
GRANT_CASES = [
    *[
        pytest.param(
            ("child", "result", "--payload", f'{{"a": {v}}}'), {}, USAGE, ("--payload", v), id=f"payload-{v}"
        )
        for v in NON_FINITE
    ],
    *[
        pytest.param(
            ("child", "heartbeat", "--receipt", f'{{"a": [{v}]}}'),
            {},
            USAGE,
            ("--receipt", v),
            id=f"receipt-{v}",
        )
        for v in NON_FINITE
    ],
    pytest.param(
        ("child", "result", "--payload", '{"a": 1e999}'),
        {},
        USAGE,
        ("--payload.a", "NaN and Infinity"),
        id="payload-overflows-to-infinity",
    ),
    pytest.param(
        ("child", "heartbeat", "--receipt", '{"a": ' + "[" * 100_000),
        {},
        USAGE,
        ("--receipt", "nested"),
        id="receipt-nested-too-deep",
    ),
    *[
        pytest.param(
            args,
            {"POOL_CHILD_TOKEN": token},
            USAGE,
            ("POOL_CHILD_TOKEN", "not a token"),
            id=f"{args[1]}-token-{why}",
        )
        for args in CHILD_COMMANDS
        for why, token in BAD_TOKENS.items()
    ],
    *[
        pytest.param(args, {"POOL_WORKER_URL": url}, CONFIG, ("POOL_WORKER_URL",), id=f"{args[1]}-url-{why}")
        for args in CHILD_COMMANDS
        for why, url in BAD_URLS.items()
    ],
    pytest.param(
        ("child", "heartbeat"), {}, UNAVAILABLE, ("ConnectError", "127.0.0.1:9"), id="nothing-listens"
    ),
    pytest.param(
        (*WORKER, "--url", "ftp://x"), {}, CONFIG, ("--url (POOL_WORKER_URL)", "scheme"), id="worker-ftp"
    ),
    pytest.param(
        WORKER, {"POOL_WORKER_URL": "http://[::1"}, CONFIG, ("POOL_WORKER_URL",), id="worker-bad-url"
    ),
    pytest.param(
        WORKER,
        {"POOL_WORKER_TOKEN": "o0.x\n"},
        USAGE,
        ("POOL_WORKER_TOKEN", "not a token"),
        id="worker-token-newline",
    ),
    pytest.param(
        WORKER, {"POOL_WORKER_TOKEN": "o0.é"}, USAGE, ("POOL_WORKER_TOKEN",), id="worker-token-non-ascii"
    ),
    pytest.param(  # the one setting a pool worker reads, read alone
        WORKER,
        {"POOL_LOG_FORMAT": "xml", "POOL_SIZE": "not read"},
        USAGE,
        ("POOL_LOG_FORMAT: must be one of text, json, got 'xml'",),
        id="worker-log-format",
    ),
    pytest.param(
        (*WORKER, "--url", "http://127.0.0.1:9", "--owner", "a b"),
        {"POOL_WORKER_TOKEN": "o0.x"},
        USAGE,
        ("--owner: may hold only",),
        id="worker-owner",
    ),
    pytest.param(
        (*WORKER, "--url", "http://127.0.0.1:9", "--poll", "inf"),
        {"POOL_WORKER_TOKEN": "o0.x"},
        USAGE,
        ("--poll",),
        id="worker-poll-inf",
    ),
]


@pytest.mark.parametrize(("args", "env", "code", "words"), GRANT_CASES)
def test_poolctl_child_and_worker_refuse_what_cannot_work_with_its_own_code(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], code: int, words: tuple[str, ...]
) -> None:
    """Bad input (NaN, a malformed token) is 2, a URL that cannot work 78, nothing listening 69."""
    line = refused(run(tmp_path, *args, env={**GRANT, **env}), code, *words)
    assert "internal error" not in line and "0" * 64 not in line  # no token is echoed
    assert files(tmp_path) == []


def test_requeue_of_a_terminal_row_is_refused(tmp_path: Path) -> None:
    _terminal_row(tmp_path)
    refused(run(tmp_path, "requeue", "1"), USAGE, "row 1 is stale", "never retried")


def test_a_task_outside_the_pools_lane_is_added_with_a_note(tmp_path: Path) -> None:
    init(tmp_path)
    done = run(tmp_path, "board", "add", "b", "t", "--id", "t1", "--lane", "other")
    assert done.stdout.strip() == "t1"
    refused(done, 0, "lane 'other' is not the pool's lane ('pool')", "never claim it")
    quiet = run(tmp_path, "board", "add", "b", "t", "--id", "t2", env={"POOL_LANE": "humans"})
    assert quiet.returncode == 0 and quiet.stderr == ""  # the default lane is the pool's own
    assert board_tasks(tmp_path) == ["t1", "t2"]


# --- busy, and a bug --------------------------------------------------------------------


def test_a_locked_store_is_busy_not_unavailable(tmp_path: Path) -> None:
    init(tmp_path)
    blocker = sqlite3.connect(tmp_path / "pool.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        done = run(tmp_path, "requeue", "1")  # waits out SQLite's busy timeout (5 s)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    refused(done, BUSY, "busy, try again", "database is locked")


def test_an_internal_error_is_one_line_with_a_hint_unless_debugging(tmp_path: Path) -> None:
    init(tmp_path)
    assert run(tmp_path, "board", "add", "b", "t").returncode == 0
    with sqlite3.connect(tmp_path / "board.db") as conn:  # poisoned by a writer that ignored the CHECKs
        conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute("UPDATE tasks SET status = 'zombie'")
    refused(run(tmp_path, "board", "list"), 1, "internal error: ValueError", "POOLCTL_DEBUG=1")
    debug = run(tmp_path, "board", "list", env={"POOLCTL_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("poolctl: internal error")


# --- a read-only database ---------------------------------------------------------------


@contextmanager
def read_only(path: Path, *, directory_too: bool) -> Iterator[tuple[str, ...]]:
    """Make the databases (and the directory) read-only; yields the prefix that runs as a
    reader who cannot write them (root sheds the capability that ignores file modes)."""
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("as root, a read-only file needs setpriv to drop CAP_DAC_OVERRIDE")
        prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search")
    modes = {p: p.stat().st_mode for p in [path, *path.iterdir()]}
    for p in path.iterdir():
        p.chmod(0o444)
    if directory_too:
        path.chmod(0o555)
    try:
        yield prefix
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def test_a_read_only_store_still_reports_and_refuses_writes_in_one_line(tmp_path: Path) -> None:
    init(tmp_path)
    assert run(tmp_path, "board", "add", "b", "t", "--id", "t1").returncode == 0
    with read_only(tmp_path, directory_too=False) as prefix:
        status = run(tmp_path, "status", "--json", prefix=prefix)
        assert status.returncode == 0, status.stderr
        assert '"ready": 1' in status.stdout
        assert run(tmp_path, "rows", prefix=prefix).returncode == 0
        refused(run(tmp_path, "requeue", "1", prefix=prefix), CONFIG, "pool store at", "read-only")
        refused(run(tmp_path, "board", "add", "b", "t2", prefix=prefix), CONFIG, "board at", "read-only")
        refused(run(tmp_path, "maintain", "--once", prefix=prefix), CONFIG, "read-only")
    assert board_tasks(tmp_path) == ["t1"]


def test_a_read_only_store_in_a_read_only_directory_is_read_creating_nothing(tmp_path: Path) -> None:
    """No ``-wal``: nobody is writing, so it is opened immutable (``core.db``) and needs no ``-shm``."""
    init(tmp_path)
    before = files(tmp_path)
    with read_only(tmp_path, directory_too=True) as prefix:
        assert run(tmp_path, "status", prefix=prefix).returncode == 0
        refused(run(tmp_path, "requeue", "1", prefix=prefix), CONFIG, "pool store at", "read-only")
    assert files(tmp_path) == before


# --- the Celery entry point ----------------------------------------------------------------


@pytest.mark.parametrize("program", ["worker", "beat"])
def test_celery_refuses_a_bad_setting_in_one_line(tmp_path: Path, program: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", program, "-l", "info"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "POOL_SIZE": "-1"},
        timeout=60,  # a worker or beat that started anyway would run until killed
    )
    refused(done, USAGE, "POOL_SIZE: must be between 1 and 100000, got -1", who="poolkeeper")


# --- help, version, and the documented codes ---------------------------------------------


def test_help_is_plain_text_with_the_exit_codes(tmp_path: Path) -> None:
    for args in (("--help",), ("board", "--help"), ("requeue", "--help")):
        done = run(tmp_path, *args, env={"COLUMNS": "100"})
        assert done.returncode == 0 and "``" not in done.stdout, done.stdout
    top = run(tmp_path, "--help", env={"COLUMNS": "100"}).stdout
    assert "Exit codes" in top
    for code in (0, 1, 2, 69, 75, 78):
        assert f" {code}  " in top


def test_version_comes_from_the_package_metadata(tmp_path: Path) -> None:
    done = run(tmp_path, "--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"poolctl {importlib.metadata.version('poolkeeper')}"
    assert files(tmp_path) == []


def test_the_operate_page_documents_every_exit_code() -> None:
    operate = (ROOT / "docs" / "operate.md").read_text()
    for code in (0, 1, 2, 69, 75, 78):
        assert f"| {code} |" in operate


# --- the same classes below the CLI ----------------------------------------------------------


def test_a_refused_connection_is_unavailable_yet_still_retried_by_the_plane() -> None:
    store = PoolStore(REFUSED_PG)
    with pytest.raises(Unavailable) as pg, store.session(readonly=True) as s:
        s.connection()
    client = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=2)
    coord = RedisCoordination(client, Settings())
    with pytest.raises(Unavailable) as red:
        coord.lock_many(["row:1"])
    for err in (pg.value, red.value):
        assert failures.classify(err) is ErrorClass.TRANSIENT
    assert "secret" not in str(pg.value) and "127.0.0.1:1" in str(pg.value)


def test_a_file_that_is_not_a_database_is_a_config_error_the_plane_does_not_retry(tmp_path: Path) -> None:
    (tmp_path / "pool.db").write_bytes(b"not a database\n" * 100)
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db")
    with pytest.raises(ConfigError, match="not a SQLite database"), store.session(readonly=True) as s:
        s.connection()
    with pytest.raises(ConfigError) as caught:
        store.require_schema()
    assert failures.classify(caught.value) is ErrorClass.OTHER


@pytest.mark.parametrize(
    ("title", "body", "field"),
    [
        ("t", "caf\udce9", "body: not valid UTF-8"),
        ("\ud800", "", "title: not valid UTF-8"),
        ("t", "a\x00b", "body: must not contain a NUL"),
        ("t", "x" * 70_000, "body: too long"),
        ("x" * 70_000, "", "title: too long"),
    ],
)
def test_add_task_refuses_what_the_pool_could_never_serve(
    kanban: Board, title: str, body: str, field: str
) -> None:
    with pytest.raises(InvalidInput, match=field):
        kanban.add_task("b", title, body, task_id="t1")
    assert kanban.list_tasks() == []


def _numeric_parameters() -> list[tuple[str, Any]]:
    """Every int or float argument and option of every `poolctl` command, by its command path."""
    import typer

    from poolkeeper.cli import board_cmds, store_cmds, wire_cmds  # noqa: F401  (they register the commands)
    from poolkeeper.cli.base import app

    found: list[tuple[str, Any]] = []

    def walk(command: Any, path: list[str]) -> None:
        subcommands = getattr(command, "commands", None)
        for name, sub in (subcommands or {}).items():
            walk(sub, [*path, name])
        for param in [] if subcommands else command.params:
            annotation = param.type_descriptor.annotation
            if annotation in (int, float) or set(typing.get_args(annotation)) & {int, float}:
                found.append((f"{' '.join(path)} {param.name}", param))

    walk(typer.main.get_command(app), [])
    return found


def test_every_number_a_command_takes_is_bounded_both_ways() -> None:
    """inf, 1e300 or 10**20 is refused by its option (exit 2, naming it), never met later as an
    overflow in a timer or a SQL integer after the command has started."""
    numbers = _numeric_parameters()
    assert len(numbers) > 10, "the walk found the numeric options"
    unbounded = [where for where, param in numbers if param.min is None or param.max is None]
    assert unbounded == []
