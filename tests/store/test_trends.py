"""Trends: the audit trail counted per bucket over a primary-key range (``store.trends``).

Every test runs on SQLite and on PostgreSQL (the ``store`` fixture), at the fixed clock:
events one unit on either side of each bucket's edge and of the window's start.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest
from sqlalchemy import Select, text

from store import PoolStore, audit, transitions, trends
from store.models import EventKind, RowState
from tests.factories import NOW, holder_envelope

K = EventKind
HOUR = trends.HOUR
TASKS = itertools.count()
# the fixed clock's minute starts at LAST; the window's first bucket at START
LAST = NOW // 60 * 60
START = LAST - 59 * 60


def write(store: PoolStore, *events: tuple[float, EventKind, str | None, str | None], row: int = 1) -> None:
    """Given events ``(at, kind, from, to)`` on ``row``, appended in the order given."""
    with store.session() as s:
        for at, kind, came, went in events:
            audit.append(s, [audit.Event(row, kind, "test", came, went)], now=at)


def hour(store: PoolStore, now: float = NOW, current: dict[str, int] | None = None) -> trends.Trend:
    with store.session(readonly=True) as s:
        return trends.read(s, HOUR, now, current or {})


def test_an_event_counts_in_the_bucket_its_time_falls_in_one_unit_either_side_of_an_edge(
    store: PoolStore,
) -> None:
    edge = START + 30 * 60
    write(
        store,
        (START - 0.001, K.GRANT, "assigned", "running"),  # before the window: not counted
        (START, K.GRANT, "assigned", "running"),  # the first bucket's first instant
        (edge - 0.001, K.FAILURE, "running", "running"),  # bucket 29's last instant
        (edge, K.FAILURE, "running", "running"),  # bucket 30's first
        (NOW, K.SETTLE, "result", "finalized"),  # now: the last bucket
        (NOW, K.ABANDON, "running", "stale"),  # an operator's settle is a settle
        (NOW, K.QUARANTINE, "running", "running"),
    )
    found = hour(store)
    assert len(found.starts) == 60 and found.starts[0] == START and found.starts[-1] == LAST
    assert found.events["grants"][0] == 1 and sum(found.events["grants"]) == 1
    assert found.events["failures"][29] == 1 and found.events["failures"][30] == 1
    assert found.events["failures"][59] == 1 and sum(found.events["failures"]) == 3
    assert found.events["settles"][59] == 2 and sum(found.events["settles"]) == 2


def test_an_hour_with_no_events_is_all_zero_and_rows_hold_their_current_count(store: PoolStore) -> None:
    write(store, (START - 3600, K.GRANT, "assigned", "running"))  # an hour before: nothing in this one
    found = hour(store, current={"running": 2})
    assert all(v == 0 for values in found.events.values() for v in values)
    assert found.rows["running"] == [2] * 60 and found.rows["assigned"] == [0] * 60
    assert found.latency_mean == [None] * 60 and found.latency_max == [None] * 60


def test_an_empty_trail_reads_as_an_empty_window(store: PoolStore) -> None:
    found = hour(store)
    assert sum(found.events["grants"]) == 0 and found.rows["lease_failed"] == [0] * 60


def test_rows_by_state_walk_back_from_now_through_each_buckets_changes(store: PoolStore) -> None:
    """Given a row claimed in bucket 10 and granted in bucket 20, now running: the chart replays it."""
    write(
        store,
        (START + 10 * 60, K.CLAIM, None, "assigned"),
        (START + 15 * 60, K.FAILURE, "assigned", "assigned"),  # no state change: no step
        (START + 20 * 60 + 59.9, K.GRANT, "assigned", "running"),
    )
    found = hour(store, current={"running": 1})
    assert found.rows["assigned"] == [0] * 10 + [1] * 10 + [0] * 40
    assert found.rows["running"] == [0] * 20 + [1] * 40
    assert found.rows[RowState.RESULT.value] == [0] * 60


def test_re_grant_latency_is_the_wait_from_a_rows_expiry_to_its_next_grant(store: PoolStore) -> None:
    at = START + 40 * 60 + 10
    write(store, (at - 100, K.GRANT, "assigned", "running"), row=1)
    write(store, (at, K.EXPIRY, "running", "assigned"), row=1)
    write(store, (at + 2, K.EXPIRY, "running", "lease_failed"), row=2)  # no re-offer: no wait
    write(store, (at + 3, K.GRANT, "assigned", "running"), row=2)
    write(store, (at + 7, K.GRANT, "assigned", "running"), row=1)
    write(store, (at + 20, K.EXPIRY, "running", "assigned"), row=3)
    write(store, (at + 33, K.GRANT, "assigned", "running"), row=3)
    found = hour(store)
    assert found.latency_mean[40] == pytest.approx(10.0) and found.latency_max[40] == pytest.approx(13.0)
    assert [i for i, v in enumerate(found.latency_mean) if v is not None] == [40]


def test_an_event_appended_behind_a_later_stamp_is_still_counted(store: PoolStore) -> None:
    """A writer that waited for the lock appends its earlier stamp after a later one (within the slack)."""
    write(store, (START - 30, K.GRANT, "assigned", "running"), (START + 1, K.GRANT, "assigned", "running"))
    write(store, (START + 0.5 - trends.SLACK_SECONDS / 2, K.GRANT, "assigned", "running"))
    write(store, (START + 2, K.RESULT, "running", "result"), (START - 1, K.RESULT, "running", "result"))
    found = hour(store)
    assert found.events["grants"][0] == 1 and found.events["results"][0] == 1


def test_first_id_finds_the_window_start_across_gaps_in_the_ids(store: PoolStore) -> None:
    rng = random.Random(19)
    times = sorted(rng.uniform(0, 1000) for _ in range(300))
    write(store, *[(t, K.GRANT, "assigned", "running") for t in times])
    with store.session() as s:  # gc took a head, a rollback left holes
        s.execute(text("DELETE FROM audit_events WHERE id <= 20 OR id % 7 = 0"))
    with store.session(readonly=True) as s:
        kept = [(int(i), float(a)) for i, a in s.execute(text("SELECT id, at FROM audit_events ORDER BY id"))]
        for since in [-1.0, 0.0, *rng.sample(times, 40), times[-1], times[-1] + 1]:
            want = next((i for i, a in kept if a >= since), None)
            assert trends.first_id(s, since) == want, since


def claimed(store: PoolStore, ordinal: int, *, ready: float | None, at: float, granted: float) -> int:
    """Given a run through the store's own calls: ready on the board, its row added, granted. Its row id."""
    task = f"t{next(TASKS)}"
    store.add_run(board="b", task_id=task, run_id=1, ordinal=ordinal, payload={}, now=at, ready_at=ready)
    offer = store.offer(ordinal, owner="w", now=granted)
    assert offer is not None
    return offer.row_id


