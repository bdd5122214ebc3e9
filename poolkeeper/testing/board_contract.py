"""The ``Board`` contract kit: the tests a board backend passes before the plane can trust it.

Subclass ``BoardContract`` in a test module and give it one fixture, ``open_handle``::

    import pytest
    from poolkeeper.testing.board_contract import BoardContract

    class TestMyBoard(BoardContract):
        @pytest.fixture
        def open_handle(self, tmp_path):
            return lambda: MyBoard(f"myboard://{tmp_path}/board.db")

Each call of ``open_handle`` opens a new handle (a ``Board``) on one fresh, empty backing
store, not yet migrated. The kit migrates the first (``board``), opens a second for the
races between two writers (``second_handle``) and more for claims from many threads, and
closes every handle it opens. ``busy`` is optional: a context manager inside which the
backing store is busy, as when another writer holds its lock (``sqlite_write_lock`` makes
one for a SQLite file); without it the busy test is skipped, since a wrapper raising in
front of the backend would test only itself.

The kit needs pytest (it imports it) and nothing of pytest's internals: fixtures, ``raises``
and ``skip``. Why each rule matters to the maintenance plane: docs/board-backends.md.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, suppress
from functools import partial
from typing import Any, TypeVar

import pytest

from board.protocol import SEARCH_MAX_CHARS, Board, TaskStatus, search_tasks
from core.errors import CapabilityError, ConfigError, InvalidInput, NotFound, TransientError, Unsupported

T = TypeVar("T")
Busy = Callable[[], AbstractContextManager[object]]

# How long a call that meets another writer may keep answering TransientError before the kit fails it.
CONTENDED_SECONDS = 30.0
THREADS = 4


def claim(board: Board, limit: int = 10) -> list[tuple[str, str, int]]:
    """Claim as the pool (assignee and lane ``pool``): (board, task_id, run_id) per claim."""
    return [(c.board, c.task_id, c.run_id) for c in board.claim_ready(limit, assignee="pool", lane="pool")]


def retrying(call: Callable[[], T]) -> T:
    """``call``, again while it is ``TransientError`` (it changed nothing), as the plane retries it."""
    deadline = time.monotonic() + CONTENDED_SECONDS
    while True:
        try:
            return call()
        except TransientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def together(calls: list[Callable[[], T]]) -> list[T]:
    """Each call in a thread of its own, all let go at once; their answers in order (errors re-raised)."""
    start = threading.Barrier(len(calls), timeout=CONTENDED_SECONDS)

    def run(call: Callable[[], T]) -> T:
        start.wait()
        return retrying(call)

    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(run, call) for call in calls]]


def sqlite_write_lock(path: str | os.PathLike[str]) -> Busy:
    """A ``busy`` for a backend on the SQLite file ``path``: another connection holds its write lock.

    Readers still read; a writer waits out its busy timeout, then must raise ``TransientError``.
    """

    @contextmanager
    def held() -> Iterator[None]:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()

    return held


def found(board: Board, text: str, limit: int = 50) -> list[tuple[str, str]]:
    """(board, task_id) of what a search finds; the test is skipped for a backend that cannot search
    (search is optional: ``board.protocol.Searching``), which must say so as ``Unsupported``."""
    try:
        return [(t.board, t.id) for t in search_tasks(board, text, limit)]
    except Unsupported:
        pytest.skip(f"{type(board).__name__} offers no task search")


def snapshot(board: Board) -> tuple[Any, ...]:
    """Everything the reads show: two equal snapshots mean nothing changed."""
    return board.list_tasks(), sorted(board.pool_runs("pool")), board.list_boards(include_archived=True)


class BoardContract:
    """The contract; a subclass named ``Test…`` overrides ``open_handle`` (and may override ``busy``)."""

    @pytest.fixture
    def open_handle(self) -> Callable[[], Board]:
        """Override: a callable opening a new handle on one fresh, empty, unmigrated backing store."""
        raise NotImplementedError(f"{type(self).__name__} must override the open_handle fixture")

    @pytest.fixture
    def busy(self) -> Busy | None:
        """Override to test the busy path: a context manager inside which the backing store is busy."""
        return None

    @pytest.fixture
    def board(self, open_handle: Callable[[], Board]) -> Iterator[Board]:
        """The board under test: migrated and empty."""
        handle = open_handle()
        handle.migrate()
        yield handle
        handle.close()

    @pytest.fixture
    def second_handle(self, board: Board, open_handle: Callable[[], Board]) -> Iterator[Board]:
        """Another writer on the board's backing store, with its own connections."""
        handle = open_handle()
        yield handle
        handle.close()

    # --- the plane's calls -------------------------------------------------------------

    def test_claim_takes_only_ready_pool_lane_tasks_oldest_first(self, board: Board) -> None:
        board.add_task("b", "first", task_id="t1")
        board.add_task("b", "other lane", task_id="t2", lane="humans")
        board.add_task("b", "second", task_id="t3")
        assert claim(board, 1) == [("b", "t1", 1)]
        assert claim(board) == [("b", "t3", 1)]
        assert claim(board) == []
        running = {t.id: t for t in board.running_tasks("b")}
        assert set(running) == {"t1", "t3"} and running["t1"].assignee == "pool"

    def test_a_claim_retried_with_its_request_id_claims_nothing_more(self, board: Board) -> None:
        for i in range(3):
            board.add_task("b", f"task {i}", task_id=f"t{i}")
        first = board.claim_ready(2, assignee="pool", lane="pool", request_id="req-1")
        assert [c.task_id for c in first] == ["t0", "t1"]
        # the answer was lost and the request is sent again: the same claims, nothing more claimed
        assert board.claim_ready(2, assignee="pool", lane="pool", request_id="req-1") == first
        assert [c.task_id for c in board.claim_ready(5, assignee="pool", lane="pool")] == ["t2"]

    def test_a_claim_skips_the_boards_it_is_told_to(self, board: Board) -> None:
        for name in ("a", "b", "c"):
            board.add_task(name, f"on {name}", task_id=f"t{name}")
        got = board.claim_ready(5, assignee="pool", lane="pool", skip_boards=["b", "c"])
        assert [(c.board, c.task_id) for c in got] == [("a", "ta")]
        assert {t.id for t in board.list_tasks(status=TaskStatus.READY)} == {"tb", "tc"}  # left ready
        assert [c.board for c in board.claim_ready(5, assignee="pool", lane="pool", skip_boards=["c"])] == [
            "b"
        ]

    def test_complete_and_block_act_on_the_exact_run_only(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        [(_, _, run)] = claim(board)
        assert not board.complete_task("b", "t1", run + 1, {"status": "done"})
        assert board.complete_task("b", "t1", run, {"status": "done"})
        assert not board.block_task("b", "t1", "late", "transient", run)  # no longer running
        task = board.get_task("b", "t1")
        assert task is not None and task.status is TaskStatus.DONE and task.result == {"status": "done"}

    @pytest.mark.parametrize("result", [{"v": "a\x00b"}, {"k\x00": 1}, {"v": "lone \ud800"}])
    def test_a_result_no_store_would_hold_is_refused_and_the_run_stays_running(
        self, board: Board, result: dict[str, Any]
    ) -> None:
        board.add_task("b", "x", task_id="t1")
        [(_, _, run)] = claim(board)
        with pytest.raises((InvalidInput, CapabilityError), match=r"result|request"):  # refused, named
            board.complete_task("b", "t1", run, result)
        task = board.get_task("b", "t1")
        assert task is not None and task.status is TaskStatus.RUNNING and task.current_run_id == run

    def test_unblocked_task_is_claimed_again_with_a_new_run_id(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        [(_, _, run)] = claim(board)
        assert board.block_task("b", "t1", "lease expired", "transient", run)
        blocked = board.get_task("b", "t1")
        assert blocked is not None and (blocked.block_reason, blocked.block_kind) == (
            "lease expired",
            "transient",
        )
        board.unblock_task("b", "t1")
        assert claim(board) == [("b", "t1", run + 1)]

    def test_ready_at_is_when_the_task_last_turned_ready(self, board: Board) -> None:
        """``ready_at``: set on add, kept by a claim, set again by an unblock and a reassign. A board
        that does not say (None) is allowed: the plane then measures no wait, rather than guess one."""

        def ready_at() -> float | None:
            task = board.get_task("b", "t1")
            assert task is not None
            return task.ready_at

        before = time.time()
        board.add_task("b", "x", task_id="t1")
        added = ready_at()
        if added is None:
            pytest.skip("this board does not say when a task turned ready")
        assert before <= added <= time.time()
        [(_, _, run)] = claim(board)
        assert ready_at() == added, "a claim ends the wait; it does not move its start"
        assert board.block_task("b", "t1", "lease expired", "transient", run)
        assert ready_at() == added
        blocked = time.time()
        board.unblock_task("b", "t1")
        unblocked = ready_at()
        assert unblocked is not None and blocked <= unblocked <= time.time()
        claim(board)
        handed = time.time()
        moved = board.reassign_task("b", "t1", assignee="pool", lane="pool")
        assert moved.ready_at is not None and handed <= moved.ready_at <= time.time()
        assert ready_at() == moved.ready_at

    def test_an_unknown_task_is_none_and_an_unknown_board_runs_nothing(self, board: Board) -> None:
        assert board.get_task("nowhere", "t1") is None
        assert board.running_tasks("nowhere") == []
        assert not board.complete_task("nowhere", "t1", 1, {"status": "done"})

    def test_every_read_and_settle_is_scoped_to_its_board(self, board: Board) -> None:
        """Two boards holding the same task ids: what one board's call reads or settles is that board's
        only (reconcile judges each board's running tasks against its rows; another's would be adopted)."""
        for name in ("b", "c"):
            for task_id in ("t1", "t2"):
                board.add_task(name, f"{name} {task_id}", task_id=task_id)
        claimed = claim(board)
        run = {(name, task_id): run_id for name, task_id, run_id in claimed}
        assert len(run) == 4
        assert board.block_task("b", "t1", "again", "transient", run["b", "t1"])
        board.unblock_task("b", "t1")
        [(_, _, again)] = claim(board)  # b/t1 has two runs, c/t1 one
        for name in ("b", "c"):
            running = board.running_tasks(name)
            assert sorted((t.board, t.id) for t in running) == [(name, "t1"), (name, "t2")], running
            assert {t.title for t in running} == {f"{name} t1", f"{name} t2"}
            listed = board.list_tasks(name)
            assert sorted((t.board, t.id, t.title) for t in listed) == [
                (name, i, f"{name} {i}") for i in ("t1", "t2")
            ], listed
            task = board.get_task(name, "t1")
            assert task is not None and (task.board, task.title) == (name, f"{name} t1"), task
        assert [r["run_id"] for r in board.list_runs("b", ["t1"])] == [run["b", "t1"], again]
        assert [r["run_id"] for r in board.list_runs("c", ["t1", "t2"])] == [run["c", "t1"], run["c", "t2"]]
        assert not board.has_board("d")
        # settling c's run with b's run id, or b's with c's, settles nothing on either board
        assert not board.complete_task("c", "t1", again, {"status": "done"})
        assert board.complete_task("b", "t1", again, {"status": "done"})
        c_task = board.get_task("c", "t1")
        assert c_task is not None and c_task.status is TaskStatus.RUNNING, c_task
        assert board.block_task("c", "t2", "parked", "transient", run["c", "t2"])
        b_task = board.get_task("b", "t2")
        assert b_task is not None and b_task.status is TaskStatus.RUNNING, b_task

    # --- two writers -------------------------------------------------------------------

    def test_a_stale_result_never_settles_the_run_after_it(self, board: Board, second_handle: Board) -> None:
        """A worker's late result for run r, after another writer parked r and the task ran again."""
        board.add_task("b", "x", task_id="t1")
        [(_, _, run)] = claim(board)
        assert second_handle.block_task("b", "t1", "lease expired", "transient", run)
        second_handle.unblock_task("b", "t1")
        assert claim(second_handle) == [("b", "t1", run + 1)]
        assert not board.complete_task("b", "t1", run, {"status": "late"})
        assert not board.block_task("b", "t1", "late", "capability", run)
        task = board.get_task("b", "t1")
        assert task is not None and (task.status, task.current_run_id, task.result) == (
            TaskStatus.RUNNING,
            run + 1,
            None,
        )
        assert board.complete_task("b", "t1", run + 1, {"status": "done"})

    def test_two_writers_settling_one_run_at_once_never_both_win(
        self, board: Board, second_handle: Board
    ) -> None:
        ids = [f"t{n}" for n in range(6)]
        for task_id in ids:
            board.add_task("b", task_id, task_id=task_id)
        claims = claim(board)
        assert [t for _, t, _ in claims] == ids
        for _, task_id, run in claims:
            complete = partial(board.complete_task, "b", task_id, run, {"status": "done"})
            park = partial(second_handle.block_task, "b", task_id, "lease expired", "transient", run)
            completed, blocked = together([complete, park])
            assert completed != blocked, f"{task_id}: completed {completed}, blocked {blocked}"
            task = second_handle.get_task("b", task_id)
            assert task is not None
            assert task.status is (TaskStatus.DONE if completed else TaskStatus.BLOCKED)
            assert (task.result, task.block_reason) == (
                ({"status": "done"}, None) if completed else (None, "lease expired")
            )

    def test_claims_from_many_threads_never_take_one_task_twice(
        self, board: Board, open_handle: Callable[[], Board]
    ) -> None:
        ids = {f"t{n:02}" for n in range(24)}
        for task_id in sorted(ids):
            board.add_task("b", task_id, task_id=task_id)
        handles = [open_handle() for _ in range(THREADS)]
        try:

            def claim_until_none(handle: Board) -> list[tuple[str, str, int]]:
                taken: list[tuple[str, str, int]] = []
                while batch := retrying(lambda: claim(handle, 3)):
                    assert len(batch) <= 3
                    taken += batch
                return taken

            by_thread = together([partial(claim_until_none, handle) for handle in handles])
        finally:
            for handle in handles:
                handle.close()
        claims = [c for taken in by_thread for c in taken] + claim(board, len(ids))  # any a thread skipped
        assert [c for c, n in Counter((b, t) for b, t, _ in claims).items() if n > 1] == []
        assert sorted(claims) == [("b", t, 1) for t in sorted(ids)]
        assert sorted(board.pool_runs("pool")) == [("b", t, 1, "running") for t in sorted(ids)]

    # --- a busy backend ----------------------------------------------------------------

    def test_a_busy_backend_raises_transient_and_changes_nothing(
        self, board: Board, busy: Busy | None
    ) -> None:
        if busy is None:
            pytest.skip("no busy fixture: give one that makes the backing store busy to test this path")
        board.add_task("b", "running", task_id="t1")
        board.add_task("b", "ready", task_id="t2")
        [(_, _, run)] = claim(board, 1)
        before = snapshot(board)
        reads: list[tuple[Callable[[], object], object]] = [
            (lambda: board.list_boards(), ["b"]),
            (lambda: board.running_tasks("b"), board.running_tasks("b")),
            (lambda: board.get_task("b", "t1"), board.get_task("b", "t1")),
        ]
        with busy():
            with pytest.raises(TransientError):
                board.claim_ready(5, assignee="pool", lane="pool")
            with pytest.raises(TransientError):
                board.complete_task("b", "t1", run, {"status": "done"})
            with pytest.raises(TransientError):
                board.block_task("b", "t1", "lease expired", "transient", run)
            for read, expected in reads:  # a read may still answer, but only with the truth
                with suppress(TransientError):
                    assert read() == expected
        assert snapshot(board) == before
        assert board.complete_task("b", "t1", run, {"status": "done"})
        assert claim(board) == [("b", "t2", 1)]

    # --- archived boards, deleted tasks ----------------------------------------------

    def test_archived_boards_are_not_claimed_or_listed(self, board: Board) -> None:
        board.add_task("old", "x", task_id="t1")
        board.archive_board("old")
        assert claim(board) == []
        assert board.list_boards() == [] and board.list_boards(include_archived=True) == ["old"]

    def test_an_archived_board_still_reads_and_settles_the_runs_it_had(self, board: Board) -> None:
        """The plane settles what it holds on a board archived under it (reconcile lists archived ones)."""
        for task_id in ("t1", "t2", "t3"):
            board.add_task("b", task_id, task_id=task_id)
        [(_, _, r1), (_, _, r2)] = claim(board, 2)
        board.archive_board("b")
        assert board.has_board("b") and {t.id for t in board.running_tasks("b")} == {"t1", "t2"}
        assert board.complete_task("b", "t1", r1, {"status": "done"})
        assert board.block_task("b", "t2", "lease expired", "transient", r2)
        assert claim(board) == []
        waiting = board.get_task("b", "t3")
        assert waiting is not None and waiting.status is TaskStatus.READY

    def test_run_ids_never_repeat_for_a_task_id_even_after_delete(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        [(_, _, first)] = claim(board)
        board.reassign_task("b", "t1", assignee="alice", lane="humans")  # run first + 1
        board.delete_task("b", "t1")
        board.add_task("b", "x again", task_id="t1")
        board.add_task("b", "other", task_id="t2")
        assert claim(board) == [("b", "t1", first + 2), ("b", "t2", 1)]
        board.delete_task("b", "t1")
        board.add_task("b", "third time", task_id="t1")
        assert claim(board) == [("b", "t1", first + 3)]

    def test_a_deleted_task_is_gone_and_its_old_run_never_settles_the_new_one(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        [(_, _, old)] = claim(board)
        board.delete_task("b", "t1")
        assert board.get_task("b", "t1") is None and board.running_tasks("b") == []
        assert not board.complete_task("b", "t1", old, {"status": "late"})
        board.add_task("b", "x again", task_id="t1")
        [(_, _, new)] = claim(board)
        assert new > old
        assert not board.block_task("b", "t1", "late", "transient", old)
        assert board.complete_task("b", "t1", new, {"status": "done"})

    # --- operator moves ----------------------------------------------------------------

    def test_reassign_moves_the_run_on_and_cancel_ends_the_task(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        [(_, _, run)] = claim(board)
        moved = board.reassign_task("b", "t1", assignee="alice", lane="humans")
        assert moved.current_run_id == run + 1 and moved.status is TaskStatus.RUNNING
        assert not board.complete_task("b", "t1", run, {"status": "done"})
        cancelled = board.cancel_task("b", "t1")
        assert cancelled.status is TaskStatus.DONE and cancelled.result == {"cancelled": True}

    def test_an_operator_move_the_status_does_not_allow_is_refused(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        with pytest.raises(InvalidInput, match="status"):
            board.unblock_task("b", "t1")  # ready, not blocked
        with pytest.raises(InvalidInput, match="status"):
            board.reassign_task("b", "t1", assignee="alice", lane="humans")  # not running
        board.cancel_task("b", "t1")
        with pytest.raises(InvalidInput, match="status"):
            board.cancel_task("b", "t1")  # already done
        for move in (board.unblock_task, board.cancel_task, board.delete_task):
            with pytest.raises(NotFound):
                move("b", "nosuch")
        with pytest.raises(NotFound):
            board.archive_board("nowhere")

    # --- setting up, and the reads -------------------------------------------------------

    def test_a_migrated_board_is_ready_and_says_where_it_is(self, board: Board) -> None:
        board.migrate()  # again: a no-op
        board.require_schema(writable=True)
        board.require_creatable()
        assert board.location()
        board.close()
        assert board.list_boards() == []  # usable again after close

    def test_an_unmigrated_board_is_refused_before_anything_is_created(
        self, open_handle: Callable[[], Board]
    ) -> None:
        handle = open_handle()
        try:
            with pytest.raises(ConfigError, match="poolctl init"):
                handle.require_schema()
        finally:
            handle.close()

    def test_added_tasks_are_listed_counted_and_their_boards_known(self, board: Board) -> None:
        board.add_task("b", "first", "body", task_id="t1")
        generated = board.add_task("b", "second")
        board.add_task("c", "elsewhere", task_id="t1", lane="humans")
        assert board.has_board("b") and board.has_board("c") and not board.has_board("nowhere")
        assert [(t.board, t.id) for t in board.list_tasks("b")] == [("b", "t1"), ("b", generated)]
        [first] = board.list_tasks("b", limit=1)
        assert (first.title, first.body, first.status) == ("first", "body", TaskStatus.READY)
        assert first.lane == "pool"
        claim(board, 1)
        assert [t.id for t in board.list_tasks(status=TaskStatus.RUNNING)] == ["t1"]
        assert board.counts_by_status() == {"ready": 2, "running": 1, "blocked": 0, "done": 0}
        with pytest.raises(InvalidInput, match="task_id"):
            board.add_task("b", "again", task_id="t1")

    def test_runs_are_kept_per_task_with_their_outcomes(self, board: Board) -> None:
        board.add_task("b", "x", task_id="t1")
        board.add_task("b", "y", task_id="t2")
        [(_, _, r1), (_, _, r2)] = claim(board)
        assert board.block_task("b", "t1", "lease expired", "transient", r1)
        assert board.complete_task("b", "t2", r2, {"status": "done"})
        board.unblock_task("b", "t1")
        [(_, _, r3)] = claim(board)
        assert sorted(board.pool_runs("pool")) == [
            ("b", "t1", r1, "blocked"),
            ("b", "t1", r3, "running"),
            ("b", "t2", r2, "done"),
        ]
        runs = board.list_runs("b", ["t1"])
        assert [(r["task_id"], r["run_id"], r["assignee"], r["outcome"]) for r in runs] == [
            ("t1", r1, "pool", "blocked"),
            ("t1", r3, "pool", "running"),
        ]
        assert board.list_runs("b", []) == []

    # --- search (optional: checked when the backend offers it) -------------------------------

    def test_search_finds_a_piece_of_a_title_or_body_in_any_case_newest_first(self, board: Board) -> None:
        board.add_task("b", "Rotate the TLS certificates", "on every proxy", task_id="t1")
        board.add_task("b", "Renew certs", "ask the vault for new Certificates", task_id="t2")
        board.add_task("c", "Unrelated", "nothing here", task_id="t3")
        assert found(board, "certificate") == [("b", "t2"), ("b", "t1")]
        assert found(board, "  PROXY ") == [("b", "t1")]
        assert found(board, "ificat", limit=1) == [("b", "t2")]
        assert found(board, "nothing here") == [("c", "t3")]
        assert found(board, "no such words") == []

    def test_search_takes_every_character_literally(self, board: Board) -> None:
        board.add_task("b", "50% off", task_id="t1")
        board.add_task("b", "500 off", task_id="t2")
        board.add_task("b", "a_b", 'say "hi" AND NEAR(x, y) OR *', task_id="t3")
        board.add_task("b", "axb", "say hi", task_id="t4")
        assert found(board, "50%") == [("b", "t1")]
        assert found(board, "a_b") == [("b", "t3")]
        for hostile in ('"hi" AND', "NEAR(x", "OR *", '"', "AND", "'; --", "\\%_"):
            assert set(found(board, hostile + "...")) <= {("b", "t3")}  # never a syntax error
        assert found(board, '"hi" AND NEAR(x, y)') == [("b", "t3")]

    def test_search_follows_every_write(self, board: Board, second_handle: Board) -> None:
        board.add_task("b", "deploy the canary", task_id="t1")
        assert found(second_handle, "canary") == [("b", "t1")]
        board.delete_task("b", "t1")
        assert found(second_handle, "canary") == []

    @pytest.mark.parametrize(
        ("text", "problem"),
        [("", "empty"), ("   ", "empty"), ("ab", "too short"), ("x" * (SEARCH_MAX_CHARS + 1), "too long")],
    )
    def test_search_refuses_text_it_cannot_take_in_one_line(
        self, board: Board, text: str, problem: str
    ) -> None:
        found(board, "can it search at all")
        with pytest.raises(InvalidInput, match=rf"^q: {problem}"):
            search_tasks(board, text)
