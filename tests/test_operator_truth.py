"""What the operator and the test runner are told is true, and nothing is left behind.

Issue 18: property tests are bounded by examples, not by wall time (finding 21); the suite
leaves nothing in the temp folder (13); a database this process cannot write is read creating
nothing (13) and refused as a setting, never as busy (7); the Python API on a store init has
not set up is a setting naming what to run (14); a demo takes its own workdir again (11).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from core.errors import ConfigError
from poolkeeper.demo import prepare_workdir
from store import PoolStore
from tests.helpers import CONFIG, files, refused
from tests.helpers import run as poolctl

REPO = Path(__file__).resolve().parent.parent

# Collected in a pytest of its own: what each Hypothesis test's timeout and settings are.
_REPORT_PLUGIN = '''
import inspect, json, os
from hypothesis import settings

MENTIONS = ("run_state_machine_as_test", "@given", "budget(")

def _mentions(fn, depth):
    """fn, or a function of its module it calls (to ``depth``), runs Hypothesis."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if any(m in source for m in MENTIONS):
        return True
    called = [getattr(inspect.getmodule(fn), n, None) for n in getattr(fn, "__code__", None).co_names]
    return depth > 0 and any(inspect.isfunction(c) and _mentions(c, depth - 1) for c in called)

def _uses_hypothesis(item):
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    return getattr(fn, "is_hypothesis_test", False) or _mentions(fn, 2)

def pytest_collection_finish(session):
    found = []
    for item in session.items:
        if not _uses_hypothesis(item):
            continue
        marker = item.get_closest_marker("timeout")
        timeout = None if marker is None else (marker.args or [marker.kwargs.get("timeout")])[0]
        inner = getattr(getattr(item, "function", None), "_hypothesis_internal_use_settings", None)
        found.append({
            "id": item.nodeid,
            "timeout": timeout,
            "property": item.get_closest_marker("property") is not None,
            "deadline": None if inner is None else str(inner.deadline),
        })
    with open(os.environ["REPORT"], "w") as out:
        json.dump({"default_deadline": str(settings.default.deadline), "tests": found}, out)
