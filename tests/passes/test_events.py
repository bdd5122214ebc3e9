"""Events: what makes work due asks for its pass's scan at once, coalesced by a flag per pass.

The events' Redis here is fakeredis (a unit test of the flags and the list); the real thing runs
in tests/plane/test_events.py with a redis-server, Celery workers, ``serve`` and pool workers.
"""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import pytest

from board import Board, FlakyBoard
from core.settings import Settings
from tasks import events as ev
from tasks.declaration import Outcome
from tasks.events import Events
from tasks.plane import Plane
from tests.factories import dispatched, scanned


@pytest.fixture
def hints(plane: Plane) -> Events:
    """The plane's events on a fake Redis of their own (the plane's coordination stays in-process)."""
    plane.events = Events(fakeredis.FakeRedis(), plane.settings)
    return plane.events


def pushed(events: Events) -> list[dict[str, Any]]:
    assert events.client is not None
    return [json.loads(e) for e in events.client.lrange(ev.events_key(events.namespace), 0, -1)]


def test_a_thousand_adds_ask_for_one_dispatch(hints: Events) -> None:
    for _ in range(1000):
        hints.scan_due("materialize")
    assert pushed(hints) == [{"scan": "materialize"}]
    assert hints.asked("materialize")


def test_a_scan_takes_its_flag_so_the_next_event_asks_again(plane: Plane, hints: Events) -> None:
    hints.scan_due("results")
    scanned(plane, "results")  # takes the flag as it starts reading
    assert not hints.asked("results")
    hints.scan_due("results")
    assert pushed(hints) == [{"scan": "results"}, {"scan": "results"}]


def test_a_task_added_while_dispatch_claims_is_claimed_by_the_same_dispatch(
    plane: Plane, kanban: Board, hints: Events
) -> None:
    # Given a board on which a task is added (and its event sent) while dispatch claims
    kanban.add_task("b", "first", task_id="t0")

    class AddsMeanwhile(FlakyBoard):
        calls = 0

        def claim_ready(self, *args: Any, **kwargs: Any) -> Any:
            claims = super().claim_ready(*args, **kwargs)
            AddsMeanwhile.calls += 1
            if AddsMeanwhile.calls == 1:
                kanban.add_task("b", "second", task_id="t1")
                hints.scan_due("materialize")
            return claims

    plane.board = AddsMeanwhile(kanban)
    # When one dispatch runs, Then it went round again and claimed the second task too
    assert sorted(c["task_id"] for c in dispatched(plane)) == ["t0", "t1"]
    assert AddsMeanwhile.calls == 2


def test_an_idle_dispatch_claims_once_and_stops(plane: Plane, kanban: Board, hints: Events) -> None:
    kanban.add_task("b", "only", task_id="t0")
    hints.scan_due("materialize")
    assert [c["task_id"] for c in dispatched(plane)] == ["t0"]
    assert not hints.asked("materialize")  # taken: the next add asks again


def test_a_dispatch_with_no_free_ordinal_leaves_the_flag_for_a_freed_one(
    plane: Plane, kanban: Board, hints: Events
) -> None:
    # Given every ordinal reserved for claims in flight, and a task added with its event
    for i in range(plane.settings.pool_size):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    assert len(dispatched(plane)) == plane.settings.pool_size
    kanban.add_task("b", "waits", task_id="w")
    hints.scan_due("materialize")
    # When dispatch finds no ordinal free, Then the flag stands: more adds send nothing more
    assert dispatched(plane) == []
    assert hints.asked("materialize")
    hints.scan_due("materialize")
    assert pushed(hints) == [{"scan": "materialize"}]
    # But a freed ordinal always sends a dispatch
    hints.scan_due("materialize", force=True)
    assert pushed(hints) == [{"scan": "materialize"}] * 2


@pytest.mark.parametrize("outcome", [Outcome.FINALIZED, Outcome.STALE, Outcome.LEASE_FAILED])
def test_a_freed_ordinal_sends_a_dispatch_even_when_one_was_asked(hints: Events, outcome: Outcome) -> None:
    hints.scan_due("materialize")
    ev.after_batch(hints, None, [(7, outcome)], pool_size=3)
    assert pushed(hints) == [{"scan": "materialize"}] * 2


def test_outcomes_that_free_nothing_send_nothing(hints: Events) -> None:
    ev.after_batch(hints, None, [(7, Outcome.CURRENT), (8, Outcome.NOTHING), (9, Outcome.LOCK_BUSY)], 3)
    assert pushed(hints) == []


def test_an_added_claim_and_a_reoffered_row_wake_their_ordinals(hints: Events) -> None:
    assert hints.client is not None
    sub = hints.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    sub.subscribe(ev.assigned_channel(hints.namespace))
    ev.after_batch(hints, lambda claim: claim["ordinal"], [({"ordinal": 2}, Outcome.ADDED)], pool_size=3)
    ev.after_batch(hints, None, [(5, Outcome.REOFFERED)], pool_size=3)  # its ordinal is not in the key
    got = [m["data"] for m in (sub.get_message(timeout=0.1) for _ in range(5)) if m is not None]
    assert got == [b"2", b"0,1,2"]


def test_events_without_redis_change_nothing(plane: Plane, kanban: Board) -> None:
    # The in-process plane has no events: dispatch takes no flag and goes round once, as beat's tick
    kanban.add_task("b", "t", task_id="t")
    assert plane.events.client is None
    assert [c["task_id"] for c in dispatched(plane)] == ["t"]


def test_a_redis_that_is_away_costs_the_producer_nothing_and_no_error(settings: Settings) -> None:
    away = Events.from_settings(settings, "redis://127.0.0.1:1/0")  # nothing listens on port 1
    away.scan_due("results")  # logged at debug, not raised
    assert away._quiet_until > 0  # and the next calls within QUIET_SECONDS do not try
    away.scan_due("results")
