"""The maintenance passes as plain functions: real SQLite store and board, fixed clock, local locks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from board import Board, FlakyBoard, TaskStatus
from core import db
from core.errors import CorruptRow, TransientError
from core.isolate import isolate
from store import PoolStore, audit, bookkeeping, queries, transitions
from store.models import RowState
from tasks import failures, registry, runner
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import NOW, OWNER, RowFactory, row_state, scanned
from tests.properties import budget


def dispatched(plane: Plane) -> list[dict[str, Any]]:
    """The claims dispatch handed to materialize this tick."""
    return scanned(plane, "materialize").get("materialize", [])


def claimed(plane: Plane, kanban: Board, n: int = 1, board: str = "b") -> list[int]:
    """Given n tasks claimed by dispatch and materialized: their row ids."""
    for i in range(n):
        kanban.add_task(board, f"task {i}", task_id=f"{board}{i}")
    for claim in scanned(plane, "materialize")["materialize"]:
        assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        return [r.id for r in queries.rows(s)][-n:]


def running_row(plane: Plane, kanban: Board) -> int:
    [row] = claimed(plane, kanban)
    ordinal = row_state(plane.store, row)["ordinal"]
    assert plane.store.offer(ordinal, owner=OWNER, now=NOW) is not None
    return row


def past_lease(plane: Plane) -> float:
    return NOW + plane.settings.lease_seconds + 1


# --- dispatch and materialize ---------------------------------------------------


def test_dispatch_claims_no_more_than_free_ordinals(plane: Plane, kanban: Board) -> None:
    for i in range(5):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    claims = dispatched(plane)
    assert sorted(c["ordinal"] for c in claims) == [0, 1, 2]
    assert dispatched(plane) == []  # the ordinals are reserved for the claims in flight
    assert kanban.counts_by_status()["ready"] == 2


def test_dispatch_surfaces_a_programming_error(plane: Plane) -> None:
    class ChangedBoard(FlakyBoard):
        def claim_ready(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError("claim_ready() got an unexpected keyword 'lane'")

    plane.board = ChangedBoard(plane.board)
    with pytest.raises(AttributeError):
        dispatched(plane)
    assert plane.coord.reserve(range(3)) == [0, 1, 2], "reservations were released"


def test_dispatch_absorbs_a_busy_board(plane: Plane, kanban: Board) -> None:
    kanban.add_task("b", "t", task_id="t")
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    assert dispatched(plane) == []
    assert kanban.counts_by_status()["ready"] == 1


@pytest.mark.parametrize(
    ("body", "lane", "outcome", "status", "kind"),
    [
        ("plain text", "pool", "added", TaskStatus.RUNNING, None),
        ('{"api_token": "s3cr3t"}', "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ("{not json", "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ("x" * 70_000, "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ('{"a":' * 63 + "1" + "}" * 63, "pool", "added", TaskStatus.RUNNING, None),  # 64 with the payload
        ('{"a":' * 64 + "1" + "}" * 64, "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ('{"a":' * 5000 + "1" + "}" * 5000, "pool", "parked", TaskStatus.BLOCKED, "capability"),
    ],
)
def test_materialize_parks_only_runs_that_cannot_be_served(
    plane: Plane,
    kanban: Board,
    engine_of: Callable[[Board], Engine],
    body: str,
    lane: str,
    outcome: str,
    status: TaskStatus,
    kind: str | None,
) -> None:
    kanban.add_task("b", "t", task_id="t", lane=lane)
    with engine_of(kanban).begin() as conn:  # another writer stores a body that add_task refuses
        conn.execute(text("UPDATE tasks SET body = :body WHERE id = 't'"), {"body": body})
    [claim] = dispatched(plane)
    assert runner.run_key(plane, "materialize", claim, NOW) == outcome
    task = kanban.get_task("b", "t")
    assert task is not None and task.status is status and task.block_kind == kind
    with plane.store.session() as s:
        assert sum(queries.counts_by_state(s).values()) == (1 if outcome == "added" else 0)


def test_materialize_of_a_vanished_moved_or_duplicate_claim_changes_nothing(
    plane: Plane, kanban: Board
) -> None:
    for t in ("gone", "moved", "dup"):
        kanban.add_task("b", t, task_id=t)
    claims = {c["task_id"]: c for c in dispatched(plane)}
    kanban.delete_task("b", "gone")
    kanban.reassign_task("b", "moved", assignee="alice", lane="humans")
    assert runner.run_key(plane, "materialize", claims["gone"], NOW) == "vanished"
    assert runner.run_key(plane, "materialize", claims["moved"], NOW) == "moved_on"
    assert runner.run_key(plane, "materialize", claims["dup"], NOW) == "added"
    assert runner.run_key(plane, "materialize", claims["dup"], NOW) == "duplicate"
    assert kanban.get_task("b", "moved").status is TaskStatus.RUNNING  # type: ignore[union-attr]


def test_materialize_never_calls_a_claim_whose_identity_already_ended_a_duplicate(
    plane: Plane, kanban: Board, make_row: RowFactory
) -> None:
    kanban.add_task("b", "x", task_id="t")
    [claim] = dispatched(plane)
    ended = make_row(
        RowState.FINALIZED, board="b", task_id="t", run_id=claim["run_id"], ordinal=claim["ordinal"]
    )
    assert runner.run_key(plane, "materialize", claim, NOW) == "deferred"
    assert kanban.get_task("b", "t").status is TaskStatus.RUNNING  # type: ignore[union-attr]
    with plane.store.session() as s:
        assert [r.id for r in queries.rows(s)] == [ended]


def test_materialize_on_a_taken_ordinal_takes_another_free_one(plane: Plane, kanban: Board) -> None:
    # Given a claim whose reservation was lost (Redis restarted) and whose ordinal a row now holds
    [row] = claimed(plane, kanban)
    kanban.add_task("b", "late", task_id="late")
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    taken = row_state(plane.store, row)["ordinal"]
    job = {"board": "b", "task_id": "late", "run_id": claim.run_id, "ordinal": taken}
    # When it runs: its row is added on another free ordinal at once, not left to reconcile
    assert runner.run_key(plane, "materialize", job, NOW) == "added"
    with plane.store.session() as s:
        ordinals = sorted(r.ordinal for r in queries.rows(s))
    assert len(set(ordinals)) == 2 and taken in ordinals
    assert plane.coord.reserve(range(3)) == [0, 1, 2], "the other ordinal's reservation was released"


def test_materialize_on_a_taken_ordinal_with_none_free_waits_for_it_without_touching_the_board(
    plane: Plane, kanban: Board
) -> None:
    rows = claimed(plane, kanban, n=3)  # every ordinal holds a live row
    kanban.add_task("b", "late", task_id="late")
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    taken = row_state(plane.store, rows[0])["ordinal"]
    assert plane.coord.reserve([taken]) == [taken]
    job = {"board": "b", "task_id": "late", "run_id": claim.run_id, "ordinal": taken}
    with pytest.raises(TransientError, match="none is free"):  # retried, its reservation kept
        runner.run_key(plane, "materialize", job, NOW)
    assert plane.coord.reserve([taken]) == [], "still reserved for the claim"
    assert kanban.get_task("b", "late").status is TaskStatus.RUNNING  # type: ignore[union-attr]


def test_an_orphan_waits_first_in_line_on_a_busy_ordinal_and_new_claims_never_starve_it(
    plane: Plane, kanban: Board
) -> None:
    # Given every ordinal busy and a claimed run with no row (its message was lost)
    claimed(plane, kanban, n=3)
    kanban.add_task("b", "orphan", task_id="orphan")
    kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    kanban.add_task("b", "new", task_id="new")
    # When reconcile hands it over: on a busy ordinal, where it waits
    [orphan] = scanned(plane, "reconcile")["materialize"]
    with pytest.raises(TransientError):
        runner.run_key(plane, "materialize", orphan, NOW)
    # and that ordinal's row ends: dispatch cannot take it for the new task
    with plane.store.session() as s:
        [busy] = [r for r in queries.rows(s) if r.ordinal == orphan["ordinal"]]
    kanban.reassign_task("b", busy.task_id, assignee="alice", lane="humans")
    assert runner.run_key(plane, "reconcile", busy.id, NOW) == "stale"
    assert dispatched(plane) == []
    # Then the orphan's retry gets its row there
    assert runner.run_key(plane, "materialize", orphan, NOW) == "added"
    with plane.store.session() as s:
        assert [r.ordinal for r in queries.rows(s) if r.task_id == "orphan"] == [orphan["ordinal"]]


def test_a_claim_retried_after_a_busy_board_keeps_its_ordinal_and_gets_its_row(
    plane: Plane, kanban: Board
) -> None:
    # Given a claim whose materialize met a busy board (a transient failure: it is retried)
    kanban.add_task("b", "first", task_id="first")
    [claim] = dispatched(plane)
    healthy, plane.board = plane.board, FlakyBoard(kanban, busy_rate=0.999999)
    with pytest.raises(TransientError):
        runner.run_key(plane, "materialize", claim, NOW)
    plane.board = healthy
    # When dispatch claims for the free ordinals meanwhile, and those claims get their rows
    for i in range(3):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    others = dispatched(plane)
    assert claim["ordinal"] not in {c["ordinal"] for c in others}, "its ordinal is still promised to it"
    assert len(others) == 2
    for c in others:
        assert runner.run_key(plane, "materialize", c, NOW) == "added"
    # Then its retry gets its row on its own ordinal, not deferred to the next reconcile
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        assert sorted(r.ordinal for r in queries.rows(s)) == [0, 1, 2]


def test_a_claim_whose_retries_ran_out_gives_its_ordinal_back(plane: Plane, kanban: Board) -> None:
    kanban.add_task("b", "t", task_id="t")
    [claim] = dispatched(plane)
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    p = registry.get("materialize")
    try:
        runner.run_key(plane, "materialize", claim, NOW)
    except TransientError as err:
        failures.give_up(plane, p, claim, err, NOW)
    assert plane.coord.reserve([claim["ordinal"]]) == [claim["ordinal"]], "reconcile may hand it over"


def test_a_claim_whose_lock_is_busy_gives_its_reservation_back_and_changes_nothing(
    plane: Plane, kanban: Board
) -> None:
    # Given a claim on its reserved ordinal whose lock another (dead or duplicate) holder has
    kanban.add_task("b", "t", task_id="t")
    [claim] = dispatched(plane)
    plane.coord.lock_many([registry.get("materialize").lock_name(claim)])
    # When its message runs: lock busy, and the ordinal is free for the next claim
    assert runner.run_key(plane, "materialize", claim, NOW) == "lock_busy"
    assert plane.coord.reserve([claim["ordinal"]]) == [claim["ordinal"]]
    with plane.store.session() as s:
        assert queries.rows(s) == []


def test_an_unreadable_row_is_seen_by_the_operator_and_freed_by_the_boards_word(
    plane: Plane, kanban: Board
) -> None:
    [row] = claimed(plane, kanban)
    with plane.store.session() as s:
        s.execute(text("UPDATE assignments SET payload = '{broken' WHERE id = :i"), {"i": row})
    with pytest.raises(CorruptRow, match=f"row {row}"):
        plane.store.offer(row_state(plane.store, row)["ordinal"], owner=OWNER, now=NOW)
    assert "payload" in row_state(plane.store, row)["last_error"]
    kanban.cancel_task("b", "b0")  # what an operator does with a run the pool cannot serve
    assert maintain_once(plane, NOW)["reconcile"] == {"stale": 1}
    assert row_state(plane.store, row)["state"] == "stale"
    with plane.store.session() as s:
        assert queries.free_ordinals(s, plane.settings.pool_size) == [0, 1, 2]


# --- expire ----------------------------------------------------------------------


def test_expire_reoffers_then_fails_after_the_last_attempt(plane: Plane, kanban: Board) -> None:
    row = running_row(plane, kanban)
    t = NOW
    for attempt in range(1, plane.settings.max_attempts + 1):
        t += plane.settings.lease_seconds + 1
        expected = "reoffered" if attempt < plane.settings.max_attempts else "lease_failed"
        assert runner.run_key(plane, "expire", row, t) == expected
        if expected == "reoffered":
            assert plane.store.offer(row_state(plane.store, row)["ordinal"], owner=OWNER, now=t) is not None
    got = row_state(plane.store, row)
    assert got["state"] == "lease_failed" and got["attempt"] == plane.settings.max_attempts


def test_expire_leaves_a_live_lease_alone(plane: Plane, kanban: Board) -> None:
    row = running_row(plane, kanban)
    lease_until = row_state(plane.store, row)["lease_until"]
    assert runner.run_key(plane, "expire", row, lease_until) == "lost_race"
    assert row_state(plane.store, row)["state"] == "running"


def test_the_expire_scanner_finds_every_due_row_while_workers_finish_earlier_pages(
    plane: Plane, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, lease_until=NOW - 10 + i) for i in range(7)]
    paged = replace(plane, settings=replace(plane.settings, scan_limit=2))
    submitted: list[int] = []

    def done_at_once(pass_name: str, keys: Sequence[int]) -> list[int]:  # before the next page is read
        submitted.extend(keys)
        with plane.store.session() as s:
            transitions.expire_many(s, keys, max_attempts=plane.settings.max_attempts, now=NOW)
        return list(keys)

    assert registry.get("expire").find(paged, NOW, done_at_once) == 7
    assert submitted == rows  # oldest lease first, none skipped, none twice


# --- recover lease failure -------------------------------------------------------


def lease_failed_row(plane: Plane, kanban: Board) -> int:
    row = running_row(plane, kanban)
    with plane.store.session() as s:
        s.execute(text("UPDATE assignments SET state='lease_failed', attempt=3 WHERE id=:i"), {"i": row})
    return row


def test_lease_failure_parks_the_exact_run_then_finalizes(plane: Plane, kanban: Board) -> None:
    row = lease_failed_row(plane, kanban)
    assert runner.run_key(plane, "lease_failures", row, NOW) == "finalized"
    task = kanban.get_task("b", "b0")
    assert task is not None and task.status is TaskStatus.BLOCKED
    assert (task.block_kind, task.block_reason) == ("transient", "lease expired after 3 fenced attempts")


@pytest.mark.parametrize(
    ("board_move", "expected"),
    [
        ("delete", "stale"),
        ("reassign", "stale"),
        ("cancel", "finalized"),
    ],
)
def test_lease_failure_settles_on_the_boards_evidence(
    plane: Plane, kanban: Board, board_move: str, expected: str
) -> None:
    row = lease_failed_row(plane, kanban)
    moves: dict[str, Callable[[], object]] = {
        "delete": lambda: kanban.delete_task("b", "b0"),
        "reassign": lambda: kanban.reassign_task("b", "b0", assignee="bob", lane="pool"),
        "cancel": lambda: kanban.cancel_task("b", "b0"),
    }
    moves[board_move]()
    assert runner.run_key(plane, "lease_failures", row, NOW) == expected
    assert row_state(plane.store, row)["state"] == expected


def test_busy_board_keeps_the_row_lease_failed_and_never_collected(plane: Plane, kanban: Board) -> None:
    row = lease_failed_row(plane, kanban)
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    with pytest.raises(TransientError):
        runner.run_key(plane, "lease_failures", row, NOW)
    runner.run_key(plane, "gc", "all", NOW + 10 * plane.settings.retention_seconds)
    assert row_state(plane.store, row)["state"] == "lease_failed"
    plane.board = kanban  # the board answers again
    assert runner.run_key(plane, "lease_failures", row, NOW) == "finalized"


# --- recover result ---------------------------------------------------------------


def deliver(plane: Plane, row: int, payload: dict[str, Any]) -> None:
    r = row_state(plane.store, row)
    plane.store.accept_result(
        {
            "delivery_id": f"r{row}",
            "board": r["board"],
            "task_id": r["task_id"],
            "run_id": r["run_id"],
            "worker_ordinal": r["ordinal"],
            "attempt": r["attempt"],
            "fence": r["fence"],
            "payload_digest": r["payload_digest"],
            "payload": payload,
        },
        now=NOW,
    )


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        ({"status": "done", "answer": 42}, TaskStatus.DONE),
        ({"status": "blocked", "reason": "needs a human"}, TaskStatus.BLOCKED),
    ],
)
def test_result_is_applied_to_the_exact_run_and_replay_is_harmless(
    plane: Plane, kanban: Board, payload: dict[str, Any], status: TaskStatus
) -> None:
    row = running_row(plane, kanban)
    deliver(plane, row, payload)
    assert runner.run_key(plane, "results", row, NOW) == "finalized"
    task = kanban.get_task("b", "b0")
    assert task is not None and task.status is status
    assert runner.run_key(plane, "results", row, NOW) == "lost_race"  # replay: nothing twice


def test_crash_between_board_and_store_is_recovered_as_finalized(plane: Plane, kanban: Board) -> None:
    row = running_row(plane, kanban)
    deliver(plane, row, {"status": "done"})
    assert kanban.complete_task("b", "b0", 1, {"status": "done"})  # the board write landed, then a crash
    assert runner.run_key(plane, "results", row, NOW) == "finalized"


def test_poisoned_result_is_quarantined_and_others_go_on(
    plane: Plane, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    rows = claimed(plane, kanban, 3)
    for row in rows:
        assert plane.store.offer(row_state(plane.store, row)["ordinal"], owner=OWNER, now=NOW) is not None
        deliver(plane, row, {"status": "done"})
    poisoned = rows[1]
    with plane.store.session() as s:
        s.execute(text("UPDATE assignments SET result='{broken' WHERE id=:i"), {"i": poisoned})
    caplog.set_level(logging.INFO, "poolkeeper")
    outcomes = [runner.run_batch(plane, "results", rows, NOW).outcomes for _ in range(3)]
    assert outcomes[0] == {"finalized": 2, "failed": 1}
    assert outcomes[2] == {"lost_race": 2, "quarantined": 1}
    got = row_state(plane.store, poisoned)
    assert got["state"] == "result" and got["quarantined"] and "JSONDecodeError" in got["last_error"]
    failure_lines = [r for r in caplog.records if "JSONDecodeError" in r.getMessage()]
    assert len(failure_lines) == 1, "an unchanged failure is reported once"
    quarantine = [r.getMessage() for r in caplog.records if "quarantined after" in r.getMessage()]
    assert quarantine == [f"results row {poisoned} quarantined after 3 failures in a row (poolctl requeue)"]


# --- reconcile ---------------------------------------------------------------------


def test_reconcile_hands_moved_runs_to_itself_and_orphans_to_materialize(plane: Plane, kanban: Board) -> None:
    [row] = claimed(plane, kanban)
    kanban.reassign_task("b", "b0", assignee="alice", lane="humans")
    kanban.add_task("b", "orphan", task_id="orphan")
    kanban.add_task("b", "human", task_id="human", lane="humans")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")  # claimed; the materialize never came
    kanban.claim_ready(5, assignee="poolkeeper", lane="humans")  # not the pool's lane: never adopted
    queued = scanned(plane, "reconcile")
    assert queued["reconcile"] == [row]
    [claim] = queued["materialize"]
    assert (claim["task_id"], claim["run_id"]) == ("orphan", 1)
    assert runner.run_key(plane, "reconcile", row, NOW) == "stale"
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    assert row_state(plane.store, row)["state"] == "stale"
    with plane.store.session() as s:
        live = [(r.task_id, r.attempt) for r in queries.rows(s, state=RowState.ASSIGNED)]
    assert live == [("orphan", 1)]
    assert scanned(plane, "reconcile") == {}


def test_reconcile_leaves_a_row_whose_run_the_board_still_runs(plane: Plane, kanban: Board) -> None:
    [row] = claimed(plane, kanban)
    assert runner.run_key(plane, "reconcile", row, NOW) == "current"
    assert row_state(plane.store, row)["state"] == "assigned"


def test_reconcile_never_adopts_a_run_that_has_a_row_in_any_state(plane: Plane, kanban: Board) -> None:
    row = lease_failed_row(plane, kanban)
    assert scanned(plane, "reconcile") == {}
    assert row_state(plane.store, row)["state"] == "lease_failed"


def test_an_orphan_the_board_cannot_read_alone_still_gets_a_row(plane: Plane, kanban: Board) -> None:
    """Reconcile's claim carries the task as the board listed it: a row stands for the run."""
    kanban.add_task("b", "x", task_id="bad")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")
    plane.board = FlakyBoard(kanban, poison=frozenset({"bad"}))
    [claim] = scanned(plane, "reconcile")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        assert [(r.task_id, r.state) for r in queries.rows(s)] == [("bad", "assigned")]


