"""End to end, at default settings: poolkeeper beside the job systems users would pick instead.

The same work for every system, in one run, one system at a time: a trickle of single jobs on
the idle system (``--trickle``, each waited for before the next), then ``--jobs`` no-op jobs
enqueued one call each as fast as the caller can, on 16 slots. Every job appends its id and
the time it started to a file (one ``O_APPEND`` write); each id must be there once at most,
and once for every job reported done. Each phase is bounded by ``--seconds``: what finished
in that time is reported (n of M), not waited for.

Systems, each as its own documentation runs it, every setting default but the slots:

- ``poolkeeper-sqlite``, ``poolkeeper-postgres``: the README's quickstart, split over processes
  (``poolctl init``; ``celery -A tasks worker -c 2`` and beat; ``poolctl serve``; one
  ``poolctl worker --ordinal N --command ...`` per ordinal, 16 of them, ``POOL_SIZE=16``);
  jobs added with the board's ``add_task`` (the public Python API). Start: the command's
  first line; done: the run's end on the board (the ``runs`` table's ``ended_at``).
- ``celery``: plain Celery 5 on Redis, ``celery worker -c 16``; ``task.delay`` per job.
- ``procrastinate``: procrastinate on PostgreSQL (LISTEN/NOTIFY), ``worker --concurrency 16``;
  ``task.defer`` per job. For the two peers a no-op job's start is its finish.

Each system has its own Redis database (of a private redis-server on a free port) and its own
fresh PostgreSQL database, dropped afterwards; every process is started in a group of its
own and SIGKILLed on every way out (Ctrl-C and SIGTERM included). Prints one line per system
(throughput, enqueue -> start p50/p99 under load, idle enqueue -> done p50/p99, mean enqueue
call) and each poolkeeper figure as a ratio to procrastinate's and Celery's. Exit 1 if a job
ran twice or executed without having been enqueued.

``--trace`` runs each poolkeeper system a second time right after, with tracing on (every
process exporting over OTLP/HTTP to a receiver in the bench's process), and prints the traced
figures as ratios to the untraced ones (target, issue 30: jobs/s at least 0.9x).

    python bench/e2e.py [--jobs 2000] [--trickle 20] [--seconds 120] [--systems a,b,...] [--trace]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import redis
from sqlalchemy import create_engine, text

from bench.api_bench import PG_URL, postgres_database
from bench.soak import _pct
from board import Board, open_board
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import ROOT, CeleryProc, RedisServer, ServeProc, wait_for

SYSTEMS = ("poolkeeper-sqlite", "poolkeeper-postgres", "celery", "procrastinate")
PEERS = ("procrastinate", "celery")  # the ratios' denominators
SLOTS = 16
TRACED = "+trace"  # a poolkeeper system's name with tracing on (--trace)
BOARD = "e2e"
POLL = 0.01  # seconds between looks for a finished job (times come from the records, not the look)
POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]  # as embedded.ServeProc runs it

# The peers' job modules, written into the run's folder and imported by their workers and by the bench.
CELERY_JOBS = """
import os, time
from celery import Celery
app = Celery("e2e", broker=os.environ["E2E_BROKER"])
@app.task(name="e2e.noop")
def noop(job_id):
    fd = os.open(os.environ["E2E_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{job_id} {time.time()}\\n".encode())
    os.close(fd)
"""
PROCRASTINATE_JOBS = CELERY_JOBS.replace(
    'from celery import Celery\napp = Celery("e2e", broker=os.environ["E2E_BROKER"])',
    "from procrastinate import App, PsycopgConnector\n"
    'app = App(connector=PsycopgConnector(conninfo=os.environ["E2E_CONNINFO"]))',
)
# The pool's command: reads its grant (stdin), appends "task_id start_time". No Python start-up.
COMMAND = 'cat >/dev/null; echo "$POOL_TASK_ID $(date +%s.%N)" >> {log}'


@dataclass
class Phase:
    """One phase's records: when each job was enqueued, started and done (epoch seconds)."""

    jobs: int
    enqueued: dict[str, float] = field(default_factory=dict)
    enqueue_seconds: float = 0.0  # time spent inside the enqueue calls
    started: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)
    window: float = 0.0  # first enqueue to the last done (all done) or to the phase's end

    def latencies(self, ends: dict[str, float]) -> list[float]:
        return sorted(ends[j] - t for j, t in self.enqueued.items() if j in ends)


