"""Issue 18's remaining findings: worker presence, logs, reconcile's order, CLI output, deploy files, beat.

Each test names its finding and failed on the code before its fix.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the dev extra
from rich.console import Console

from board import Board
from core.errors import TransientError
from core.retry import RetryPolicy
from core.settings import Settings
from poolkeeper.cli import render
from poolkeeper.server import probes
from poolkeeper.status import snapshot
from store import PoolStore, bookkeeping, numbers
from store.presence import EVERY_SECONDS
from tasks import plane, registry, runner, scan
from tasks.collectors import StoreCollector
from tasks.declaration import Outcome
from tasks.plane import Plane
from tests.factories import NOW, OWNER, envelope, scanned

LEASE = 30.0  # the settings fixture's lease


def _text(renderable: Any, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _given_one_worker_for_three_ordinals(store: PoolStore) -> None:
    """POOL_SIZE=3, runs on every ordinal, and one worker, on ordinal 0, that took its run."""
    for ordinal in range(3):
        store.add_run(board="b", task_id=f"t{ordinal}", run_id=1, ordinal=ordinal, payload={}, now=NOW)
    assert store.offer(0, owner=OWNER, now=NOW) is not None


def _presence(store: PoolStore) -> list[tuple[int, str | None, str | None, float | None]]:
    with store.session(readonly=True) as s:
        return [(p.ordinal, p.owner, p.call, p.at) for p in numbers.read(s, store.pool_size).presence]


# --- finding 2: worker presence -------------------------------------------------------------


def test_each_ordinals_last_call_and_owner_are_kept(store: PoolStore) -> None:
    _given_one_worker_for_three_ordinals(store)
    assert _presence(store) == [(0, OWNER, "offer", NOW), (1, None, None, None), (2, None, None, None)]

    grant = store.offer(0, owner=OWNER, now=NOW + 10)
    assert grant is not None
    store.heartbeat(envelope(grant, "h1"), now=NOW + 20)
    assert _presence(store)[0] == (0, OWNER, "heartbeat", NOW + 20)

    store.accept_result({**envelope(grant, "r1"), "payload": {"status": "done"}}, now=NOW + 21)
    assert _presence(store)[0] == (0, OWNER, "result", NOW + 21)  # a result always writes


def test_presence_is_written_at_most_once_per_interval_per_ordinal(store: PoolStore) -> None:
    """An idle worker polls offer about once a second: most polls write nothing."""
    store.offer(1, owner="w-a", now=NOW)
    store.offer(1, owner="w-a", now=NOW + EVERY_SECONDS / 2)
    assert _presence(store)[1] == (1, "w-a", "offer", NOW)
    store.offer(1, owner="w-b", now=NOW + EVERY_SECONDS / 2)  # a restarted worker is news at once
    assert _presence(store)[1] == (1, "w-b", "offer", NOW + EVERY_SECONDS / 2)
    store.offer(1, owner="w-b", now=NOW + 2 * EVERY_SECONDS)
    assert _presence(store)[1] == (1, "w-b", "offer", NOW + 2 * EVERY_SECONDS)


def test_status_warns_of_ordinals_without_a_worker_and_runs_waiting_assigned(
    store: PoolStore, kanban: Board, settings: Settings
) -> None:
    """The issue's scene: one worker, POOL_SIZE=3; runs on ordinals 1 and 2 stay ``assigned``."""
    _given_one_worker_for_three_ordinals(store)
    later = NOW + LEASE + 1
    grant = store.offer(0, owner=OWNER, now=later - 1)  # ordinal 0's worker is still there
    assert grant is not None

    data = snapshot(store, kanban, settings, None, later)
    assert data["ordinals_without_worker"] == [1, 2]
    assert [(w["ordinal"], w["waited_seconds"]) for w in data["waiting_assigned"]] == [(1, 31.0), (2, 31.0)]
    assert data["presence"][0] == {
        "ordinal": 0,
        "owner": OWNER,
        "call": "offer",
        "at": later - 1,
        "age_seconds": 1.0,
        "state": "busy",
        "holds": {"row": 1, "board": "b", "task_id": "t0", "run_id": 1, "state": "running"},
    }
    assert [p["state"] for p in data["presence"]] == ["busy", "gone", "gone"]
    shown = _text(render.status(data, store.pool_size))
    assert "ordinal 1 worker" in shown and "no worker for over a lease" in shown
    assert "assigned longer than a lease" in shown and "row 2 on ordinal 1" in shown

    early = snapshot(store, kanban, settings, None, NOW + 1)
    assert early["waiting_assigned"] == []