def test_a_claim_the_board_cannot_read_alone_gets_its_row_at_once(plane: Plane, kanban: Board) -> None:
    """Not a reconcile interval later: the board's listing is the evidence reconcile would use."""
    kanban.add_task("b", "x", task_id="bad")
    [claim] = dispatched(plane)
    plane.board = FlakyBoard(kanban, poison=frozenset({"bad"}))
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        assert [(r.task_id, r.ordinal, r.state) for r in queries.rows(s)] == [
            ("bad", claim["ordinal"], "assigned")
        ]


def test_reconcile_adopts_orphans_of_archived_boards(plane: Plane, kanban: Board) -> None:
    kanban.add_task("old", "x", task_id="x")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")
    kanban.archive_board("old")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 1}


def test_one_failing_board_does_not_stop_the_next(
    plane: Plane, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    kanban.add_task("bad", "x", task_id="x")
    kanban.add_task("good", "y", task_id="y")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")

    class OneBoardDown(FlakyBoard):
        def running_tasks(self, board: str) -> Any:
            if board == "bad":
                raise RuntimeError("bad board's index is corrupt")
            return super().running_tasks(board)

    plane.board = OneBoardDown(kanban)
    caplog.set_level(logging.WARNING, "poolkeeper")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 1}
    maintain_once(plane, NOW)
    reports = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(reports) == 1 and reports[0].levelno == logging.ERROR, "reported once, as a bug"


