"""The deterministic simulation (bench/sim.py) on a bounded budget: clean, replayable, and
catching re-introduced defects, each with a named seed and within a counted number of steps.

Budgets are steps, not seconds: a loaded machine makes a run slower, never a different one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, select

import store.worker
from bench import sim
from store.envelope import Envelope
from store.models import Assignment


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """The passes log every injected fault; the simulation reports what matters itself."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def run(seed: int, steps: int, defect: str | None = None) -> tuple[sim.Sim, sim.Broken | None, str]:
    s, broken, _, digest = sim.run_once(sim.Config(seed=seed, steps=steps, defect=defect))
    return s, broken, digest


def test_a_clean_run_breaks_no_invariant_through_two_calm_ends() -> None:
    s, broken, _ = run(seed=1, steps=12000)
    assert broken is None, f"{broken}\n" + "\n".join(s.log)
    assert s.kinds["episode"] >= 3  # faults on, calm, and a calm end whose settling was checked
    assert s.kinds["finish"] > 20 and s.kinds["fault"] > 10  # it ran work, and it broke things


def test_the_same_seed_gives_the_same_digest_and_another_seed_another() -> None:
    first, again, other = run(4, 2000)[2], run(4, 2000)[2], run(5, 2000)[2]
    assert first == again
    assert first != other


# Each re-introduced defect: (the switch or patch, a seed that catches it, the steps it may take,
# what the broken invariant says).
FAKE_DEFECTS = [
    ("command-outlives-worker", 8, 1000, "executed twice at once"),  # caught at step 429
    ("runs-on-after-refusal", 7, 2000, "executed twice at once"),  # 894
    ("dead-holder-keeps-lock", 2, 2000, "still held by"),  # 1402: the dispatch lock
    ("reruns-refused-result", 5, 1000, "fence 1 executed twice"),  # 326
]


@pytest.mark.parametrize(("defect", "seed", "budget", "says"), FAKE_DEFECTS, ids=[d[0] for d in FAKE_DEFECTS])
def test_a_defect_in_the_fakes_is_caught_with_its_seed(
    defect: str, seed: int, budget: int, says: str
) -> None:
    s, broken, _ = run(seed, budget, defect)
    assert broken is not None, f"{defect} not caught in {budget} steps of seed {seed}"
    assert says in str(broken)
    assert s.log  # the events leading there


def test_a_result_applied_under_a_stale_fence_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's defect: a result checked against the row's current fence, not the sender's."""
    real = store.worker.accept_result

    def trusting(conn: Connection, env: Envelope, *, now: float) -> Any:
        where = (
            Assignment.board == env.board,
            Assignment.task_id == env.task_id,
            Assignment.run_id == env.run_id,
        )
        fence = conn.scalar(select(Assignment.fence).where(*where))
        return real(conn, dataclasses.replace(env, fence=fence or env.fence), now=now)

    monkeypatch.setattr(store.worker, "accept_result", trusting)
    s, broken, _ = run(seed=8, steps=1500)  # caught at step 752
    assert broken is not None and "applied after fence" in str(broken), "\n".join(s.log)


def test_shrink_cuts_a_failing_schedule_to_a_shorter_one_that_still_fails() -> None:
    cfg = sim.Config(seed=5, steps=1000, defect="reruns-refused-result")
    step = sim.failing_step(cfg)
    assert step is not None
    small = sim.shrink(cfg, step)
    assert small.steps <= step and len(small.faults) < len(cfg.faults)
    assert sim.failing_step(small) is not None