def done(store: PoolStore, row: int, at: float) -> None:
    """Its result accepted at ``at``, and the row settled (its ordinal free again)."""
    store.accept_result(holder_envelope(store, row, f"r{row}", payload={"status": "done"}), now=at)
    with store.session() as s:
        transitions.settle(s, row, RowState.FINALIZED, expect_state="result", expect_attempt=1, now=at)


def some(value: float | None) -> float:
    assert value is not None
    return value


def ran(
    store: PoolStore, ordinal: int, *, ready: float | None, at: float, granted: float, ended: float
) -> int:
    row = claimed(store, ordinal, ready=ready, at=at, granted=granted)
    done(store, row, ended)
    return row


def test_wait_percentiles_are_read_from_each_claims_ready_at_in_its_claims_bucket(store: PoolStore) -> None:
    """Given 100 claims in bucket 30 that waited 0.3 to 99.3 ms since ready, and one in bucket 31 that
    waited 50 minutes: p50/p95/p99 read off the histogram buckets; a claim without ``ready_at`` is not
    counted."""
    at = START + 30 * 60
    for i in range(100):
        ran(store, i % 3, ready=at - (i + 0.3) / 1000, at=at, granted=at + 1, ended=at + 2)
    ran(store, 0, ready=at + 60 - 3000, at=at + 60, granted=at + 61, ended=at + 62)
    ran(store, 1, ready=None, at=at + 120, granted=at + 121, ended=at + 122)  # the board did not say
    found = hour(store)
    p50, p95, p99 = (found.waits[q] for q in ("p50", "p95", "p99"))
    # 50 of the 100 are at most 50 ms, the last 25 of them in (25 ms, 50 ms]: p50 is that bucket's top
    assert (
        p50[30] == pytest.approx(0.05) and p95[30] == pytest.approx(0.095) and p99[30] == pytest.approx(0.099)
    )
    assert 1800 < some(p50[31]) < some(p95[31]) < some(p99[31]) <= 3600  # one claim: within its bucket
    assert [i for i, v in enumerate(p50) if v is not None] == [30, 31]
    assert found.runs["p50"][30] == pytest.approx(0.75)  # each ran 1 s: halfway into (0.5 s, 1 s]


