"""The project's own fault soak: the whole plane on real processes, each kind of process killed at random.

A private redis-server on a free loopback port, a SQLite store and board in a temporary
folder (``--database-url`` for PostgreSQL, ``--postgres`` for a private cluster the soak
starts and may restart, cut, lock and freeze), ``poolctl init``, 2 Celery workers, 2 beats,
``poolctl serve`` and one ``poolctl worker`` per ordinal, whose command is a small script
that records every execution from inside itself (one ``O_APPEND`` write per line): run,
attempt, fence, owner, pid and time at start and at end. It also takes a ``flock`` on its
run, so a second execution of one run while the first lives is seen by the kernel, even
when the first was SIGKILLed and wrote no end. Tasks: short ones, some poisoned (every board
call about them fails), some hanging (longer than the lease: heartbeats must hold it), some
failing (exit 3: parked), on a busy board.

For ``--duration`` seconds a fault injector kills one process at a time (``--faults
production``: freezes one for a lease and a second, restarts the database, cuts its
connections or locks a table), round-robin over the chosen kinds in a shuffled order; a
supervisor loop restarts every dead process after
``--restart-delay`` (Redis: stopped, then started on the same port; a ``worker-away`` pool
worker, killed with its command, only once the expire pass has re-offered its run). Then
it waits, faults off, until every task is done or blocked, or the hard ``--deadline`` passes. A sampler
compares the board's running runs with the store's rows and watches dispatch; quarantined
rows are abandoned, as an operator would (that is how a poisoned task ends).

It prints the settings and its command line first, a progress line every 30 s, and at the
end, per fault kind, the time to recover (p50, p99) against its bound, and the checks: lost,
two executions of one run at once, a fence executed twice, the longest time a claimed run
had no row, the longest dispatch stall. Exit 1 on any violation or broken bound. Every
process it started is killed on every way out (Ctrl-C and its own crash included).

    python bench/soak.py [--tasks N] [--ordinals N] [--duration S] [--faults all|none|KIND,...]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import itertools
import json
import math
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

from board import Board, open_board
from core.errors import PoolError
from core.settings import Settings
from poolkeeper import operator, tokens
from poolkeeper.embedded import ROOT, CeleryProc, RedisServer, ServeProc, free_port
from store import PoolStore, audit, presence, queries
from store.models import RowState

BOARD = "soak"
FAULT_KINDS = (
    "worker+command", "worker-only", "worker-away", "celery-worker", "celery-child", "beat", "serve", "redis"
)  # fmt: skip
# What production adds to process deaths (``--faults production``): the database restarted
# (immediate shutdown), its connections cut, a table locked for a lease, and processes frozen
# (SIGSTOP, then SIGCONT a lease and a second later). The database's need ``--postgres``.
DB_KINDS = ("db-restart", "db-cut", "db-lock", "freeze-database")
FREEZE_KINDS = ("freeze-serve", "freeze-celery-worker", "freeze-beat", "freeze-redis", "freeze-database")
PRODUCTION_KINDS = ("db-restart", "db-cut", "db-lock", *FREEZE_KINDS)
DISPATCH_KINDS = ("celery-worker", "celery-child", "beat", "redis")  # recovery: the next claim
# recovery: the next claim after the dependency is back (restarted, cut, unlocked, thawed)
BACK_KINDS = tuple(k for k in PRODUCTION_KINDS if k != "freeze-serve")
WORKER_KINDS = ("worker+command", "worker-only", "worker-away")  # a pool worker killed mid-command
WITH_COMMAND = ("worker+command", "worker-away")  # its command killed too (the whole pod)
# worker-away: not restarted until the expire pass re-offered its run (recovery: kill to re-offer);
# the other worker kinds: restarted at once (recovery: the run starts again under the new worker).
PROGRESS_EVERY = 30.0  # seconds between progress lines
POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]  # as embedded.ServeProc runs it

# The command each `poolctl worker` runs: argv LOG LOCKS WORK_MIN WORK_MAX HANG. Standard library only.
COMMAND = r"""
import fcntl, json, os, random, signal, sys, time
log_path, locks, low, high, hang = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:6])
env = os.environ
key = f"{env['POOL_BOARD']}/{env['POOL_TASK_ID']}/{env['POOL_RUN_ID']}"
log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def line(event, **extra):
    rec = {"ev": event, "key": key, "attempt": int(env["POOL_ATTEMPT"]), "fence": int(env["POOL_FENCE"]),
           "owner": env["POOL_OWNER"], "pid": os.getpid(), "t": time.time(), **extra}
    os.write(log, (json.dumps(rec) + "\n").encode())
lock = os.open(os.path.join(locks, key.replace("/", "_")), os.O_RDWR | os.O_CREAT, 0o644)
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    alone = True
except BlockingIOError:
    alone = False  # another execution of this run is alive right now
line("start", alone=alone)
def end(rc):
    fcntl.flock(lock, fcntl.LOCK_UN)  # before the end line: a later start that finds it held overlapped
    line("end", rc=rc)
    os._exit(rc)
signal.signal(signal.SIGTERM, lambda *_: end(143))
sys.stdin.read()
kind = env["POOL_TASK_ID"].split("-")[0]
time.sleep(hang if kind == "hang" else random.uniform(low, high))
if kind == "fail":
    try:
        print("soak: failing on purpose", file=sys.stderr, flush=True)
    except OSError:
        pass  # the worker that read our stderr is gone: still end, and say so in the log