def test_a_task_deleted_and_added_again_gets_new_run_ids_and_wedges_nothing(
    plane: Plane, kanban: Board
) -> None:
    row = running_row(plane, kanban)
    deliver(plane, row, {"status": "done"})
    assert maintain_once(plane, NOW)["results"] == {"finalized": 1}
    kanban.delete_task("b", "b0")
    kanban.add_task("b", "same id again", task_id="b0")
    kanban.add_task("b", "a neighbour", task_id="n")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 2}
    with plane.store.session() as s:
        got = sorted((r.task_id, r.run_id, r.state) for r in queries.rows(s))
    assert got == [("b0", 1, "finalized"), ("b0", 2, "assigned"), ("n", 1, "assigned")]


def test_a_corrupt_result_on_one_task_never_hides_an_orphan_of_its_board(
    plane: Plane, kanban: Board, engine_of: Callable[[Board], Engine]
) -> None:
    kanban.add_task("b", "x", task_id="corrupt")
    kanban.add_task("b", "y", task_id="healthy")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")  # claimed; the materialize never came
    with engine_of(kanban).begin() as conn:
        conn.execute(text("UPDATE tasks SET result = '{broken' WHERE id = 'corrupt'"))
    queued = scanned(plane, "reconcile")
    assert sorted(c["task_id"] for c in queued["materialize"]) == ["corrupt", "healthy"]
    for claim in queued["materialize"]:
        assert runner.run_key(plane, "materialize", claim, NOW) == "added"


