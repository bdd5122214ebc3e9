"""A deterministic simulation of the whole pool: one process, one seed, virtual time (issue 32).

The real store (``store.PoolStore`` on SQLite files in /dev/shm), the real passes, scanners
and runner (``tasks.scan``, ``tasks.runner``), the real failure path and the real Kanban
(behind ``board.faults.FlakyBoard`` for busy calls and poisoned tasks) are driven by fakes
of everything around them, each drawn from one ``random.Random(seed)``:

- a clock: every call gets the simulation's ``now`` (the store and passes take it);
- coordination (``SimCoordination``): locks, pending markers and reservations whose holder
  is a simulated process; what a dead one held lapses ``hold_seconds`` after its death, a
  queued marker ``queued_seconds`` after it was set (as the Redis driver's TTLs do);
- a queue: messages delayed, duplicated, reordered, lost, and redelivered after the
  visibility timeout when the worker that took them dies (acks_late);
- 0-3 beats with skewed clocks sending scan messages; Celery workers (one child each)
  that run them as ``tasks.celery`` does and die at any coordination or board call, or
  freeze (the rest of their message runs with a stale ``now``);
- pool workers, one per ordinal, through the store's wire-level calls (offer, heartbeat,
  accept_result, release, as ``poolkeeper.api.protocol`` calls them): they run, heartbeat,
  deliver (spooling first), release, die (with or without their spool), freeze, come back;
- operators abandoning, requeueing, pausing, cancelling, reassigning and unblocking.

Time runs in episodes: faults for ``--fault-seconds``, then calm (faults off, everyone back,
no new tasks) for ``--calm-seconds``, at whose end everything must have settled. Every step
checks the invariants (``Checker``); the first broken one ends the run with the seed, the
step and the events that led there. The last line names the seed, the steps, steps/s and a
digest of the final state (every row and task): the same seed gives the same digest.

    python bench/sim.py [--seed S] [--steps N | --hours H] [--shrink] [--defect NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from board import open_board
from board.faults import FlakyBoard
from board.protocol import Board, BoardTask, TaskStatus
from core.errors import PoolError, ProtocolError, TransientError
from core.retry import RetryPolicy
from core.settings import Settings
from poolkeeper import operator
from poolkeeper.workerhost.client import envelope
from store import Offer, PoolStore, pause, transitions
from store.models import Assignment, AuditEvent
from tasks import failures, registry, runner, scan
from tasks.plane import Plane
from tasks.redis_coordination import hold_seconds, queued_seconds

LIVE = ("assigned", "running", "result")
TERMINAL = ("finalized", "stale")
BOARD = "sim"
T0 = 1_000_000.0  # the virtual clock's start
FAULTS = ("celery", "pool", "queue", "board", "beat", "operator")
FAULT_WEIGHTS = {"celery": 0.25, "pool": 0.4, "board": 0.2, "beat": 0.15}

# The defects a test may re-introduce in the simulation's own fakes (``--defect``).
DEFECTS = (
    "command-outlives-worker",
    "runs-on-after-refusal",
    "dead-holder-keeps-lock",
    "reruns-refused-result",
)


class Died(BaseException):
    """A simulated process's death at one of its calls: nothing of it runs on."""


class Broken(Exception):
    """An invariant broken: what, at which step."""


@dataclass
class Proc:
    name: str
    alive: bool = True
    died_at: float = 0.0
    die_in: int = -1  # calls until it dies (-1: not this message)


@dataclass
class Entry:
    """A lock, marker or reservation: held by a process (renewed until ``until`` at most), or
    queued (``holder`` None) until ``until``."""

    token: str
    holder: Proc | None
    until: float = float("inf")