end(3 if kind == "fail" else 0)
"""


@dataclass
class Managed:
    """One process the soak supervises: how to start it, the live one, when to start it again."""

    kind: str
    name: str
    spawn: Callable[[str], subprocess.Popen[bytes]]  # the log name of this incarnation
    proc: subprocess.Popen[bytes] | None = None
    generation: int = 0
    restart_at: float | None = None
    planned: bool = False  # the soak killed it (not a crash)
    crashes: int = 0
    ready: int = 0  # a Celery worker: the last generation whose log said it is ready

    def consuming(self, workdir: Path) -> bool:
        """A Celery worker whose live generation is up (its log says ``ready``)."""
        if not self.alive():
            return False
        if self.ready != self.generation:
            log = workdir / f"{self.name}-{self.generation}.log"
            if log.exists() and " ready." in log.read_text(errors="replace"):
                self.ready = self.generation
        return self.ready == self.generation

    def start(self) -> None:
        self.generation += 1
        self.proc = self.spawn(f"{self.name}-{self.generation}")

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Fault:
    kind: str
    t: float
    target: str
    command_pids: list[int] = field(default_factory=list)  # what ran under a killed pool worker
    run: str = ""  # board/task/run of the grant that command served
    attempt: int = 0  # and its attempt
    reoffered: float | None = None  # worker-away: when the expire pass moved that attempt off running
    restarted: float | None = None
    log: Path | None = None  # the replacement's log


@dataclass
class Watch:
    """What the sampler saw, filled in from its thread."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)  # t, ready, free ordinals
    no_row_since: dict[tuple[str, int], float] = field(default_factory=dict)
    no_row: dict[str, float] = field(default_factory=dict)  # run -> longest time it was claimed, no row
    stall_since: float | None = None
    down_spans: list[tuple[float, float]] = field(default_factory=list)  # no Celery worker could serve
    down_since: float | None = None
    longest_stall: float = 0.0
    stall_at: float = 0.0
    claims: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # the board's tasks by status, last sample
    abandoned: int = 0
    settled: bool = False
    errors: Counter[str] = field(default_factory=Counter)


@dataclass
class Lasting:
    """A fault that lasts: frozen processes thawed (SIGCONT), or a lock let go, at ``until``."""

    fault: Fault
    until: float
    pids: list[int] = field(default_factory=list)
    done: threading.Event | None = None  # a db-lock's holder: set once it let go


