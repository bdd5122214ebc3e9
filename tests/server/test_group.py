"""The heartbeat's short path: group commit (each request its own answer, a batch that fails whole
retried one by one, every request answered) and the verified-token cache."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

import pytest

from core.errors import TransientError, Unauthenticated
from poolkeeper import tokens
from poolkeeper.api import deps
from poolkeeper.api.group import GroupCommit


def test_each_item_gets_its_own_answer_and_a_failed_batch_is_retried_one_per_transaction() -> None:
    calls: list[list[int]] = []

    def apply(items: Sequence[int]) -> list[int | Exception]:
        calls.append(list(items))
        if 13 in items:
            raise RuntimeError("the transaction failed as a whole")
        return [ValueError(f"refused {i}") if i % 2 else i * 10 for i in items]

    group: GroupCommit[int, int] = GroupCommit(apply, contextlib.nullcontext())

    async def send(items: list[int]) -> list[int | BaseException]:
        return await asyncio.gather(*(group(i) for i in items), return_exceptions=True)

    answers = asyncio.run(send([2, 3, 13, 4]))

    assert answers[0] == 20 and answers[3] == 40
    assert isinstance(answers[1], ValueError) and str(answers[1]) == "refused 3"
    assert isinstance(answers[2], RuntimeError)  # 13's own failure, alone
    # whatever batches formed, 13 failed each it was in, alone too; the others were applied once
    assert [13] in calls
    applied = [i for batch in calls if 13 not in batch for i in batch]
    assert sorted(applied) == [2, 3, 4]


def test_a_busy_gate_is_every_waiting_items_answer() -> None:
    class Busy:
        def __enter__(self) -> None:
            raise TimeoutError("busy")

        def __exit__(self, *_: object) -> None:
            pass

    group: GroupCommit[int, int] = GroupCommit(lambda items: list(items), Busy())
    with pytest.raises(TimeoutError):
        group.submit(1).result(timeout=10)


def test_a_cancelled_request_is_not_applied_and_the_writer_goes_on() -> None:
    """A caller that went away (its future cancelled) must not take the writer down with it."""
    applied: list[int] = []
    started, release = threading.Event(), threading.Event()

    def apply(items: Sequence[int]) -> list[int | Exception]:
        if 0 in items:
            started.set()
            release.wait(10)
        applied.extend(items)
        return list(items)

    group: GroupCommit[int, int] = GroupCommit(apply, contextlib.nullcontext())
    first = group.submit(0)
    assert started.wait(10)
    gone = group.submit(1)  # queued behind the batch under way, then its caller leaves
    assert gone.cancel()
    release.set()
    assert first.result(timeout=10) == 0
    assert group.submit(2).result(timeout=10) == 2
    assert applied == [0, 2]


def test_whatever_a_batch_raises_every_request_is_answered_and_the_writer_goes_on() -> None:
    calls = iter([KeyboardInterrupt(), None])

    def apply(items: Sequence[int]) -> list[int | Exception]:
        err = next(calls)
        if err is not None:
            raise err
        return list(items)

    group: GroupCommit[int, int] = GroupCommit(apply, contextlib.nullcontext())
    with pytest.raises(TransientError, match="not applied"):
        group.submit(1).result(timeout=10)
    assert group.submit(2).result(timeout=10) == 2


def test_a_store_away_answers_the_whole_batch_at_once_not_one_wait_per_item() -> None:
    """A transient failure is no item's fault: splitting would repeat the wait once per item."""
    calls: list[list[int]] = []
    started, release = threading.Event(), threading.Event()

    def apply(items: Sequence[int]) -> list[int | Exception]:
        calls.append(list(items))
        if items == [0]:
            started.set()
            release.wait(10)
            return [0]
        raise TransientError("pool store: unreachable")

    group: GroupCommit[int, int] = GroupCommit(apply, contextlib.nullcontext())
    first = group.submit(0)
    assert started.wait(10)
    waiting = [group.submit(i) for i in (1, 2, 3)]  # one batch, once the first is done
    release.set()
    assert first.result(timeout=10) == 0
    for done in waiting:
        with pytest.raises(TransientError):
            done.result(timeout=10)
    assert calls == [[0], [1, 2, 3]]


def test_each_shard_has_one_writer_so_its_items_are_applied_in_order_by_it() -> None:
    """One ordinal's heartbeats on one writer: two batches under way never share a row."""
    seen: dict[int, set[str]] = {}
    lock = threading.Lock()

    def apply(items: Sequence[int]) -> list[int | Exception]:
        with lock:
            for i in items:
                seen.setdefault(i % 4, set()).add(threading.current_thread().name)
        return list(items)

    group: GroupCommit[int, int] = GroupCommit(apply, contextlib.nullcontext(), writers=4, shard=lambda i: i)
    futures = [group.submit(i) for i in range(200)]
    assert [f.result(timeout=10) for f in futures] == list(range(200))
    assert all(len(names) == 1 for names in seen.values()), seen
    assert len({name for names in seen.values() for name in names}) == 4


def test_a_token_of_no_form_is_refused_without_being_remembered() -> None:
    """The verified-token cache holds only tokens of a token's form: junk cannot fill it."""
    secret = "s" * 32
    before = deps._verified.cache_info().currsize
    for n in range(50):
        with pytest.raises(Unauthenticated):
            deps.authenticate(secret, "x" * 1000 + str(n))
    assert deps._verified.cache_info().currsize == before
    assert deps.authenticate(secret, tokens.ordinal_token(secret, 3)).acts_for(3)
