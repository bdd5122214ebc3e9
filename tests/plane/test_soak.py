"""The fault soak (bench/soak.py) at a small size: every kind of process killed at least once.

Real processes and real signals: a private redis-server, 2 Celery workers, 2 beats,
``poolctl serve`` and 4 ``poolctl worker``s; eight faults, one of each kind, in ~40 s, then
the soak waits for every task to be done or blocked. It must exit 0 (nothing lost, no run
executed twice at once, no fence executed twice, every bound kept) and its table must name
each fault kind. Then the same on a private PostgreSQL cluster with what production adds:
the database restarted, its connections cut, a table locked, and serve, a Celery worker,
beat, Redis and the database each frozen past a lease. ``make soak`` runs the full size.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import FAULT_KINDS, PRODUCTION_KINDS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
INITDB = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb")) or shutil.which("initdb")
NO_POSTGRES = not INITDB and os.environ.get("CI") != "true"
SMALL = [
    "--ordinals", "4", "--tasks", "150", "--duration", "40", "--fault-every", "5",
    "--reconcile", "5", "--hang-rate", "0.08", "--poison", "2", "--deadline", "190",
]  # fmt: skip


def soak(*options: str, kinds: tuple[str, ...]) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), *SMALL, *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    # every kind was injected, and every check held
    injected = {m[1]: int(m[2]) for m in re.finditer(r"^(\S+) +(\d+) ", done.stdout, re.MULTILINE)}
    missing = [kind for kind in kinds if injected.get(kind, 0) < 1]
    assert not missing, f"fault kinds not injected: {missing}\n{done.stdout[-3000:]}"
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


@pytest.mark.timeout(300)
def test_the_plane_survives_every_kind_of_process_death() -> None:
    # Given the whole plane on real processes, when each kind of process is killed in turn
    soak(kinds=FAULT_KINDS)


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not INITDB and os.environ.get("CI") != "true", reason="no initdb: PostgreSQL is not installed"
)
def test_the_plane_survives_the_database_restarted_cut_locked_and_frozen_processes() -> None:
    # Given the plane on a private PostgreSQL cluster, when the database is restarted, its
    # connections cut and a table locked, and serve, a Celery worker, beat, Redis and the
    # database are each frozen past a lease
    soak("--postgres", "--faults", "production", "--deadline", "240", kinds=PRODUCTION_KINDS)