class PrivatePostgres:
    """A PostgreSQL cluster of the soak's own (``initdb`` into its folder, a free loopback port),
    so restarting, cutting, locking and freezing the database never touch a shared server."""

    def __init__(self, workdir: Path) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        initdb = str(found[-1]) if found else shutil.which("initdb")  # Debian's, else one on PATH
        if initdb is None:
            sys.exit("soak: --postgres: no initdb here (Debian's postgresql package brings it)")
        self.bin = Path(initdb).parent
        self.dir, self.sockets = workdir / "pg", workdir / "pg-sockets"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/soak"
        # PostgreSQL refuses to run as root: then its processes run as the postgres user.
        self.as_user: dict[str, Any] = (
            {"user": "postgres", "group": "postgres", "extra_groups": []} if os.geteuid() == 0 else {}
        )
        self.log = workdir / "database.log"

    def init(self) -> None:
        for d in (self.dir, self.sockets):
            d.mkdir()
            if self.as_user:
                shutil.chown(d, "postgres", "postgres")
        if self.as_user:
            self.dir.parent.chmod(0o755)  # the postgres user reaches its folders
        argv = [str(self.bin / "initdb"), "-D", str(self.dir), "-A", "trust", "-U", "postgres", "--no-sync"]
        subprocess.run(argv, check=True, capture_output=True, timeout=120, **self.as_user)

    def spawn(self, _: str) -> subprocess.Popen[bytes]:
        settings = ["listen_addresses=127.0.0.1", "fsync=off", "max_connections=300"]
        argv = [
            str(self.bin / "postgres"),
            "-D",
            str(self.dir),
            "-p",
            str(self.port),
            "-k",
            str(self.sockets),
        ]
        argv += [arg for c in settings for arg in ("-c", c)]
        with self.log.open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True, **self.as_user)
        deadline = time.time() + 60
        while not self.ready():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the private PostgreSQL did not start: see {self.log}")
            time.sleep(0.1)
        return proc

    def ready(self) -> bool:
        argv = [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0

    def connect(self, database: str = "soak") -> Any:
        import psycopg

        return psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname={database}", autocommit=True
        )

    def create_database(self) -> None:
        with self.connect("postgres") as conn:
            conn.execute("CREATE DATABASE soak")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tasks", type=int, default=2000, help="tasks added to the board")
    p.add_argument("--ordinals", type=int, default=16, help="pool size: one `poolctl worker` each")
    p.add_argument("--duration", type=float, default=300, help="seconds of fault injection")
    p.add_argument("--deadline", type=float, default=900, help="hard limit on the whole soak, seconds")
    p.add_argument(
        "--faults",
        default="all",
        help=f"all (process deaths: {', '.join(FAULT_KINDS)}), production ({', '.join(PRODUCTION_KINDS)}),"
        " every (both), none, or a comma list of kinds",
    )
    p.add_argument("--fault-every", type=float, default=8, help="mean seconds between faults")
    p.add_argument("--restart-delay", type=float, default=0.5, help="a supervisor's delay before a restart")
    p.add_argument("--lease", type=float, default=6, help="POOL_LEASE_SECONDS")
    p.add_argument(
        "--time-limit",
        type=float,
        default=15,
        help="POOL_TASK_TIME_LIMIT (a Celery message's; a lost message's keys are sent again about"
        " two of them after the queue runs dry)",
    )
    p.add_argument("--tick", type=float, default=1, help="POOL_TICK_SECONDS")
    p.add_argument("--reconcile", type=float, default=30, help="POOL_RECONCILE_SECONDS")
    p.add_argument("--poll", type=float, default=0.2, help="`poolctl worker --poll`")
    p.add_argument("--work", type=float, nargs=2, default=(0.05, 0.5), metavar=("MIN", "MAX"))
    p.add_argument("--hang-rate", type=float, default=0.03, help="tasks that run 2 leases long")
    p.add_argument("--fail-rate", type=float, default=0.05, help="tasks whose command exits 3")
    p.add_argument("--poison", type=int, default=4, help="poisoned tasks (every board call fails)")
    p.add_argument("--board-busy", type=float, default=0.02, help="POOL_CHAOS_BOARD_BUSY_RATE")
    p.add_argument("--database-url", default="", help="the store and board (default: SQLite files)")
    p.add_argument(
        "--postgres",
        action="store_true",
        help="the store and board on a private PostgreSQL cluster the soak starts (initdb, a free port):"
        " the database's faults never touch a shared server",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep the temporary folder even on success")
    args = p.parse_args(argv)
    named = {
        "none": (),
        "all": FAULT_KINDS,
        "production": PRODUCTION_KINDS,
        "every": FAULT_KINDS + PRODUCTION_KINDS,
    }
    args.kinds = named.get(args.faults) or tuple(args.faults.split(","))
    unknown = set(args.kinds) - set(FAULT_KINDS + PRODUCTION_KINDS)
    if unknown:
        p.error(f"--faults: unknown kind(s) {', '.join(sorted(unknown))}")
    if set(args.kinds) & set(DB_KINDS) and not args.postgres:
        needs = ", ".join(k for k in args.kinds if k in DB_KINDS)
        p.error(f"--faults: {needs} need --postgres (a private cluster)")
    if args.postgres and args.database_url:
        p.error("--postgres: give it or --database-url, not both")
    return args


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="poolkeeper-soak-"))
        self.exec_log = self.workdir / "executions.jsonl"
        (self.workdir / "locks").mkdir()
        self.command_py = self.workdir / "command.py"
        self.command_py.write_text(COMMAND)
        self.redis = RedisServer(self.workdir)
        self.postgres = PrivatePostgres(self.workdir) if args.postgres else None
        db = self.postgres.url if self.postgres else args.database_url
        self.settings = Settings.from_env(
            {},
            database_url=db or f"sqlite:///{self.workdir}/pool.db",
            board_url=db or f"sqlite:///{self.workdir}/board.db",
            redis_url=self.redis.url,
            pool_size=args.ordinals,
            lease_seconds=args.lease,
            tick_seconds=args.tick,
            reconcile_seconds=args.reconcile,
            task_time_limit=args.time_limit,
            chaos_board_busy_rate=args.board_busy,
            chaos_poison_tasks=",".join(f"poison-{i:05d}" for i in range(args.poison)),
        )
        self.env = {**os.environ, **self.settings.env(), "PYTHONPATH": str(ROOT)}
        self.env.pop("POOL_SERVER_SECRET", None)
        self.secret = secrets.token_hex(32)
        self.serve_port = 0
        self.due_since = 0.0  # when the next fault fell due
        self.managed: list[Managed] = []
        self.faults: list[Fault] = []
        self.watch = Watch()
        self.stop_sampling = threading.Event()
        self.store: PoolStore | None = None
        self.expired_first: list[Fault] = []  # worker faults whose run came back through expire
        self.lasting: list[Lasting] = []  # faults not over yet: frozen processes, a held lock

    # --- processes ---------------------------------------------------------------

    def _celery(self, kind: str) -> Callable[[str], subprocess.Popen[bytes]]:
        return lambda name: CeleryProc(kind, self.settings.env(), self.workdir, name).proc

    def _serve(self, name: str) -> subprocess.Popen[bytes]:
        serve = ServeProc(
            self.settings.env(), self.workdir, secret=self.secret, name=name, port=self.serve_port
        )
        self.serve_port = serve.port
        serve.wait_ready()
        return serve.proc

    def _redis(self, _: str) -> subprocess.Popen[bytes]:
        self.redis.start()  # the same port every time
        assert self.redis.proc is not None
        return self.redis.proc

    def _pool_worker(self, ordinal: int) -> Callable[[str], subprocess.Popen[bytes]]:
        token_file = self.workdir / f"token-{ordinal}"
        token_file.write_text(tokens.ordinal_token(self.secret, ordinal))
        low, high = self.args.work
        script = [str(self.command_py), str(self.exec_log), str(self.workdir / "locks")]
        command = shlex.join([sys.executable, "-S", *script, str(low), str(high), str(2 * self.args.lease)])
        url = f"http://127.0.0.1:{self.serve_port}"
        argv = [*POOLCTL, "worker", "--ordinal", str(ordinal), "--command", command, "--url", url]
        argv += ["--token-file", str(token_file), "--poll", str(self.args.poll)]
        argv += ["--state-dir", str(self.workdir / "worker-state")]  # what a restarted worker finds

        def spawn(name: str) -> subprocess.Popen[bytes]:
            with (self.workdir / f"{name}.log").open("ab") as out:
                return subprocess.Popen(
                    argv, env=self.env, cwd=self.workdir, stdout=out, stderr=out, start_new_session=True
                )

        return spawn

    @functools.cached_property
    def board_db(self) -> Engine:
        """The built-in board's database, read directly for what the Board protocol does not
        say: every claim ever made, with its start (the ``runs`` table)."""
        return create_engine(self.settings.board_url)

    def start(self) -> None:
        self.managed.append(Managed("redis", "redis", self._redis))
        self.managed[-1].start()
        if self.postgres is not None:
            self.postgres.init()
            self.managed.append(Managed("database", "database", self.postgres.spawn))
            self.managed[-1].start()
            self.postgres.create_database()
        subprocess.run([*POOLCTL, "init"], env=self.env, check=True, capture_output=True, timeout=120)
        self.store = PoolStore.from_settings(self.settings)  # the supervisor's own reads
        board = open_board(self.settings)
        for i in range(self.args.tasks):
            board.add_task(BOARD, f"soak task {i}", task_id=f"{self.task_kind(i)}-{i:05d}")
        board.close()
        for kind, n in (("celery-worker", 2), ("beat", 2)):
            for i in range(1, n + 1):
                m = Managed(kind, f"{kind}{i}", self._celery("worker" if kind == "celery-worker" else "beat"))
                self.managed.append(m)
                m.start()
        for m in self.managed:
            if m.kind in ("celery-worker", "beat"):
                _wait_ready(m, self.workdir / f"{m.name}-{m.generation}.log")
        self.managed.append(Managed("serve", "serve", self._serve))
        self.managed[-1].start()
        for o in range(self.args.ordinals):
            self.managed.append(Managed("pool-worker", f"pool-worker{o}", self._pool_worker(o)))
            self.managed[-1].start()

    def task_kind(self, i: int) -> str:
        if i < self.args.poison:
            return "poison"
        draw, hang = self.rng.random(), self.args.hang_rate
        return "hang" if draw < hang else "fail" if draw < hang + self.args.fail_rate else "ok"

    def supervise(self) -> None:
        """Start again what died, after the delay a supervisor (systemd, Kubernetes) takes."""
        now = time.time()
        for m in self.managed:
            if m.alive():
                continue
            if m.restart_at is None:
                m.crashes += not m.planned
                m.restart_at = now + self.args.restart_delay
                if m.kind in ("celery-worker", "beat") and m.proc is not None:
                    _killpg(m.proc.pid)  # systemd's KillMode=control-group: orphaned pool children go too
            elif now >= m.restart_at and not self.kept_away(m):
                m.restart_at, m.planned = None, False
                m.start()
                for f in self.faults:
                    if f.target == m.name and f.restarted is None:
                        f.restarted, f.log = time.time(), self.workdir / f"{m.name}-{m.generation}.log"

    def kept_away(self, m: Managed) -> bool:
        """Whether ``m`` is a worker-away fault's pool worker whose run is not re-offered yet.

        Re-offered: the store's audit trail holds the expiry that moved the killed attempt
        off ``running`` (``assigned`` at attempt+1, or ``lease_failed`` after the last one).
        A run that left ``running`` otherwise (its result got in first) ends the wait too,
        unmeasured; a wait past 3 leases ends it as never re-offered (``inf``: broken).
        """
        f = next((f for f in self.faults if f.target == m.name and f.restarted is None), None)
        if f is None or f.kind != "worker-away":
            return False
        board, task_id, run_id = f.run.split("/")
        assert self.store is not None
        try:
            with self.store.session(readonly=True) as s:
                rows = queries.rows_of_tasks(s, board, [task_id])
                row = next((r for r in rows if r.run_id == int(run_id)), None)
                events = audit.history(s, row.id) if row is not None else []
        except Exception as err:  # a busy database: ask again on the next round
            self.watch.errors[type(err).__name__] += 1
            return True
        f.reoffered = next(
            (
                e["at"]
                for e in events
                if e["kind"] == "expiry" and (e["attempt"] > f.attempt or e["to"] == RowState.LEASE_FAILED)
            ),
            None,
        )
        still_running = row is not None and row.state == RowState.RUNNING and row.attempt == f.attempt
        if f.reoffered is None and still_running and time.time() > f.t + 3 * self.args.lease:
            f.reoffered = math.inf
        return f.reoffered is None and still_running

    def inject(self, kind: str) -> bool:
        """Kill one process of ``kind`` (SIGKILL), recording when and what ran under it.

        A pool worker is killed only while it runs a command (False: none does; try again soon),
        a long one with most of its time ahead, so what survives it has time to show (for up to
        10 s after the fault is due it waits for one; then any command will do).
        """
        if kind in PRODUCTION_KINDS:
            return self.impair(kind)
        up = [m for m in self.managed if m.alive()]
        fault = Fault(kind, time.time(), "")
        if kind in WORKER_KINDS:
            commands = {m.name: kids[0] for m in up if m.kind == "pool-worker" and (kids := _children(m.pid))}
            if not commands:
                return False
            grants = {name: _grant_of(pid) for name, pid in commands.items()}
            fresh = [
                name
                for name, pid in commands.items()
                if grants[name].get("POOL_TASK_ID", "").startswith("hang-")
                and 0.5 < _age(pid) < self.args.lease
            ]
            if not fresh and time.time() < self.due_since + 10:
                return False
            name = self.rng.choice(fresh or sorted(commands))
            victim = next(m for m in up if m.name == name)
            g = grants[name]
            fault.run = f"{g.get('POOL_BOARD')}/{g.get('POOL_TASK_ID')}/{g.get('POOL_RUN_ID')}"
            fault.attempt = int(g.get("POOL_ATTEMPT", 0))
            assert victim.proc is not None
            fault.command_pids = _descendants(victim.proc.pid)
            victim.planned = True
            _kill(victim.proc.pid)
            if kind in WITH_COMMAND:  # the whole pod: the worker, its command and anything under it
                for pid in fault.command_pids:
                    _kill(pid)
        elif kind == "celery-child":
            victim = self.rng.choice([m for m in up if m.kind == "celery-worker"])
            assert victim.proc is not None
            children = _children(victim.proc.pid)
            if not children:
                return False  # between children: try again soon
            _kill(self.rng.choice(children))  # billiard starts a new child; the main process lives on
        else:
            victim = self.rng.choice([m for m in up if m.kind == kind])
            assert victim.proc is not None
            victim.planned = True
            _kill(victim.proc.pid)
        fault.target = victim.name if kind != "celery-child" else ""
        fault.t = time.time()
        self.faults.append(fault)
        print(f"  {time.time() - self.t0:7.1f}s fault {kind:15s} {victim.name}", flush=True)
        return True

    def impair(self, kind: str) -> bool:
        """A production fault: the database restarted, its connections cut or a table locked; a
        process frozen (itself and everything under it) for a lease and a second.

        ``Fault.restarted`` is when the dependency is back: restarted and answering, cut (at
        once), unlocked, thawed. Until then no other fault is injected."""
        now = time.time()
        fault = Fault(kind, now, "database" if kind.startswith("db-") else "")
        lasting = Lasting(fault, now + self.args.lease + 1)
        if kind.startswith("freeze-"):
            victim = self.rng.choice([m for m in self.managed if m.alive() and m.kind == kind[7:]])
            lasting.pids = [victim.pid, *_descendants(victim.pid)]
            for pid in lasting.pids:
                _signal(pid, signal.SIGSTOP)
            fault.target = victim.name
            self.lasting.append(lasting)
        elif kind == "db-restart":
            victim = next(m for m in self.managed if m.kind == "database")
            victim.planned = True
            _signal(victim.pid, signal.SIGQUIT)  # immediate shutdown: crash recovery at the next start
        elif kind == "db-cut":
            self.postgres_cut()
            fault.restarted = time.time()
        else:  # db-lock
            lasting.done = threading.Event()
            threading.Thread(target=self.postgres_lock, args=(lasting,), daemon=True).start()
            self.lasting.append(lasting)
        self.faults.append(fault)
        print(f"  {time.time() - self.t0:7.1f}s fault {kind:15s} {fault.target}", flush=True)
        return True

    def postgres_cut(self) -> None:
        """Terminate every backend of the plane's database but this one (serve, the board, workers)."""
        assert self.postgres is not None
        with self.postgres.connect() as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = 'soak' AND pid <> pg_backend_pid()"
            )

    def postgres_lock(self, lasting: Lasting) -> None:
        """Hold the ``assignments`` table's strongest lock for a lease: every store write waits."""
        assert self.postgres is not None and lasting.done is not None
        try:
            with self.postgres.connect() as conn, conn.transaction():
                conn.execute("LOCK TABLE assignments IN ACCESS EXCLUSIVE MODE")
                time.sleep(max(0.0, lasting.until - 1 - time.time()))
        except Exception as err:
            print(f"  db-lock failed: {type(err).__name__}: {err}", flush=True)
        lasting.fault.restarted = time.time()
        lasting.done.set()

    def end_lasting(self, now: float, every: bool = False) -> None:
        """Thaw what is due (all of it on the way out); forget a lock that was let go."""
        for lasting in list(self.lasting):
            if lasting.done is not None:
                if lasting.done.is_set():
                    self.lasting.remove(lasting)
            elif every or now >= lasting.until:
                for pid in lasting.pids:
                    _signal(pid, signal.SIGCONT)
                lasting.fault.restarted = time.time()
                self.lasting.remove(lasting)

    # --- the sampler ---------------------------------------------------------------

    def sample_forever(self, every: float = 0.25) -> None:
        store, board = PoolStore.from_settings(self.settings), open_board(self.settings)
        try:
            while not self.stop_sampling.wait(every):
                try:
                    self.sample(store, board)
                except Exception as err:  # a busy database: the next sample will do
                    self.watch.errors[type(err).__name__] += 1
        finally:
            store.engine.dispose()
            board.close()

    def redis_up(self) -> bool:
        return all(m.alive() for m in self.managed if m.kind == "redis")

    def sample(self, store: PoolStore, board: Board) -> None:
        w, now = self.watch, time.time()
        counts = board.counts_by_status()
        running = board.running_tasks(BOARD)
        with self.board_db.connect() as conn:
            claims = int(conn.scalar(text("SELECT count(*) FROM runs")) or 0)
        with store.session(readonly=True) as s:
            rows = queries.rows_of_tasks(s, BOARD, [t.id for t in running])
            stuck = [r for r in queries.rows(s, quarantined=True) if r.state not in ("finalized", "stale")]
            # what dispatch may fill: free ordinals whose worker called within a lease
            staffed = presence.staffed(s, self.args.ordinals, now - self.settings.lease_seconds)
            open_ = [o for o in queries.free_ordinals(s, self.args.ordinals) if o in staffed]
        has_row = {(r.task_id, r.run_id) for r in rows}
        claimed = {
            (t.id, int(t.current_run_id or 0)) for t in running if t.assignee == self.settings.assignee
        }
        for key in claimed - has_row:
            w.no_row_since.setdefault(key, now)
        for key in list(w.no_row_since):
            if key not in claimed or key in has_row:
                del w.no_row_since[key]
        for (task, run), since in w.no_row_since.items():
            w.no_row[f"{task} run {run}"] = max(w.no_row.get(f"{task} run {run}", 0.0), now - since)
        ready, free = counts["ready"], len(open_) - len(w.no_row_since)
        w.samples.append((now, ready, free))
        # Celery workers exit when Redis restarts under them (kombu's restore_unacked; their
        # supervisor restarts them): until Redis and one worker are up, nothing can dispatch,
        # and a stall is the supervisor's restart, not the plane's.
        down = (
            not self.redis_up()
            or not all(m.alive() for m in self.managed if m.kind == "database")
            or bool(self.lasting)  # frozen, or locked: dispatch waits for it by design
            or not any(m.consuming(self.workdir) for m in self.managed if m.kind == "celery-worker")
        )
        if down and w.down_since is None:
            w.down_since = now
        elif not down and w.down_since is not None:
            w.down_spans.append((w.down_since, now))
            w.down_since = None
        if down:
            w.stall_since = None
        elif claims > w.claims:
            w.claims, w.stall_since = claims, None
        elif ready > 0 and free > 0:
            w.stall_since = w.stall_since or now
            if now - w.stall_since > w.longest_stall:
                w.longest_stall, w.stall_at = now - w.stall_since, w.stall_since - self.t0
        else:
            w.stall_since = None
        for row in stuck:  # what an operator does with a quarantined row: `poolctl abandon`
            with contextlib.suppress(PoolError):
                operator.abandon(board, store, row.id, f"quarantined: {(row.last_error or '')[:200]}", now)
                w.abandoned += 1
        w.counts = counts
        w.settled = counts["ready"] == 0 and counts["running"] == 0

    # --- the run ---------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        print(f"soak: {' '.join(shlex.quote(x) for x in [sys.executable, *sys.argv])}")
        print(
            f"settings: tasks={a.tasks} ordinals={a.ordinals} lease={a.lease}s tick={a.tick}s "
            f"reconcile={a.reconcile}s time_limit={a.time_limit}s poll={a.poll}s "
            f"work={a.work[0]}-{a.work[1]}s hang={2 * a.lease}s "
            f"hang_rate={a.hang_rate} fail_rate={a.fail_rate} poison={a.poison} board_busy={a.board_busy}\n"
            f"          faults={','.join(a.kinds) or 'none'} every~{a.fault_every}s for {a.duration}s, "
            f"restart delay {a.restart_delay}s, deadline {a.deadline}s, seed={a.seed}, files {self.workdir}",
            flush=True,
        )
        self.t0 = started = time.time()
        self.start()
        print(f"  {time.time() - started:7.1f}s plane up: serve on port {self.serve_port}", flush=True)
        sampler = threading.Thread(target=self.sample_forever, daemon=True)
        sampler.start()
        faults_end = time.time() + a.duration
        order: list[str] = []
        next_fault = time.time() + a.fault_every * self.rng.uniform(0.5, 1.5)
        next_progress = time.time() + PROGRESS_EVERY
        while time.time() < started + a.deadline:
            self.end_lasting(time.time())
            self.supervise()
            now = time.time()
            if now >= next_progress:
                next_progress = now + PROGRESS_EVERY
                self.progress(now)
            # Past --duration only to finish the first round: every kind at least once.
            due = now < faults_end or len({f.kind for f in self.faults}) < len(a.kinds)
            calm = not self.lasting and all(m.alive() for m in self.managed) and now >= self.recovered_by()
            if a.kinds and due and now >= next_fault and calm:
                order = order or self.rng.sample(a.kinds, len(a.kinds))
                self.due_since = self.due_since or now
                if self.inject(order[-1]):
                    order.pop()
                    next_fault, self.due_since = now + a.fault_every * self.rng.uniform(0.5, 1.5), 0.0
            if self.watch.settled and (now >= faults_end or not a.kinds):
                break
            time.sleep(0.1)
        self.stop_sampling.set()
        sampler.join(10)
        self.wall = time.time() - started
        faults = [{**vars(f), "t0": f.t - started} for f in self.faults]
        (self.workdir / "faults.json").write_text(json.dumps(faults, indent=1, default=str))
        return self.report()

    def recovered_by(self) -> float:
        """When the last fault's recovery window ends: its bound (2 ticks) and a second, from when
        what it stopped was back. No fault starts inside another's window, so a recovery is that
        fault's alone (a Redis frozen the instant the database thawed would charge the database
        with Redis's freeze)."""
        if not self.faults:
            return 0.0
        last = self.faults[-1]
        return (last.restarted or last.t) + 2 * float(self.args.tick) + 1

    def progress(self, now: float) -> None:
        """One line: the board's tasks by status, claims so far, faults so far."""
        c = self.watch.counts
        print(
            f"  {now - self.t0:7.1f}s progress: done {c.get('done', 0)} blocked {c.get('blocked', 0)} "
            f"running {c.get('running', 0)} ready {c.get('ready', 0)} of {self.args.tasks}; "
            f"claims {self.watch.claims}, faults {len(self.faults)}",
            flush=True,
        )

    def stop(self) -> None:
        self.end_lasting(time.time(), every=True)  # nothing stays frozen
        self.stop_sampling.set()
        if self.store is not None:
            self.store.engine.dispose()
        for m in self.managed:
            if m.proc is not None and m.proc.poll() is None:
                for pid in [*_descendants(m.proc.pid), m.proc.pid]:  # a command in a session of its own too
                    _kill(pid)
                _killpg(m.proc.pid)  # and anything else left in its process group
                with contextlib.suppress(subprocess.TimeoutExpired):
                    m.proc.wait(10)
        for rec in _read_log(self.exec_log):  # commands orphaned by a worker killed without them
            with contextlib.suppress(OSError):
                if str(self.command_py) in Path(f"/proc/{rec['pid']}/cmdline").read_text():
                    _kill(rec["pid"])

    # --- the report ----------------------------------------------------------------

    def report(self) -> int:
        board = open_board(self.settings)
        counts = board.counts_by_status()
        with self.board_db.connect() as conn:
            claim_times = sorted(float(t) for (t,) in conn.execute(text("SELECT started_at FROM runs")))
        board.close()
        records = _read_log(self.exec_log)
        starts = [r for r in records if r["ev"] == "start"]
        ends = {(r["pid"], r["key"]): r for r in records if r["ev"] == "end"}
        by_pid = {r["pid"]: r for r in starts}
        by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in starts:
            by_key[r["key"]].append(r)
        start_times = sorted(r["t"] for r in starts)
        killed = {pid: f.t for f in self.faults for pid in f.command_pids if f.kind in WITH_COMMAND}
        # Two at once: the kernel's flock saw a live holder, or two recorded intervals overlap.
        intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in starts:
            end = ends.get((r["pid"], r["key"]), {}).get("t", killed.get(r["pid"]))
            if end is not None:
                intervals[r["key"]].append((r["t"], end))
        doubled = {r["key"] for r in starts if not r["alone"]}
        for key, spans in intervals.items():
            spans.sort()
            if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
                doubled.add(key)
        no_row = sorted(self.watch.no_row.items(), key=lambda kv: -kv[1])
        longest_no_row = no_row[0][1] if no_row else 0.0
        fences = Counter(r["fence"] for r in starts)
        twice = {f: n for f, n in fences.items() if n > 1}
        lost = counts["ready"] + counts["running"]
        # Not a violation (a worker can die between its command's exit and the result's spool): shown.
        finished = [(r["key"], r["t"]) for r in ends.values() if r["rc"] != 143]
        again = {key for key, t in finished if any(s["t"] > t for s in by_key[key])}
        startup = sorted(
            p - f.restarted for f in self.faults if f.log and f.restarted and (p := _polling_since(f.log))
        )

        recovery: dict[str, list[float]] = defaultdict(list)
        for f in self.faults:
            got = self.recovery(f, claim_times, start_times, by_key, ends, by_pid)
            if got is not None:
                recovery[f.kind].append(got)
        a, w = self.args, self.watch
        bounds = {
            "worker+command": (2.0, "run back <= 2s after the old command's end (new worker polling)"),
            "worker-only": (2.0, "run back <= 2s after the old command's end (new worker polling)"),
            "worker-away": (a.lease + 2 * a.tick, "re-offered <= lease + 2 ticks after its worker died"),
            "celery-worker": (2 * a.tick, "dispatch resumes <= 2 ticks"),
            "celery-child": (2 * a.tick, "dispatch resumes <= 2 ticks"),
            "beat": (2 * a.tick, "dispatch resumes <= 2 ticks"),
            "redis": (2 * a.tick, "dispatch resumes <= 2 ticks after Redis and a Celery worker are back"),
            "serve": (None, "next execution after serve is back (no bound)"),
            "freeze-serve": (None, "next execution after serve thaws (no bound)"),
            **{k: (2 * a.tick, "dispatch resumes <= 2 ticks after it is back") for k in BACK_KINDS},
        }
        broken: list[str] = []
        crashes = ", ".join(f"{m.name} {m.crashes}" for m in self.managed if m.crashes) or "none"
        print(f"\nfaults injected: {len(self.faults)} in {self.wall:.0f}s; unplanned exits: {crashes}")
        print(
            f"{'fault kind':20s} {'n':>4s} {'measured':>8s} {'p50':>7s} {'p99':>7s} {'bound':>6s}"
            "  verdict  recovery is"
        )
        for kind in a.kinds:
            taken = sorted(recovery[kind])
            bound, what = bounds[kind]
            n = sum(f.kind == kind for f in self.faults)
            p50, p99 = _pct(taken, 0.5), _pct(taken, 0.99)
            bad = bound is not None and p99 is not None and p99 > bound
            if bad:
                broken.append(f"{kind}: p99 {p99:.2f}s > {bound:.2f}s")
            print(f"{kind:20s} {n:4d} {len(taken):8d} {_s(p50):>7s} {_s(p99):>7s} {_s(bound):>6s}  "
                  f"{'BROKEN ' if bad else 'ok     '}  {what}")  # fmt: skip
        never = [kind for kind in a.kinds if not any(f.kind == kind for f in self.faults)]
        checks = [
            ("fault kinds never injected", ", ".join(never) or 0, not never),
            ("lost (tasks not done/blocked)", lost, lost == 0),
            ("runs executed twice at once", len(doubled), not doubled),
            ("fences executed twice", len(twice), not twice),
            (f"longest claimed run without a row (bound {2 * a.reconcile:.0f}s)",
             ", ".join(f"{run} {t:.1f}s" for run, t in no_row[:3]) or "0s",
             longest_no_row <= 2 * a.reconcile + 0.5),
            (f"longest dispatch stall (bound {2 * a.tick:.0f}s)",
             f"{w.longest_stall:.1f}s at {w.stall_at:.0f}s", w.longest_stall <= 2 * a.tick + 0.5),
        ]  # fmt: skip
        print(f"\nboard: {counts}; executions {len(starts)}, claims {len(claim_times)}, "
              f"abandoned (quarantined) {w.abandoned}, sampler errors {dict(w.errors) or 0}")  # fmt: skip
        print(f"info    runs executed again after an execution of theirs had finished: {len(again)}")
        late = Counter(f.kind for f in self.expired_first)
        print(f"info    restarted workers that asked after their run's lease had ended (re-offered by "
              f"expire, not measured against 2s): {dict(late) or 0}")  # fmt: skip
        print(f"info    pool worker start-up (spawn to polling): p50 {_s(_pct(startup, 0.5))}s, "
              f"p99 {_s(_pct(startup, 0.99))}s")  # fmt: skip
        for name, value, ok in checks:
            print(f"{'ok     ' if ok else 'FAILED '} {name}: {value}")
        for key in sorted(doubled)[:10]:
            print(f"    twice at once: {key}: {sorted(intervals.get(key, []))}")
        for fence, n in sorted(twice.items())[:10]:
            print(f"    fence {fence} executed {n} times")
        failed = [name for name, _, ok in checks if not ok] + broken
        print(f"\nsoak {'FAILED: ' + '; '.join(failed) if failed else 'passed'} in {self.wall:.0f}s")
        return 1 if failed else 0

    def recovery(
        self,
        f: Fault,
        claim_times: list[float],
        start_times: list[float],
        by_key: dict[str, list[dict[str, Any]]],
        ends: dict[tuple[int, str], dict[str, Any]],
        by_pid: dict[int, dict[str, Any]],
    ) -> float | None:
        """Seconds from the fault (or the restart it needs) to the sign that the plane works again."""
        if f.kind in DISPATCH_KINDS:
            t = f.restarted if f.kind == "redis" and f.restarted else f.t
            # Dispatch could only resume once ready tasks met free ordinals again.
            t = next((s[0] for s in self.watch.samples if s[0] >= t and s[1] > 0 and s[2] > 0), t)
            i = bisect.bisect_right(claim_times, f.t)
            if i == len(claim_times):
                return None
            # Counted from when a Celery worker could serve again: they exit when Redis restarts
            # under them, and a second death meanwhile is not the single death the bound is for.
            claim = claim_times[i]
            t = max([t, *(end for start, end in self.watch.down_spans if start <= claim and end >= t)])
            return max(0.0, claim - t)
        if f.kind == "worker-away":
            return None if f.reoffered is None else max(0.0, f.reoffered - f.t)  # inf: never
        if f.kind in BACK_KINDS:
            if f.restarted is None:
                return None
            # from when it was back and ready tasks met free ordinals again, to the next claim
            back = f.restarted
            at = next((s[0] for s in self.watch.samples if s[0] >= back and s[1] > 0 and s[2] > 0), None)
            i = bisect.bisect_right(claim_times, back)
            return None if at is None or i == len(claim_times) else max(0.0, claim_times[i] - at)
        if f.kind in ("serve", "freeze-serve"):
            i = bisect.bisect_right(start_times, f.restarted or f.t)
            return None if i == len(start_times) or f.restarted is None else start_times[i] - f.restarted
        old = next((by_pid[p] for p in f.command_pids if p in by_pid), None)
        serving = _polling_since(f.log) if f.log else None  # the replacement's start-up is not the plane's
        again = [r for r in by_key[f.run] if r["t"] > f.t and r["pid"] not in f.command_pids]
        if serving is None or not again:
            return None  # the run settled meanwhile (its result was delivered before the kill)
        first = min(again, key=lambda r: r["t"])
        if first["attempt"] > f.attempt:
            # The new worker asked only after the lease had ended (a slow start-up): the run
            # came back through the expire pass, whose bound worker-away measures, not this one.
            self.expired_first.append(f)
            return None
        old_end = ends.get((old["pid"], old["key"]), {}).get("t", f.t) if old else f.t
        return max(0.0, float(first["t"]) - max(serving, float(old_end)))


