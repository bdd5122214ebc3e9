"""Races between real processes: one winner per ordinal, each board task claimed once."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from board import Board, open_board
from core.errors import PoolError
from core.settings import Settings
from store import PoolStore

WORKERS = 6
ctx = mp.get_context("spawn")


def _add_and_offer(url: str, me: int, barrier: Any, results: Any) -> None:
    store = PoolStore.from_settings(Settings(database_url=url, pool_size=3))
    barrier.wait()
    try:
        store.add_run(board="b", task_id=f"t{me}", run_id=1, ordinal=0, payload={"me": me})
        outcome = "added"
    except PoolError as err:
        outcome = type(err).__name__
    try:
        offer = store.offer(0, owner="w-0")
    except PoolError:  # LostRace: another process took the lease between read and update
        offer = None
    results.put((me, outcome, None if offer is None else (offer.task_id, offer.fence)))


def test_many_processes_adding_on_one_ordinal_have_exactly_one_winner(store: PoolStore) -> None:
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [
        ctx.Process(target=_add_and_offer, args=(store.url, i, barrier, results)) for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    winners = [me for me, outcome, _ in got if outcome == "added"]
    assert len(winners) == 1, got
    assert {o for _, o, _ in got} <= {"added", "OrdinalTaken", "TransientError"}
    offers = {o for _, _, o in got if o is not None}
    # every process asks as the ordinal's one worker instance: one run, one grant, one fence
    assert len(offers) == 1 and next(iter(offers))[0] == f"t{winners[0]}", "exactly one lease was granted"


def _claim_all(url: str, barrier: Any, results: Any) -> None:
    kanban = open_board(Settings(board_url=url))
    barrier.wait()
    mine: list[tuple[str, int]] = []
    misses = 0
    while misses < 3:
        try:
            claims = kanban.claim_ready(3, assignee="pool", lane="pool")
        except PoolError:
            continue
        misses = 0 if claims else misses + 1
        mine += [(c.task_id, c.run_id) for c in claims]
    results.put(mine)


def test_many_processes_claiming_take_each_task_exactly_once(kanban: Board, settings: Settings) -> None:
    for i in range(60):
        kanban.add_task("b", f"task {i}", task_id=f"t{i:02d}")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [
        ctx.Process(target=_claim_all, args=(settings.board_url, barrier, results)) for _ in range(WORKERS)
    ]
    for p in procs:
        p.start()
    claimed = [c for _ in procs for c in results.get(timeout=120)]
    for p in procs:
        p.join(30)
    assert sorted(claimed) == [(f"t{i:02d}", 1) for i in range(60)]