class SimCoordination:
    """``tasks.plane.Coordination`` in virtual time, held by simulated processes."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.hold_s = hold_seconds(sim.settings)
        self.queued_s = queued_seconds(sim.settings)
        self.locks: dict[str, Entry] = {}
        self.pending: dict[tuple[str, str], Entry] = {}
        self.reserved: dict[int, Entry] = {}
        self.waiting: dict[str, str] = {}  # claims with no ordinal free, oldest first
        self.tokens = itertools.count(1)

    def valid(self, e: Entry | None) -> bool:
        if e is None:
            return False
        if e.holder is None:
            return self.sim.now < e.until
        if self.sim.defect == "dead-holder-keeps-lock":
            return True
        # its keeper renews it until its holder dies or its ``until`` (a hold's seconds) comes
        renewed = e.until if e.holder.alive else min(e.until, e.holder.died_at)
        return self.sim.now < renewed + self.hold_s

    def _take(self, table: dict[Any, Entry], names: Iterable[Any]) -> list[str | None]:
        self.sim.point()
        holder = self.sim.current
        won: list[str | None] = []
        for name in names:
            if self.valid(table.get(name)):
                won.append(None)
            else:
                token = f"{holder.name if holder else '-'}:{next(self.tokens)}"
                table[name] = Entry(token, holder)
                won.append(token)
        return won

    def lock_many(self, keys: list[str]) -> list[str | None]:
        return self._take(self.locks, keys)

    def unlock_many(self, held: dict[str, str]) -> None:
        self.sim.point()
        for key, token in held.items():
            e = self.locks.get(key)
            if e is not None and e.token == token:
                del self.locks[key]

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]:
        names = [(pass_name, k) for k in keys]
        return [k for (_, k), t in zip(names, self._take(self.pending, names), strict=True) if t]

    def queue_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        self._queue(self.pending, [(pass_name, k) for k in keys])

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        self.sim.point()
        for k in keys:
            self.pending.pop((pass_name, k), None)

    def finish(self, held: dict[str, str], pass_name: str, done: Iterable[str]) -> None:
        self.unlock_many(held)
        self.clear_pending(pass_name, done)

    def reserve(self, ordinals: Iterable[int]) -> list[int]:
        wanted = list(ordinals)
        return [o for o, t in zip(wanted, self._take(self.reserved, wanted), strict=True) if t]

    def queue_reserved(self, ordinals: Iterable[int]) -> None:
        self._queue(self.reserved, list(ordinals))

    def _queue(self, table: dict[Any, Entry], names: list[Any]) -> None:
        self.sim.point()
        for name in names:
            e = table.get(name)
            if e is not None and e.holder is self.sim.current and self.valid(e):
                table[name] = Entry("queued", None, self.sim.now + self.queued_s)

    def wait_for_ordinal(self, claims: dict[str, str]) -> None:
        self.sim.point()
        for name, claim in claims.items():
            self.waiting.setdefault(name, claim)

    def take_waiting(self, at_most: int) -> list[str]:
        self.sim.point()
        taken = list(self.waiting)[: max(at_most, 0)]
        return [self.waiting.pop(name) for name in taken]

    def release(self, ordinals: Iterable[int]) -> None:
        self.sim.point()
        for o in ordinals:
            self.reserved.pop(o, None)

    def hold(self, pass_name: str, names: Iterable[str], ordinals: Iterable[int], seconds: float) -> None:
        self.sim.point()
        keyed: list[tuple[dict[Any, Entry], Any]] = [(self.pending, (pass_name, n)) for n in names]
        keyed += [(self.reserved, o) for o in ordinals]
        for table, key in keyed:
            if self.valid(table.get(key)):
                table[key] = Entry(f"held:{next(self.tokens)}", self.sim.current, self.sim.now + seconds)

    def ping(self) -> None:
        return None

    def record_scan(self, pass_name: str, now: float) -> None:
        return None


class DyingBoard(FlakyBoard):
    """The chaos board, where the calling Celery process may die before or after any call."""

    def __init__(self, inner: Board, sim: Sim) -> None:
        super().__init__(inner, rng=sim.rng)
        self.sim = sim

    def _maybe_fail(self, task_id: str | None = None) -> None:
        self.sim.point()
        super()._maybe_fail(task_id)


@dataclass(order=True)
class Msg:
    ready_at: float
    id: int
    pass_name: str = field(compare=False)
    keys: list[Any] | None = field(compare=False)  # None: a scan message for pass_name
    retries: int = field(compare=False, default=0)


@dataclass
class PoolWorker:
    """One ordinal's worker instance (``owner``), its grant, its command and its spool."""

    ordinal: int
    gen: int = 0
    alive: bool = True
    frozen_until: float = 0.0
    grant: Offer | None = None
    command_ends: float = 0.0
    spool: dict[str, Any] | None = None  # {"grant": Offer, "result": {...}, "id": delivery id}
    releases: bool = False

    @property
    def owner(self) -> str:
        return f"w{self.ordinal}.{self.gen}"


@dataclass
class Config:
    seed: int = 1
    steps: int = 20_000
    ordinals: int = 3
    celery: int = 2
    tasks: int = 30  # tasks added per episode
    fault_seconds: float = 600.0
    calm_seconds: float = 600.0
    faults: tuple[str, ...] = FAULTS
    defect: str | None = None
    log_events: int = 40


