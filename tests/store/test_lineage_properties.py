"""A Hypothesis state machine over runs and their child executions, on SQLite and PostgreSQL.

Rules: add and grant runs (two owners, so re-grants happen), register children
(nested, up to a cap of 2), child heartbeats and results, a child's worker
vanishing, expiry, release, the run's result, settling, an operator reset, GC,
the clock, and crashes: a transition run in a transaction that raises before
it commits. After every step (docs/design.md, "Lineage"):
- no live child under a run that is not running under the child's epoch, nor
  under a child that is not live;
- at most one live execution per lineage: one epoch among a run's live children;
- a child that was seen retired is never live again, and no write from it is
  accepted (checked in the write rules against the state just before);
- terminal children hold no receipt, and their digests never change.
A refused or crashed call changes nothing.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from core.errors import LineageLive, PoolError
from core.validate import canonical_json, sha256
from store import Child, Envelope, Offer, PoolStore, lineage, queries, transitions, worker
from store.models import RowState
from store.models import metadata as store_metadata
from tests.factories import envelope, grant
from tests.properties import budget

POOL, LEASE, MAX_ATTEMPTS, MAX_DEPTH = 2, 30.0, 2, 2
LIVE = ("registered", "running")
EXAMPLES = {"sqlite": 200, "postgres": 40}  # of 40 steps; ten times as many under HYPOTHESIS_PROFILE=long


class Crash(Exception):
    """The process dies after the transition's statements, before its commit."""


