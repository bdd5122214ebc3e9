"""Beat stops promptly on SIGTERM and SIGINT while its Redis is down (a systemd stop, a Ctrl-C); a worker
refused at start as busy is started again."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from poolkeeper.embedded import CeleryProc
from tests.helpers import PlaneEnv

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_beat_stops_within_seconds_of_a_signal_while_redis_is_away(
    env: PlaneEnv, sig: signal.Signals
) -> None:
    # Given beat running, and then its Redis gone for a few of its ticks (it is retrying a send)
    beat = env.beat()
    env.redis.stop()
    time.sleep(2)
    # When it is told to stop (the main process only, as a terminal or systemd's main-pid kill does)
    os.kill(beat.proc.pid, sig)
    sent = time.monotonic()
    # Then it exits within a few seconds
    try:
        beat.proc.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"beat still running 10 s after {sig.name}:\n{beat.text()[-2000:]}")
    print(f"{sig.name}: exited {time.monotonic() - sent:.1f}s later with {beat.proc.returncode}")
    beat.stopped = True


REFUSES_ONCE = """
import os, sys
from pathlib import Path
first = Path(os.environ["REFUSED_ONCE_MARK"])
if not first.exists():  # the first start: refused as the store or board busy (TransientError's 75)
    first.write_text("refused")
    sys.exit(75)
from tasks.celery import app  # then the plane's own app
"""


def test_a_worker_refused_at_start_as_busy_is_started_again(env: PlaneEnv) -> None:
    """Exit 75 at start (the store or the board busy, as on a loaded machine) is worth waiting for:
    the embedded supervisor starts the worker again, as systemd's Restart= would."""
    (env.tmp / "refuses_once.py").write_text(REFUSES_ONCE)
    mark = env.tmp / "refused"
    settings_env = {**env.settings.env(), "REFUSED_ONCE_MARK": str(mark)}  # cwd is env.tmp: importable
    proc = CeleryProc("worker", settings_env, env.tmp, "w1", app="refuses_once")
    env.procs.append(proc)
    proc.wait_ready()
    assert mark.exists() and proc.starts == 2 and not proc.crashed(), proc.text()[-2000:]