@dataclass
class Result:
    system: str
    trickle: Phase
    burst: Phase
    twice: int = 0  # jobs executed more than once
    strays: int = 0  # executions of jobs never enqueued
    undone: int = 0  # jobs reported done with no execution recorded

    @property
    def rate(self) -> float:
        return len(self.burst.done) / self.burst.window if self.burst.window else 0.0

    def figures(self) -> dict[str, float | None]:
        """The table's figures: jobs/s, enqueue -> start under load, idle enqueue -> done (ms)."""
        start = self.burst.latencies(self.burst.started)
        idle = self.trickle.latencies(self.trickle.done)
        calls = len(self.burst.enqueued) + len(self.trickle.enqueued)
        spent = self.burst.enqueue_seconds + self.trickle.enqueue_seconds
        ms = [None if v is None else v * 1000 for v in (_pct(start, 0.5), _pct(start, 0.99))]
        ms += [None if v is None else v * 1000 for v in (_pct(idle, 0.5), _pct(idle, 0.99))]
        return dict(zip(FIGURES, [self.rate, *ms, spent / calls * 1000 if calls else None], strict=True))


FIGURES = (
    "jobs/s",
    "start p50 ms",
    "start p99 ms",
    "idle done p50 ms",
    "idle done p99 ms",
    "enqueue ms",
)