def test_run_percentiles_are_each_results_time_since_the_grant_before_it(store: PoolStore) -> None:
    """A run longer than the window still counts: its grant is found by its row, not in the range."""
    at = START + 45 * 60
    long = claimed(store, 2, ready=None, at=START - 7200, granted=START - 7200)
    with store.session() as s:  # its heartbeats kept the lease all along
        s.execute(text("UPDATE assignments SET lease_until = :far WHERE id = :id"), {"far": NOW, "id": long})
    for i in range(20):
        ran(store, i % 2, ready=at - 5, at=at - 4, granted=at - 3, ended=at)  # 3 s each
    done(store, long, at + 60)  # 2 h 46 min
    found = hour(store)
    assert found.runs["p50"][45] == pytest.approx(3.75) and 3.75 < some(found.runs["p99"][45]) <= 5
    assert 7200 < some(found.runs["p50"][46]) <= 14400
    assert [i for i, v in enumerate(found.runs["p99"]) if v is not None] == [45, 46]
    assert found.waits["p50"][44] == pytest.approx(0.75)  # claimed a minute earlier, each after 1 s


def test_run_seconds_of_a_row_is_its_last_result_since_the_grant_before_it(store: PoolStore) -> None:
    row = ran(store, 2, ready=NOW - 9, at=NOW - 8, granted=NOW - 6.5, ended=NOW)
    with store.session(readonly=True) as s:
        assert trends.run_seconds(s, row) == pytest.approx(6.5)
        assert trends.run_seconds(s, row + 1) is None  # no such row: nothing ran


@pytest.mark.parametrize(
    ("counts", "q", "want"),
    [
        ([0] * 25, 0.5, None),  # nothing counted
        ([4] + [0] * 24, 0.5, 0.0005),  # the first bucket starts at 0
        ([0, 2, 2] + [0] * 22, 0.5, 0.0025),  # the 2nd of 4 ends bucket (0.001, 0.0025]
        ([0, 2, 2] + [0] * 22, 0.75, 0.00375),  # halfway into (0.0025, 0.005]
        ([0] * 24 + [3], 0.99, trends.DURATION_BUCKETS[-1]),  # past the last bound: read as the last
    ],
)
def test_a_quantile_interpolates_within_its_bucket_as_histogram_quantile_does(
    counts: list[int], q: float, want: float | None
) -> None:
    assert len(counts) == len(trends.DURATION_BUCKETS) + 1
    assert trends.quantile(q, counts) == (None if want is None else pytest.approx(want))


def _plan(store: PoolStore, statement: Select[Any]) -> str:
    """The database's plan for ``statement`` (its values inlined)."""
    sql = str(statement.compile(dialect=store.engine.dialect, compile_kwargs={"literal_binds": True}))
    with store.session(readonly=True) as s:
        if store.engine.dialect.name == "sqlite":
            return "\n".join(str(r[-1]) for r in s.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
        s.execute(text("SET LOCAL enable_seqscan = off"))  # an index it can use, it then uses
        return "\n".join(str(r[0]) for r in s.execute(text(f"EXPLAIN {sql}")))


@pytest.mark.parametrize("query", ["counts", "latency", "seek", "waits", "runs"])
def test_each_chart_reads_one_primary_key_range_not_the_table(store: PoolStore, query: str) -> None:
    write(store, *[(NOW - i, K.GRANT, "assigned", "running") for i in range(50)])
    statement = {
        "counts": trends._counts(10, START, 60),
        "latency": trends._latency(10, START, 60),
        "seek": trends._seek(10),
        "waits": trends._waits(10, START, 60),
        "runs": trends._runs(10, START, 60),
    }[query]
    plan = _plan(store, statement)
    if store.engine.dialect.name == "sqlite":
        assert re.search(r"(SEARCH|SCAN) audit_events USING INTEGER PRIMARY KEY \(rowid>\?\)", plan), plan
        assert not re.search(r"SCAN (audit_events|assignments)$", plan, re.M), plan
    else:
        assert "Index Cond: (id >= 10)" in plan and "Seq Scan" not in plan, plan
