"""Shared fixtures: real SQLite files in tmp_path, PostgreSQL where reachable, a fixed clock.

PostgreSQL: ``POOL_TEST_POSTGRES_URL`` (default: the local server, database
``test``). Without a server the PostgreSQL cases are skipped with the reason;
under CI (``CI=true``) a missing server is an error instead, since CI must
run them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from board import Board, open_board
from board.kanban import KanbanBoard
from board.schema import metadata as board_metadata
from core.settings import Settings
from core.validate import canonical_json, sha256
from store import PoolStore
from store.models import Assignment, RowState
from store.models import metadata as store_metadata
from tasks import failures
from tasks.coordination import LocalCoordination
from tasks.plane import Plane
from tests import properties
from tests.factories import NOW, RowFactory
from tests.helpers import staff

properties.load()  # before any test module builds its Hypothesis settings

PG_URL = os.environ.get("POOL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _postgres_database() -> str | None:
    """A fresh database on the test server for this run, or None when none answers."""
    try:
        admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
        name = f"poolkeeper_test_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
        admin.dispose()
    except Exception as err:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"CI needs PostgreSQL at {PG_URL}: {err}") from err
        return None
    return PG_URL.rsplit("/", 1)[0] + "/" + name


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every Hypothesis test is a ``property`` test, bounded by its examples: no pytest-timeout.

    A loaded machine (``make test`` beside other work) only makes it slower; the per-test
    timeout of ``[tool.pytest.ini_options]`` still bounds every other test.
    """
    for item in items:
        given = getattr(getattr(item, "function", None), "is_hypothesis_test", False)
        if given and not item.get_closest_marker("property"):
            item.add_marker(pytest.mark.property)
        if item.get_closest_marker("property") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(0))


@pytest.fixture(autouse=True)
def fresh_reporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no failure already reported (the reporter is per process)."""
    monkeypatch.setattr(failures, "reporter", failures.Reporter())


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    url = _postgres_database()
    if url is None:
        pytest.skip(f"no PostgreSQL server answers at {PG_URL}")
    yield url
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """The store's database: a SQLite file, then the same tests on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/pool.db"
        return
    url: str = request.getfixturevalue("postgres_url")
    yield url
    engine = create_engine(url)
    with engine.begin() as conn:
        versions = ["store_alembic_version", "board_alembic_version"]
        tables = [*store_metadata.tables, *board_metadata.tables, *versions]
        conn.execute(text(f"DROP TABLE IF EXISTS {', '.join(tables)} CASCADE"))
    engine.dispose()


@pytest.fixture(scope="session")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite store to copy per example: migrating once per run, in pytest's temp folder.

    pytest keeps its last few runs' folders and removes older ones, so nothing piles up.
    """
    path = tmp_path_factory.mktemp("store-template") / "template.db"
    template = PoolStore.from_settings(Settings(database_url=f"sqlite:///{path}"))
    template.migrate()
    template.engine.dispose()
    return path


@pytest.fixture
def settings(backend_url: str) -> Settings:
    return Settings(
        database_url=backend_url,
        board_url=backend_url,
        pool_size=3,
        lease_seconds=30,
        max_attempts=3,
        retention_seconds=3600,
        quarantine_after=3,
        backoff_base_seconds=1,
        backoff_max_seconds=8,
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[PoolStore]:
    st = PoolStore.from_settings(settings)
    st.migrate()
    yield st
    st.engine.dispose()


@pytest.fixture
def kanban(settings: Settings) -> Iterator[Board]:
    """The board at ``settings.board_url``, migrated (the built-in Kanban: the URL is a database)."""
    kb = open_board(settings)
    kb.migrate()
    yield kb
    kb.close()


@pytest.fixture
def engine_of() -> Callable[[Board], Engine]:
    """The database engine under a built-in Kanban board, for tests that write past the ``Board`` API."""

    def engine(board: Board) -> Engine:
        assert isinstance(board, KanbanBoard), f"{board!r} is not the built-in Kanban"
        return board.engine

    return engine


@pytest.fixture
def make_row(store: PoolStore) -> RowFactory:
    """Given a row in ``state`` on ``ordinal``; the schema's CHECKs still apply."""
    counter = iter(range(1, 1_000_000))

    def make(
        state: RowState = RowState.ASSIGNED,
        *,
        ordinal: int = 0,
        attempt: int = 1,
        lease_until: float | None = None,
        updated_at: float = NOW,
        board: str = "b",
        task_id: str | None = None,
        run_id: int = 1,
    ) -> int:
        n = next(counter)
        task = task_id or f"t{n}"
        terminal = state in (RowState.FINALIZED, RowState.STALE)
        payload = canonical_json({"title": task})
        row = Assignment(
            board=board,
            task_id=task,
            run_id=run_id,
            ordinal=ordinal,
            state=state.value,
            attempt=attempt,
            payload=None if terminal else payload,
            payload_digest=sha256(payload),
            created_at=updated_at,
            updated_at=updated_at,
        )
        if state is not RowState.ASSIGNED:
            row.fence = n
            row.lease_until = NOW + 30 if lease_until is None else lease_until
        if state is RowState.RESULT:
            row.result, row.result_digest = '{"status":"done"}', "0" * 64
        with store.session() as s:
            s.add(row)
            s.flush()
            return row.id

    return make


@pytest.fixture
def plane(settings: Settings, store: PoolStore, kanban: Board) -> Iterator[Plane]:
    """The plane over a pool with a worker on every ordinal, seen at the tests' clock (``NOW``)."""
    staff(store, range(settings.pool_size), NOW)
    yield Plane(settings, store, kanban, LocalCoordination())