class Processes:
    """Every process the bench started, each the leader of its own group: SIGKILLed together."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.procs.append(proc)
        return proc

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return self.add(
                subprocess.Popen(
                    argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.procs.clear()


class System:
    """One system under test: started in ``folder``, given jobs one call each, read back from records."""

    name = ""

    def __init__(self, folder: Path, procs: Processes) -> None:
        self.folder, self.procs = folder, procs
        self.log = folder / "executions.log"
        self.log.touch()

    def start(self) -> None:
        raise NotImplementedError

    def enqueue(self, job_id: str) -> None:
        raise NotImplementedError

    def executions(self) -> list[tuple[str, float]]:
        """(job id, start) of every execution so far, in the order written."""
        out = []
        for line in self.log.read_text().splitlines():
            job, _, at = line.partition(" ")
            if at:
                out.append((job, float(at)))
        return out

    def done(self) -> dict[str, float]:
        """When each finished job finished; a no-op job of a peer ends as it starts."""
        return dict(self.executions())

    def close(self) -> None:
        """Release what the bench process holds (its processes are the ``Processes``')."""


def _module(path: Path, source: str) -> ModuleType:
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Celery(System):
    name = "celery"

    def __init__(self, folder: Path, procs: Processes, redis_url: str) -> None:
        super().__init__(folder, procs)
        self.env = {
            **os.environ,
            "E2E_BROKER": redis_url,
            "E2E_LOG": str(self.log),
            "PYTHONPATH": str(folder),
        }
        os.environ.update(E2E_BROKER=redis_url)
        self.jobs: Any = _module(folder / "celery_jobs.py", CELERY_JOBS)

    def start(self) -> None:
        worker_log = self.folder / "worker.log"
        argv = [sys.executable, "-m", "celery", "-A", "celery_jobs", "worker", "-c", str(SLOTS), "-l", "info"]
        proc = self.procs.spawn(argv, self.env, self.folder, worker_log)
        wait_for("the Celery worker to be ready", lambda: _ready(proc, worker_log, " ready."), 120)

    def enqueue(self, job_id: str) -> None:
        self.jobs.noop.delay(job_id)

    def close(self) -> None:
        self.jobs.app.close()


class Procrastinate(System):
    name = "procrastinate"

    def __init__(self, folder: Path, procs: Processes, url: str) -> None:
        super().__init__(folder, procs)
        self.conninfo = url.replace("+psycopg", "")
        self.env = {**os.environ, "E2E_CONNINFO": self.conninfo, "E2E_LOG": str(self.log)}
        self.env["PYTHONPATH"] = str(folder)
        os.environ.update(E2E_CONNINFO=self.conninfo)
        self.jobs: Any = _module(folder / "procrastinate_jobs.py", PROCRASTINATE_JOBS)
        self.jobs.app.open()
        self.jobs.app.schema_manager.apply_schema()

    def start(self) -> None:
        worker_log = self.folder / "worker.log"
        argv = [sys.executable, "-m", "procrastinate", "--app=procrastinate_jobs.app", "worker"]
        proc = self.procs.spawn([*argv, "--concurrency", str(SLOTS)], self.env, self.folder, worker_log)
        engine = create_engine(self.conninfo.replace("postgresql://", "postgresql+psycopg://"))

        def registered() -> bool:
            _ready(proc, worker_log, "")
            with engine.connect() as conn:
                return bool(conn.scalar(text("SELECT count(*) FROM procrastinate_workers")))

        try:
            wait_for("the procrastinate worker to register", registered, 120)
        finally:
            engine.dispose()

    def enqueue(self, job_id: str) -> None:
        self.jobs.noop.defer(job_id=job_id)

    def close(self) -> None:
        self.jobs.app.close()


class Poolkeeper(System):
    """The README's quickstart split over processes (docs/protocol.md), with 16 ordinals and 16 workers."""

    def __init__(
        self, folder: Path, procs: Processes, redis_url: str, database_url: str, traced: dict[str, str]
    ) -> None:
        super().__init__(folder, procs)
        self.name = "poolkeeper-" + ("sqlite" if database_url.startswith("sqlite") else "postgres")
        pool, board = (
            (f"sqlite:///{folder}/pool.db", f"sqlite:///{folder}/board.db")
            if database_url.startswith("sqlite")
            else (database_url, database_url)
        )
        self.settings = Settings.from_env(
            {}, database_url=pool, board_url=board, redis_url=redis_url, pool_size=SLOTS
        )
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("POOL_", "OTEL_"))}
        self.env.update(self.settings.env(), PYTHONPATH=str(ROOT))
        self.traced = traced  # OTEL_* for every process of the system (--trace), or nothing
        self.secret = secrets.token_hex(32)
        self.board: Board | None = None
        self.board_db = create_engine(board)

    def start(self) -> None:
        subprocess.run([*POOLCTL, "init"], env=self.env, cwd=self.folder, check=True, capture_output=True)
        self.board = open_board(self.settings)
        plane = [
            CeleryProc(kind, {**self.settings.env(), **self.traced}, self.folder, f"celery-{kind}")
            for kind in ("worker", "beat")
        ]
        for p in plane:
            self.procs.add(p.proc)
        serve = ServeProc({**self.settings.env(), **self.traced}, self.folder, secret=self.secret)
        self.procs.add(serve.proc)
        serve.wait_ready(60)
        command = shlex.join(["sh", "-c", COMMAND.format(log=shlex.quote(str(self.log)))])
        state = self.folder / "worker-state"
        for o in range(SLOTS):
            argv = [*POOLCTL, "worker", "--ordinal", str(o), "--url", serve.url, "--command", command]
            env = {**self.env, **self.traced, "POOL_WORKER_TOKEN": tokens.ordinal_token(self.secret, o)}
            self.procs.spawn(
                [*argv, "--state-dir", str(state)], env, self.folder, self.folder / f"worker{o}.log"
            )
        for p in plane:
            p.wait_ready(120)

    def enqueue(self, job_id: str) -> None:
        assert self.board is not None
        self.board.add_task(BOARD, f"job {job_id}", task_id=job_id)

    def done(self) -> dict[str, float]:
        """When the board recorded each run done."""
        query = text("SELECT task_id, ended_at FROM runs WHERE board = :b AND outcome = 'done'")
        with self.board_db.connect() as conn:
            return {task: float(at) for task, at in conn.execute(query, {"b": BOARD})}

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        self.board_db.dispose()


