"""The fault soak (bench/soak.py) at a small size: every kind of process killed at least once.

Real processes and real signals: a private redis-server, 2 Celery workers, 2 beats,
``poolctl serve`` and 4 ``poolctl worker``s; eight faults, one of each kind, in ~40 s, then
the soak waits for every task to be done or blocked. It must exit 0 (nothing lost, no run
executed twice at once, no fence executed twice, every bound kept) and its table must name
each fault kind. ``make soak`` runs the full size.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import FAULT_KINDS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--ordinals", "4", "--tasks", "150", "--duration", "40", "--fault-every", "5",
    "--reconcile", "5", "--hang-rate", "0.08", "--poison", "2", "--deadline", "190",
]  # fmt: skip


@pytest.mark.timeout(260)
def test_the_plane_survives_every_kind_of_process_death() -> None:
    # Given the whole plane on real processes, when each kind of process is killed in turn
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), *SMALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=250,
    )
    # then every kind was injected, and every check held
    injected = {m[1]: int(m[2]) for m in re.finditer(r"^(\S+) +(\d+) ", done.stdout, re.MULTILINE)}
    missing = [kind for kind in FAULT_KINDS if injected.get(kind, 0) < 1]
    assert not missing, f"fault kinds not injected: {missing}\n{done.stdout[-3000:]}"
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
