"""What only the built-in Kanban does: operator moves, its SQLite locking, the chaos wrapper.

The ``Board`` protocol itself is tested for every backend in ``tests/board/test_contract.py``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, event, text

from board import Board, FlakyBoard, TaskSpec, TaskStatus, add_tasks, open_board
from board.faults import PoisonedTask
from board.schema import metadata
from core import db
from core.errors import InvalidInput, NotFound, TransientError, UnusableURL
from core.settings import Settings
from core.validate import INT32_MAX, INT64_MAX


def test_operator_moves_name_what_was_wrong(kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="t1")
    with pytest.raises(NotFound, match="b/nope"):
        kanban.cancel_task("b", "nope")
    with pytest.raises(InvalidInput, match="status: b/t1 is ready"):
        kanban.unblock_task("b", "t1")
    with pytest.raises(InvalidInput, match="task_id"):
        kanban.add_task("b", "dup", task_id="t1")
    with pytest.raises(InvalidInput, match="board"):
        kanban.add_task("b'; DROP TABLE tasks; --", "x")
    assert [t.id for t in kanban.list_tasks()] == ["t1"]


def test_two_thousand_tasks_are_added_in_one_call(kanban: Board) -> None:
    specs = [TaskSpec(f"task {i}", body=f"item {i}", task_id=f"t{i:04d}") for i in range(2000)]
    assert add_tasks(kanban, "bulk", specs) == [s.task_id for s in specs]
    assert kanban.counts_by_status()["ready"] == 2000
    assert kanban.get_task("bulk", "t1999") is not None


def test_a_bulk_add_is_all_or_nothing_and_names_the_task_refused(kanban: Board) -> None:
    kanban.add_task("b", "there already", task_id="old")
    cases = [
        ([TaskSpec("a", task_id="x"), TaskSpec("b", task_id="x")], "task 2: b/x is in the batch twice"),
        ([TaskSpec("a", task_id="y"), TaskSpec("b", task_id="old")], "b/old already exists"),
        ([TaskSpec("a", task_id="z"), TaskSpec("   ")], "task 2: must not be empty"),
        ([TaskSpec("a"), TaskSpec("b", body="\x00")], "task 2"),
        ([TaskSpec("a"), TaskSpec("b", lane="no lane")], "task 2"),
    ]
    for specs, refusal in cases:
        with pytest.raises(InvalidInput, match=refusal):
            add_tasks(kanban, "b", specs)
    assert [t.id for t in kanban.list_tasks()] == ["old"]  # nothing of any refused batch was written


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ('{"n": 1, "n": 2}', "body: not JSON: the key n appears twice in one object"),
        ('{"a": {"x": [], "x": {}}}', "the key x appears twice"),
        ('{"n": NaN}', "NaN has no JSON form"),
        ('{"n": -Infinity}', "-Infinity has no JSON form"),
        ('{"a":' * 10_000, "body: JSON nested deeper than 64 levels"),
    ],
)
def test_a_body_that_is_json_must_mean_one_thing(kanban: Board, body: str, refusal: str) -> None:
    """The board keeps the body as given and the worker gets it parsed as ``input`` too: a repeated
    key (parsers differ on which wins) or a value JSON has no form for is refused, not guessed at."""
    with pytest.raises(InvalidInput, match=refusal):
        kanban.add_task("b", "x", body=body, task_id="t1")
    assert kanban.get_task("b", "t1") is None
    assert kanban.add_task("b", "x", body='{"n": 1, "m": {"n": 2}}', task_id="t1") == "t1"  # a key per object


def test_tasks_are_not_added_to_an_archived_board_whose_tasks_the_pool_never_claims(kanban: Board) -> None:
    kanban.add_task("old", "done long ago", task_id="t1")
    kanban.archive_board("old")
    with pytest.raises(InvalidInput, match="board: old is archived: the pool claims none of its tasks"):
        add_tasks(kanban, "old", [TaskSpec("queued for ever")])
    assert [t.id for t in kanban.list_tasks("old")] == ["t1"]
    assert add_tasks(kanban, "fresh", [TaskSpec("a new board is made")]) != []


def test_locked_board_database_is_a_transient_error(
    tmp_path: object, engine_of: Callable[[Board], Engine]
) -> None:
    path = f"{tmp_path}/board.db"
    kanban = open_board(Settings(board_url=f"sqlite:///{path}"))
    kanban.migrate()
    kanban.add_task("b", "x", task_id="t1")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        kanban.close()
        from sqlalchemy import event

        @event.listens_for(engine_of(kanban), "connect")
        def short_timeout(conn: sqlite3.Connection, _rec: object) -> None:
            conn.execute("PRAGMA busy_timeout=50")

        with pytest.raises(TransientError, match="board"):
            kanban.claim_ready(1, assignee="pool", lane="pool")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert len(kanban.claim_ready(1, assignee="pool", lane="pool")) == 1


def test_flaky_board_fails_poisoned_tasks_every_time(kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="bad")
    flaky = FlakyBoard(kanban, poison=frozenset({"bad"}))
    for _ in range(3):
        with pytest.raises(PoisonedTask, match="bad"):
            flaky.get_task("b", "bad")
    assert flaky.list_boards() == ["b"]


def test_an_operator_move_that_lost_a_race_changes_nothing(
    settings: Settings, kanban: Board, engine_of: Callable[[Board], Engine]
) -> None:
    """Between the move's read and its guarded write another writer moves the task: refused, not blind."""
    if not settings.board_url.startswith("postgresql"):
        pytest.skip("SQLite's BEGIN IMMEDIATE already keeps every other writer out of the move")
    kanban.add_task("b", "x", task_id="t1")
    kanban.claim_ready(1, assignee="pool", lane="pool")
    other = open_board(settings)
    fired: list[bool] = []

    @event.listens_for(engine_of(kanban), "before_cursor_execute")
    def sneak_in(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("UPDATE tasks") and not fired:
            fired.append(True)
            assert other.complete_task("b", "t1", 1, {"status": "done"})

    with pytest.raises(TransientError, match="changed concurrently"):
        kanban.reassign_task("b", "t1", assignee="alice", lane="humans")
    event.remove(engine_of(kanban), "before_cursor_execute", sneak_in)
    assert fired, "the other writer got in"
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.lane == "pool"
    other.close()


def test_one_task_that_cannot_be_claimed_never_stops_the_others(
    kanban: Board, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its savepoint rolls back, it stays ready as it was, it is reported once; the rest are claimed."""
    for task_id in ("bad", "t1", "t2"):  # "bad" is the oldest: first in line every time
        kanban.add_task("b", task_id, task_id=task_id)
    kanban_class = type(kanban)  # the built-in Kanban's own savepoint, so its private helper
    open_run = kanban_class._open_run  # type: ignore[attr-defined]

    def failing_open_run(conn: Any, board: str, task_id: str, *args: Any) -> None:
        open_run(conn, board, task_id, *args)
        if task_id == "bad":  # the same run row twice: a real IntegrityError after the task's UPDATE
            open_run(conn, board, task_id, *args)

    monkeypatch.setattr(kanban_class, "_open_run", staticmethod(failing_open_run))
    caplog.set_level(logging.ERROR, "poolkeeper.board")
    assert [c.task_id for c in kanban.claim_ready(1, assignee="pool", lane="pool")] == ["t1"]
    assert [c.task_id for c in kanban.claim_ready(5, assignee="pool", lane="pool")] == ["t2"]
    bad = kanban.get_task("b", "bad")
    assert bad is not None and bad.status is TaskStatus.READY and bad.current_run_id is None
    assert [r for r in kanban.pool_runs("pool") if r[1] == "bad"] == []
    reports = [r.getMessage() for r in caplog.records if "b/bad" in r.getMessage()]
    assert len(reports) == 1 and "IntegrityError" in reports[0], reports


def test_a_run_id_past_its_column_is_never_minted(
    kanban: Board, engine_of: Callable[[Board], Engine]
) -> None:
    kanban.add_task("b", "worn out", task_id="old")
    kanban.add_task("b", "fresh", task_id="new")
    with engine_of(kanban).begin() as conn:
        conn.execute(text("UPDATE tasks SET current_run_id = :v WHERE id = 'old'"), {"v": INT64_MAX})
    claims = kanban.claim_ready(1, assignee="pool", lane="pool")
    assert [(c.task_id, c.run_id) for c in claims] == [("new", 1)]
    old = kanban.get_task("b", "old")
    assert old is not None and old.status is TaskStatus.READY and old.current_run_id == INT64_MAX


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda k: k.claim_ready(INT32_MAX + 1, assignee="pool", lane="pool"), "limit"),
        (lambda k: k.claim_ready(-1, assignee="pool", lane="pool"), "limit"),
        (lambda k: k.claim_ready(True, assignee="pool", lane="pool"), "limit"),
        (lambda k: k.complete_task("b", "t1", INT64_MAX + 1, {"status": "done"}), "expected_run_id"),
        (lambda k: k.block_task("b", "t1", "r", "transient", 0), "expected_run_id"),
        (lambda k: k.list_tasks(limit=INT32_MAX + 1), "limit"),
    ],
)
def test_integers_past_their_column_are_refused_by_name(
    kanban: Board, call: Callable[[Board], object], field: str
) -> None:
    kanban.add_task("b", "x", task_id="t1")
    kanban.claim_ready(1, assignee="pool", lane="pool")
    with pytest.raises(InvalidInput, match=f"^{field}: "):
        call(kanban)
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.RUNNING and task.current_run_id == 1


def test_a_corrupt_result_is_read_as_none_for_that_task_alone(
    kanban: Board, engine_of: Callable[[Board], Engine], caplog: pytest.LogCaptureFixture
) -> None:
    for task_id in ("t1", "t2", "t3"):
        kanban.add_task("b", task_id, task_id=task_id)
    kanban.claim_ready(3, assignee="pool", lane="pool")
    deep = "[" * 100_000 + "]" * 100_000
    with engine_of(kanban).begin() as conn:
        conn.execute(text("UPDATE tasks SET result = '{broken' WHERE id = 't1'"))
        conn.execute(text("UPDATE tasks SET result = :deep WHERE id = 't2'"), {"deep": deep})
        conn.execute(text("UPDATE tasks SET result = :ok WHERE id = 't3'"), {"ok": '{"fine":true}'})
    caplog.set_level(logging.ERROR, "poolkeeper.board")
    for _ in range(2):
        running = {t.id: t for t in kanban.running_tasks("b")}
        assert {i: (t.result, t.current_run_id) for i, t in running.items()} == {
            "t1": (None, 1),
            "t2": (None, 1),
            "t3": ({"fine": True}, 1),
        }
        got = kanban.get_task("b", "t1")
        assert got is not None and got.status is TaskStatus.RUNNING and got.result is None
    reports = sorted(r.getMessage() for r in caplog.records)
    assert len(reports) == 2, reports  # one per task, however often it is read
    assert "b/t1" in reports[0] and "JSONDecodeError" in reports[0]
    assert "b/t2" in reports[1] and "RecursionError" in reports[1]


@pytest.mark.parametrize(
    ("url", "got"),
    [
        ("ftp://board.example/api", "scheme 'ftp:'"),  # http: is a backend now (board.http)
        ("garbage", "no scheme"),
        ("mysql://x@h/db", "scheme 'mysql:'"),
    ],
)
def test_the_board_url_scheme_picks_a_backend_or_names_the_known_ones(url: str, got: str) -> None:
    with pytest.raises(UnusableURL) as err:
        open_board(Settings(board_url=url))
    message = str(err.value)
    assert message.startswith("POOL_BOARD_URL: ") and "postgresql:, sqlite:" in message and got in message
    assert "\n" not in message and "example" not in message  # one line; the URL is not echoed


def test_a_database_scheme_the_driver_cannot_open_names_the_variable() -> None:
    with pytest.raises(UnusableURL, match=r"^POOL_BOARD_URL: not a database URL"):
        open_board(Settings(board_url="sqlite+nosuchdriver:///x.db"))


def test_the_ready_at_migration_fills_in_only_what_the_board_knew(
    settings: Settings, engine_of: Callable[[Board], Engine]
) -> None:
    """Given a board at revision 0002 with a ready task and a running one: at head, the ready one's
    ``ready_at`` is its last update (an add or an unblock), the running one's is unknown (None)."""
    kanban = open_board(settings)
    engine = engine_of(kanban)
    cfg = db._alembic_config("board")
    cfg.attributes["target_metadata"] = metadata
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
        conn.execute(text("INSERT INTO boards (name, archived, created_at) VALUES ('b', false, 1)"))
        for task, status, run in (("waits", "ready", None), ("runs", "running", 1)):
            conn.execute(
                text(
                    "INSERT INTO tasks (board, id, title, body, status, current_run_id, lane, created_at,"
                    " updated_at) VALUES ('b', :id, 'x', '', :status, :run, 'pool', 10, 20)"
                ),
                {"id": task, "status": status, "run": run},
            )
    try:
        kanban.migrate()
        ready, running = kanban.get_task("b", "waits"), kanban.get_task("b", "runs")
        assert ready is not None and ready.ready_at == 20.0
        assert running is not None and running.ready_at is None
    finally:
        kanban.close()
