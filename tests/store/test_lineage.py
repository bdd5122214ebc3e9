"""Child executions: registered by the holder, refused once stale, retired with the grant.

See docs/design.md, "Lineage".

Every case runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.sql import visitors

from core.errors import (
    DeliveryConflict,
    InvalidInput,
    LineageLive,
    LineageTooDeep,
    NotFound,
    StaleHolder,
)
from store import Child, Offer, PoolStore, lineage, transitions
from store.models import RowState
from tasks.collectors import StoreCollector
from tests.factories import NOW, envelope, given_running, grant, row_state

DONE = {"status": "done"}
LATER = NOW + 1


def children(store: PoolStore, row_id: int | None = None) -> dict[str, dict[str, Any]]:
    where = "" if row_id is None else f" WHERE row_id = {int(row_id)}"
    with store.session(readonly=True) as s:
        got = s.execute(text(f"SELECT * FROM child_executions{where} ORDER BY id")).mappings()
        return {r["id"]: dict(r) for r in got}


def register(store: PoolStore, offer: Offer, under: Child | None = None, now: float = NOW) -> Child:
    return store.register_child(grant(offer, under=None if under is None else under.id), now=now)


def snapshot(store: PoolStore) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    with store.session(readonly=True) as s:
        rows = [dict(r) for r in s.execute(text("SELECT * FROM assignments ORDER BY id")).mappings()]
    return rows, children(store)


# --- ids and the range probe ---------------------------------------------------


def test_a_child_id_is_its_parents_id_plus_child_and_a_random_suffix(store: PoolStore) -> None:
    offer = given_running(store)
    first = register(store, offer)
    nested = register(store, offer, under=first)
    sibling = register(store, offer)

    assert re.fullmatch(rf"run:{offer.row_id}/child:[0-9a-f]{{12}}", first.id)
    assert re.fullmatch(re.escape(first.id) + r"/child:[0-9a-f]{12}", nested.id)
    assert (first.depth, nested.depth, first.epoch, nested.parent_id) == (1, 2, offer.fence, first.id)
    with store.session(readonly=True) as s:
        assert [c.id for c in lineage.descendants(s, f"run:{offer.row_id}")] == sorted(
            [first.id, nested.id, sibling.id]
        )
        assert [c.id for c in lineage.descendants(s, first.id)] == [nested.id]
    assert {c["status"] for c in children(store).values()} == {"registered"}


def test_the_range_holds_exactly_the_descendants(store: PoolStore) -> None:
    """``run:1`` must not reach ``run:10``'s children, nor its own id's neighbours."""
    offer = given_running(store)
    r = offer.row_id
    ids = [f"run:{r}/child:{'a' * 12}", f"run:{r}/child:{'a' * 12}/child:{'b' * 12}"]
    strangers = [f"run:{r}0/child:{'c' * 12}", f"run:{r}/childx", f"run:{r}/child;", f"run:{r}"]
    with store.session() as s:
        for cid in ids + strangers:
            s.execute(
                text(
                    "INSERT INTO child_executions (id, row_id, parent_id, status, epoch, depth,"
                    " created_at, updated_at) VALUES (:id, :r, 'p', 'registered', 1, 1, 0, 0)"
                ).bindparams(id=cid, r=r)
            )
        assert [c.id for c in lineage.descendants(s, f"run:{r}")] == ids


def _plan(store: PoolStore, stmt: Any, **values: Any) -> str:
    """The database's plan for ``stmt``, its bound parameters set to ``values``."""

    def bind(param: Any) -> None:
        if param.key in values:
            param.value, param.required = values[param.key], False

    stmt = visitors.cloned_traverse(stmt, {}, {"bindparam": bind})
    return _plan_sql(
        store, str(stmt.compile(dialect=store.engine.dialect, compile_kwargs={"literal_binds": True}))
    )


def _plan_sql(store: PoolStore, sql: str) -> str:
    """The database's plan for ``sql``, written with its values."""
    explain = "EXPLAIN QUERY PLAN " if store.engine.dialect.name == "sqlite" else "EXPLAIN "
    with store.session(readonly=True) as s:
        return "\n".join(" ".join(str(c) for c in r) for r in s.execute(text(explain + sql)))