def test_v1_status_and_the_gauges_say_which_ordinals_have_no_worker(store: PoolStore) -> None:
    """They read the real clock: the runs were added a lease ago, only ordinal 0's worker calls."""
    then = time.time() - LEASE - 5
    for ordinal in range(3):
        store.add_run(board="b", task_id=f"t{ordinal}", run_id=1, ordinal=ordinal, payload={}, now=then)
    assert store.offer(0, owner=OWNER, now=time.time()) is not None

    status = probes.status(None, store)  # type: ignore[arg-type]  # the operator check is the router's
    assert status.ordinals_without_worker == [1, 2]
    assert status.waiting_assigned == [2, 3]
    assert status.worker_states == ["busy", "gone", "gone"]

    gauges = {m.name: m for m in StoreCollector(store).collect()}
    seen = {s.labels["ordinal"]: s.value for s in gauges["poolkeeper_ordinal_last_seen_seconds"].samples}
    assert set(seen) == {"0"} and 0 <= seen["0"] < 5
    assert gauges["poolkeeper_ordinals_without_worker"].samples[0].value == 2
    assert gauges["poolkeeper_assigned_over_lease_rows"].samples[0].value == 2


# --- findings 3 and 4: logs name the row, and say a repeated thing once --------------------


def test_a_batch_names_the_row_of_each_outcome_and_says_nothing_when_nothing_happened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "poolkeeper")
    done = runner.BatchResult(registry.get("results"))
    done.finish(17, Outcome.FINALIZED)
    done.report()
    many = runner.BatchResult(registry.get("expire"))
    for row in range(1, 26):
        many.finish(row, Outcome.REOFFERED)
    many.report()
    quiet = runner.BatchResult(registry.get("results"))
    quiet.finish(18, Outcome.LOCK_BUSY)
    quiet.finish(19, Outcome.LOST_RACE)
    quiet.report()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "results 17: finalized",
        "expire " + ", ".join(map(str, range(1, 21))) + " and 5 more: reoffered",
    ]


def test_beat_does_not_log_a_line_per_due_task(caplog: pytest.LogCaptureFixture) -> None:
    from tasks import celery

    celery._quiet_celery()
    caplog.set_level(logging.INFO, "celery.beat")
    beat = logging.getLogger("celery.beat")
    beat.info("Scheduler: Sending due task %s (%s)", "poolkeeper-expire", "poolkeeper.scan")
    beat.info("beat: Starting...")
    assert [r.getMessage() for r in caplog.records] == ["beat: Starting..."]


def test_a_scan_skipped_on_every_tick_is_logged_once_per_detail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tasks import celery

    def busy(*_: Any) -> int:
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(plane, "current", lambda: None)
    monkeypatch.setattr(scan, "scan", busy)
    caplog.set_level(logging.INFO, "poolkeeper")
    for _ in range(3):
        celery.scan_pass.run("expire")
    assert [r.getMessage() for r in caplog.records] == [
        "expire scan: skipped this tick: TransientError: pool store: database is locked"
    ]


# --- finding 6: a failing board registry never keeps a moved-on run live -------------------


def test_reconcile_releases_moved_on_rows_while_the_board_registry_fails(
    plane: Plane, kanban: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    kanban.add_task("b", "task", task_id="t1")
    [claim] = scanned(plane, "materialize")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    kanban.reassign_task("b", "t1", assignee="alice", lane="humans")  # the run moved on

    def registry_down(**_: Any) -> list[str]:
        raise TransientError("board: registry busy")

    monkeypatch.setattr(plane.board, "list_boards", registry_down)
    queued = scanned(plane, "reconcile")
    assert queued["reconcile"] == [1]
    assert runner.run_key(plane, "reconcile", 1, NOW) == "stale"


# --- findings 12 and 15: what poolctl writes to a terminal ----------------------------------


def _poolctl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{cwd}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{cwd}/board.db",
        "POOL_REDIS_URL": "",
        "COLUMNS": "80",
        "TERM": "xterm-256color",
    }
    code = "from poolkeeper.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.fixture
