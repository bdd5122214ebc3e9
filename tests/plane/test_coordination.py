"""One coordination contract, run over both drivers (``tasks.coordination.Coordination``).

The contract (``driver``: the in-process ``LocalCoordination`` and ``RedisCoordination`` on
a real redis-server): locks, pending markers, reservations, a live holder keeping what it
holds past several holds (the keeper's renewals), and a dead holder's claims free again
within a hold (Redis: a real child process, SIGKILLed). A third driver gets the same tests
by one more ``driver`` parameter. What only the Redis driver does (lifetimes, the adrift
window, round trips) is ``test_coordination_redis.py``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.settings import Settings
from poolkeeper.embedded import RedisServer, wait_for
from tasks.coordination import Coordination, LocalCoordination
from tasks.redis_coordination import RedisCoordination, hold_seconds

SETTINGS = Settings(tick_seconds=1.0, task_time_limit=10.0, visibility_timeout=1000.0)
HOLD = hold_seconds(SETTINGS)  # 1 s: how long a dead holder's claims outlive it
SLACK = 1.5  # a loaded two-core machine's scheduling, on top of a hold

Take = Callable[[Coordination], None]


class LocalDriver:
    """One process: every holder is this process, and what it holds dies with it."""

    name, hold = "local", 0.0  # nothing lapses: nothing to wait for

    def __init__(self) -> None:
        self.coord = LocalCoordination()

    def peer(self) -> Coordination:
        return self.coord

    def holder_dies(self, take: Take, while_alive: Take) -> Coordination:
        take(self.coord)
        while_alive(self.coord)
        self.coord = LocalCoordination()  # the next process starts from nothing
        return self.coord


class RedisDriver:
    """Every holder its own ``RedisCoordination`` (its own keeper) on one redis-server."""

    name, hold = "redis", HOLD

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def peer(self) -> Coordination:
        return RedisCoordination(self.server.client(), SETTINGS)

    def holder_dies(self, take: Take, while_alive: Take) -> Coordination:
        """``take`` in a real child process, which lives past two holds, then is SIGKILLed."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own connection and keeper; it holds until it is killed
            try:
                take(RedisCoordination(self.server.client(), SETTINGS))
                os.write(write, b"1")
            finally:
                os.write(write, b"0")
                time.sleep(60)
                os._exit(1)
        try:
            assert os.read(read, 1) == b"1", "the holder took what it was to take"
            time.sleep(2 * HOLD)  # only its keeper's renewals keep them now
            while_alive(self.peer())
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return self.peer()


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.integration)])
def driver(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalDriver | RedisDriver]:
    if request.param == "local":
        yield LocalDriver()
        return
    server = RedisServer(tmp_path).start()
    yield RedisDriver(server)
    server.stop()


def test_a_lock_is_one_holder_s_and_let_go_only_by_its_token(driver: LocalDriver | RedisDriver) -> None:
    a, b = driver.peer(), driver.peer()
    tokens = a.lock_many(["row:1", "row:2"])
    assert None not in tokens and str(tokens[0]).split(":")[1] == str(os.getpid()), "a token names its holder"
    assert b.lock_many(["row:3", "row:1"])[1] is None, "another holder does not get it"
    b.unlock_many({"row:1": "not-its-token"})
    assert b.lock_many(["row:1"]) == [None], "a stale token lets nothing go"
    a.unlock_many({"row:1": str(tokens[0])})
    assert b.lock_many(["row:1"]) != [None]


def test_a_pending_marker_is_one_message_per_pass_and_key(driver: LocalDriver | RedisDriver) -> None:
    a, b = driver.peer(), driver.peer()
    assert a.mark_pending("expire", ["1", "2"]) == ["1", "2"]
    assert b.mark_pending("expire", ["2", "3"]) == ["3"], "those already pending are left out"
    assert b.mark_pending("results", ["1"]) == ["1"], "per pass"
    a.clear_pending("expire", ["1"])
    assert b.mark_pending("expire", ["1", "2"]) == ["1"]


def test_finish_lets_go_of_its_own_locks_and_clears_the_finished_markers(
    driver: LocalDriver | RedisDriver,
) -> None:
    a, b = driver.peer(), driver.peer()
    [token] = a.lock_many(["row:1"])
    assert token is not None and a.mark_pending("expire", ["1", "2"]) == ["1", "2"]
    assert b.lock_many(["row:2"]) != [None]
    a.finish({"row:1": token, "row:2": "not-its-token"}, "expire", ["1"])
    won = b.lock_many(["row:1", "row:2"])
    assert won[0] is not None and won[1] is None, "its own lock let go, another holder's kept"
    a.finish({}, "expire", [])  # nothing at all: harmless
    assert b.mark_pending("expire", ["1", "2"]) == ["1"], "the unfinished one is still pending"
    a.finish({}, "expire", ["2"])  # no lock held: the markers are still cleared
    assert b.mark_pending("expire", ["2"]) == ["2"]