def _wait_ready(m: Managed, log: Path, timeout: float = 90) -> None:
    """Until a Celery worker logs "ready." (a beat "Starting..."), as ``CeleryProc.wait_ready`` does."""
    marker = "ready." if m.kind == "celery-worker" else "Starting..."
    deadline = time.time() + timeout
    while not (log.exists() and marker in log.read_text(errors="replace")):
        if not m.alive() or time.time() > deadline:
            raise RuntimeError(f"{m.name} did not start: see {log}")
        time.sleep(0.1)


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(ln))
    return out


def _polling_since(log: Path) -> float | None:
    """When a ``poolctl worker`` logged that it polls (its log's local time), as a Unix time."""
    with contextlib.suppress(OSError):
        for ln in log.read_text(errors="replace").splitlines():
            if " polling" in ln:
                return datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def _grant_of(pid: int) -> dict[str, str]:
    """The ``POOL_*`` variables a command was started with: its grant (empty once it is gone)."""
    with contextlib.suppress(OSError):
        env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        return dict(v.split("=", 1) for v in env if v.startswith("POOL_") and "=" in v)
    return {}


def _age(pid: int) -> float:
    """Seconds since process ``pid`` started (0 once it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        found.append(todo.pop())
        todo += _children(found[-1])
    return found


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else None


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    soak = Soak(parse_args(sys.argv[1:] if argv is None else argv))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally, like Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (&)
    code: int | None = None
    try:
        code = soak.run()
        return code
    except KeyboardInterrupt:
        print("interrupted: stopping everything the soak started")
        return 130
    finally:
        soak.stop()
        if code == 0 and not soak.args.keep:
            shutil.rmtree(soak.workdir, ignore_errors=True)
        else:
            print(f"files kept in {soak.workdir}")


if __name__ == "__main__":
    sys.exit(main())