def _ready(proc: subprocess.Popen[bytes], log: Path, marker: str) -> bool:
    """Whether ``log`` says ``marker``; an exited ``proc`` is an error naming its log's tail."""
    body = log.read_text(errors="replace") if log.exists() else ""
    if proc.poll() is not None:
        raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}\n{body[-3000:]}")
    return marker in body


def trickle(system: System, n: int, seconds: float) -> Phase:
    """``n`` single jobs, each enqueued on an idle system and waited for, all within ``seconds``."""
    phase, end = Phase(n), time.time() + seconds
    for i in range(n):
        job = f"idle{i:05d}"
        if time.time() >= end:
            break
        enqueue(system, phase, job)
        while job not in system.done() and time.time() < end:
            time.sleep(POLL)
    return settle(system, phase, end)


def burst(system: System, n: int, seconds: float) -> Phase:
    """``n`` jobs enqueued one call each, as fast as one caller can; what is done within ``seconds``."""
    phase, end = Phase(n), time.time() + seconds
    for i in range(n):
        if time.time() >= end:
            break
        enqueue(system, phase, f"job{i:05d}")
    while len(system.done().keys() & phase.enqueued.keys()) < n and time.time() < end:
        time.sleep(POLL)
    return settle(system, phase, end)


def enqueue(system: System, phase: Phase, job: str) -> None:
    phase.enqueued[job] = time.time()
    system.enqueue(job)
    phase.enqueue_seconds += time.time() - phase.enqueued[job]


def settle(system: System, phase: Phase, end: float) -> Phase:
    """The phase's starts and dones as recorded by ``end``, and its window."""
    mine = phase.enqueued.keys()
    phase.started = {j: t for j, t in system.executions() if j in mine and t <= end}
    phase.done = {j: t for j, t in system.done().items() if j in mine and t <= end}
    first = min(phase.enqueued.values(), default=end)
    last = end if len(phase.done) < phase.jobs else max(phase.done.values())
    phase.window = last - first
    return phase


def run_system(
    name: str, args: argparse.Namespace, root: Path, server: RedisServer, db: int
) -> Result | None:
    """``name`` started, measured, stopped and counted, on Redis database ``db`` (flushed before, after).

    ``poolkeeper-…+trace``: the same system with tracing on, exporting over OTLP/HTTP to a
    receiver in this process that counts what it is sent (``poolkeeper.testing.otlp``).
    """
    folder = root / name
    name, trace, _ = name.partition(TRACED)  # trace: TRACED, or "" for the system as it is
    folder.mkdir()
    procs = Processes()
    redis_url = server.url.rsplit("/", 1)[0] + f"/{db}"
    with contextlib.ExitStack() as stack:
        queue = redis.Redis.from_url(redis_url)
        queue.flushdb()
        stack.callback(queue.close)
        stack.callback(lambda: _flush(queue))  # Redis itself may be gone (a Ctrl-C reaches it too)
        stack.callback(procs.kill)
        url = (
            "sqlite" if name == "poolkeeper-sqlite" else stack.enter_context(postgres_database(args.postgres))
        )
        if url is None:
            return None
        traced: dict[str, str] = {}
        if trace:
            from poolkeeper.testing.otlp import Receiver

            sink = Receiver(decode=False)
            stack.callback(lambda: print(f"{name}{TRACED}: {sink.requests} exports, {sink.bytes} bytes"))
            stack.callback(sink.stop)
            traced = sink.env(delay_ms=None)  # the SDK's own batching, as a deployment would have it
        system: System = (
            Celery(folder, procs, redis_url)
            if name == "celery"
            else Procrastinate(folder, procs, url)
            if name == "procrastinate"
            else Poolkeeper(folder, procs, redis_url, url, traced)
        )
        stack.callback(system.close)
        print(f"{name}: starting", flush=True)
        system.start()
        print(f"{name}: trickle of {args.trickle}", flush=True)
        idle = trickle(system, args.trickle, args.seconds)
        print(f"{name}: {args.jobs} jobs", flush=True)
        load = burst(system, args.jobs, args.seconds)
        procs.kill()  # before the count: nothing runs any more
        return tally(Result(name + (TRACED if trace else ""), idle, load), system.executions())