class Sim:
    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg, self.defect = cfg, cfg.defect
        self.rng = random.Random(cfg.seed)
        random.seed(cfg.seed)  # the store's and the runner's jitter draw from the module's generator
        self.settings = replace(
            Settings(),
            database_url=f"sqlite:///{workdir / 'store.db'}",
            board_url=f"sqlite:///{workdir / 'board.db'}",
            redis_url="",
            pool_size=cfg.ordinals,
            lease_seconds=30.0,
            tick_seconds=5.0,
            reconcile_seconds=30.0,
            gc_seconds=600.0,
            retention_seconds=3600.0,
            backoff_base_seconds=2.0,
            backoff_max_seconds=60.0,
            quarantine_retry_seconds=120.0,
            task_time_limit=30.0,
            visibility_timeout=180.0,
        )
        self.now = T0
        self.store = PoolStore.from_settings(self.settings)
        self.store.migrate()
        self.kanban = open_board(self.settings)  # the Kanban: a sqlite board URL
        self.kanban.migrate()
        self.board = DyingBoard(self.kanban, self)
        self.coord = SimCoordination(self)
        self.plane = Plane(self.settings, self.store, self.board, self.coord)
        self.policy = RetryPolicy.from_settings(self.settings)
        self.current: Proc | None = None
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.queue: list[Msg] = []
        self.msg_ids = itertools.count(1)
        self.log: deque[str] = deque(maxlen=cfg.log_events)
        self.step = 0
        self.summary = ""
        self.cpu_seconds = 0.0
        self.kinds: Counter[str] = Counter()
        self.calm = True  # the first episode's start turns the faults on
        self.episode_end = self.now + cfg.fault_seconds
        self.celery = [Proc(f"c{i}.0") for i in range(cfg.celery)]
        self.busy: list[Msg | None] = [None] * cfg.celery
        self.beats = [Proc(f"b{i}.0", alive=i == 0 or self.on("beat")) for i in range(3)]
        self.skew = [self.rng.uniform(-1.0, 1.0) for _ in range(3)]
        self.workers = [PoolWorker(o) for o in range(cfg.ordinals)]
        self.task_n = itertools.count(1)
        self.poisoned: set[str] = set()
        self.check = Checker(self)
        for i, _ in enumerate(self.beats):
            for p in registry.PASSES:
                self.at(self.now + self.rng.uniform(0, 1), "beat", (i, p.name))
        for o in range(cfg.ordinals):
            self.at(self.now + self.rng.uniform(0, 2), "poll", o)
        self.at(self.now, "episode", None)

    # --- the schedule -------------------------------------------------------------------

    def on(self, fault: str) -> bool:
        return not self.calm and fault in self.cfg.faults

    def chance(self, fault: str, p: float) -> bool:
        return self.on(fault) and self.rng.random() < p

    def at(self, t: float, kind: str, arg: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, arg))

    def note(self, what: str) -> None:
        self.log.append(f"{self.step:>8d} t={self.now - T0:9.2f} {what}")

    def point(self) -> None:
        """A call of the current process: where a Celery process dies, if it is to."""
        me = self.current
        if me is not None and me.die_in >= 0:
            if me.die_in == 0:
                raise Died(me.name)
            me.die_in -= 1

    def run(self) -> None:
        while self.step < self.cfg.steps:
            t, _, kind, arg = heapq.heappop(self.events)
            self.now = max(self.now, t)
            self.step += 1
            self.kinds[kind] += 1
            touched = getattr(self, f"ev_{kind}")(arg)
            if touched:
                self.check.store()
            self.check.healed()

    # --- episodes, tasks, operators ------------------------------------------------------

    def ev_episode(self, _: Any) -> bool:
        if self.calm:
            if self.step > 1:
                self.check.settled()
            self.calm = False
            self.episode_end = self.now + self.cfg.fault_seconds
            self.note("episode: faults on")
            for _ in range(self.cfg.tasks):
                self.at(self.now + self.rng.uniform(0, self.cfg.fault_seconds * 0.8), "add", None)
            self.at(self.now + self.rng.expovariate(1 / 60), "operator", None)
            self.at(self.now + self.rng.expovariate(1 / 120), "fault", None)
            self.at(self.episode_end, "episode", None)
        else:
            self.calm = True
            self.note("episode: calm")
            for i, b in enumerate(self.celery):
                if not b.alive:
                    self.restart_celery(i)
            if not any(b.alive for b in self.beats):
                self.beats[0] = Proc(f"b0.{self.now:.0f}")
            self.board.busy_rate = 0.0
            for w in self.workers:
                w.frozen_until = min(w.frozen_until, self.now)
                if not w.alive:
                    self.restart_worker(w)
            with self.store.session() as s:
                pause.resume(s, now=self.now, actor="operator")
            self.at(self.now + self.cfg.calm_seconds, "episode", None)
            self.at(self.now + 60, "operator", None)
        return False

    def ev_add(self, _: Any) -> bool:
        task_id = f"t{next(self.task_n)}"
        self.kanban.add_task(BOARD, f"task {task_id}", task_id=task_id)
        if self.chance("board", 0.05):
            self.poisoned.add(task_id)
            self.board.poison = frozenset(self.poisoned)
        self.note(f"add {task_id}{' (poisoned)' if task_id in self.poisoned else ''}")
        return False

    def ev_operator(self, _: Any) -> bool:
        with self.store.session(readonly=True) as s:
            rows = list(s.scalars(select(Assignment).where(Assignment.state.not_in(TERMINAL))))
        try:
            if self.calm:  # what an operator does with a quarantined row: abandon it
                for r in rows:
                    if r.quarantined:
                        self.note(f"operator abandons quarantined row {r.id}")
                        operator.abandon(self.kanban, self.store, r.id, "quarantined", self.now)
                self.at(self.now + 60, "operator", None)
                return True
            if not self.on("operator"):
                return True
            act = self.rng.choice(["abandon", "requeue", "pause", "resume", "cancel", "reassign", "unblock"])
            tasks = self.kanban.list_tasks(BOARD)
            if act in ("abandon", "requeue") and rows:
                r = self.rng.choice(rows)
                self.note(f"operator {act} row {r.id} ({r.state})")
                if act == "abandon":
                    operator.abandon(self.kanban, self.store, r.id, "operator", self.now)
                else:
                    with self.store.session() as s:
                        transitions.requeue(s, r.id, now=self.now, actor="operator")
            elif act in ("pause", "resume"):
                self.note(f"operator {act}")
                with self.store.session() as s:
                    if act == "pause":
                        pause.pause(s, "sim", now=self.now, actor="operator")
                    else:
                        pause.resume(s, now=self.now, actor="operator")
            elif tasks:
                t = self.rng.choice(tasks)
                self.note(f"operator {act} {t.id} ({t.status})")
                if act == "cancel" and t.status != TaskStatus.DONE:
                    operator.cancel(self.kanban, self.store, BOARD, t.id, self.now)
                elif act == "reassign" and t.status == TaskStatus.RUNNING:
                    self.kanban.reassign_task(BOARD, t.id, assignee="someone", lane="other")
                elif act == "unblock" and t.status == TaskStatus.BLOCKED:
                    self.kanban.unblock_task(BOARD, t.id)
        except PoolError as err:
            self.note(f"operator refused: {type(err).__name__}: {str(err)[:80]}")
        self.at(self.now + self.rng.expovariate(1 / 60), "operator", None)
        return True

    def ev_fault(self, _: Any) -> bool:
        if self.calm:
            return False
        kinds = [k for k in ("celery", "pool", "board", "beat") if k in self.cfg.faults]
        if kinds:
            kind = self.rng.choices(kinds, [FAULT_WEIGHTS[k] for k in kinds])[0]
            if kind == "celery":
                i = self.rng.randrange(len(self.celery))
                self.kill_celery(i, child=False)
            elif kind == "pool":
                busy = [w for w in self.workers if w.alive and w.grant is not None]
                w = self.rng.choice(busy or self.workers)  # a fault hits a worker at work more often
                roll = self.rng.random()
                if roll < 0.3:
                    self.kill_worker(w, keep_spool=self.rng.random() < 0.5)
                elif roll < 0.7 and w.alive and w.grant is not None:
                    self.replace_frozen(w)
                else:
                    w.frozen_until = self.now + self.rng.uniform(1, 3 * self.settings.lease_seconds)
                    self.note(f"{w.owner} frozen until {w.frozen_until - T0:.1f}")
            elif kind == "board":
                self.board.busy_rate = self.rng.choice([0.0, 0.1, 0.5, 1.0])
                self.note(f"board busy rate {self.board.busy_rate}")
            else:
                i = self.rng.randrange(3)
                b = self.beats[i]
                b.alive = not b.alive
                if b.alive:
                    self.beats[i] = Proc(f"b{i}.{self.step}")
                self.note(f"beat {i} {'up' if b.alive else 'down'}")
        self.at(self.now + self.rng.expovariate(1 / 30), "fault", None)
        return False

    # --- beats, the queue, Celery workers -----------------------------------------------

    def ev_beat(self, arg: tuple[int, str]) -> bool:
        i, pass_name = arg
        p = registry.get(pass_name)
        if self.beats[i].alive:
            self.send(Msg(self.now, next(self.msg_ids), pass_name, None))
        self.at(self.now + p.interval(self.settings) + self.skew[i] * 0.1, "beat", arg)
        return False

    def send(self, msg: Msg) -> None:
        if self.chance("queue", 0.02):
            self.note(f"queue loses {msg.pass_name} {msg.keys}")
            return
        if self.chance("queue", 0.05):
            msg.ready_at += self.rng.expovariate(1 / 10)
        heapq.heappush(self.queue, msg)
        if self.chance("queue", 0.03):
            heapq.heappush(self.queue, replace(msg, id=next(self.msg_ids)))
        for i, m in enumerate(self.busy):
            if m is None and self.celery[i].alive:
                self.at(max(self.now, msg.ready_at), "celery", i)
                break

    def enqueue(self, pass_name: str, keys: list[Any]) -> None:
        self.point()
        self.send(Msg(self.now, next(self.msg_ids), pass_name, keys))

    def take(self) -> Msg | None:
        ready = [m for m in self.queue if m.ready_at <= self.now]
        if not ready:
            return None
        msg = self.rng.choice(ready) if self.chance("queue", 0.2) else min(ready)
        self.queue.remove(msg)
        heapq.heapify(self.queue)
        return msg

    def ev_celery(self, i: int) -> bool:
        me = self.celery[i]
        if not me.alive or self.busy[i] is not None:
            return False
        msg = self.take()
        if msg is None:
            if self.queue:
                self.at(min(self.queue).ready_at, "celery", i)
            return False
        self.busy[i] = msg
        stale = 0.0
        if self.chance("celery", 0.01):
            stale = self.rng.uniform(0, 2 * self.settings.lease_seconds)
            self.note(f"{me.name} frozen {stale:.1f}s in {msg.pass_name} {msg.keys}")
        me.die_in = self.rng.randrange(8) if self.chance("celery", 0.01) else -1
        self.current = me
        try:
            self.process(msg, self.now - stale)
        except Died:
            self.note(f"{me.name} dies in {msg.pass_name} {msg.keys}")
            self.kill_celery(i, child=self.rng.random() < 0.5, msg=msg)
            return True
        finally:
            self.current = None
            me.die_in = -1
        self.busy[i] = None
        self.at(self.now + 0.01, "celery", i)
        return True

    def process(self, msg: Msg, now: float) -> None:
        """``tasks.celery.scan_pass`` or ``tasks.celery.process`` for one message."""
        if msg.keys is None:
            with contextlib.suppress(TransientError):  # the scan skips this tick
                scan.scan(self.plane, msg.pass_name, now, self.enqueue)
            return
        p = registry.get(msg.pass_name)
        self.coord.hold(p.name, [p.key_name(k) for k in msg.keys], [], self.settings.task_time_limit)
        again: list[Any] = []

        def settle(result: runner.BatchResult) -> list[Any]:
            finished = [key for key, _ in result.done]
            for key, err in result.transient:
                if msg.retries < self.settings.transient_retries:
                    again.append(key)
                else:
                    failures.give_up(self.plane, p, key, err, now)
                    finished.append(key)
            return finished

        runner.run_batch(self.plane, msg.pass_name, msg.keys, now, settle=settle)
        if len(msg.keys) == 1 and again:
            backoff = self.policy.backoff(msg.retries + 1, self.rng)
            self.send(Msg(self.now + backoff, next(self.msg_ids), msg.pass_name, msg.keys, msg.retries + 1))
        else:
            for key in again:
                backoff = self.policy.backoff(1, self.rng)
                self.send(Msg(self.now + backoff, next(self.msg_ids), msg.pass_name, [key], 1))

    def kill_celery(self, i: int, *, child: bool, msg: Msg | None = None) -> None:
        me = self.celery[i]
        if not me.alive:
            return
        me.alive, me.died_at = False, self.now
        msg = msg or self.busy[i]
        self.busy[i] = None
        if msg is not None:  # acks_late: a lost child's message is rejected now; a lost worker's waits
            later = 0.0 if child else self.settings.visibility_timeout
            heapq.heappush(self.queue, replace(msg, ready_at=self.now + later))
        self.note(f"{me.name} {'child' if child else 'worker'} dead")
        self.at(self.now + self.rng.uniform(0.5, 30), "restart", i)

    def ev_restart(self, i: int) -> bool:
        if not self.celery[i].alive:
            self.restart_celery(i)
        return False

    def restart_celery(self, i: int) -> None:
        gen = int(self.celery[i].name.split(".")[1]) + 1
        self.celery[i] = Proc(f"c{i}.{gen}")
        self.note(f"c{i}.{gen} up")
        self.at(self.now, "celery", i)

    # --- pool workers -----------------------------------------------------------------

    def ev_poll(self, o: int) -> bool:
        w = self.workers[o]
        if not w.alive:
            return False
        if w.frozen_until > self.now:
            self.at(w.frozen_until, "poll", o)
            return False
        if w.grant is not None:  # a stale poll: the worker is busy with a grant
            return False
        try:
            if w.spool is not None:  # a spooled result goes before any new grant
                self.deliver(w)
                if w.spool is not None:
                    self.at(self.now + 1, "poll", o)
                    return True
            grant = self.store.offer(o, owner=w.owner, now=self.now)
        except TransientError:
            self.at(self.now + 1, "poll", o)
            return True
        except PoolError as err:
            self.note(f"{w.owner} offer refused: {type(err).__name__}")
            self.at(self.now + 1, "poll", o)
            return True
        if grant is None:
            self.at(self.now + self.rng.uniform(0.5, 2), "poll", o)
            return True
        self.check.granted(grant)
        w.grant = grant
        w.command_ends = self.now + self.rng.expovariate(1 / 20)
        w.releases = self.chance("pool", 0.03)
        self.check.started(w, grant)
        self.note(
            f"{w.owner} runs {grant.task_id} run {grant.run_id} attempt {grant.attempt} fence {grant.fence}"
        )
        self.at(self.now + self.settings.lease_seconds / 3, "heartbeat", (o, grant.fence))
        self.at(w.command_ends, "finish", (o, grant.fence))
        return True

    def ev_heartbeat(self, arg: tuple[int, int]) -> bool:
        o, fence = arg
        w = self.workers[o]
        if not w.alive or w.grant is None or w.grant.fence != fence:
            return False
        if w.frozen_until > self.now:
            self.at(w.frozen_until, "heartbeat", arg)
            return False
        try:
            got = self.store.heartbeat(envelope(w.grant, f"hb-{fence}-{self.step}"), now=self.now)
            self.check.applied(w.grant, "heartbeat", got)
        except TransientError:
            self.at(self.now + 1, "heartbeat", arg)
            return True
        except ProtocolError as err:
            self.note(f"{w.owner} heartbeat refused: {str(err)[:80]}")
            self.drop(w, refused=True)
            return True
        self.at(self.now + self.settings.lease_seconds / 3, "heartbeat", arg)
        return True

    def ev_finish(self, arg: tuple[int, int]) -> bool:
        o, fence = arg
        w = self.workers[o]
        if not w.alive or w.grant is None or w.grant.fence != fence:
            return False
        if w.frozen_until > self.now:
            self.at(w.frozen_until, "finish", arg)
            return False
        g = w.grant
        self.check.ended(g)
        if w.releases:
            try:
                got = self.store.release(envelope(g, f"rel-{fence}"), now=self.now)
                self.note(f"{w.owner} releases fence {fence}: {got}")
            except PoolError as err:
                self.note(f"{w.owner} release refused: {type(err).__name__}")
            w.grant = None
            self.at(self.now + 0.1, "poll", o)
            return True
        blocked = self.rng.random() < 0.1
        result = {"status": "blocked", "reason": "sim"} if blocked else {"status": "done"}
        w.spool = {"grant": g, "id": f"res-{fence}", "result": {**result, "run": g.run_id, "fence": fence}}
        w.grant = None
        self.deliver(w)
        self.at(self.now + (1 if w.spool is not None else 0.1), "poll", o)
        return True

    def deliver(self, w: PoolWorker) -> None:
        """The spooled result: delivered (or refused) clears the spool; a busy store keeps it."""
        assert w.spool is not None
        g: Offer = w.spool["grant"]
        try:
            got = self.store.accept_result(
                envelope(g, w.spool["id"], payload=w.spool["result"]), now=self.now
            )
            self.check.applied(g, "result", got)
            self.check.delivered(g)
            self.note(f"{w.owner} delivers fence {g.fence}: {got}")
        except TransientError:
            return
        except ProtocolError as err:
            self.note(f"{w.owner} result refused: {str(err)[:80]}")
            if self.defect == "reruns-refused-result":  # runs the command again for that grant
                self.check.started(w, g)
                self.check.ended(g)
        w.spool = None

    def drop(self, w: PoolWorker, *, refused: bool) -> None:
        """The grant is gone (refused): the worker ends its command, unless a defect keeps it on."""
        if w.grant is not None and not (refused and self.defect == "runs-on-after-refusal"):
            self.check.ended(w.grant)
        w.grant = None
        self.at(self.now + 0.1, "poll", w.ordinal)

    def kill_worker(self, w: PoolWorker, *, keep_spool: bool) -> None:
        if not w.alive:
            return
        self.note(f"{w.owner} dies{' keeping its spool' if keep_spool else ''}")
        if w.grant is not None and self.defect != "command-outlives-worker":
            self.check.ended(w.grant)
        w.alive, w.grant = False, None
        w.spool = w.spool if keep_spool else None
        self.at(self.now + self.rng.uniform(0.5, 2 * self.settings.lease_seconds), "comeback", w.ordinal)

    def replace_frozen(self, w: PoolWorker) -> None:
        """The worker freezes and its supervisor starts another in its place; the frozen one
        thaws later and makes one late write with its old grant (a heartbeat or its result)."""
        assert w.grant is not None
        late = "result" if self.rng.random() < 0.5 else "heartbeat"
        self.note(f"{w.owner} frozen and replaced; a late {late} of fence {w.grant.fence} to come")
        self.at(
            self.now + self.rng.uniform(0.5, 1.5 * self.settings.lease_seconds), "zombie", (w.grant, late)
        )
        w.grant = None
        self.restart_worker(w)

    def ev_zombie(self, arg: tuple[Offer, str]) -> bool:
        g, late = arg
        try:
            if late == "result":
                body = envelope(
                    g, f"res-{g.fence}", payload={"status": "done", "run": g.run_id, "fence": g.fence}
                )
                got = self.store.accept_result(body, now=self.now)
                self.check.delivered(g)
            else:
                got = self.store.heartbeat(envelope(g, f"hb-{g.fence}-late"), now=self.now)
            self.check.applied(g, late, got)
            self.note(f"late {late} of fence {g.fence}: {got}")
        except PoolError as err:
            self.note(f"late {late} of fence {g.fence} refused: {str(err)[:80]}")
        return True

    def ev_comeback(self, o: int) -> bool:
        if not self.workers[o].alive:
            self.restart_worker(self.workers[o])
        return False

    def restart_worker(self, w: PoolWorker) -> None:
        w.alive, w.gen, w.frozen_until = True, w.gen + 1, 0.0
        if self.defect != "command-outlives-worker":
            self.check.end_ordinal(w.ordinal)  # it ends whatever a predecessor left running
        self.note(f"{w.owner} up")
        self.at(self.now, "poll", w.ordinal)

    # --- the end ------------------------------------------------------------------------

    def digest(self) -> str:
        with self.store.session(readonly=True) as s:
            rows = s.execute(
                select(
                    Assignment.id,
                    Assignment.board,
                    Assignment.task_id,
                    Assignment.run_id,
                    Assignment.ordinal,
                    Assignment.state,
                    Assignment.attempt,
                    Assignment.fence,
                ).order_by(Assignment.id)
            ).all()
        tasks = sorted(
            (t.id, str(t.status), t.current_run_id, t.lane, json.dumps(t.result, sort_keys=True))
            for t in self.kanban.list_tasks(BOARD)
        )
        return hashlib.sha256(json.dumps([[list(r) for r in rows], tasks]).encode()).hexdigest()[:16]


