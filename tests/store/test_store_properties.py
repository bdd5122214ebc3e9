"""A Hypothesis state machine over the store's transitions, checking invariants 1-6 after every step.

The invariants are numbered as in docs/design.md.

Bounded by examples (``tests/properties.py``): 200 runs of 30 steps under the ``ci``
profile, ten times as many under ``HYPOTHESIS_PROFILE=long``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sqlalchemy import text

from core.errors import DeliveryConflict, NotFound, OrdinalTaken, PoolError, StaleHolder
from core.settings import Settings
from store import Offer, PoolStore, queries, rows, transitions
from store.models import RowState
from tests.factories import OWNER, envelope
from tests.properties import budget

POOL = 3
LEASE = 30.0
MAX_ATTEMPTS = 2


@dataclass
class Model:
    live_on: dict[int, int] = field(default_factory=dict)  # ordinal -> row id
    settled: set[int] = field(default_factory=set)  # rows we made terminal
    added: dict[tuple[str, int], int] = field(default_factory=dict)  # (task, run) -> row id
    last_fence: int = 0
    holders: list[Offer] = field(default_factory=list)  # every lease ever granted
    sent: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)  # accepted deliveries


class StoreMachine(RuleBasedStateMachine):
    template: ClassVar[Path]  # conftest's store_template (set below): copied per example, beside it

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pk-prop-", dir=self.template.parent)
        shutil.copy(self.template, f"{self.dir}/pool.db")
        self.store = PoolStore.from_settings(
            Settings(
                database_url=f"sqlite:///{self.dir}/pool.db",
                pool_size=POOL,
                lease_seconds=LEASE,
                max_attempts=MAX_ATTEMPTS,
            )
        )
        self.now = 1_000_000.0
        self.m = Model()
        self.n = 0

    def teardown(self) -> None:
        self.store.engine.dispose()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _next(self) -> int:
        self.n += 1
        return self.n

    @rule(ordinal=st.integers(0, POOL - 1), task=st.sampled_from(["a", "b", "c", "d"]))
    def add(self, ordinal: int, task: str) -> None:
        run = self._next()
        try:
            self.store.add_run(
                board="b", task_id=task, run_id=run, ordinal=ordinal, payload={"t": task}, now=self.now
            )
        except OrdinalTaken:
            assert ordinal in self.m.live_on
            return
        assert ordinal not in self.m.live_on
        with self.store.session() as s:
            row_id = s.scalar(text("SELECT id FROM assignments WHERE run_id = :r"), {"r": run})
        self.m.live_on[ordinal] = row_id
        self.m.added[(task, run)] = row_id

    @precondition(lambda self: self.m.added)
    @rule(data=st.data())
    def add_again(self, data: st.DataObject) -> None:
        (task, run) = data.draw(st.sampled_from(sorted(self.m.added)))
        if not self._exists(self.m.added[(task, run)]):
            return  # collected after its retention: the identity may be claimed afresh
        try:
            self.store.add_run(
                board="b", task_id=task, run_id=run, ordinal=0, payload={"t": task}, now=self.now
            )
        except PoolError:
            return
        with self.store.session() as s:  # accepted only as an identical duplicate
            assert s.scalar(text("SELECT ordinal FROM assignments WHERE run_id = :r"), {"r": run}) == 0

    @rule(ordinal=st.integers(0, POOL - 1), owner=st.sampled_from([OWNER, "w-2"]))
    def offer(self, ordinal: int, owner: str) -> None:
        """Also the restart: a second owner on the ordinal takes the live grant over."""
        before = self._live_row(ordinal)
        got = self.store.offer(ordinal, owner=owner, now=self.now)
        if (
            before is None
            or before.state == "result"
            or (before.state == "running" and (before.lease_until or 0) < self.now)
        ):
            assert got is None
            return
        assert got is not None and got.row_id == before.id == self.m.live_on.get(ordinal)
        assert (got.ordinal, got.owner, got.attempt) == (ordinal, owner, before.attempt)
        if before.state == "running" and before.owner == owner:  # asked again: the same grant
            assert (got.fence, got.lease_until) == (before.fence, before.lease_until)
            return
        assert got.fence > self.m.last_fence, "fences are monotonic"
        self.m.last_fence = got.fence
        self.m.holders.append(got)

    @rule(dt=st.sampled_from([1.0, LEASE / 2, LEASE, LEASE + 1, 4000.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.m.holders)
    @rule(data=st.data(), kind=st.sampled_from(["heartbeat", "result", "release"]))
    def deliver(self, data: st.DataObject, kind: str) -> None:
        holder = data.draw(st.sampled_from(self.m.holders))
        env = _envelope(holder, f"d{self._next()}", kind == "result")
        row = self._row(holder.row_id)
        holds_result = (
            kind == "result" and row is not None and row.result_digest is not None and _same_grant(row, env)
        )
        current = row is not None and row.state == "running" and _same_grant(row, env) and self._live(row)
        try:
            got = self._call(kind)(env, now=self.now)
        except (StaleHolder, NotFound):
            assert not (current or holds_result), "the current holder was refused"
            return
        assert current or holds_result, "a stale holder's delivery was applied"
        if holds_result:
            assert got == "duplicate"
        elif kind == "release":
            assert got == ("reoffered" if holder.attempt < MAX_ATTEMPTS else "lease_failed")
            if got == "lease_failed":
                self._release(holder.row_id)
        self.m.sent.append((self.now, kind, env))

    @precondition(lambda self: self.m.sent)
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """Check before replay: a duplicate only while the sender still has the authority it used."""
        _, kind, env = data.draw(st.sampled_from(self.m.sent))
        row = self._row(self._row_id(env))
        if row is None:
            expected: Any = NotFound
        elif row.state == "running":
            expected = "duplicate" if _same_grant(row, env) and self._live(row) else StaleHolder
        elif row.result_digest is not None:
            expected = "duplicate" if _same_grant(row, env) else StaleHolder
        else:
            expected = "duplicate" if kind == "release" and row.fence == env["fence"] else StaleHolder
        before = self._deliveries()
        if expected == "duplicate":
            assert self._call(kind)(env, now=self.now) == "duplicate"
        else:
            with pytest.raises(expected):
                self._call(kind)(env, now=self.now)
        other = "result" if kind == "heartbeat" else "heartbeat"  # the same id for other content
        if expected == "duplicate" and kind != "release":
            expected = DeliveryConflict  # the sender may write, but not this under a used id
        elif expected == "duplicate":
            expected = StaleHolder  # a released run takes no heartbeat
        with pytest.raises(expected):
            self._call(other)(_envelope_as(env, other == "result"), now=self.now)
        assert self._deliveries() == before, "a replay or a refusal recorded something"

    @rule()
    def expire(self) -> None:
        with self.store.session() as s:
            due = queries.due_expired(s, now=self.now, limit=100)
        for row_id in (row.id for row in due):
            with self.store.session() as s:
                new = (
                    transitions.expire_many(s, [row_id], max_attempts=MAX_ATTEMPTS, now=self.now)
                    .moved[row_id]
                    .state
                )
            if new is RowState.LEASE_FAILED:
                self._release(row_id)

    @rule(
        to=st.sampled_from([RowState.FINALIZED, RowState.STALE]),
        source=st.sampled_from([RowState.RESULT, RowState.LEASE_FAILED, RowState.ASSIGNED]),
    )
    def settle(self, to: RowState, source: RowState) -> None:
        with self.store.session() as s:
            rows = [(r.id, r.attempt) for r in queries.rows(s, state=source)]
        for row_id, attempt in rows[:1]:
            with self.store.session() as s:
                transitions.settle(
                    s, row_id, to, expect_state=source.value, expect_attempt=attempt, now=self.now
                )
            self.m.settled.add(row_id)
            self._release(row_id)

    @rule()
    def gc(self) -> None:
        with self.store.session() as s:
            _, deliveries = transitions.collect_garbage(s, retention_seconds=3600, batch=1000, now=self.now)
        kept = [d for d in self.m.sent if d[0] >= self.now - 3600]
        assert deliveries == len(self.m.sent) - len(kept)
        self.m.sent = kept  # past the retention a delivery id is forgotten, by design

    def _call(self, kind: str) -> Any:
        return {
            "heartbeat": self.store.heartbeat,
            "result": self.store.accept_result,
            "release": self.store.release,
        }[kind]

    def _row(self, row_id: int | None) -> Any:
        if row_id is None or not self._exists(row_id):
            return None
        with self.store.session(readonly=True) as s:
            return rows.get_row(s, row_id)

    def _row_id(self, env: dict[str, Any]) -> int | None:
        with self.store.session(readonly=True) as s:
            row_id: int | None = s.scalar(
                text("SELECT id FROM assignments WHERE run_id = :r"), {"r": env["run_id"]}
            )
            return row_id

    def _live_row(self, ordinal: int) -> Any:
        return self._row(self.m.live_on.get(ordinal))

    def _live(self, row: Any) -> bool:
        return (row.lease_until or 0) >= self.now

    def _deliveries(self) -> int:
        with self.store.session(readonly=True) as s:
            return int(s.scalar(text("SELECT count(*) FROM deliveries")) or 0)

    def _release(self, row_id: int) -> None:
        self.m.live_on = {o: r for o, r in self.m.live_on.items() if r != row_id}

    def _exists(self, row_id: int) -> bool:
        with self.store.session(readonly=True) as s:
            return s.scalar(text("SELECT 1 FROM assignments WHERE id = :i"), {"i": row_id}) is not None

    @invariant()
    def store_invariants(self) -> None:
        with self.store.session(readonly=True) as s:
            rows = {r.id: r for r in queries.rows(s, limit=10_000)}
        live = [r for r in rows.values() if r.state in ("assigned", "running", "result")]
        # 1. at most one live row per ordinal, and the model agrees which
        assert len({r.ordinal for r in live}) == len(live)
        assert {r.ordinal: r.id for r in live} == self.m.live_on
        for r in rows.values():
            # 2. terminal only through an evidence-backed settle; compacted when terminal
            if r.state in ("finalized", "stale"):
                assert r.id in self.m.settled and r.payload is None and r.result is None
            # 4. a running row holds the newest fence it was granted
            if r.state == "running":
                assert r.fence == max(h.fence for h in self.m.holders if h.row_id == r.id)
        # 5. what is recorded is exactly what was accepted: nothing from a stale fence
        assert self._deliveries() == len(self.m.sent)
        # 3 + 6. every claimed run still has its row, unless it was terminal and collected
        for row_id in self.m.added.values():
            assert row_id in rows or row_id in self.m.settled, f"row {row_id} lost"


def _same_grant(row: Any, env: dict[str, Any]) -> bool:
    return bool(row.fence == env["fence"] and row.attempt == env["attempt"])


def _envelope_as(env: dict[str, Any], as_result: bool) -> dict[str, Any]:
    out = {k: v for k, v in env.items() if k != "payload"}
    if as_result:
        out["payload"] = {"status": "done", "by": env["fence"]}
    return out


def _envelope(holder: Offer, delivery_id: str, as_result: bool) -> dict[str, Any]:
    result = {"payload": {"status": "done", "by": holder.fence}} if as_result else {}
    return envelope(holder, delivery_id, **result)


@pytest.fixture(autouse=True, scope="module")
def _template(store_template: Path) -> None:
    StoreMachine.template = store_template


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = budget(200, 30)