def initialised(tmp_path: Path) -> Path:
    assert _poolctl(tmp_path, "init").returncode == 0
    return tmp_path


LONG_ID = "task-2f9c1e7a-5b3d-4c8e-9f0a-7b6c5d4e3f2a"


def test_board_text_never_reaches_the_terminal_as_control_characters(initialised: Path) -> None:
    title = "\x1b[2J\x1b[Hcleared \x07\u202egnp.exe [bold]x[/bold]"
    added = _poolctl(initialised, "board", "add", "b", title, "--body", "\x1b]0;owned\x07")
    listed = _poolctl(initialised, "board", "list")
    for done in (added, listed):
        assert done.returncode == 0, done.stderr
        assert not [c for c in done.stdout if unicodedata.category(c) == "Cc" and c != "\n"], done.stdout
        assert "\u202e" not in done.stdout
    assert "\\x1b[2J" in listed.stdout and "[bold]x[/bold]" in listed.stdout  # shown, not obeyed


def test_ids_are_never_cut_at_80_columns(initialised: Path) -> None:
    store = PoolStore(f"sqlite:///{initialised}/pool.db")
    store.add_run(board="engineering", task_id=LONG_ID, run_id=987654321, ordinal=2, payload={}, now=NOW)
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={}, now=NOW)
    with store.session() as s:
        bookkeeping.record_failure(
            s,
            1,
            "TransientError: board: the board database is locked " * 3,
            policy=RetryPolicy(),
            now=NOW,
            actor="pass:materialize",
        )
    store.engine.dispose()
    listed = _poolctl(initialised, "rows")
    assert listed.returncode == 0, listed.stderr
    assert f"engineering/{LONG_ID}" in listed.stdout and "987654321" in listed.stdout
    assert max(len(line) for line in listed.stdout.splitlines()) <= 80
    history = _poolctl(initialised, "rows", "1", "--history")
    assert history.returncode == 0 and "pass:materialize" in history.stdout, history.stdout
    assert "…" not in listed.stdout + history.stdout


def test_help_shows_no_type_after_a_flag_and_a_bad_status_lists_the_good_ones(initialised: Path) -> None:
    helped = _poolctl(initialised, "rows", "--help")
    assert "--quarantined" in helped.stdout and "<bool>" not in helped.stdout
    bogus = _poolctl(initialised, "board", "list", "--status", "bogus")
    assert bogus.returncode == 2
    assert "ready, running, blocked, done" in bogus.stderr, bogus.stderr


# --- finding 20: every manifest gives each process what the README says it needs -----------

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _needs() -> dict[str, list[set[str]]]:
    """README "Deploy": per process, the variables it needs; ``A` or `B`` is one need met by either."""
    section = (ROOT / "README.md").read_text().split("What each process reads", 1)[1].split("\n\n", 2)[1]
    needs: dict[str, list[set[str]]] = {}
    for row in section.splitlines()[2:]:
        _, process, wanted, _ = row.split("|")
        alternatives = re.sub(r"\([^)]*\)", "", wanted).split(",")  # an aside in brackets names no need
        needs[_process(process.strip(" `"))] = [set(re.findall(r"POOL_[A-Z_]+", a)) for a in alternatives]
    return needs


def _process(command: str) -> str:
    words = command.replace('"', " ").split()
    for name in ("init", "serve", "worker", "beat"):
        if name in words and ({"poolctl", "celery"} & {w.rsplit("/", 1)[-1] for w in words}):
            return name
    return ""


def _dotenv(path: Path) -> set[str]:
    lines = [line.split("=", 1)[0].strip() for line in path.read_text().splitlines()]
    return {name for name in lines if name and not name.startswith("#")}