def test_a_reservation_is_one_holder_s_while_held_and_queued(driver: LocalDriver | RedisDriver) -> None:
    a, b = driver.peer(), driver.peer()
    assert a.reserve([0, 1, 2]) == [0, 1, 2]
    assert b.reserve([1, 3]) == [3]
    a.queue_reserved([0])  # handed over: its claim is in the queue
    assert b.reserve([0]) == [], "its claim is on its way"
    a.release([1, 2])
    assert b.reserve([0, 1, 2]) == [1, 2]


def test_waiting_claims_are_taken_oldest_first_once_each(driver: LocalDriver | RedisDriver) -> None:
    a, b = driver.peer(), driver.peer()
    a.wait_for_ordinal({"b:t:1": '{"n": 1}', "b:t:2": '{"n": 2}'})
    b.wait_for_ordinal({"b:t:1": '{"n": "again"}', "b:t:3": '{"n": 3}'})  # t:1 already waits: kept as first
    assert b.take_waiting(0) == []
    assert b.take_waiting(2) == ['{"n": 1}', '{"n": 2}']
    assert a.take_waiting(5) == ['{"n": 3}'] and a.take_waiting(5) == []


def test_the_receiver_holds_what_is_there_and_recreates_nothing(driver: LocalDriver | RedisDriver) -> None:
    dispatcher, receiver = driver.peer(), driver.peer()
    assert dispatcher.mark_pending("materialize", ["b:t:1"]) == ["b:t:1"]
    assert dispatcher.reserve([4]) == [4]
    dispatcher.queue_pending("materialize", ["b:t:1"])
    dispatcher.queue_reserved([4])
    receiver.hold("materialize", ["b:t:1", "b:gone:1"], [4], seconds=60)
    assert dispatcher.mark_pending("materialize", ["b:t:1", "b:gone:1"]) == ["b:gone:1"]
    assert dispatcher.reserve([4]) == []


def test_a_live_holder_keeps_what_it_holds_past_several_holds(driver: LocalDriver | RedisDriver) -> None:
    holder, other = driver.peer(), driver.peer()
    [token] = holder.lock_many(["row:1"])
    holder.mark_pending("materialize", ["b:t:1"])
    holder.hold("materialize", ["b:t:1"], [], seconds=60)
    assert holder.reserve([5]) == [5]
    time.sleep(2.5 * driver.hold)  # Redis: only the keeper's renewals keep them
    assert other.lock_many(["row:1"]) == [None]
    assert other.mark_pending("materialize", ["b:t:1"]) == []
    assert other.reserve([5]) == []
    holder.unlock_many({"row:1": str(token)})
    assert other.lock_many(["row:1"]) != [None]


def test_a_dead_holder_s_claims_are_free_again_within_a_hold(driver: LocalDriver | RedisDriver) -> None:
    def take(coord: Coordination) -> None:
        assert coord.lock_many(["dispatch"]) != [None]
        assert coord.mark_pending("materialize", ["b:t:1", "b:t:2"]) == ["b:t:1", "b:t:2"]
        coord.hold("materialize", ["b:t:1"], [], seconds=60)  # received: no longer only queued
        # b:t:2 marked, its message never sent: its scanner dies before sending it
        assert coord.reserve([3]) == [3]

    def held(peer: Coordination) -> None:
        assert peer.lock_many(["dispatch"]) == [None], "while its holder lives"
        assert peer.mark_pending("materialize", ["b:t:1", "b:t:2"]) == [] and peer.reserve([3]) == []

    survivor = driver.holder_dies(take, held)
    died = time.monotonic()
    tries: dict[str, Callable[[], object]] = {
        "lock": lambda: survivor.lock_many(["dispatch"]) != [None],
        "marker": lambda: survivor.mark_pending("materialize", ["b:t:1"]),
        "unsent marker": lambda: survivor.mark_pending("materialize", ["b:t:2"]),
        "reservation": lambda: survivor.reserve([3]),
    }

    def all_free() -> bool:  # each taken once: a second try would find it the survivor's own
        for what in [w for w, take in tries.items() if take()]:
            del tries[what]
        return not tries

    wait_for("a dead holder's lock, marker and reservation to be free", all_free, HOLD + SLACK, every=0.05)
    assert time.monotonic() - died <= HOLD + SLACK
