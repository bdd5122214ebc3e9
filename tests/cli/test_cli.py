"""poolctl against real store and board files: table and --json output, clear refusals, exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from board import open_board
from core.settings import Settings
from poolkeeper.embedded import RedisServer, wait_for
from poolkeeper.events import dispatch_settled
from store import PoolStore
from tasks.redis_coordination import RedisCoordination
from tests.factories import envelope
from tests.helpers import POOLCTL, poolctl, poolctl_env, staff_url


def ok(tmp: Path, *args: str) -> str:
    done = poolctl(tmp, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def as_json(tmp: Path, *args: str) -> Any:
    return json.loads(ok(tmp, *args, "--json"))


def test_init_is_idempotent_and_status_has_a_stable_json_shape(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    ok(tmp_path, "init")
    status = as_json(tmp_path, "status")
    assert set(status) == {
        "rows",
        "pool_size",
        "free_ordinals",
        "oldest_lease_failed_seconds",
        "quarantined",
        "held_by_quarantined",
        "ordinals",
        "live_children",
        "audit_events",
        "presence",
        "dispatch",
        "processes",
        "ordinals_without_worker",
        "waiting_assigned",
        "lease_seconds",
        "board",
        "board_error",
        "queue_depth",
        "waiting_claims",
        "beat_alive",
        "redis_error",
        "scans",
        "unknown",
    }
    assert status["free_ordinals"] == [0, 1] and status["rows"]["assigned"] == 0
    assert status["held_by_quarantined"] == []
    assert status["ordinals"] == {"free": 2, "held": 0, "quarantined": 0}
    assert status["ordinals_without_worker"] == [0, 1] and status["waiting_assigned"] == []
    assert set(status["scans"]) == {"expire", "lease_failures", "results", "reconcile", "materialize", "gc"}


def test_board_commands_and_maintain_once_drive_a_task(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    staff_url(f"sqlite:///{tmp_path}/pool.db", range(3))  # dispatch fills ordinals with a worker
    ok(tmp_path, "board", "add", "b1", "first task", "--id", "t1")
    ok(tmp_path, "board", "add", "b1", "second task", "--id", "t2")
    summary = as_json(tmp_path, "maintain", "--once")
    assert summary["materialize"] == {"added": 2}
    rows = as_json(tmp_path, "rows", "--state", "assigned")
    assert [(r["task_id"], r["ordinal"], r["attempt"]) for r in rows] == [("t1", 0, 1), ("t2", 1, 1)]
    tasks = {t["id"]: t for t in as_json(tmp_path, "board", "list", "b1")}
    assert tasks["t1"]["status"] == "running" and tasks["t1"]["run_id"] == 1
    assert "row 1 (assigned) is stale" in ok(tmp_path, "board", "cancel", "b1", "t1")
    assert as_json(tmp_path, "rows", "--state", "stale")[0]["task_id"] == "t1"  # at once, not at reconcile
    assert as_json(tmp_path, "maintain", "--once")["reconcile"] == {}
    assert "requeued" in ok(tmp_path, "requeue", str(rows[1]["id"]))
    assert as_json(tmp_path, "status")["board"]["done"] == 1


def test_board_search_lists_tasks_holding_the_text_newest_first(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    ok(tmp_path, "board", "add", "b1", "Rotate the TLS certificates", "--id", "t1")
    ok(
        tmp_path,
        "board",
        "add",
        "b1",
        "Renew certs",
        "--body",
        'ask "the vault" for CERTIFICATES',
        "--id",
        "t2",
    )
    ok(tmp_path, "board", "add", "b2", "unrelated", "--id", "t3")
    found = as_json(tmp_path, "board", "search", "certificate")
    assert [(t["board"], t["id"], t["status"]) for t in found] == [
        ("b1", "t2", "ready"),
        ("b1", "t1", "ready"),
    ]
    assert [t["id"] for t in as_json(tmp_path, "board", "search", '"the vault" for')] == ["t2"]
    assert as_json(tmp_path, "board", "search", "certificate", "--limit", "1")[0]["id"] == "t2"
    assert "Rotate the TLS" in ok(tmp_path, "board", "search", "TLS cert")
    from board.protocol import SEARCH_LIMIT  # --limit's bound is the board's own, stated twice

    too_many = poolctl(tmp_path, "board", "search", "cert", "--limit", str(SEARCH_LIMIT + 1))
    assert too_many.returncode == 2 and "--limit" in too_many.stderr
    assert ok(tmp_path, "board", "search", "cert", "--limit", str(SEARCH_LIMIT))


def test_rows_shows_one_row_with_its_children_as_a_tree(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2)
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={})
    offer = store.offer(0, owner="w-1")
    assert offer is not None
    held = {"row_id": offer.row_id, "attempt": offer.attempt, "fence": offer.fence, "owner": offer.owner}
    parent = store.register_child(held)
    nested = store.register_child({**held, "under": parent.id})
    store.child_result({**parent.token(), "payload": {"ok": True}})
    store.engine.dispose()

    shown = as_json(tmp_path, "rows", str(offer.row_id))
    assert (shown["id"], shown["state"]) == (offer.row_id, "running")
    [child] = shown["children"]
    assert (child["id"], child["status"], child["outcome"]) == (parent.id, "terminal", "done")
    assert [(c["id"], c["outcome"]) for c in child["children"]] == [(nested.id, "retired")]
    tree = ok(tmp_path, "rows", str(offer.row_id))
    assert f"row {offer.row_id} b/t1 run 1: running" in tree
    assert f"child:{nested.id[-12:]} terminal (retired) epoch {offer.fence}" in tree


def test_rows_search_finds_rows_by_task_or_error_as_the_console_does(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2)
    for n, task in enumerate(("import-1", "import-2", "export-1")):
        store.add_run(board="b", task_id=task, run_id=1, ordinal=n % 2, payload={})
        with store.session() as s:
            s.execute(
                text("UPDATE assignments SET state='stale', payload=NULL WHERE task_id=:t"), {"t": task}
            )
    with store.session() as s:
        s.execute(text("UPDATE assignments SET last_error='Disk full' WHERE task_id='export-1'"))
    store.engine.dispose()
    assert [r["task_id"] for r in as_json(tmp_path, "rows", "--search", "IMPORT")] == ["import-2", "import-1"]
    assert [r["task_id"] for r in as_json(tmp_path, "rows", "--search", "disk")] == ["export-1"]
    assert as_json(tmp_path, "rows", "--search", "disk", "--state", "running") == []


def test_board_add_from_json_lines_adds_every_task_or_none(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    # U+2028 and U+0085 are legal raw inside a JSON string: a line ends at "\n" only
    tasks = [{"title": "a", "id": "ta"}, {"title": "b", "body": "x\u2028y"}, {"title": "c\x85d"}]
    lines = "\r\n".join(json.dumps(t, ensure_ascii=False) for t in tasks)
    done = poolctl(tmp_path, "board", "add", "b1", "--from", "-", stdin=lines)
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert len(ids) == 3 and ids[0] == "ta"
    assert {t["title"] for t in as_json(tmp_path, "board", "list", "b1")} == {"a", "b", "c\x85d"}
    assert {t["id"] for t in as_json(tmp_path, "board", "list", "b1")} == set(ids)
    # A bad line refuses the whole file, naming its line; nothing of it is added
    for bad, says in [
        ('{"title": "d"}\n{"titel": "e"}', 'line 2: an object with a "title" string is needed'),
        ('{"title": "d"}\nnot json', "line 2: not JSON"),
        ('{"title": "d", "title": "e"}', "line 1: not JSON: the key title appears twice"),
        ('{"title": "d", "id": "ta"}', "b1/ta already exists"),
        ('{"title": "d", "owner": "me"}', "line 1: unknown field(s) owner"),
    ]:
        refused = poolctl(tmp_path, "board", "add", "b1", "--from", "-", stdin=bad)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert len(as_json(tmp_path, "board", "list", "b1")) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("requeue", "42"), "row 42: no such row"),
        (("rows", "42"), "row 42: no such row"),
        (("board", "list", "nosuch"), "nosuch: no such board"),
        (("board", "unblock", "b1", "t9"), "b1/t9: no such task"),
        (("rows", "--state", "zombie"), "--state: unknown state 'zombie'"),
        (("board", "add", "b 1", "x"), "board: may hold only"),
        (("abandon", "42"), "row 42: no such row"),
        (("board", "add", "b1"), "title: give a TITLE, or --from FILE"),
        (("board", "add", "b1", "x", "--from", "-"), "not both"),
        (("board", "add", "b1", "--from", "nosuch.jsonl"), "--from: cannot read nosuch.jsonl"),
        (("board", "add", "b1", "--from", "/dev/zero"), "--from: cannot read /dev/zero: not a regular file"),
        (("abandon", "1", "--reason", ""), "reason: must be 1 to 500 characters"),
        (("board", "search", "ab"), "q: too short: tasks are searched by 3 characters or more"),
        (("board", "search", "x" * 201), "q: too long: at most 200 characters"),
        (("board", "search", "  "), "q: empty"),
        (("board", "search", "cert", "--limit", "51"), "'--limit': Input should be less than or equal to 50"),
    ],
)
def test_user_mistakes_are_one_clear_line_and_exit_2(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    ok(tmp_path, "init")
    done = poolctl(tmp_path, *args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"poolctl: {done.stderr.strip().removeprefix('poolctl: ')}"]
    assert message in done.stderr and "Traceback" not in done.stderr


def test_abandon_frees_the_ordinal_a_quarantined_row_held_and_refuses_a_settled_row(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    staff_url(f"sqlite:///{tmp_path}/pool.db", range(3))
    ok(tmp_path, "board", "add", "b1", "poisoned", "--id", "t1")
    ok(tmp_path, "maintain", "--once")
    with sqlite3.connect(tmp_path / "pool.db") as db:  # what repeated failures leave behind
        db.execute("UPDATE assignments SET quarantined = 1, failures = 5, last_error = 'poisoned'")
    status = as_json(tmp_path, "status")
    assert (status["free_ordinals"], status["held_by_quarantined"]) == ([1], [0])
    assert "[0] (see `poolctl abandon`)" in ok(tmp_path, "status")
    done = poolctl(tmp_path, "abandon", "1", "--reason", "poisoned payload")
    assert done.returncode == 0, done.stderr
    assert "row 1 (b1/t1 run 1) abandoned: board parked; ordinal 0 free" in done.stdout
    logged = "abandon: row 1 b1/t1 run 1 (assigned): abandoned by operator: poisoned payload"
    assert done.stderr.strip() == logged
    status = as_json(tmp_path, "status")
    assert (status["free_ordinals"], status["held_by_quarantined"]) == ([0, 1], [])
    [task] = as_json(tmp_path, "board", "list", "b1")
    assert (task["status"], task["block_reason"]) == ("blocked", "abandoned by operator: poisoned payload")
    again = poolctl(tmp_path, "abandon", "1")
    assert again.returncode == 2 and again.stderr.strip() == (
        "poolctl: row: row 1 is stale: a settled row is never abandoned"
    )


def test_a_bad_setting_names_the_variable(tmp_path: Path) -> None:
    done = poolctl(tmp_path, "status", env={"POOL_LEASE_SECONDS": "soon"})
    assert done.returncode == 2
    assert done.stderr.strip() == "poolctl: POOL_LEASE_SECONDS: expected a number, got 'soon'"


DEMO_ARGS = (
    "demo",
    "--tasks",
    "30",
    "--pool-size",
    "4",
    "--crash-rate",
    "0.1",
    "--hang-rate",
    "0.05",
    "--poison",
    "1",
    "--board-busy-rate",
    "0.05",
    "--lease",
    "2",
    "--seed",
    "7",
    "--timeout",
    "240",
)


@pytest.mark.integration
def test_demo_runs_to_its_summary_with_the_embedded_redis(tmp_path: Path) -> None:
    done = poolctl(tmp_path, *DEMO_ARGS, "--workdir", str(tmp_path / "demo"), env={"POOL_REDIS_URL": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "embedded redis-server" in done.stdout
    assert "\nlost: 0\n" in done.stdout and "INVARIANT FAILED" not in done.stdout
    # piped: the console's line is whole (not folded at 80 columns), the summary apart from the table
    assert re.search(
        r"\nconsole: http://\S+/ui \(operator token for this run: op\.[0-9a-f]{64}\)\n", done.stdout
    )
    assert "┘\n\ndone:" in done.stdout, done.stdout[-3000:]
    # the poisoned task's row ends quarantined, or abandoned if it was holding its ordinal
    given_up = re.search(r"\nquarantined: (\d+)\n(?:.*\n)*?abandoned: +(\d+) ", done.stdout)
    assert given_up and int(given_up[1]) + int(given_up[2]) == 1, done.stdout[-3000:]


@pytest.mark.integration
def test_a_pool_smaller_than_its_poisoned_tasks_settles_and_leaves_no_temp_files(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"  # the demo's temp folder, to see what it leaves in it
    temp.mkdir()
    args = ("demo", "--tasks", "5", "--poison", "3", "--pool-size", "2", "--seed", "3", "--timeout", "240")
    done = poolctl(tmp_path, *args, env={"POOL_REDIS_URL": "", "TMPDIR": str(temp)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "\nlost: 0\n" in done.stdout and "INVARIANT FAILED" not in done.stdout
    assert re.search(r"\nabandoned: +[23] ", done.stdout), done.stdout[-3000:]  # each freed a held ordinal
    assert list(temp.iterdir()) == [], "the demo left files in the temp folder"


@pytest.mark.integration
def test_demo_reuses_a_workdir_a_demo_left_behind(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    workdir.mkdir()
    # a previous demo's board: its task ids are taken
    previous = open_board(Settings(board_url=f"sqlite:///{workdir}/board.db"))
    previous.migrate()
    previous.add_task("demo", "demo task 0", task_id="task-0000")
    previous.close()
    (workdir / "worker.log").write_text("an old log\n")
    args = ("demo", "--tasks", "3", "--poison", "0", "--pool-size", "2", "--timeout", "240")
    done = poolctl(tmp_path, *args, "--workdir", str(workdir), env={"POOL_REDIS_URL": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "\nlost: 0\n" in done.stdout and "an old log" not in _read(workdir / "worker.log")
    assert (workdir / "pool.db").exists(), "a --workdir is kept"


def test_demo_refuses_a_workdir_holding_files_it_did_not_make(tmp_path: Path) -> None:
    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
    done = poolctl(tmp_path, "demo", "--workdir", str(workdir))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"poolctl: --workdir: {workdir} holds files a demo did not make (notes.txt); "
        "give a new or empty folder, or one a demo used before"
    )
    assert [p.name for p in workdir.iterdir()] == ["notes.txt"]


@pytest.mark.integration
def test_demo_uses_the_redis_it_is_given(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        done = poolctl(
            tmp_path, *DEMO_ARGS, "--workdir", str(tmp_path / "demo"), env={"POOL_REDIS_URL": server.url}
        )
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert server.url in done.stdout and "\nlost: 0\n" in done.stdout


@pytest.mark.integration
def test_two_demos_on_one_redis_keep_to_their_own_namespace(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, bundled=True).start()  # one Redis, one db, for both deployments
    client = server.client()
    namespaces = ("blue", "green")
    args = list(DEMO_ARGS)
    args[args.index("--poison") + 1] = "0"  # a poisoned task is logged at ERROR by design
    command = [sys.executable, "-c", "from poolkeeper.cli import main; main()", *args]
    demos = {
        ns: subprocess.Popen(
            [*command, "--workdir", tmp_path / ns],
            cwd=tmp_path,
            env={**os.environ, "POOL_REDIS_URL": server.url, "POOL_NAMESPACE": ns},
            stdout=(tmp_path / f"{ns}.out").open("w"),
            stderr=subprocess.STDOUT,
        )
        for ns in namespaces
    }
    seen: set[str] = set()  # every Redis key either deployment wrote while they ran side by side
    try:

        def finished() -> bool:
            seen.update(k.decode() if isinstance(k, bytes) else k for k in client.keys("*"))
            return all(d.poll() is not None for d in demos.values())

        wait_for("both demos to finish", finished, 300, every=0.2)
    finally:
        for d in demos.values():
            if d.poll() is None:
                d.terminate()  # the demo stops everything it started
                d.wait(60)
        server.stop()
    for ns, d in demos.items():
        out = _read(tmp_path / f"{ns}.out")
        assert d.returncode == 0 and "\nlost: 0\n" in out, out[-3000:]
        logs = "".join(_read(p) for p in sorted((tmp_path / ns).glob("worker*.log")))
        assert "ERROR" not in logs, f"{ns}: {logs[-3000:]}"
        assert re.search(r"results [\d, ]+(and \d+ more)?: finalized", logs), f"{ns}'s worker did its results"
        beat = "".join(_read(p) for p in sorted((tmp_path / ns).glob("beat*.log")))
        assert "Sending due task" not in beat  # beat's per-tick lines are quiet (issue 18, finding 3)
    assert seen, "the demos used the Redis they were given"
    # kombu's binding tables are named by exchange (so by namespace); one index of when
    # expiring ones are due is kombu's own, shared by design, keyed by those names.
    foreign = [k for k in seen if not re.match(r"(_kombu\.binding(_permanent)?\.)?(blue|green)[.:]", k)]
    assert set(foreign) <= {"_kombu.binding_deadlines"}, f"keys outside both namespaces: {foreign}"
    assert {k.split(":")[0] for k in seen if ":" in k} == set(namespaces)


@pytest.mark.integration
def test_ctrl_c_stops_everything_the_demo_started(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    base = {**os.environ, "POOL_REDIS_URL": ""}
    demo = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from poolkeeper.cli import main; main()",
            "demo",
            "--tasks",
            "500",
            "--workdir",
            str(workdir),
        ],
        cwd=tmp_path,
        env=base,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for("the demo's beat to start", lambda: "Starting..." in _read(workdir / "beat.log"), 60)
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=90)
    assert demo.returncode == 130 and "interrupted" in err
    assert _processes_mentioning(str(workdir)) == []


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # the process ended while we looked
        if text in args:
            found.append(args)
    return found


@pytest.mark.integration
def test_a_pause_is_acknowledged_only_once_the_dispatch_round_in_flight_has_ended(tmp_path: Path) -> None:
    # Given a dispatch round in flight: another process holds the dispatch lock (a real redis-server)
    ok(tmp_path, "init")
    server = RedisServer(tmp_path).start()
    try:
        settings = Settings(redis_url=server.url, namespace=f"pause{os.getpid()}")
        dispatcher = RedisCoordination(server.client(), settings)
        [token] = dispatcher.lock_many(["dispatch"])
        assert token is not None
        # When an operator pauses
        env = poolctl_env(tmp_path, {"POOL_REDIS_URL": server.url, "POOL_NAMESPACE": settings.namespace})
        pausing = subprocess.Popen([*POOLCTL, "pause", "--reason", "deploy"], env=env, cwd=tmp_path,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        wait_for("the pause written", lambda: paused_in(tmp_path / "pool.db"), 60, every=0.02)
        # Then it waits for the round: acknowledged only after the lock is let go
        assert pausing.poll() is None, "acknowledged while a round could still claim"
        dispatcher.unlock_many({"dispatch": token})
        out, err = pausing.communicate(timeout=60)
        assert pausing.returncode == 0, err
        assert "dispatch paused: deploy (no claim follows; claimed runs go on" in out
        # and a round that never ends, or a Redis that is away, is said, not waited on for ever
        [token] = dispatcher.lock_many(["dispatch"])
        assert "still claimed after 0 s" in str(dispatch_settled(settings, timeout=0.2))
    finally:
        server.stop()
    away = dispatch_settled(settings, timeout=0.2)
    assert "could not see whether a dispatch round is in flight" in str(away)


def paused_in(db: Path) -> bool:
    with sqlite3.connect(db) as conn:
        return bool(conn.execute("SELECT paused FROM dispatch_pause").fetchone()[0])


def test_pause_and_resume_dispatch_show_in_status_and_the_audit_trail(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    assert as_json(tmp_path, "status")["dispatch"]["paused"] is False
    assert "dispatch paused: deploy 42" in ok(tmp_path, "pause", "--reason", "deploy 42")
    assert "already paused: deploy 42 (unchanged)" in ok(tmp_path, "pause", "--reason", "other")
    status = as_json(tmp_path, "status")["dispatch"]
    assert (status["paused"], status["reason"], status["by"]) == (True, "deploy 42", "operator")
    assert "PAUSED by operator" in ok(tmp_path, "status")
    refused = poolctl(tmp_path, "pause", "--reason", " ")
    assert refused.returncode == 2 and "reason" in refused.stderr
    assert ok(tmp_path, "resume").strip() == "dispatch resumed"
    assert ok(tmp_path, "resume").strip() == "dispatch was not paused (unchanged)"
    assert as_json(tmp_path, "status")["dispatch"]["paused"] is False
    with sqlite3.connect(tmp_path / "pool.db") as db:
        events = db.execute("SELECT row_id, kind, actor, detail FROM audit_events ORDER BY id").fetchall()
    assert events == [(0, "pause", "operator", "deploy 42"), (0, "resume", "operator", None)]


def test_a_board_pauses_and_resumes_on_its_own_in_status_and_the_audit_trail(tmp_path: Path) -> None:
    # Given a store and two boards
    ok(tmp_path, "init")
    for board in ("b", "c"):
        ok(tmp_path, "board", "add", board, "a task")
    # When board "b" is paused alone, status names it (and only it), and dispatch as a whole runs
    said = ok(tmp_path, "pause", "--board", "b", "--reason", "move b")
    assert "dispatch of board b paused: move b" in said and "`poolctl resume --board b` ends it" in said
    assert "already paused: move b (unchanged)" in ok(tmp_path, "pause", "--board", "b", "--reason", "x")
    status = as_json(tmp_path, "status")["dispatch"]
    assert status["paused"] is False
    assert [(b["board"], b["paused"], b["reason"], b["by"]) for b in status["boards"]] == [
        ("b", True, "move b", "operator")
    ]
    assert "dispatch of b" in ok(tmp_path, "status") and "PAUSED by operator" in ok(tmp_path, "status")
    # and a board that does not exist is refused, in one line, with nothing written
    refused = poolctl(tmp_path, "pause", "--board", "nosuch", "--reason", "typo")
    assert refused.returncode != 0 and refused.stderr.strip() == "poolctl: nosuch: no such board"
    # Then the pool-wide resume leaves it paused; resuming the board ends it
    assert ok(tmp_path, "resume").strip() == "dispatch was not paused (unchanged)"
    assert ok(tmp_path, "resume", "--board", "b").strip() == "dispatch of board b resumed"
    assert ok(tmp_path, "resume", "--board", "b").strip() == "dispatch of board b was not paused (unchanged)"
    refused = poolctl(tmp_path, "resume", "--board", "nosuch")
    assert refused.returncode == 2 and refused.stderr.strip() == "poolctl: nosuch: no such board"
    assert as_json(tmp_path, "status")["dispatch"]["boards"] == []
    with sqlite3.connect(tmp_path / "pool.db") as db:
        events = db.execute("SELECT row_id, kind, detail FROM audit_events ORDER BY id").fetchall()
    assert events == [(0, "pause", "board b: move b"), (0, "resume", "board b")]


def test_piped_output_keeps_long_values_whole_and_history_shows_milliseconds(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    reason = "deploy 42: " + "the database moves to its new host, then the workers follow " * 2
    ok(tmp_path, "pause", "--reason", reason)
    piped = poolctl(tmp_path, "status", env={"COLUMNS": ""})  # a pipe, and no width given
    assert piped.returncode == 0, piped.stderr
    assert reason.strip() in piped.stdout  # on one line: not folded at 80 columns

    store = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2)
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={})
    offer = store.offer(0, owner="w-1")
    assert offer is not None
    with store.session(readonly=True) as s:
        [at] = s.execute(
            text("SELECT at FROM audit_events WHERE row_id = :r AND kind = 'grant'"), {"r": offer.row_id}
        ).scalars()
    store.engine.dispose()
    shown = ok(tmp_path, "rows", str(offer.row_id), "--history")
    assert f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(at))}.{int(at * 1000) % 1000:03d}" in shown


def test_rows_row_shows_what_the_run_was_and_printed_then_that_it_was_compacted(tmp_path: Path) -> None:
    ok(tmp_path, "init")
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2, max_attempts=3)
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={"body": "make test \x1b[2J"})
    offer = store.offer(0, owner="w-1")
    assert offer is not None
    printed = {"stdout_tail": "compiling\nall 12 tests passed\n", "stderr_tail": "warning: \x1b]0;owned\x07"}
    result = {"status": "done", "exit_code": 0, **printed}
    store.accept_result({**envelope(offer, "r1"), "payload": result})

    shown = as_json(tmp_path, "rows", str(offer.row_id))["detail"]
    assert (shown["payload"], shown["result"], shown["compacted"]) == (
        {"body": "make test \x1b[2J"},
        result,
        False,
    )
    assert shown["max_attempts"] == 3
    assert (
        0 <= shown["wait_seconds"] <= shown["total_seconds"]
        and 0 <= shown["run_seconds"] <= shown["total_seconds"]
    )
    tree = ok(tmp_path, "rows", str(offer.row_id))
    assert "attempt 1 of 3; waited " in tree and 'payload: {"body": "make test \\u001b[2J"}' in tree
    assert '"exit_code": 0' in tree and "all 12 tests passed" in tree
    assert "warning: \\x1b]0;owned\\x07" in tree and "\x1b" not in tree  # escaped, never raw

    with store.session() as s:  # settled: terminal, its payload and result compacted (invariant 8)
        s.execute(
            text("UPDATE assignments SET state='finalized', payload=NULL, result=NULL WHERE id=:r"),
            {"r": offer.row_id},
        )
    store.engine.dispose()
    shown = as_json(tmp_path, "rows", str(offer.row_id))["detail"]
    assert (shown["payload"], shown["result"], shown["compacted"]) == (None, None, True)
    assert "payload: compacted" in ok(tmp_path, "rows", str(offer.row_id))


def test_board_show_gives_the_body_the_result_with_its_output_and_each_run_with_its_row(
    tmp_path: Path,
) -> None:
    ok(tmp_path, "init")
    ok(tmp_path, "board", "add", "b", "build it", "--id", "t1", "--body", "make all\n\x1b[31mred\x1b[0m")
    kanban = open_board(Settings(board_url=f"sqlite:///{tmp_path}/board.db"))
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2)
    store.add_run(board="b", task_id="t1", run_id=claim.run_id, ordinal=0, payload={"body": "make all"})
    result = {"status": "done", "exit_code": 0, "stdout_tail": "built\n", "stderr_tail": ""}
    assert kanban.complete_task("b", "t1", expected_run_id=claim.run_id, result=result)
    store.engine.dispose()
    kanban.close()

    shown = as_json(tmp_path, "board", "show", "b", "t1")
    assert (shown["body"], shown["result"], shown["status"]) == (
        "make all\n\x1b[31mred\x1b[0m",
        result,
        "done",
    )
    [run] = shown["runs"]
    assert (run["run_id"], run["outcome"], run["row"]) == (claim.run_id, "done", 1)
    tree = ok(tmp_path, "board", "show", "b", "t1")
    assert "b/t1: done (lane pool)" in tree and "make all" in tree and "\\x1b[31mred\\x1b[0m" in tree
    assert '"exit_code": 0' in tree and "built" in tree and f"run {claim.run_id}: done, started " in tree
    assert "; row 1" in tree and "\x1b" not in tree
    missing = poolctl(tmp_path, "board", "show", "b", "nope")
    assert missing.returncode == 2 and "b/nope: no such task" in missing.stderr