def _many_children(store: PoolStore, row_id: int, n: int) -> None:
    with store.session() as s:
        s.execute(
            text(
                "INSERT INTO child_executions (id, row_id, parent_id, status, outcome, epoch, depth,"
                " created_at, updated_at) VALUES (:id, :r, :p, 'terminal', 'retired', 1, 1, 0, 0)"
            ),
            [{"id": f"run:{row_id}/child:{i:012x}", "r": row_id, "p": f"run:{row_id}"} for i in range(n)],
        )
        if store.engine.dialect.name == "postgresql":
            s.execute(text("ANALYZE child_executions"))


def test_all_descendants_are_one_range_probe_on_the_primary_key(store: PoolStore) -> None:
    offer = given_running(store)
    other = given_running(store, ordinal=1, task_id="t2")
    _many_children(store, other.row_id, 5000)  # a big neighbour: a scan would not pay off

    plan = _plan(store, lineage.descendants_query(f"run:{offer.row_id}"))

    if store.engine.dialect.name == "sqlite":
        probe = r"SEARCH child_executions USING (PRIMARY KEY|INDEX sqlite_autoindex_\w+) \(id>\? AND id<\?\)"
        assert re.search(probe, plan), plan
    else:
        assert re.search(r"(Index Scan|Index Only Scan|Bitmap Index Scan) (using|on) pk_\w+", plan), plan
        assert "~~" not in plan and "LIKE" not in plan.upper()


def test_retiring_a_run_without_children_is_one_index_probe(store: PoolStore) -> None:
    offer = given_running(store)
    other = given_running(store, ordinal=1, task_id="t2")
    _many_children(store, other.row_id, 5000)

    pg = store.engine.dialect.name == "postgresql"
    among = f"= ANY('{{{offer.row_id}}}'::bigint[])" if pg else f"IN ({offer.row_id})"  # as db.among
    plan = _plan_sql(store, lineage.RETIRE_RUNS_SQL.format(p=repr(NOW), among=among))

    if store.engine.dialect.name == "sqlite":
        assert re.search(r"SEARCH child_executions USING INDEX ix_\w+_row_id \(row_id=\?\)", plan), plan
    else:
        assert re.search(r"(Index Scan|Index Only Scan|Bitmap Index Scan) (using|on) ix_\w+_row_id", plan), (
            plan
        )


def test_postgres_ids_sort_bytewise_whatever_the_database_locale(store: PoolStore) -> None:
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite compares text bytewise (BINARY) by default")
    with store.session(readonly=True) as s:
        got = s.execute(
            text(
                "SELECT column_name, collation_name FROM information_schema.columns"
                " WHERE table_name = 'child_executions' AND column_name IN ('id', 'parent_id')"
            )
        ).all()
    assert sorted(got) == [("id", "C"), ("parent_id", "C")]


# --- registration --------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "over", "now"),
    [
        ("attempt", {"attempt": 2}, NOW),
        ("fence", {"fence": 999}, NOW),
        ("owner", {"owner": "w-2"}, NOW),
        ("lease", {}, NOW + 31),
    ],
)
def test_only_the_current_holder_registers_and_a_refusal_writes_nothing(
    store: PoolStore, field: str, over: dict[str, Any], now: float
) -> None:
    offer = given_running(store)
    with pytest.raises(StaleHolder, match=rf"^{field}: "):
        store.register_child(grant(offer, **over), now=now)
    assert children(store) == {}


def test_a_run_that_left_running_takes_no_children(store: PoolStore) -> None:
    offer = given_running(store)
    store.accept_result(envelope(offer, "r1", payload=DONE), now=LATER)
    with pytest.raises(StaleHolder, match=r"^state: .* is result, not running"):
        register(store, offer, now=LATER)
    with pytest.raises(NotFound, match="row_id: no row 99"):
        store.register_child(grant(offer, row_id=99), now=LATER)
    assert children(store) == {}