'''


def _pytest(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A pytest of its own over this suite's files, from the checkout, with ``env`` set."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_hypothesis_test_is_bounded_by_its_examples_not_the_per_test_timeout(tmp_path: Path) -> None:
    """A loaded machine makes a property test slower, never a failure (finding 21)."""
    files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "from hypothesis" in p.read_text() and p != Path(__file__).resolve()
    )
    (tmp_path / "hypothesis_report.py").write_text(_REPORT_PLUGIN)
    report = tmp_path / "report.json"
    done = _pytest(tmp_path, "--collect-only", "-q", "-p", "hypothesis_report", *files, REPORT=str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(report.read_text())
    assert got["default_deadline"] == "None"  # the profile conftest loads: no per-example deadline
    assert len({t["id"].split("::")[0] for t in got["tests"]}) == len(files), (files, got["tests"])
    for test in got["tests"]:
        assert test["property"] and test["timeout"] == 0, test
        assert test["deadline"] in (None, "None"), test


def test_collecting_the_suite_leaves_nothing_in_the_temp_folder(tmp_path: Path) -> None:
    """Templates and scratch files live in pytest's own temp folder, made when a test needs them
    (finding 13): importing a test module writes nothing."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = _pytest(tmp_path, "--collect-only", "-q", "tests", TMPDIR=str(scratch))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in scratch.iterdir() if not p.name.startswith("pytest-of-")) == []


# --- a database this process cannot write: read, creating nothing; refused as a setting (78) ---

READS = (("status", "--json"), ("rows",), ("board", "list"))


@pytest.fixture
def initialised(tmp_path: Path) -> Path:
    db_dir = tmp_path / "db"
    db_dir.mkdir()
    assert poolctl(db_dir, "init").returncode == 0
    assert poolctl(db_dir, "board", "add", "b", "a task", "--id", "t1").returncode == 0
    return db_dir


def read_only_mount(path: Path) -> tuple[str, ...]:
    """A prefix that runs a command with ``path`` bind-mounted read-only in a mount namespace
    of its own (the mount ends with it): a real read-only file system, even for root."""
    prefix = ("unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(path))
    probe = subprocess.run([*prefix, "touch", str(path / "probe")], capture_output=True, text=True)
    if probe.returncode == 0 or "Read-only file system" not in probe.stderr:
        (path / "probe").unlink(missing_ok=True)
        pytest.skip(f"no read-only bind mount here (needs root and unshare): {probe.stderr.strip()}")
    return prefix


@contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """``chattr +i``: nobody, root included, may change them (a directory: nothing is created in it)."""
    done = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i does not work here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=True)


def test_reads_on_a_read_only_file_system_answer_and_init_is_refused_as_a_setting(initialised: Path) -> None:
    before, ro = files(initialised), read_only_mount(initialised)
    for args in READS:
        done = poolctl(initialised, *args, prefix=ro)
        assert done.returncode == 0, (args, done.stderr)
    assert '"ready": 1' in poolctl(initialised, "status", "--json", prefix=ro).stdout
    refused(poolctl(initialised, "init", prefix=ro), CONFIG, "pool store at", "read-only file system")
    refused(poolctl(initialised, "requeue", "1", prefix=ro), CONFIG, "pool store at", "read-only")
    assert files(initialised) == before


def test_a_read_only_file_system_with_a_write_ahead_log_is_a_setting_not_busy(initialised: Path) -> None:
    """A ``-wal`` beside the file (a writer elsewhere, or one that died) means it must be opened
    as always, which needs the ``-shm`` SQLite cannot make there: 78, never "try again" (75)."""
    (initialised / "pool.db-wal").touch()
    before, ro = files(initialised), read_only_mount(initialised)
    for args in (("status",), ("rows",)):
        refused(poolctl(initialised, *args, prefix=ro), CONFIG, "pool store at", "read-only file system")
    assert files(initialised) == before


def test_reads_of_an_immutable_database_leave_no_wal_or_shm(initialised: Path) -> None:
    before = files(initialised)
    with immutable(initialised / "pool.db", initialised / "board.db"):
        for args in READS:
            done = poolctl(initialised, *args)
            assert done.returncode == 0, (args, done.stderr)
            assert files(initialised) == before, args
        refused(poolctl(initialised, "requeue", "1"), CONFIG, "read-only")
        refused(poolctl(initialised, "maintain", "--once"), CONFIG, "read-only")
        refused(poolctl(initialised, "init"), CONFIG, "cannot migrate it", "read-only")
    assert files(initialised) == before


def test_a_database_in_a_directory_nothing_can_be_created_in_is_a_setting_not_busy(initialised: Path) -> None:
    before = files(initialised)
    with immutable(initialised):
        for args in (*READS, ("init",)):
            refused(poolctl(initialised, *args), CONFIG, "not writable by this user", "-shm")
    assert files(initialised) == before


# --- the PoolStore Python API on a store `poolctl init` has not set up (finding 14) ---


def _every_entry(store: PoolStore) -> list[Callable[[], object]]:
    def in_a_session() -> None:
        with store.session(readonly=True):
            pass

    def in_a_connection() -> None:
        with store.connection():
            pass

    grant = {"board": "b", "task_id": "t", "run_id": 1, "worker_ordinal": 0, "attempt": 1, "fence": 1}
    return [
        lambda: store.offer(0, owner="w"),
        lambda: store.add_run(board="b", task_id="t", run_id=1, ordinal=0, payload={}, now=1.0),
        lambda: store.heartbeat({**grant, "delivery_id": "d1", "payload_digest": "0" * 64}),
        in_a_session,
        in_a_connection,
    ]


@pytest.mark.parametrize("setup", ["no file", "not initialised", "an empty file"])
def test_the_python_api_on_a_store_init_has_not_set_up_names_it_and_what_to_run(
    tmp_path: Path, setup: str
) -> None:
    path = tmp_path / "pool.db"
    if setup == "not initialised":
        sqlite3.connect(path).execute("CREATE TABLE other (x)").connection.close()
    elif setup == "an empty file":
        path.touch()
    before = files(tmp_path)
    named = rf"no pool store at sqlite:///{re.escape(str(path))}: run `poolctl init`"
    store = PoolStore(f"sqlite:///{path}")
    for call in _every_entry(store):
        with pytest.raises(ConfigError, match=named):
            call()
    store.engine.dispose()
    assert files(tmp_path) == before, "nothing is created"


def test_the_python_api_in_a_missing_directory_is_a_setting_not_busy(tmp_path: Path) -> None:
    store = PoolStore(f"sqlite:///{tmp_path}/nosuch/pool.db")
    for call in _every_entry(store):
        with pytest.raises(ConfigError, match=r"directory .*nosuch does not exist .*run `poolctl init`"):
            call()
    assert files(tmp_path) == []


def test_the_python_api_works_once_init_has_run(tmp_path: Path) -> None:
    store = PoolStore(f"sqlite:///{tmp_path}/pool.db")
    with pytest.raises(ConfigError):
        store.offer(0, owner="w")
    assert poolctl(tmp_path, "init").returncode == 0
    assert store.offer(0, owner="w") is None  # nothing assigned yet; the same instance now works
    store.engine.dispose()


# --- poolctl demo --workdir: what a demo leaves there, a demo takes again (finding 11) ---


@pytest.mark.integration
def test_a_workdir_a_demo_used_is_taken_again_whatever_the_demo_wrote(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    args = ("demo", "--tasks", "3", "--poison", "0", "--pool-size", "2", "--timeout", "240")
    done = poolctl(tmp_path, *args, "--workdir", str(workdir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    left = files(workdir)
    assert "serve.log" in left and "pool.db" in left, left
    prepare_workdir(workdir)  # the check a second `poolctl demo --workdir` makes first: no refusal
    assert files(workdir) == []