def test_maintain_once_runs_a_claim_to_the_board(plane: Plane, kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="x")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 1}
    offer = plane.store.offer(0, owner=OWNER, now=NOW)
    assert offer is not None
    row = offer.row_id
    deliver(plane, row, {"status": "done"})
    assert maintain_once(plane, NOW)["results"] == {"finalized": 1}
    assert kanban.get_task("b", "x").status is TaskStatus.DONE  # type: ignore[union-attr]


def test_reporter_logs_each_distinct_detail_once_with_bounded_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rep = failures.Reporter(size=2)
    caplog.set_level(logging.INFO, "poolkeeper")
    for detail in ["a", "a", "b", "b", "a"]:
        rep.once("expire", "1", detail)
    for key in "234":
        rep.once("expire", key, "x")
    assert [r.getMessage() for r in caplog.records][:3] == ["expire 1: a", "expire 1: b", "expire 1: a"]
    assert len(rep._seen) == 2


# --- store-only batches ------------------------------------------------------------

POISON_SQL = {
    "sqlite": [
        "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments WHEN OLD.task_id LIKE 'poison%'"
        " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
    ],
    "postgresql": [
        "CREATE OR REPLACE FUNCTION poison() RETURNS trigger AS $$ BEGIN"
        " IF OLD.task_id LIKE 'poison%' THEN RAISE EXCEPTION 'poisoned row'; END IF;"
        " RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments FOR EACH ROW EXECUTE FUNCTION poison()",
    ],
}