def test_bad_registrations_are_named(store: PoolStore) -> None:
    offer = given_running(store)
    other = given_running(store, ordinal=1, task_id="t2")
    theirs = register(store, other)
    with pytest.raises(InvalidInput, match=r"^under: .* is not a child of row"):
        register(store, offer, under=theirs)
    with pytest.raises(InvalidInput, match=r"^under: expected a child execution id"):
        store.register_child(grant(offer, under="run:1/child:../x"), now=NOW)
    with pytest.raises(InvalidInput, match=r"^colour: unknown field"):
        store.register_child(grant(offer, colour="red"), now=NOW)
    with pytest.raises(NotFound, match=r"^under: no child execution"):
        store.register_child(grant(offer, under=f"run:{offer.row_id}/child:{'0' * 12}"), now=NOW)
    assert list(children(store)) == [theirs.id]


def test_a_key_makes_registering_idempotent_and_no_key_registers_anew(store: PoolStore) -> None:
    offer = given_running(store)
    first = store.register_child(grant(offer, key="step-1"), now=NOW)
    store.child_heartbeat({**first.token(), "receipt": {"seen": 1}}, now=NOW)
    before = children(store)

    again = store.register_child(grant(offer, key="step-1"), now=LATER)  # a retry after a lost answer

    assert again == first and children(store) == before  # the same child, nothing written
    other = store.register_child(grant(offer, key="step-2"), now=NOW)
    nested = store.register_child(grant(offer, key="step-1", under=first.id), now=NOW)  # another parent
    unkeyed = [register(store, offer), register(store, offer)]
    assert len({first.id, other.id, nested.id, *(c.id for c in unkeyed)}) == 5
    assert nested.parent_id == first.id and len(children(store)) == 5


def test_a_key_names_a_child_of_one_grant_only(store: PoolStore) -> None:
    old = given_running(store)
    first = store.register_child(grant(old, key="k"), now=NOW)
    new = store.offer(0, owner="w-2", now=LATER)  # a re-grant retires the old epoch's children
    assert new is not None

    again = store.register_child(grant(new, key="k"), now=LATER)

    assert again.id != first.id and again.epoch == new.fence
    got = children(store)
    assert (got[first.id]["outcome"], got[again.id]["status"]) == ("retired", "registered")
    with pytest.raises(StaleHolder, match=r"^fence: "):  # the old holder's retry is refused, not served
        store.register_child(grant(old, key="k"), now=LATER)
    with pytest.raises(InvalidInput, match=r"^key: may hold only"):
        store.register_child(grant(new, key="a b"), now=LATER)
    assert len(children(store)) == 2


def test_past_the_depth_cap_the_store_fails_closed(store: PoolStore) -> None:
    capped = PoolStore(store.url, pool_size=store.pool_size, lineage_max_depth=3, engine=store.engine)
    offer = given_running(capped)
    chain = [register(capped, offer)]
    for _ in range(2):
        chain.append(register(capped, offer, under=chain[-1]))
    assert [c.depth for c in chain] == [1, 2, 3]
    before = children(capped)
    with pytest.raises(LineageTooDeep, match=r"depth 4, past the cap of 3 \(POOL_LINEAGE_MAX_DEPTH\)"):
        register(capped, offer, under=chain[-1])
    assert children(capped) == before


def test_a_finished_child_takes_no_children(store: PoolStore) -> None:
    offer = given_running(store)
    done = register(store, offer)
    store.child_result({**done.token(), "payload": DONE}, now=LATER)
    with pytest.raises(StaleHolder, match=r"^under: .* is terminal \(done\)"):
        register(store, offer, under=done, now=LATER)


# --- the child's writes --------------------------------------------------------