class LineageMachine(RuleBasedStateMachine):
    url: ClassVar[str]  # set per backend by the tests below
    engine: ClassVar[Engine | None] = None  # PostgreSQL: one database, emptied per example
    template: ClassVar[Path]  # SQLite: conftest's store_template, copied per example, beside it

    def __init__(self) -> None:
        super().__init__()
        self.dir = None
        if self.engine is None:
            self.dir = tempfile.mkdtemp(prefix="pk-lineage-", dir=self.template.parent)
            shutil.copy(self.template, f"{self.dir}/pool.db")
            url = f"sqlite:///{self.dir}/pool.db"
        else:
            url = self.url
            with self.engine.begin() as conn:
                conn.execute(
                    text("TRUNCATE child_executions, deliveries, audit_events, assignments RESTART IDENTITY")
                )
                conn.execute(text("UPDATE fence_sequence SET value = 0"))
        self.store = PoolStore(
            url,
            pool_size=POOL,
            lease_seconds=LEASE,
            max_attempts=MAX_ATTEMPTS,
            lineage_max_depth=MAX_DEPTH,
            engine=self.engine,
        )
        self.now = 1_000_000.0
        self.grants: list[Offer] = []
        self.kids: list[Child] = []
        self.retired: set[str] = set()  # children seen not live: never live again
        self.frozen: dict[str, tuple[str | None, str | None]] = {}  # terminal child -> its digests
        self.n = 0

    def teardown(self) -> None:
        if self.dir is not None:
            self.store.engine.dispose()
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- reading the store -----------------------------------------------------

    def snapshot(self) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        with self.store.session(readonly=True) as s:
            rows = [dict(r) for r in s.execute(text("SELECT * FROM assignments ORDER BY id")).mappings()]
            kids = s.execute(text("SELECT * FROM child_executions ORDER BY id")).mappings()
            return rows, {k["id"]: dict(k) for k in kids}

    def current(self, row: dict[str, Any] | None, epoch: int) -> bool:
        return (
            row is not None
            and row["state"] == "running"
            and row["fence"] == epoch
            and row["lease_until"] >= self.now
        )

    def refused_changes_nothing(self, call: Callable[[], Any]) -> Any:
        """Run ``call``; if it raises a project error, nothing may have changed."""
        before = self.snapshot()
        try:
            return call()
        except PoolError as err:
            assert self.snapshot() == before, f"a refusal changed the store: {err}"
            return err

    def holder(self, data: st.DataObject) -> Offer:
        """Mostly a recent grant (likely current), sometimes any grant ever handed out."""
        return data.draw(st.sampled_from(self.grants[-POOL:]) | st.sampled_from(self.grants))

    # --- runs ------------------------------------------------------------------

    @initialize()
    def busy_pool(self) -> None:
        """Every example starts with each ordinal's run granted, with a child and a grandchild."""
        for ordinal in range(POOL):
            self.add(ordinal)
            self.offer(ordinal, "w-1")
            held = grant(self.grants[-1])
            self.kids.append(self.store.register_child(held, now=self.now))
            self.kids.append(self.store.register_child({**held, "under": self.kids[-1].id}, now=self.now))

    @rule(ordinal=st.integers(0, POOL - 1))
    def add(self, ordinal: int) -> None:
        self.n += 1
        self.refused_changes_nothing(
            lambda: self.store.add_run(
                board="b", task_id=f"t{self.n}", run_id=1, ordinal=ordinal, payload={}, now=self.now
            )
        )

    @rule(ordinal=st.integers(0, POOL - 1), owner=st.sampled_from(["w-1", "w-2"]))
    def offer(self, ordinal: int, owner: str) -> None:
        got = self.store.offer(ordinal, owner=owner, now=self.now)
        if got is not None:
            self.grants.append(got)

    @rule(dt=st.sampled_from([1.0, LEASE / 2, LEASE + 1, 4000.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.grants)
    @rule(data=st.data(), as_result=st.booleans())
    def holder_writes(self, data: st.DataObject, as_result: bool) -> None:
        """The run's holder delivers its result (its grant ends) or releases its run."""
        g = self.holder(data)
        self.n += 1
        env = _envelope(g, f"d{self.n}", as_result)
        call = self.store.accept_result if as_result else self.store.release
        self.refused_changes_nothing(lambda: call(env, now=self.now))

    @rule(lapse=st.booleans())
    def expire(self, lapse: bool) -> None:
        """The expire pass; with ``lapse``, first let every lease run out (children often still live)."""
        if lapse:
            self.now += LEASE + 1
        with self.store.session(readonly=True) as s:
            due = queries.due_expired(s, now=self.now, limit=100)
        for row_id in (row.id for row in due):
            with self.store.session() as s:
                transitions.expire_many(s, [row_id], max_attempts=MAX_ATTEMPTS, now=self.now)

    @rule(
        to=st.sampled_from([RowState.FINALIZED, RowState.STALE]),
        source=st.sampled_from([RowState.RESULT, RowState.LEASE_FAILED, RowState.RUNNING]),
    )
    def settle(self, to: RowState, source: RowState) -> None:
        with self.store.session(readonly=True) as s:
            found = [(r.id, r.attempt) for r in queries.rows(s, state=source)][:1]
        for row_id, attempt in found:
            with self.store.session() as s:
                transitions.settle(
                    s, row_id, to, expect_state=source.value, expect_attempt=attempt, now=self.now
                )

    @rule(row_id=st.integers(1, 8))
    def reset(self, row_id: int) -> None:
        _, kids = self.snapshot()
        had_live = any(k["row_id"] == row_id and k["status"] in LIVE for k in kids.values())

        def requeue() -> None:
            with self.store.session() as s:
                transitions.requeue(s, row_id, now=self.now)

        got = self.refused_changes_nothing(requeue)
        if isinstance(got, LineageLive):
            assert had_live
        elif not isinstance(got, PoolError):
            assert not had_live, "a reset went through while a child was live"
            _, after = self.snapshot()
            assert not any(k["row_id"] == row_id and k["status"] == "unknown" for k in after.values())

    @rule()
    def gc(self) -> None:
        with self.store.session() as s:
            transitions.collect_garbage(s, retention_seconds=3600, batch=1000, now=self.now)

    # --- children --------------------------------------------------------------

    @precondition(lambda self: self.grants)
    @rule(data=st.data(), count=st.integers(1, 3))
    def register(self, data: st.DataObject, count: int) -> None:
        g = self.holder(data)
        for _ in range(count):
            mine = [k for k in self.kids if k.row_id == g.row_id]
            under = data.draw(st.none() | st.sampled_from(mine)) if mine else None
            rows, kids = self.snapshot()
            row = next((r for r in rows if r["id"] == g.row_id), None)
            held = {**grant(g), **({} if under is None else {"under": under.id})}
            got = self.refused_changes_nothing(partial(self.store.register_child, held, now=self.now))
            if isinstance(got, Child):
                assert self.current(row, g.fence) and row is not None and row["owner"] == g.owner
                if under is not None:
                    assert kids[under.id]["status"] in LIVE and under.id not in self.retired
                assert got.depth <= MAX_DEPTH
                self.kids.append(got)

    @precondition(lambda self: self.kids)
    @rule(data=st.data(), as_result=st.booleans(), content=st.integers(0, 1))
    def child_writes(self, data: st.DataObject, as_result: bool, content: int) -> None:
        recent = self.kids[-3:]
        parents = [k for k in self.kids if any(r.parent_id == k.id for r in recent)]  # a result retires below
        kid = data.draw(
            st.sampled_from(parents or recent) | st.sampled_from(recent) | st.sampled_from(self.kids)
        )
        rows, kids = self.snapshot()
        row = next((r for r in rows if r["id"] == kid.row_id), None)
        was = kids.get(kid.id)
        if as_result:
            doc = {"out": content}
            got = self.refused_changes_nothing(
                lambda: self.store.child_result({**kid.token(), "payload": doc}, now=self.now)
            )
        else:
            got = self.refused_changes_nothing(
                lambda: self.store.child_heartbeat({**kid.token(), "receipt": {"n": content}}, now=self.now)
            )
        if got == "applied":
            assert was is not None and was["status"] in LIVE and kid.id not in self.retired, (
                "a write from a retired child was accepted"
            )
            assert self.current(row, kid.epoch), "a child wrote outside its parent's current grant"
        elif got == "duplicate":
            assert was is not None and was["result_digest"] == sha256(canonical_json(doc))
            assert self.current(row, kid.epoch)

    @precondition(lambda self: self.kids)
    @rule(data=st.data())
    def child_vanishes(self, data: st.DataObject) -> None:
        kid = data.draw(st.sampled_from(self.kids))
        holders = [g for g in self.grants if g.row_id == kid.row_id]
        g = data.draw(st.sampled_from(holders[-1:]) | st.sampled_from(holders))
        rows, kids = self.snapshot()
        row = next((r for r in rows if r["id"] == kid.row_id), None)
        got = self.refused_changes_nothing(
            lambda: self.store.child_vanished({**grant(g), "child_id": kid.id}, now=self.now)
        )
        if isinstance(got, int):
            assert kids[kid.id]["status"] in LIVE and self.current(row, g.fence) and g.fence == kid.epoch

    # --- crashes ---------------------------------------------------------------

    @precondition(lambda self: self.grants)
    @rule(
        data=st.data(),
        step=st.sampled_from(["expire", "result", "regrant", "register", "child", "settle"]),
    )
    def crash(self, data: st.DataObject, step: str) -> None:
        g = self.holder(data)
        kid = data.draw(st.sampled_from(self.kids)) if self.kids else None
        steps: dict[str, Callable[[Session], Any]] = {
            "expire": lambda s: transitions.expire_many(
                s, [g.row_id], max_attempts=MAX_ATTEMPTS, now=self.now
            ),
            "result": lambda s: worker.accept_result(
                s, Envelope.parse(_envelope(g, "crash", True), pool_size=POOL, with_result=True), now=self.now
            ),
            "regrant": lambda s: worker.offer(
                s, g.ordinal, owner="w-3", pool_size=POOL, lease_seconds=LEASE, now=self.now
            ),
            "register": lambda s: lineage.register(
                s, lineage.Grant.parse(grant(g)), under=None, max_depth=MAX_DEPTH, now=self.now
            ),
            "child": lambda s: (
                kid
                and lineage.deliver(
                    s, lineage.Report.parse({**kid.token(), "payload": {}}, with_result=True), now=self.now
                )
            ),
            "settle": lambda s: transitions.settle(
                s, g.row_id, RowState.STALE, expect_state="running", expect_attempt=g.attempt, now=self.now
            ),
        }
        before = self.snapshot()
        try:
            with self.store.session() as s:
                steps[step](s)
                raise Crash
        except (Crash, PoolError):
            pass
        assert self.snapshot() == before, f"a crash during {step} left a trace"

    # --- after every step -----------------------------------------------------

    @invariant()
    def lineage_invariants(self) -> None:
        rows, kids = self.snapshot()
        by_id = {r["id"]: r for r in rows}
        epochs: dict[int, set[int]] = {}
        order = {k.id: i for i, k in enumerate(self.kids)}  # ids are random: check in a replayable order
        for k in sorted(kids.values(), key=lambda k: order[k["id"]]):
            row = by_id[k["row_id"]]  # the foreign key: no orphan
            if k["status"] in LIVE:
                assert row["state"] == "running" and row["fence"] == k["epoch"], (
                    f"live child {k['id']} under row {row['id']} ({row['state']}, fence {row['fence']})"
                )
                if k["depth"] > 1:
                    assert kids[k["parent_id"]]["status"] in LIVE, f"{k['id']} outlived its parent child"
                assert k["id"] not in self.retired, f"retired child {k['id']} is live again"
                epochs.setdefault(k["row_id"], set()).add(k["epoch"])
            else:
                self.retired.add(k["id"])
            if k["status"] == "terminal":
                assert k["receipt"] is None, "a terminal child keeps its bulky receipt"
                digests = (k["receipt_digest"], k["result_digest"])
                assert self.frozen.setdefault(k["id"], digests) == digests, "compaction lost a digest"
            assert k["depth"] <= MAX_DEPTH
        assert all(len(e) == 1 for e in epochs.values()), "two live executions in one lineage"


def _envelope(g: Offer, delivery_id: str, as_result: bool) -> dict[str, Any]:
    return envelope(g, delivery_id, **({"payload": {"status": "done"}} if as_result else {}))


def _run(url: str, engine: Engine | None, examples: int, template: Path | None = None) -> None:
    machine = type("Machine", (LineageMachine,), {"url": url, "engine": engine, "template": template})
    run_state_machine_as_test(
        machine,
        settings=budget(examples, 40),
    )


@pytest.mark.property
def test_lineage_machine_on_sqlite(store_template: Path) -> None:
    _run("", None, EXAMPLES["sqlite"], store_template)


@pytest.mark.postgres
@pytest.mark.property
def test_lineage_machine_on_postgres(postgres_url: str) -> None:
    store = PoolStore(postgres_url)
    store.migrate()
    try:
        _run(postgres_url, store.engine, EXAMPLES["postgres"])
    finally:
        with store.engine.begin() as conn:
            tables = ", ".join([*store_metadata.tables, "store_alembic_version"])  # every table, as conftest
            conn.execute(text(f"DROP TABLE IF EXISTS {tables} CASCADE"))
        store.engine.dispose()
