"""One run, one trace, across the real processes, exported over OTLP/HTTP to a receiver the test starts.

Given the plane with tracing on (a Celery worker and beat, ``poolctl serve``, ``poolctl board
serve`` holding the board, the ``OTEL_*`` variables pointing at ``poolkeeper.testing.otlp``),
when a task is claimed and its first worker freezes mid-run (SIGSTOP) after a heartbeat and
a child execution, its lease expires and the run is re-offered to a second worker, which
delivers; then the run's trace holds, in order, the claim, materialize, the first grant, its
run, heartbeats and child, the expiry, the second grant, its run, heartbeats and result, and
finalize with its board call, each a child of the span it continues, from five processes.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from poolkeeper import tokens
from poolkeeper.embedded import CeleryProc, ServeProc, wait_for
from poolkeeper.testing.otlp import Receiver, Span, tree
from tests.helpers import BOARD_TOKEN, POOLCTL, SECRET, PlaneEnv

pytestmark = [pytest.mark.integration, pytest.mark.plane_settings(pool_size=1, lease_seconds=2.0)]

# Attempt 1 registers a child, says where its TRACEPARENT points, and hangs; attempt 2 works a second.
COMMAND = """
import os, subprocess, sys, time
if os.environ["POOL_ATTEMPT"] == "1":
    subprocess.run(sys.argv[1:] + ["child", "register"], check=True, stdout=subprocess.DEVNULL)
    open(os.environ["SAW"], "w").write(os.environ.get("TRACEPARENT", ""))
    time.sleep(120)
time.sleep(1.0)
"""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def worker(url: str, tmp: Path, name: str, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    script = tmp / "command.py"
    script.write_text(COMMAND)
    command = shlex.join([sys.executable, str(script), *POOLCTL])
    return subprocess.Popen(
        [*POOLCTL, "worker", "--ordinal", "0", "--command", command, "--url", url, "--wait", "1", *extra],
        env={
            **env,
            "POOL_WORKER_TOKEN": tokens.ordinal_token(SECRET, 0),
            "POOL_WORKER_STATE_DIR": str(tmp / f"state-{name}"),
            "SAW": str(tmp / "saw"),
        },
        stdout=subprocess.DEVNULL,
        stderr=(tmp / f"{name}.log").open("wb"),
        start_new_session=True,
    )


def named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def test_one_run_is_one_trace_across_the_processes(env: PlaneEnv, receiver: Receiver) -> None:
    traced = {**os.environ, **receiver.env()}
    board = ServeProc(
        {**env.settings.env(), **traced, "POOL_BOARD_TOKEN": BOARD_TOKEN},
        env.tmp,
        name="board",
        command=("board", "serve"),
    ).wait_ready()
    plane = {
        **traced,
        **env.settings.env(),
        "POOL_BOARD_URL": board.url,
        "POOL_BOARD_TOKEN": BOARD_TOKEN,
    }
    procs: list[CeleryProc | ServeProc] = [board]
    first = second = None
    try:
        serve = ServeProc(plane, env.tmp, secret=SECRET).wait_ready()
        procs.append(serve)
        for kind in ("worker", "beat"):
            proc = CeleryProc(kind, plane, env.tmp, kind)
            procs.append(proc.wait_ready())
        first = worker(serve.url, env.tmp, "first", plane)
        env.kanban.add_task("b", "traced", task_id="t1")

        saw = env.tmp / "saw"
        wait_for("the first attempt's child", lambda: saw.exists() and saw.read_text(), 60)
        wait_for("a heartbeat of the first attempt", lambda: named(receiver.spans, "POST /v1/heartbeat"), 30)
        first.send_signal(signal.SIGSTOP)  # frozen: no more heartbeats; the lease ends
        wait_for("the expiry", lambda: named(receiver.spans, "expire"), 30)
        second = worker(serve.url, env.tmp, "second", plane, "--once")
        assert second.wait(60) == 0, (env.tmp / "second.log").read_text()[-3000:]
        wait_for("the board to have the result", lambda: env.board_done(["t1"]), 30)
        wait_for("finalize's board call", lambda: named(receiver.spans, "finalize"), 30)
    finally:
        if first is not None:
            first.send_signal(signal.SIGCONT)
            first.send_signal(signal.SIGTERM)  # its heartbeat is refused by now; it exports and exits
            first.wait(30)
        for stopping in reversed(procs):
            stopping.stop()

    [claim] = named(receiver.spans, "claim")
    spans = receiver.trace(claim.trace_id)
    print("\n" + tree(spans))  # the run's trace, for the closing note (pytest -s)
    by_id = {s.span_id: s for s in spans}
    order = [s.name for s in spans if not s.name.startswith("POST /v1/boards")]

    def first_of(name: str, after: int = 0) -> int:
        return order.index(name, after)

    # In order: claim, materialize, grant, run, (heartbeats, the child), expire, grant, run, result, finalize.
    steps = ["claim", "materialize", "grant", "run", "POST /v1/children", "expire", "grant", "run"]
    at = 0
    for step in steps:
        at = first_of(step, at) + 1
    assert first_of("POST /v1/result", at) < first_of("finalize", at), order

    grants, runs = named(spans, "grant"), named(spans, "run")
    assert len(grants) == len(runs) == 2 and [r.attributes["pool.attempt"] for r in runs] == [1, 2]
    for name in ("materialize", "grant", "expire", "finalize"):
        assert {s.parent_id for s in named(spans, name)} == {claim.span_id}, name
    for grant, run in zip(grants, runs, strict=True):
        assert run.parent_id == grant.span_id and run.service == "poolkeeper-worker"
    beats = named(spans, "POST /v1/heartbeat")
    assert {by_id[b.parent_id].name for b in beats} == {"run"}
    assert {b.service for b in beats} == {"poolkeeper-serve"}
    assert {by_id[b.parent_id].attributes["pool.attempt"] for b in beats} == {1, 2}  # both attempts beat
    [child] = named(spans, "POST /v1/children")
    assert child.parent_id == runs[0].span_id  # from the command, through TRACEPARENT
    assert saw.read_text().split("-")[2] == runs[0].span_id
    [result] = named(spans, "POST /v1/result")
    assert by_id[result.parent_id].name == "deliver" and by_id[by_id[result.parent_id].parent_id] == runs[1]
    [finalize] = named(spans, "finalize")
    board_calls = [s for s in spans if s.parent_id == finalize.span_id]
    assert board_calls and {s.service for s in board_calls} == {"poolkeeper-board"}

    processes = {(s.service, s.pid) for s in spans}
    assert len(processes) >= 5, processes  # Celery child(ren), serve, two workers, the board server
    # The claim's round is a trace of its own, carried to the batch through the Celery message's headers.
    [dispatch] = [s for s in receiver.spans if s.span_id in claim.links]
    assert dispatch.name == "dispatch"
    assert any(s.parent_id == dispatch.span_id and s.name == "materialize batch" for s in receiver.spans)