def test_a_child_heartbeats_and_delivers_while_its_parents_grant_is_current(store: PoolStore) -> None:
    offer = given_running(store)
    parent = register(store, offer)
    nested = register(store, offer, under=parent)

    assert store.child_heartbeat({**parent.token(), "receipt": {"step": 1}}, now=LATER) == "applied"
    got = children(store)[parent.id]
    assert (got["status"], got["receipt"]) == ("running", '{"step":1}') and got["receipt_digest"]

    assert store.child_result({**parent.token(), "payload": {"out": 42}}, now=LATER) == "applied"

    got, below = children(store)[parent.id], children(store)[nested.id]
    assert (got["status"], got["outcome"], got["receipt"]) == ("terminal", "done", None)
    assert got["receipt_digest"] and got["result_digest"], "digests stay"
    assert (below["status"], below["outcome"]) == ("terminal", "retired"), "closed with its descendants"
    assert row_state(store, offer.row_id)["state"] == "running", "the run goes on"


def test_a_childs_result_is_a_duplicate_while_the_grant_lasts_then_stale(store: PoolStore) -> None:
    offer = given_running(store)
    child = register(store, offer)
    result = {**child.token(), "payload": {"out": 1}}
    store.child_result(result, now=LATER)
    before = children(store)

    assert store.child_result(result, now=LATER + 1) == "duplicate"
    with pytest.raises(DeliveryConflict, match="already delivered a different result"):
        store.child_result({**result, "payload": {"out": 2}}, now=LATER + 1)
    store.accept_result(envelope(offer, "r1", payload=DONE), now=LATER + 2)
    with pytest.raises(StaleHolder, match=r"^state: .*not running"):
        store.child_result(result, now=LATER + 3)
    with pytest.raises(DeliveryConflict):
        store.child_result({**result, "payload": {"out": 2}}, now=LATER + 3)
    assert children(store) == before


@pytest.mark.parametrize(
    ("case", "field"),
    [("epoch", "epoch"), ("lease ended", "lease"), ("re-granted", "status"), ("unknown", "status")],
)
def test_a_stale_child_is_refused_and_changes_nothing(store: PoolStore, case: str, field: str) -> None:
    offer = given_running(store)
    child = register(store, offer)
    store.child_heartbeat(child.token(), now=LATER)
    token, now = child.token(), LATER
    if case == "epoch":
        token["epoch"] += 1
    elif case == "lease ended":
        now = offer.lease_until + 1  # not yet expired: the child is still listed live, but its grant is over
    elif case == "re-granted":
        store.offer(0, owner="w-2", now=LATER)
    else:
        store.child_vanished(grant(offer, child_id=child.id), now=LATER)
    before = snapshot(store)

    with pytest.raises(StaleHolder, match=rf"^{field}: stale child refused"):
        store.child_heartbeat({**token, "receipt": {"late": True}}, now=now)
    with pytest.raises(StaleHolder, match=rf"^{field}: stale child refused"):
        store.child_result({**token, "payload": DONE}, now=now)
    assert snapshot(store) == before


def test_an_unknown_child_id_is_not_found_and_a_malformed_one_is_named(store: PoolStore) -> None:
    offer = given_running(store)
    with pytest.raises(NotFound, match=r"^child_id: no child execution"):
        store.child_heartbeat({"child_id": f"run:{offer.row_id}/child:{'f' * 12}", "epoch": 1}, now=NOW)
    with pytest.raises(InvalidInput, match=r"^child_id: "):
        store.child_heartbeat({"child_id": "run:1/child:x", "epoch": 1}, now=NOW)
    with pytest.raises(InvalidInput, match="looks like a credential"):
        store.child_heartbeat(
            {"child_id": f"run:{offer.row_id}/child:{'f' * 12}", "epoch": 1, "receipt": {"api_key": "x"}},
            now=NOW,
        )


# --- retirement with the grant -------------------------------------------------


def _end_by_result(store: PoolStore, offer: Offer) -> None:
    store.accept_result(envelope(offer, "r1", payload=DONE), now=LATER)


def _end_by_expiry(store: PoolStore, offer: Offer) -> None:
    with store.session() as s:
        assert (
            offer.row_id
            in transitions.expire_many(s, [offer.row_id], max_attempts=3, now=offer.lease_until + 1).moved
        )


