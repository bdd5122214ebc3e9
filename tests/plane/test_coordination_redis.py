"""What only the Redis driver does, on a real redis-server: each key's lifetime (a hold while
held, ``queued_seconds`` while queued), the adrift window, one round trip per batch, a
forked child's keeper. The contract both drivers keep is ``test_coordination.py``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from core.settings import Settings
from poolkeeper.embedded import RedisServer, wait_for
from tasks import liveness
from tasks.coordination import queue_lists, queue_name
from tasks.redis_coordination import (
    Keeper,
    RedisCoordination,
    adrift_lead,
    adrift_seconds,
    hold_seconds,
    queued_seconds,
)

pytestmark = pytest.mark.integration

SETTINGS = Settings(tick_seconds=1.0, task_time_limit=10.0, visibility_timeout=1000.0)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[redis.Redis]:
    server = RedisServer(tmp_path).start()
    yield server.client()
    server.stop()


def ttl(client: redis.Redis, key: str) -> float:
    return float(client.pttl(f"poolkeeper:{key}")) / 1000


def test_the_ttls_come_from_the_tick_never_from_a_time_limit() -> None:
    assert hold_seconds(Settings()) == Settings().tick_seconds / 2 == 2.5
    assert hold_seconds(Settings(tick_seconds=0.1)) == 1.0  # a floor: a loaded machine's jitter
    assert queued_seconds(SETTINGS) == 1010.0


def test_a_lock_lives_a_hold_and_its_keeper_renews_it_until_unlocked(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    [token] = coord.lock_many(["row:1"])
    assert token is not None and 0 < ttl(client, "lock:row:1") <= 1.0
    assert coord.keeper.held() == {"lock:row:1": token}
    coord.unlock_many({"row:1": token})
    assert coord.keeper.held() == {} and not client.exists("poolkeeper:lock:row:1")


def test_renewal_is_one_round_trip_and_forgets_what_another_holder_took(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Keeper, "_run", lambda self: None)  # renewals only where this test says
    coord = RedisCoordination(client, SETTINGS)
    tokens = coord.lock_many([f"row:{i}" for i in range(100)])
    coord.keeper.renew()  # the script is loaded
    client.set("poolkeeper:lock:row:7", "someone else")
    client.delete("poolkeeper:lock:row:8")
    before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    coord.keeper.renew()
    assert client.info("commandstats")["cmdstat_evalsha"]["calls"] == before + 1
    held = coord.keeper.held()
    assert len(held) == 98 and "lock:row:7" not in held and "lock:row:8" not in held
    assert client.get("poolkeeper:lock:row:7") == b"someone else", "never renewed nor taken back"
    assert tokens[0] is not None


def test_a_reservation_lives_a_hold_then_a_queued_lifetime_with_its_claim(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    assert coord.reserve([0, 1, 2]) == [0, 1, 2]
    assert 0 < ttl(client, "reserved:0") <= 1.0  # held by its dispatcher: gone within a hold if it dies
    coord.queue_reserved([0])  # handed over: its claim is in the queue
    assert ttl(client, "reserved:0") > 900 and "reserved:0" not in coord.keeper.held()
    coord.release([1, 2])
    assert not client.exists("poolkeeper:reserved:1") and not client.exists("poolkeeper:reserved:2")


def test_a_marker_lives_a_hold_until_its_message_is_sent_then_a_queued_lifetime(client: redis.Redis) -> None:
    coord, receiver = RedisCoordination(client, SETTINGS), RedisCoordination(client, SETTINGS)
    assert coord.mark_pending("expire", ["1", "2", "3"]) == ["1", "2", "3"]
    assert 0 < ttl(client, "pending:expire:1") <= 1.0  # held by its scanner: gone within a hold if it dies
    receiver.hold("expire", ["3"], [], seconds=60)  # received before its sender said it was sent
    coord.queue_pending("expire", ["1", "3"])
    assert ttl(client, "pending:expire:1") > 900 and "pending:expire:1" not in coord.keeper.held()
    assert 0 < ttl(client, "pending:expire:2") <= 1.0, "not sent yet: still its scanner's"
    assert "pending:expire:3" in receiver.keeper.held() and 0 < ttl(client, "pending:expire:3") <= 1.0


def queued(coord: RedisCoordination, pass_name: str, keys: list[str]) -> list[str]:
    """Marked and sent, as a scan does: the markers stand for messages in the queue."""
    fresh = coord.mark_pending(pass_name, keys)
    coord.queue_pending(pass_name, fresh)
    return fresh


def test_the_receiver_holds_a_queued_marker_and_reservation_for_a_hold_at_a_time(client: redis.Redis) -> None:
    dispatcher, receiver = RedisCoordination(client, SETTINGS), RedisCoordination(client, SETTINGS)
    assert queued(dispatcher, "materialize", ["b:t:1", "b:u:1"]) == ["b:t:1", "b:u:1"]
    assert dispatcher.reserve([4]) == [4]
    dispatcher.queue_reserved([4])
    assert ttl(client, "pending:materialize:b:t:1") > 900  # queued: the queue keeps the message
    receiver.hold("materialize", ["b:t:1", "b:gone:1"], [4], seconds=60)
    assert set(receiver.keeper.held()) == {"pending:materialize:b:t:1", "reserved:4"}, "nothing recreated"
    assert not client.exists("poolkeeper:pending:materialize:b:gone:1")
    assert 0 < ttl(client, "pending:materialize:b:t:1") <= 1.0 and 0 < ttl(client, "reserved:4") <= 1.0


def aged(client: redis.Redis, key: str, seconds: float) -> None:
    """As if ``key`` had been queued ``seconds`` ago (its lifetime counts down from ``queued_seconds``)."""
    client.pexpire(f"poolkeeper:{key}", int((queued_seconds(SETTINGS) - seconds) * 1000))


def dry_for(client: redis.Redis, seconds: float, last_read: float = 0.0) -> None:
    """As if the queue had been seen empty of process messages for ``seconds``, at reads never
    a lead apart, the last ``last_read`` seconds ago."""
    seconds_now, micros = client.time()
    now = seconds_now + micros / 1e6
    client.set("poolkeeper:queue-dry-since", f"{now - seconds:.6f}")
    client.set("poolkeeper:queue-dry-since:read", f"{now - last_read:.6f}")


SCAN_MESSAGE = json.dumps({"headers": {"task": "poolkeeper.scan"}, "body": ""})
WINDOW = adrift_seconds(SETTINGS)
NEEDED = WINDOW + adrift_lead(SETTINGS)  # dry this long, and queued as long


def test_a_queued_marker_stands_while_its_message_may_be_in_flight(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    assert WINDOW == 2 * SETTINGS.task_time_limit + SETTINGS.tick_seconds == 21.0 and NEEDED == 23.0
    assert queued(coord, "expire", ["1", "2", "3"]) == ["1", "2", "3"]
    for key in ("1", "2", "3"):
        aged(client, f"pending:expire:{key}", NEEDED + 10)
    assert coord.mark_pending("expire", ["1"]) == [], "the queue was only now seen dry"
    assert client.exists("poolkeeper:queue-dry-since"), "and that was stamped"
    dry_for(client, NEEDED - 1)
    assert coord.mark_pending("expire", ["1"]) == [], "dry for less than two time limits, a tick and a lead"
    dry_for(client, NEEDED + 1)
    aged(client, "pending:expire:2", NEEDED - 1)
    assert coord.mark_pending("expire", ["2"]) == [], "queued as the queue ran dry: its message may be popped"
    client.lpush(queue_name(SETTINGS), "a process message")
    assert coord.mark_pending("expire", ["3"]) == [], "the queue holds a message: it may be this key's"
    assert not client.exists("poolkeeper:queue-dry-since"), "and the dry stamp is gone with it"
    client.delete(queue_name(SETTINGS))
    client.lpush(queue_lists(SETTINGS)[2], "a message of priority 6")
    dry_for(client, NEEDED + 1)
    assert coord.mark_pending("expire", ["3"]) == [], "every priority's list counts"


def test_a_queue_unread_for_a_lead_is_dry_only_from_the_next_read(client: redis.Redis) -> None:
    """A backlog keeps the scans that read the queue waiting: what it held then is unknown, so
    a message of it may have been popped a moment ago, by a worker yet to hold it."""
    coord, other = RedisCoordination(client, SETTINGS), RedisCoordination(client, SETTINGS)
    assert queued(coord, "expire", ["1"]) == ["1"]
    assert coord.reserve([2]) == [2]
    coord.queue_reserved([2])
    aged(client, "pending:expire:1", NEEDED + 10)
    aged(client, "reserved:2", NEEDED + 10)
    dry_for(client, NEEDED + 10, last_read=adrift_lead(SETTINGS) + 0.5)  # no read for more than a lead
    assert coord.mark_pending("expire", ["1"]) == [], "the dry window starts again at this read"
    assert other.reserve([2]) == [], "so does a reservation's"
    since = float(client.get("poolkeeper:queue-dry-since") or 0)
    read = float(client.get("poolkeeper:queue-dry-since:read") or 0)
    assert 0 <= read - since < 1, "stamped anew, at this read"


def test_a_queued_marker_of_a_queue_long_dry_is_adrift_and_sent_again(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    assert queued(coord, "expire", ["1", "2", "3"]) == ["1", "2", "3"]
    coord.hold("expire", ["3"], [], seconds=60)  # received: its worker holds it
    for key in ("pending:expire:1", "pending:expire:3"):
        aged(client, key, NEEDED + 10)
    client.lpush(queue_name(SETTINGS), SCAN_MESSAGE)  # beat's scan messages do not count
    dry_for(client, NEEDED + 1)
    # key 1's message was taken by a worker that died before holding it
    assert coord.mark_pending("expire", ["1", "2", "3"]) == ["1"], "only the old, unheld queued marker"
    assert 0 < ttl(client, "pending:expire:1") <= 1.0, "its scanner's again, until it sends the new message"
    assert coord.mark_pending("expire", ["1"]) == [], "and pending again"
    coord.queue_pending("expire", ["1"])
    assert ttl(client, "pending:expire:1") > 1000, "queued for its new message's whole life"


def test_a_queued_reservation_of_a_queue_long_dry_is_adrift_and_reserved_again(client: redis.Redis) -> None:
    dispatcher, other = RedisCoordination(client, SETTINGS), RedisCoordination(client, SETTINGS)
    assert dispatcher.reserve([4, 5]) == [4, 5]
    dispatcher.queue_reserved([4, 5])
    aged(client, "reserved:4", NEEDED + 10)
    assert other.reserve([4, 5]) == [], "queued: their claims are on their way"
    dry_for(client, NEEDED + 1)
    assert other.reserve([4, 5]) == [4], "adrift: the ordinal is free again"
    assert 0 < ttl(client, "reserved:4") <= 1.0 and "reserved:4" in other.keeper.held()


def test_a_hold_ends_at_its_deadline_even_while_its_holder_lives(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    coord.mark_pending("expire", ["9"])
    coord.hold("expire", ["9"], [], seconds=0.5)
    wait_for("the hold to end", lambda: not client.exists("poolkeeper:pending:expire:9"), 2.5, every=0.05)


def test_a_forked_child_holds_nothing_of_its_parent(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    coord.lock_many(["row:1"])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its keeper starts empty, and renews nothing of the parent's
        os.write(write, b"1" if coord.keeper.held() == {} else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert "lock:row:1" in coord.keeper.held()


def test_finish_lets_go_of_its_own_locks_and_clears_the_finished_markers_at_once(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    names = [f"row:{i}" for i in range(2500)]  # more than one chunk of the script's MGET and DEL
    tokens = coord.lock_many(names)
    assert None not in tokens
    client.set("poolkeeper:lock:row:7", "someone-else")  # lapsed and taken over meanwhile
    keys = [str(i) for i in range(2500)]
    assert queued(coord, "expire", keys) == keys
    calls: list[object] = []
    script = coord._finish

    def counted(**kw: Any) -> Any:
        calls.append(kw)
        return script(**kw)

    coord._finish = counted  # type: ignore[assignment]
    held = {n: t for n, t in zip(names, tokens, strict=True) if t}
    coord.finish(held, "expire", keys[:-1])  # the last one is retried
    assert len(calls) == 1, "one round trip"
    assert [n for n in names if client.exists(f"poolkeeper:lock:{n}")] == ["row:7"]
    assert client.get("poolkeeper:lock:row:7") == b"someone-else", "another holder's lock stays"
    assert [k for k in keys if client.exists(f"poolkeeper:pending:expire:{k}")] == ["2499"]
    assert coord.keeper.held() == {}, "nothing of the batch is renewed any more"


def test_waiting_claims_are_what_status_counts_until_dispatch_takes_them(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    coord.wait_for_ordinal({f"b:t{i}:1": json.dumps({"board": "b", "task_id": f"t{i}"}) for i in range(3)})
    assert liveness.read(client, SETTINGS, 0.0).waiting_claims == 3
    assert [json.loads(c)["task_id"] for c in coord.take_waiting(2)] == ["t0", "t1"]  # oldest first
    assert liveness.read(client, SETTINGS, 0.0).waiting_claims == 1
