"""The autoscaling signal (issue 30, item 3): the demand gauges, and the KEDA ScaledObject's query
evaluated by ``promtool`` over series taken from the real exporter's scrape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the dev extra
from prometheus_client.parser import text_string_to_metric_families

from board import Board, open_board
from core.settings import Settings
from poolkeeper.embedded import ROOT, free_port, wait_for
from store import PoolStore
from tasks import collectors
from tests.factories import OWNER
from tests.test_alerts import run_promtool

KEDA = ROOT / "deploy" / "k8s" / "keda" / "scaledobject.yaml"


def query() -> str:
    [trigger] = yaml.safe_load(KEDA.read_text())["spec"]["triggers"]
    return str(trigger["metadata"]["query"])


def given_demand(store: PoolStore, kanban: Board, *, running: int, assigned: int, ready: int) -> None:
    """``running`` ordinals whose worker holds its grant, ``assigned`` more waiting for theirs, and
    ``ready`` tasks on the board that no ordinal has claimed."""
    for o in range(running + assigned):
        store.add_run(board="b", task_id=f"held{o}", run_id=1, ordinal=o, payload={})
    for o in range(running):
        assert store.offer(o, owner=OWNER) is not None
    for i in range(ready):
        kanban.add_task("b", f"ready {i}", task_id=f"ready{i}")


def gauges(*found: Any) -> dict[str, list[Any]]:
    return {m.name: m.samples for collector in found for m in collector.collect()}


def test_the_demand_gauges_count_busy_ordinals_and_ready_tasks(
    store: PoolStore, kanban: Board, settings: Settings
) -> None:
    given_demand(store, kanban, running=2, assigned=1, ready=4)
    found = gauges(collectors.StoreCollector(store), collectors.BoardCollector(kanban))
    assert found["poolkeeper_ordinals_busy"][0].value == 2
    assert {s.labels["state"]: s.value for s in found["poolkeeper_ordinals"]}["held"] == 3
    assert found["poolkeeper_ready_tasks_waiting"][0].value == 4
    assert found["poolkeeper_board_up"][0].value == 1


def test_a_board_that_does_not_answer_leaves_the_ready_gauge_out(tmp_path: Path, settings: Settings) -> None:
    away = open_board(Settings(board_url=f"sqlite:///{tmp_path}/missing/board.db"))
    found = gauges(collectors.BoardCollector(away))
    assert "poolkeeper_ready_tasks_waiting" not in found
    assert found["poolkeeper_board_up"][0].value == 0


def test_the_scalers_query_returns_the_demand_the_exporter_says(
    store: PoolStore, kanban: Board, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held ordinals plus ready tasks, counted once however many targets export them; 0 for a gauge
    that is absent (a board away)."""
    given_demand(store, kanban, running=2, assigned=1, ready=4)
    (tmp_path / "metrics").mkdir()  # the children's counters, as a worker's (none here)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    port = free_port()
    collectors.start_exporter(port, "127.0.0.1", store, settings)
    url = f"http://127.0.0.1:{port}/metrics"
    scrape = str(wait_for("the exporter to answer", lambda: _get(url), 10))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name in ("poolkeeper_ordinals", "poolkeeper_ready_tasks_waiting")
    }
    held = samples[("poolkeeper_ordinals", (("state", "held"),))]
    ready = samples[("poolkeeper_ready_tasks_waiting", ())]
    assert (held, ready) == (3, 4)  # what the store and the board hold

    def series(name: str, labels: dict[str, str], value: float, minutes: int = 5) -> list[dict[str, str]]:
        """The scraped sample, as two targets export it (a worker's exporter and a serve)."""
        rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return [
            {
                "series": f'{name}{{{rendered}{"," if rendered else ""}instance="{i}"}}',
                "values": f"{value}x{minutes}",
            }
            for i in ("worker-0:9808", "serve-0:8080")
        ]

    everything = [
        *series("poolkeeper_ordinals", {"state": "held"}, held),
        *series(
            "poolkeeper_ordinals", {"state": "free"}, samples[("poolkeeper_ordinals", (("state", "free"),))]
        ),
        *series("poolkeeper_ready_tasks_waiting", {}, ready),
    ]
    board_away = [s for s in everything if "ready_tasks" not in s["series"]]
    tests = [
        {"interval": "1m", "input_series": everything, "promql_expr_test": [_expect(held + ready)]},
        {"interval": "1m", "input_series": board_away, "promql_expr_test": [_expect(held)]},
        {"interval": "1m", "input_series": [], "promql_expr_test": [_expect(0)]},
    ]
    spec = tmp_path / "scaler_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    done = run_promtool("test", "rules", spec)
    assert done.returncode == 0, done.stdout + done.stderr
    wrong = tmp_path / "wrong_test.yml"  # the same query with another answer fails: the test can fail
    tests[0]["promql_expr_test"] = [_expect(held + ready + 1)]
    wrong.write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    assert run_promtool("test", "rules", wrong).returncode != 0


def _expect(value: float) -> dict[str, Any]:
    return {"expr": query(), "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": value}]}


def _get(url: str) -> str | None:
    try:
        return httpx.get(url, timeout=2).text
    except httpx.TransportError:
        return None
