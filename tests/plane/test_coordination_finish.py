"""A batch's end on a real redis-server: its locks and its finished keys' markers go in one round trip."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from core.settings import Settings
from poolkeeper.embedded import RedisServer
from tasks.plane import LocalCoordination, RedisCoordination

pytestmark = pytest.mark.integration

SETTINGS = Settings(tick_seconds=1.0, task_time_limit=10.0, visibility_timeout=1000.0)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[redis.Redis]:
    server = RedisServer(tmp_path).start()
    yield server.client()
    server.stop()


def test_finish_lets_go_of_its_own_locks_and_clears_the_finished_markers_at_once(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    names = [f"row:{i}" for i in range(2500)]  # more than one chunk of the script's MGET and DEL
    tokens = coord.lock_many(names)
    assert None not in tokens
    client.set("poolkeeper:lock:row:7", "someone-else")  # lapsed and taken over meanwhile
    keys = [str(i) for i in range(2500)]
    assert coord.mark_pending("expire", keys) == keys
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


def test_finish_without_a_lock_held_still_clears_markers(client: redis.Redis) -> None:
    coord = RedisCoordination(client, SETTINGS)
    assert coord.mark_pending("expire", ["1", "2"]) == ["1", "2"]
    coord.finish({}, "expire", ["1"])
    assert not client.exists("poolkeeper:pending:expire:1") and client.exists("poolkeeper:pending:expire:2")
    coord.finish({}, "expire", [])  # nothing at all: harmless
    assert client.exists("poolkeeper:pending:expire:2")


def test_local_finish_is_unlock_and_clear() -> None:
    coord = LocalCoordination()
    [token] = coord.lock_many(["row:1"])
    assert token is not None and coord.mark_pending("expire", ["1", "2"]) == ["1", "2"]
    coord.finish({"row:1": token}, "expire", ["1"])
    assert coord.lock_many(["row:1"]) != [None]
    assert coord.mark_pending("expire", ["1", "2"]) == ["1"]