def _end_by_last_expiry(store: PoolStore, offer: Offer) -> None:
    with store.session() as s:
        assert (
            offer.row_id
            in transitions.expire_many(s, [offer.row_id], max_attempts=1, now=offer.lease_until + 1).moved
        )


def _end_by_release(store: PoolStore, offer: Offer) -> None:
    store.release(envelope(offer, "x1"), now=LATER)


def _end_by_regrant(store: PoolStore, offer: Offer) -> None:
    assert store.offer(offer.ordinal, owner="w-2", now=LATER) is not None


def _settle(to: RowState) -> Callable[[PoolStore, Offer], None]:
    def end(store: PoolStore, offer: Offer) -> None:
        with store.session() as s:
            transitions.settle(s, offer.row_id, to, expect_state="running", expect_attempt=1, now=LATER)

    return end


ENDS = {
    "result": _end_by_result,
    "expiry": _end_by_expiry,
    "last expiry": _end_by_last_expiry,
    "release": _end_by_release,
    "re-grant": _end_by_regrant,
    "stale": _settle(RowState.STALE),
    "finalized": _settle(RowState.FINALIZED),
}


def _family(store: PoolStore, offer: Offer) -> dict[str, Child]:
    """A running child with a receipt, its registered child, an unknown one and a finished one."""
    fam = {"running": register(store, offer)}
    fam["nested"] = register(store, offer, under=fam["running"])
    fam["unknown"], fam["done"] = register(store, offer), register(store, offer)
    store.child_heartbeat({**fam["running"].token(), "receipt": {"bulky": "x" * 1000}}, now=NOW)
    store.child_vanished(grant(offer, child_id=fam["unknown"].id), now=NOW)
    store.child_result({**fam["done"].token(), "payload": DONE}, now=NOW)
    return fam


@pytest.mark.parametrize("end", list(ENDS))
def test_every_end_of_the_grant_retires_the_live_children_in_its_transaction(
    store: PoolStore, end: str
) -> None:
    offer = given_running(store)
    fam = _family(store, offer)
    before = children(store)

    ENDS[end](store, offer)

    after = children(store)
    for name in ("running", "nested"):
        c = after[fam[name].id]
        assert (c["status"], c["outcome"], c["receipt"]) == ("terminal", "retired", None)
        assert c["receipt_digest"] == before[fam[name].id]["receipt_digest"]
    assert after[fam["running"].id]["receipt_digest"] is not None, "compaction keeps the digest"
    assert after[fam["unknown"].id] == before[fam["unknown"].id], "unknown waits for an explicit reset"
    assert after[fam["done"].id] == before[fam["done"].id]
    with pytest.raises(StaleHolder):
        store.child_heartbeat(fam["running"].token(), now=LATER)