# The same poison in the statement after the transition: the expired row's audit event
# (only that one, so the failure is still recorded on the row).
POISON_EVENT_SQL = {
    "sqlite": [
        "CREATE TRIGGER poison BEFORE INSERT ON audit_events WHEN NEW.kind = 'expiry'"
        " AND (SELECT task_id FROM assignments WHERE id = NEW.row_id) LIKE 'poison%'"
        " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
    ],
    "postgresql": [
        "CREATE OR REPLACE FUNCTION poison() RETURNS trigger AS $$ BEGIN"
        " IF NEW.kind = 'expiry' AND (SELECT task_id FROM assignments WHERE id = NEW.row_id) LIKE 'poison%'"
        " THEN RAISE EXCEPTION 'poisoned row'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER poison BEFORE INSERT ON audit_events FOR EACH ROW EXECUTE FUNCTION poison()",
    ],
}


@pytest.mark.parametrize(
    ("poison", "table"), [(POISON_SQL, "assignments"), (POISON_EVENT_SQL, "audit_events")]
)
def test_a_store_only_batch_splits_around_its_poisoned_rows(
    plane: Plane, make_row: Any, poison: dict[str, list[str]], table: str
) -> None:
    """One set statement for the batch; where it fails, in parts, until the poisoned rows stand alone.

    Whichever of the pass's statements fails (the transition or its audit event), the
    poisoned row is left exactly as it was: no half of its transition commits.
    """
    poisoned = {3, 4, 11}
    names = [f"{'poison' if i in poisoned else 'ok'}{i}" for i in range(16)]
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=t, lease_until=1.0) for i, t in enumerate(names)]
    rows.append(make_row(RowState.ASSIGNED, ordinal=16))  # not running: lost its race
    with plane.store.session() as s:
        dialect = s.get_bind().dialect.name
        for sql in poison[dialect]:
            s.execute(text(sql))
    try:
        outcomes = runner.run_batch(plane, "expire", rows, NOW).outcomes
    finally:
        with plane.store.session() as s:
            on_table = "" if dialect == "sqlite" else f" ON {table}"
            s.execute(text(f"DROP TRIGGER IF EXISTS poison{on_table}"))
    assert outcomes == {"reoffered": 13, "failed": 3, "lost_race": 1}
    for i, row in enumerate(rows[:16]):
        got = row_state(plane.store, row)
        with plane.store.session(readonly=True) as s:
            kinds = [e["kind"] for e in audit.history(s, row)]
        if i in poisoned:
            assert (got["state"], got["failures"]) == ("running", 1) and "poisoned row" in got["last_error"]
            assert "expiry" not in kinds
        else:
            assert (got["state"], got["attempt"], got["failures"]) == ("assigned", 2, 0)
            assert kinds.count("expiry") == 1