def tally(result: Result, executions: list[tuple[str, float]]) -> Result:
    """``result`` with its exactly-once counts, from every execution recorded once nothing runs."""
    counts = Counter(job for job, _ in executions)
    phases = (result.trickle, result.burst)
    result.twice = sum(1 for n in counts.values() if n > 1)
    result.strays = len(counts.keys() - {j for p in phases for j in p.enqueued})
    result.undone = len({j for p in phases for j in p.done} - counts.keys())
    return result


def table(results: list[Result]) -> str:
    head = ("system", "jobs done", "idle done", *FIGURES, "twice")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        counts = [f"{len(p.done)} of {p.jobs}" for p in (r.burst, r.trickle)]
        cells = [*counts, *map(_cell, r.figures().values())]
        lines.append("| " + " | ".join([r.system, *cells, str(r.twice)]) + " |")
    by_name = {r.system: r for r in results}
    traced = [(by_name[r.system + TRACED], r) for r in results if r.system + TRACED in by_name]
    if traced:  # --trace: what tracing costs, in the same run (target: jobs/s at least 0.9x)
        lines += [
            "",
            "| tracing on / off | " + " | ".join(FIGURES) + " |",
            "|" + " --- |" * (len(FIGURES) + 1),
        ]
        for on, off in traced:
            mine, theirs = on.figures(), off.figures()
            cells = [_cell(_ratio(mine[f], theirs[f]), "x") for f in FIGURES]
            lines.append(f"| {on.system} / {off.system} | " + " | ".join(cells) + " |")
    ratios = [
        (r, by_name[peer])
        for r in results
        if r.system.startswith("poolkeeper")
        for peer in PEERS
        if peer in by_name
    ]
    if ratios:
        lines += ["", "| ratio | " + " | ".join(FIGURES) + " |", "|" + " --- |" * (len(FIGURES) + 1)]
        for r, peer in ratios:
            mine, theirs = r.figures(), peer.figures()
            cells = [_cell(_ratio(mine[f], theirs[f]), "x") for f in FIGURES]
            lines.append(f"| {r.system} / {peer.system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _flush(queue: redis.Redis) -> None:
    with contextlib.suppress(redis.RedisError):
        queue.flushdb()


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=2000, help="no-op jobs of the throughput phase")
    p.add_argument("--trickle", type=int, default=20, help="single jobs on the idle system, for latency")
    p.add_argument("--seconds", type=float, default=120, help="the bound of each phase")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"a comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--postgres", default=PG_URL, help="a PostgreSQL server (a fresh database per system)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (logs, records)")
    p.add_argument(
        "--trace",
        action="store_true",
        help="run each poolkeeper system again with tracing on (OTLP/HTTP to a local receiver): the ratio",
    )
    args = p.parse_args(argv)
    args.names = args.systems.split(",")
    unknown = set(args.names) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {', '.join(sorted(unknown))}")
    if args.trace:  # each poolkeeper system, then the same traced
        pairs = [[name, name + TRACED] if name.startswith("poolkeeper") else [name] for name in args.names]
        args.names = [name for pair in pairs for name in pair]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally, like Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (&)
    root = Path(tempfile.mkdtemp(prefix="poolkeeper-e2e-"))
    print(f"e2e: {shlex.join([sys.executable, *sys.argv])}", flush=True)
    print(
        f"e2e: {args.jobs} jobs, trickle {args.trickle}, {args.seconds:g} s a phase, files {root}", flush=True
    )
    server = RedisServer(root)
    results: list[Result] = []
    try:
        server.start()
        for db, name in enumerate(args.names):
            result = run_system(name, args, root, server, db)
            if result is not None:
                results.append(result)
    except KeyboardInterrupt:
        print("e2e: interrupted; every process it started is killed", file=sys.stderr)
        return 130
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    broken = [r.system for r in results if r.twice or r.strays or r.undone]
    print(f"exactly once: {'held' if not broken else 'BROKEN for ' + ', '.join(broken)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