@pytest.mark.parametrize("end", list(ENDS))
def test_a_crash_after_retiring_rolls_back_the_grants_end_too(
    store: PoolStore, end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retiring and ending the grant are one transaction: a failure after both leaves neither."""
    offer = given_running(store)
    _family(store, offer)
    before = snapshot(store)
    real = lineage.retire_children

    def retire_then_crash(*args: Any, **kwargs: Any) -> int:
        real(*args, **kwargs)
        raise RuntimeError("crash after retiring")

    monkeypatch.setattr(lineage, "retire_children", retire_then_crash)
    with pytest.raises(RuntimeError, match="crash after retiring"):
        ENDS[end](store, offer)
    assert snapshot(store) == before


def test_a_restarted_owner_never_adopts_the_previous_epochs_children(store: PoolStore) -> None:
    old = given_running(store)
    orphan = register(store, old)
    same = store.offer(0, owner=old.owner, now=LATER)  # the same instance asking again: same epoch
    assert same is not None and same.fence == old.fence
    assert children(store)[orphan.id]["status"] == "registered"

    new = store.offer(0, owner="w-2", now=LATER)

    assert new is not None and new.fence > old.fence
    assert children(store)[orphan.id]["outcome"] == "retired"
    with pytest.raises(StaleHolder, match=r"^under: .* is terminal \(retired\)"):
        register(store, new, under=orphan, now=LATER)
    with pytest.raises(StaleHolder, match=r"^epoch: "):
        store.child_heartbeat({**orphan.token(), "epoch": new.fence}, now=LATER)
    fresh = register(store, new, now=LATER)
    assert fresh.epoch == new.fence


def test_a_grant_never_starts_beside_a_live_member_of_its_lineage(store: PoolStore, make_row: Any) -> None:
    """A live child under an ``assigned`` row (the API never leaves one) is retired by the grant."""
    row = make_row(RowState.ASSIGNED)
    with store.session() as s:
        s.execute(
            text(
                "INSERT INTO child_executions (id, row_id, parent_id, status, epoch, depth, created_at,"
                " updated_at) VALUES (:id, :r, :p, 'running', 1, 1, 0, 0)"
            ).bindparams(id=f"run:{row}/child:{'1' * 12}", r=row, p=f"run:{row}")
        )
    offer = store.offer(0, owner="w-1", now=NOW)
    assert offer is not None
    assert {c["status"] for c in children(store).values()} == {"terminal"}
    with pytest.raises(StaleHolder):
        store.child_heartbeat({"child_id": f"run:{row}/child:{'1' * 12}", "epoch": 1}, now=NOW)


# --- operator reset, GC, metrics ----------------------------------------------


@pytest.mark.parametrize("status", ["registered", "running"])
def test_a_reset_is_refused_while_a_child_is_live(store: PoolStore, status: str) -> None:
    offer = given_running(store)
    child = register(store, offer)
    if status == "running":
        store.child_heartbeat(child.token(), now=NOW)
    with store.session() as s:
        s.execute(text("UPDATE assignments SET failures = 2, quarantined = true"))
    before = snapshot(store)
    refused = rf"row {offer.row_id} has live child executions \(1 {status}\)"
    with pytest.raises(LineageLive, match=refused), store.session() as s:
        transitions.requeue(s, offer.row_id, now=LATER)
    assert snapshot(store) == before


def test_a_reset_discards_unknown_children_never_replaying_them(store: PoolStore) -> None:
    offer = given_running(store)
    lost = register(store, offer)
    store.child_heartbeat({**lost.token(), "receipt": {"partial": 1}}, now=NOW)
    below = register(store, offer, under=lost)
    assert store.child_vanished(grant(offer, child_id=lost.id), now=NOW) == 2

    with store.session() as s:
        transitions.requeue(s, offer.row_id, now=LATER)

    got = children(store)
    assert {(c["status"], c["outcome"], c["receipt"]) for c in got.values()} == {
        ("terminal", "discarded", None)
    }
    assert got[lost.id]["receipt_digest"] is not None
    with pytest.raises(StaleHolder):
        store.child_heartbeat(below.token(), now=LATER)


def test_gc_removes_children_with_their_row_and_the_database_refuses_orphans(store: PoolStore) -> None:
    offer = given_running(store)
    register(store, offer, under=register(store, offer))
    keep = given_running(store, ordinal=1, task_id="t2")
    kept = register(store, keep)
    with store.session() as s:
        transitions.settle(s, offer.row_id, RowState.STALE, expect_state="running", expect_attempt=1, now=NOW)
    with pytest.raises(Exception, match=r"(?i)foreign key"), store.session() as s:
        s.execute(text("DELETE FROM assignments WHERE id = :i").bindparams(i=offer.row_id))

    with store.session() as s:
        assert transitions.collect_garbage(s, retention_seconds=3600, batch=10, now=NOW + 7200) == (1, 0)

    assert list(children(store)) == [kept.id]


def test_the_metrics_count_live_children(store: PoolStore) -> None:
    offer = given_running(store)
    a, b = register(store, offer), register(store, offer)
    store.child_heartbeat(a.token(), now=NOW)
    store.child_result({**b.token(), "payload": DONE}, now=NOW)
    register(store, offer)

    collected = [m for m in StoreCollector(store).collect() if m.samples]  # a labelled family may be empty
    gauges = {m.name: m.samples[0].value for m in collected if not m.samples[0].labels}

    assert gauges["poolkeeper_live_children"] == 2
