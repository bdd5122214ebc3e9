"""Worker presence in the store: each ordinal's last call and owner, written at most once an interval."""

from __future__ import annotations

from store import PoolStore, numbers
from store.presence import EVERY_SECONDS
from tests.factories import NOW, OWNER, envelope, one_worker_for_three_ordinals


def _presence(store: PoolStore) -> list[tuple[int, str | None, str | None, float | None]]:
    with store.session(readonly=True) as s:
        return [(p.ordinal, p.owner, p.call, p.at) for p in numbers.read(s, store.pool_size).presence]


def test_each_ordinals_last_call_and_owner_are_kept(store: PoolStore) -> None:
    one_worker_for_three_ordinals(store)
    assert _presence(store) == [(0, OWNER, "offer", NOW), (1, None, None, None), (2, None, None, None)]

    grant = store.offer(0, owner=OWNER, now=NOW + 10)
    assert grant is not None
    store.heartbeat(envelope(grant, "h1"), now=NOW + 20)
    assert _presence(store)[0] == (0, OWNER, "heartbeat", NOW + 20)

    store.accept_result({**envelope(grant, "r1"), "payload": {"status": "done"}}, now=NOW + 21)
    assert _presence(store)[0] == (0, OWNER, "result", NOW + 21)  # a result always writes


def test_presence_is_written_at_most_once_per_interval_per_ordinal(store: PoolStore) -> None:
    """An idle worker polls offer about once a second: most polls write nothing."""
    store.offer(1, owner="w-a", now=NOW)
    store.offer(1, owner="w-a", now=NOW + EVERY_SECONDS / 2)
    assert _presence(store)[1] == (1, "w-a", "offer", NOW)
    store.offer(1, owner="w-b", now=NOW + EVERY_SECONDS / 2)  # a restarted worker is news at once
    assert _presence(store)[1] == (1, "w-b", "offer", NOW + EVERY_SECONDS / 2)
    store.offer(1, owner="w-b", now=NOW + 2 * EVERY_SECONDS)
    assert _presence(store)[1] == (1, "w-b", "offer", NOW + 2 * EVERY_SECONDS)