def _kubernetes() -> list[tuple[str, set[str]]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "poolkeeper.yaml").read_text()) if d]
    maps = {d["metadata"]["name"]: set(d.get("data", {})) for d in docs if d["kind"] == "ConfigMap"}
    found = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            env = {e["name"] for e in c.get("env", [])}
            for source in c.get("envFrom", []):
                env |= maps.get(source.get("configMapRef", {}).get("name"), set())
            found.append((_process(" ".join(c["command"])), env))
    return found


def _compose(name: str) -> list[tuple[str, set[str]]]:
    services = yaml.safe_load((DEPLOY / name).read_text())["services"]
    found = []
    for service in services.values():
        command = service.get("command", [])
        env = set(service.get("environment", {}))
        for env_file in service.get("env_file", []):
            env |= _dotenv(DEPLOY / (env_file + ".example" if env_file == ".env" else env_file))
        found.append((_process(" ".join(command) if isinstance(command, list) else command), env))
    return found


def _systemd() -> list[tuple[str, set[str]]]:
    found = []
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text()
        env = set(re.findall(r"^Environment=(POOL_[A-Z_]+)=", text, re.M))
        if re.search(r"^EnvironmentFile=/etc/poolkeeper/env$", text, re.M):
            env |= _dotenv(DEPLOY / "systemd" / "env.example")
        for command in re.findall(r"^ExecStart(?:Pre)?=(.*)$", text, re.M):
            found.append((_process(command), env))
    return found


@pytest.mark.parametrize(
    "manifest",
    ["k8s/poolkeeper.yaml", "docker-compose.yml", "docker-compose.sqlite.yml", "systemd/*.service"],
)
def test_each_manifest_runs_every_process_with_the_environment_the_readme_documents(manifest: str) -> None:
    needs = _needs()
    assert set(needs) == {"init", "worker", "beat", "serve"}
    found = {
        "k8s/poolkeeper.yaml": _kubernetes,
        "docker-compose.yml": lambda: _compose("docker-compose.yml"),
        "docker-compose.sqlite.yml": lambda: _compose("docker-compose.sqlite.yml"),
        "systemd/*.service": _systemd,
    }[manifest]()
    assert {p for p, _ in found if p} == set(needs), f"{manifest} runs every process the README names"
    missing = [
        (process, sorted(need))
        for process, env in found
        if process
        for need in needs[process]
        if not need & env
    ]
    assert missing == [], f"{manifest}: processes without what the README says they need"


def test_every_systemd_unit_has_the_hardening_its_readme_promises() -> None:
    hardening = ["NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes"]
    hardening += ["PrivateDevices=yes", "CapabilityBoundingSet=", "User=poolkeeper", "Group=poolkeeper"]
    readme = (DEPLOY / "systemd" / "README.md").read_text()
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        lines = unit.read_text().splitlines()
        assert [h for h in hardening if h not in lines] == [], unit.name
        assert f"`{unit.name}`" in readme, f"{unit.name} is in deploy/systemd/README.md"


# --- finding 13, leftover: a refused beat writes nothing, and exits as the README says ------


def test_a_refused_beat_writes_no_schedule_file_and_exits_78(tmp_path: Path) -> None:
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    env = {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/never-initialised.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
        "POOL_REDIS_URL": "redis://127.0.0.1:1/0",
        "XDG_STATE_HOME": str(state),
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "beat", "-l", "info"]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    assert "run `poolctl init`" in done.stderr
    assert sorted(p.name for p in cwd.iterdir()) == []
    assert not state.exists() or not any(state.rglob("*")), "nothing in the state directory either"
    readme = (ROOT / "README.md").read_text()
    assert "exit 78 (as `poolctl` does: run `poolctl init`)" in readme


def test_beats_default_schedule_file_is_in_the_state_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks import celery

    monkeypatch.setenv("XDG_STATE_HOME", "/var/lib/x")
    assert (
        celery.schedule_file(Settings(namespace="blue")) == "/var/lib/x/poolkeeper/blue-celerybeat-schedule"
    )