@given(
    n=st.integers(min_value=0, max_value=300),
    poisoned=st.sets(st.integers(min_value=0, max_value=299), max_size=40),
)
@budget(200)
def test_isolate_finds_exactly_the_failing_keys_and_does_every_other_once(n: int, poisoned: set[int]) -> None:
    keys = list(range(n))
    bad = {k for k in poisoned if k < n}
    done: list[int] = []

    def attempt(part: Sequence[int]) -> list[int]:
        if bad & set(part):
            raise ValueError(f"poisoned {sorted(bad & set(part))}")
        done.extend(part)
        return list(part)

    results, failed = isolate(keys, attempt, goes_up=lambda err: False)

    assert [k for k, _ in failed] == sorted(bad)
    assert all(str(k) in str(err) for k, err in failed)
    assert [k for part in results for k in part] == [k for k in keys if k not in bad]
    assert done == [k for k in keys if k not in bad]  # each healthy key's work done once, in order


def test_isolate_stops_at_an_error_that_goes_up() -> None:
    def attempt(part: Sequence[int]) -> None:
        raise TransientError("store busy") if len(part) < 4 else ValueError("split me")

    with pytest.raises(TransientError, match="store busy"):
        isolate(list(range(64)), attempt, goes_up=lambda err: isinstance(err, TransientError))


