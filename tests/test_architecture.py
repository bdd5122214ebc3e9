"""The shape of the code: floors, one list of passes, imports that do nothing, bounded labels."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import beat_schedule
from core.settings import Settings
from tasks import registry
from tasks.declaration import Outcome, Pass
from tasks.maintain import maintain_once
from tasks.plane import Plane

ROOT = Path(__file__).resolve().parent.parent
BELOW_THE_APPS = ("core", "store", "board", "tasks")


def imported_roots(path: Path) -> set[str]:
    """Top-level names a file imports (absolute imports only: the project uses no others)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_layers_contract_holds() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each set of modules importing one another round a circle (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(graph.find_modules_directly_imported_by(target)))))
                    break
                if target in stack:
                    low[module] = min(low[module], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    members = []
                    while (member := stack.pop()) != module:
                        members.append(member)
                    if members:
                        cycles.append(sorted([module, *members]))
    return cycles


def test_no_module_imports_round_a_circle() -> None:
    """No cycle among the project's modules, counting imports inside functions and under TYPE_CHECKING.

    The layers contract sees only arrows between floors; a circle inside one (``tasks.metrics`` ->
    ``tasks.liveness`` -> ``tasks.registry`` -> a pass -> ``tasks.metrics``) hides behind a
    function-level import, which is still an arrow (STYLE.md 19).
    """
    graph = grimp.build_graph(*BELOW_THE_APPS, "poolkeeper", cache_dir=None)
    # grimp reads every import statement, a function's too: this one is inside serve.create_app
    assert "poolkeeper.api.app" in graph.find_modules_directly_imported_by("poolkeeper.serve")
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.d", "p.d2")):
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_the_schedule_stands_on_the_ground_only() -> None:
    assert imported_roots(ROOT / "beat_schedule.py") & {"store", "board", "tasks", "poolkeeper"} == set()


def test_only_the_celery_entry_point_imports_celery() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in BELOW_THE_APPS
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "tasks" / "celery.py" and imported_roots(path) & {"celery", "kombu"}
    ]
    assert offenders == []


def test_only_the_board_package_names_a_board_backend() -> None:
    """Everything else opens a board with ``board.open_board`` and talks to the ``Board`` protocol."""
    backend = "Kanban" + "Board"  # not spelled out: this file would name it
    allowed = {"tests/conftest.py"}  # the fixtures: the Kanban's own engine
    dirs = ("core", "store", "tasks", "poolkeeper", "bench", "tests")
    files = [*ROOT.glob("*.py"), *(p for d in dirs for p in (ROOT / d).rglob("*.py"))]
    offenders = sorted(
        name
        for path in files
        if (name := str(path.relative_to(ROOT))) not in allowed and backend in path.read_text()
    )
    assert offenders == []


def test_importing_any_module_but_the_entry_point_does_nothing() -> None:
    """With a broken environment every module still imports: none reads it, builds an app or a dir."""
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in (*BELOW_THE_APPS, "poolkeeper")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts and path != ROOT / "tasks" / "celery.py"
    ] + ["beat_schedule"]
    probe = (
        "import importlib, json, os, sys\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(json.dumps({'celery_app': 'tasks.celery' in sys.modules,"
        " 'multiproc': 'PROMETHEUS_MULTIPROC_DIR' in os.environ}))\n"
    )
    env = {**os.environ, "POOL_SIZE": "-1", "POOL_DATABASE_URL": "", "POOL_METRICS_PORT": "9100"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", probe, *modules], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"celery_app": False, "multiproc": False}


def test_every_registered_pass_is_scheduled_and_run_by_maintain_once(plane: Plane) -> None:
    names = [p.name for p in registry.PASSES]
    assert len(set(names)) == len(names)
    entries = beat_schedule.schedule(Settings(namespace="ns1"), registry.PASSES)
    assert sorted(e["args"][0] for e in entries.values()) == sorted(names)
    assert all(e["task"] == "ns1.scan" for e in entries.values())
    assert list(maintain_once(plane, 0.0)) == names


@pytest.mark.parametrize("p", registry.PASSES, ids=lambda p: p.name)
def test_every_pass_declares_an_interval_from_the_settings(p: Pass) -> None:
    intervals = Settings(tick_seconds=7.0, reconcile_seconds=11.0, gc_seconds=13.0)
    assert p.interval(intervals) in (7.0, 11.0, 13.0)


def test_outcomes_are_a_closed_set_of_plain_words() -> None:
    assert all(o.value.replace("_", "").isalpha() for o in Outcome)