class Checker:
    """The invariants, checked at every step that touched the store, and at each calm end."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.seen: dict[int, tuple[str, int, int]] = {}  # row id -> (state, fence, attempt)
        self.granted_fence: dict[int, int] = {}  # row id -> the newest fence any offer granted
        self.running: dict[tuple[str, int], tuple[int, int]] = {}  # (task, run) -> (ordinal, fence)
        self.fences: set[int] = set()  # fences whose command started
        self.accepted: set[tuple[str, int, int]] = set()  # (task, run, fence) whose result was accepted
        self.db = sqlite3.connect(sim.store.engine.url.database or "", isolation_level=None)
        self.version = -1

    def fail(self, what: str) -> None:
        raise Broken(what)

    def granted(self, g: Offer) -> None:
        if g.fence <= self.granted_fence.get(g.row_id, 0):
            self.fail(f"row {g.row_id}: fence {g.fence} granted after fence {self.granted_fence[g.row_id]}")
        self.granted_fence[g.row_id] = g.fence

    def started(self, w: PoolWorker, g: Offer) -> None:
        if g.fence in self.fences:
            self.fail(f"fence {g.fence} executed twice ({g.task_id} run {g.run_id})")
        self.fences.add(g.fence)
        other = self.running.get((g.task_id, g.run_id))
        if other is not None:
            self.fail(f"{g.task_id} run {g.run_id} executed twice at once: fences {other[1]} and {g.fence}")
        self.running[(g.task_id, g.run_id)] = (w.ordinal, g.fence)

    def ended(self, g: Offer) -> None:
        if self.running.get((g.task_id, g.run_id), (0, 0))[1] == g.fence:
            del self.running[(g.task_id, g.run_id)]

    def end_ordinal(self, ordinal: int) -> None:
        for run, (o, _) in list(self.running.items()):
            if o == ordinal:
                del self.running[run]

    def applied(self, g: Offer, what: str, outcome: str) -> None:
        newest = self.granted_fence.get(g.row_id, 0)
        if outcome == "applied" and g.fence < newest:
            self.fail(f"row {g.row_id}: {what} of fence {g.fence} applied after fence {newest} was granted")

    def delivered(self, g: Offer) -> None:
        self.accepted.add((g.task_id, g.run_id, g.fence))

    def healed(self) -> None:
        """Coordination heals itself: what a dead process held is free within 2 ticks."""
        coord, bound = self.sim.coord, 2 * self.sim.settings.tick_seconds
        tables: list[dict[Any, Entry]] = [coord.locks, coord.pending, coord.reserved]
        for table in tables:
            for name, e in table.items():
                h = e.holder
                if h is not None and not h.alive and self.sim.now - h.died_at > bound and coord.valid(e):
                    self.fail(f"{name} still held by {h.name}, dead for {self.sim.now - h.died_at:.1f}s")

    def store(self) -> None:
        """The rows, read on a connection of the checker's own, only when the store has changed:
        SQLite's ``data_version`` moves whenever another connection commits."""
        version = self.db.execute("PRAGMA data_version").fetchone()[0]
        if version == self.version:
            return
        self.version = version
        rows = self.db.execute(
            "SELECT id, state, ordinal, fence, attempt, task_id, run_id FROM assignments"
        ).fetchall()
        live: dict[int, int] = {}
        now_seen: dict[int, tuple[str, int, int]] = {}
        for rid, state, ordinal, fence, attempt, task_id, run_id in rows:
            if state in LIVE:
                if ordinal in live:
                    self.fail(f"ordinal {ordinal} holds two live rows: {live[ordinal]} and {rid}")
                live[ordinal] = rid
            was = self.seen.get(rid)
            if was is not None:
                if was[0] in TERMINAL and state != was[0]:
                    self.fail(f"row {rid}: terminal {was[0]} became {state}")
                if (fence or 0) < was[1]:
                    self.fail(f"row {rid}: fence went back from {was[1]} to {fence}")
            if state in TERMINAL and (was is None or was[0] not in TERMINAL):
                self.evidence(rid, state, task_id, run_id)
            now_seen[rid] = (state, fence or 0, attempt)
        for rid, was in self.seen.items():
            if rid not in now_seen and was[0] not in TERMINAL:
                self.fail(f"row {rid} deleted while {was[0]}")
        self.seen = now_seen

    def evidence(self, rid: int, state: str, task_id: str, run_id: int) -> None:
        """A row turned terminal: the board's word about its exact run must say so."""
        t = self.sim.kanban.get_task(BOARD, task_id)
        if t is not None and t.status == TaskStatus.RUNNING and t.current_run_id == run_id:
            self.fail(f"row {rid} ({task_id} run {run_id}) {state} while the board still runs that run")
        if state == "finalized" and t is not None and t.status == TaskStatus.DONE:
            got = t.result or {}
            if "fence" in got and (task_id, run_id, got["fence"]) not in self.accepted:
                self.fail(f"{task_id} done with a result no accepted delivery of run {run_id} made")

    def settled(self) -> None:
        """At a calm phase's end: every pool task settled, every row terminal, the audit trail
        replaying to every row's state."""
        open_: list[BoardTask] = [
            t
            for t in self.sim.kanban.list_tasks(BOARD)
            if t.lane == self.sim.settings.lane and t.status in (TaskStatus.READY, TaskStatus.RUNNING)
        ]
        if open_:
            self.fail(f"not settled after calm: {', '.join(f'{t.id} {t.status}' for t in open_[:5])}")
        with self.sim.store.session(readonly=True) as s:
            rows = s.execute(select(Assignment.id, Assignment.state)).all()
            newest = select(func.max(AuditEvent.id)).group_by(AuditEvent.row_id)
            last = dict(
                s.execute(
                    select(AuditEvent.row_id, AuditEvent.to_state).where(AuditEvent.id.in_(newest))
                ).all()
            )
        for rid, state in rows:
            if state not in TERMINAL:
                self.fail(f"row {rid} still {state} after calm")
            if rid in last and last[rid] not in (None, state):
                self.fail(f"row {rid}: audit trail ends at {last[rid]}, row is {state}")