def test_a_scattered_poison_is_refused_row_by_row_and_the_rest_expire_with_one_event_each(
    store: PoolStore, make_row: Any
) -> None:
    poisoned = set(range(5, 200, 13))
    rows = [
        make_row(
            RowState.RUNNING, ordinal=i, task_id=f"{'poison' if i in poisoned else 'ok'}{i}", lease_until=1.0
        )
        for i in range(200)
    ]
    with store.session() as s:
        dialect = s.get_bind().dialect.name
        for sql in POISON_SQL[dialect]:
            s.execute(text(sql))
    try:
        with store.session() as s:
            got = transitions.expire_many(s, rows, max_attempts=3, now=NOW, actor="pass:expire")
    finally:
        with store.session() as s:
            s.execute(
                text("DROP TRIGGER IF EXISTS poison" + ("" if dialect == "sqlite" else " ON assignments"))
            )
    bad = {rows[i] for i in poisoned}
    assert set(got.refused) == bad and all("poisoned row" in str(err) for err in got.refused.values())
    assert set(got.moved) == set(rows) - bad
    with store.session(readonly=True) as s:
        for row in rows:
            kinds = [e["kind"] for e in audit.history(s, row)]
            assert kinds.count("expiry") == (row not in bad)
            assert row_state(store, row)["state"] == ("running" if row in bad else "assigned")


