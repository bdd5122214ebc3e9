"""Beat stops promptly on SIGTERM and SIGINT while its Redis is down (a systemd stop, a Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

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