def run_once(cfg: Config) -> tuple[Sim, Broken | None, float, str]:
    workdir = Path(tempfile.mkdtemp(prefix="sim-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    sim = Sim(cfg, workdir)
    broken: Broken | None = None
    started, cpu = time.perf_counter(), time.process_time()
    try:
        sim.run()
    except Broken as err:
        broken = err
    elapsed = time.perf_counter() - started
    sim.cpu_seconds = time.process_time() - cpu
    try:
        digest = sim.digest()
        counts = sim.kanban.counts_by_status()
        sim.summary = f"virtual {sim.now - T0:.0f}s, board {counts}, steps by kind {dict(sim.kinds)}"
    finally:
        sim.check.db.close()
        sim.store.engine.dispose()
        sim.kanban.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return sim, broken, elapsed, digest


def failing_step(cfg: Config) -> int | None:
    """The step at which ``cfg``'s schedule breaks an invariant, or None."""
    sim, broken, _, _ = run_once(cfg)
    return sim.step if broken is not None else None


def shrink(cfg: Config, step: int) -> Config:
    """A shorter schedule that still fails: steps cut to the failing one, then each fault kind,
    Celery worker, ordinal and task per episode taken away while the run still fails."""
    best = replace(cfg, steps=step)
    for kind in cfg.faults:
        trial = replace(best, faults=tuple(k for k in best.faults if k != kind))
        got = failing_step(trial)
        if got is not None:
            best = replace(trial, steps=got)
    for name in ("celery", "ordinals", "tasks"):
        while getattr(best, name) > 1:
            got = failing_step(replace(best, **{name: getattr(best, name) - 1}))
            if got is None:
                break
            best = replace(best, steps=got, **{name: getattr(best, name) - 1})
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--hours", type=float, help="run seed after seed for this long (wall clock)")
    ap.add_argument("--ordinals", type=int, default=3)
    ap.add_argument("--celery", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=30, help="tasks added per episode")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--defect", choices=DEFECTS)
    ap.add_argument("--shrink", action="store_true")
    a = ap.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the passes log every injected fault; the checker reports
    cfg = Config(
        seed=a.seed,
        steps=a.steps,
        ordinals=a.ordinals,
        celery=a.celery,
        tasks=a.tasks,
        faults=tuple(f for f in a.faults.split(",") if f),
        defect=a.defect,
    )
    deadline = time.monotonic() + a.hours * 3600 if a.hours else None
    total_steps, total_s = 0, 0.0
    while True:
        sim, broken, elapsed, digest = run_once(cfg)
        total_steps, total_s = total_steps + sim.step, total_s + elapsed
        if broken is not None:
            print(f"BROKEN at step {sim.step} (seed {cfg.seed}): {broken}")
            print("events leading there:")
            print("\n".join(sim.log))
            if a.shrink:
                small = shrink(cfg, sim.step)
                print(f"shrunk: {command(small)}")
        print(f"  {sim.summary}")
        line = (
            f"sim seed={cfg.seed} steps={sim.step} steps/s={sim.step / elapsed:.0f} "
            f"(per CPU second {sim.step / max(sim.cpu_seconds, 1e-9):.0f}) "
            f"digest={digest} {'BROKEN' if broken else 'ok'}"
        )
        if deadline is None or broken is not None or time.monotonic() > deadline:
            if deadline is not None:
                line += f" (total {total_steps} steps, {total_steps / total_s:.0f} steps/s)"
            print(line, flush=True)
            return 1 if broken else 0
        print(line, flush=True)
        cfg = replace(cfg, seed=cfg.seed + 1)


def command(cfg: Config) -> str:
    parts = [f"python bench/sim.py --seed {cfg.seed} --steps {cfg.steps}", f"--faults {','.join(cfg.faults)}"]
    parts += [f"--ordinals {cfg.ordinals} --celery {cfg.celery} --tasks {cfg.tasks}"]
    parts += [f"--defect {cfg.defect}"] if cfg.defect else []
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
