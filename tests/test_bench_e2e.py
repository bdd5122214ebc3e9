"""bench/e2e.py at a tiny size: its table's figures parse, and every job ran exactly once.

Real processes: a private redis-server, a plain Celery worker (``-c 16``) and poolkeeper's
README recipe on SQLite (``poolctl init``, its Celery worker and beat, ``poolctl serve``, 16
``poolctl worker``s), each given 2 idle jobs and then 20 at once. ``make bench-e2e`` runs the
full size, with PostgreSQL and procrastinate.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.e2e import FIGURES, Phase, Result, tally

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-|\d+(\.\d+)?(e[+-]?\d+)?x?")


def rows(table: str) -> dict[str, list[str]]:
    """The bench's table rows by their first cell (systems, and ``a / b`` for ratios)."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("system", "ratio", "---"):
            out[cells[0]] = cells[1:]
    return out


@pytest.mark.integration
@pytest.mark.timeout(330)
def test_a_tiny_run_prints_figures_that_parse_and_runs_every_job_once() -> None:
    # Given plain Celery and poolkeeper on SQLite, when the bench runs them tiny
    argv = ["--jobs", "20", "--trickle", "2", "--seconds", "60", "--systems", "celery,poolkeeper-sqlite"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "e2e.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=320,
    )
    out = done.stdout + done.stderr[-3000:]
    # then it exits 0 saying exactly-once held, with one line per system and each ratio
    assert done.returncode == 0, out
    assert "exactly once: held" in done.stdout, out
    table = rows(done.stdout)
    assert set(table) == {"celery", "poolkeeper-sqlite", "poolkeeper-sqlite / celery"}, out
    for system in ("celery", "poolkeeper-sqlite"):
        finished, idle, *figures, twice = table[system]
        assert len(figures) == len(FIGURES) and all(NUMBER.fullmatch(f) for f in figures), out
        n, of = map(int, finished.split(" of "))
        assert of == 20 and n >= 1 and idle.endswith(" of 2") and twice == "0", out
    assert table["celery"][:2] == ["20 of 20", "2 of 2"] and "-" not in table["celery"], out
    assert all(NUMBER.fullmatch(f) for f in table["poolkeeper-sqlite / celery"]), out


def test_the_count_finds_a_job_run_twice_a_stray_and_a_done_job_never_run() -> None:
    # Given jobs a, b enqueued, b reported done, and executions of a twice and of c
    load = Phase(2, enqueued={"a": 1.0, "b": 1.0}, done={"b": 2.0})
    # when they are counted
    result = tally(Result("x", Phase(0), load), [("a", 1.5), ("a", 1.6), ("c", 1.7)])
    # then each breach is counted once
    assert (result.twice, result.strays, result.undone) == (1, 1, 1)
