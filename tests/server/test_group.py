"""Group commit: each request gets its own answer, and a batch that fails whole is retried one by one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest

from poolkeeper.server.group import GroupCommit


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