def test_a_row_that_rolls_back_the_whole_transaction_leaves_the_batch_unchanged_and_transient(
    plane: Plane, make_row: Any
) -> None:
    """SQLite's RAISE(ROLLBACK) ends the transaction, savepoints and all: no part may go on
    without it (it would commit on its own), so the whole batch comes back transient."""
    if plane.store.engine.dialect.name != "sqlite":
        pytest.skip("only SQLite lets a statement end the transaction it runs in")
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"ok{i}", lease_until=1.0) for i in range(8)]
    rows.append(make_row(RowState.RUNNING, ordinal=8, task_id="poison8", lease_until=1.0))
    with plane.store.session() as s:
        s.execute(
            text(
                "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments WHEN OLD.task_id LIKE 'poison%'"
                " BEGIN SELECT RAISE(ROLLBACK, 'poisoned row'); END"
            )
        )
    result = runner.run_batch(plane, "expire", rows, NOW)

    assert [k for k, _ in result.transient] == rows and not result.done
    assert all("rolled the transaction back" in str(err) for _, err in result.transient)
    assert {row_state(plane.store, row)["state"] for row in rows} == {"running"}
    with plane.store.session(readonly=True) as s:
        assert not [e for row in rows for e in audit.history(s, row) if e["kind"] == "expiry"]


def test_rows_of_a_batch_failing_alike_share_one_line_naming_the_database_error(
    plane: Plane, make_row: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"poison{i}", lease_until=1.0) for i in range(25)]
    with plane.store.session() as s:
        dialect = s.get_bind().dialect.name
        for sql in POISON_SQL[dialect]:
            s.execute(text(sql))
    caplog.set_level(logging.INFO, "poolkeeper")
    try:
        assert runner.run_batch(plane, "expire", rows, NOW).outcomes == {"failed": 25}
    finally:
        with plane.store.session() as s:
            s.execute(
                text("DROP TRIGGER IF EXISTS poison" + ("" if dialect == "sqlite" else " ON assignments"))
            )
    assert not [r for r in caplog.records if r.getMessage().endswith(": failed")]  # no line per row besides
    lines = [r.getMessage() for r in caplog.records if "failed (1 in a row)" in r.getMessage()]
    shown = ", ".join(map(str, rows[:20]))
    assert len(lines) == 1 and lines[0].startswith(f"expire rows {shown} and 5 more failed (1 in a row): ")
    assert "poisoned row" in lines[0] and "[SQL:" not in lines[0]
    error = row_state(plane.store, rows[0])["last_error"]
    assert "poisoned row" in error and "[SQL:" not in error and "sqlalche.me" not in error


@pytest.mark.parametrize("size", [1, 5])
def test_the_time_limit_during_a_batch_statement_ends_the_batch_and_is_no_rows_failure(
    plane: Plane, make_row: Any, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Only the database refusing a row is that row's failure: the worker's time limit going
    off mid-statement is no row's fault, and goes up to end the message."""
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"ok{i}", lease_until=1.0) for i in range(size)]
    real = db.raw

    def raw(conn: Any, sql: str, params: Any) -> list[Any]:
        if sql.startswith("UPDATE assignments"):
            raise SoftTimeLimitExceeded()
        return real(conn, sql, params)

    monkeypatch.setattr(db, "raw", raw)
    with pytest.raises(SoftTimeLimitExceeded):
        runner.run_batch(plane, "expire", rows, NOW, abort=(SoftTimeLimitExceeded,))
    monkeypatch.undo()
    for row in rows:
        got = row_state(plane.store, row)
        assert (got["state"], got["failures"], got["last_error"]) == ("running", 0, None)


def test_a_busy_store_is_asked_once_for_a_batch_of_failures_not_once_per_row(
    plane: Plane, make_row: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"t{i}", lease_until=1.0) for i in range(3)]
    tries: list[list[int]] = []

    def busy(conn: Any, errors: dict[int, str], **_: Any) -> None:
        tries.append(sorted(errors))
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(bookkeeping, "record_failures", busy)
    caplog.set_level(logging.INFO, "poolkeeper")
    got = failures.record(
        plane, registry.get("expire"), [(r, ValueError("x")) for r in rows], NOW, counts=True
    )

    assert got == ["failed"] * 3 and tries == [sorted(rows)]
    lines = [r.getMessage() for r in caplog.records if "unrecorded" in r.getMessage()]
    assert lines == [
        f"expire rows {', '.join(map(str, rows))} failed (unrecorded: pool store: database is locked)"
        ": ValueError: x"
    ]
