"""Alerting that ships (issue 19, item 7): ``deploy/prometheus/`` and ``deploy/grafana/poolkeeper.json``.

``promtool`` (Debian's ``prometheus`` package) checks the rules and runs their unit tests
(``alerts_test.yml``: each rule firing, and quiet where it must be); the dashboard is a
dashboard (panels with PromQL targets); and every metric the rules or the dashboard name
is served by a running Celery worker's exporter or a running ``poolctl serve``, so a
typo'd or renamed metric fails here, not as an alert that never fires. Without promtool
its tests skip, saying why, except under CI (``CI=true``), where that is an error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the dev extra
from prometheus_client.parser import text_string_to_metric_families

from board import open_board
from core.settings import Settings
from poolkeeper.embedded import ROOT, CeleryProc, RedisServer, ServeProc, free_port, wait_for
from store import PoolStore
from store.models import RowState
from tasks import collectors, registry
from tasks.redis_coordination import RedisCoordination
from tests.factories import NOW
from tests.helpers import make_settings

PROMETHEUS = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "poolkeeper.json"
METRIC = re.compile(r"\bpoolkeeper_\w+")
SEVERITIES = {"critical", "warning"}  # critical pages, warning opens a ticket (alerts.yml)


def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    why = "promtool is not installed (Debian's prometheus package; .ci/run installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs promtool: {why}", pytrace=False)
    pytest.skip(why)


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True, timeout=120)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def metric_names(exprs: Iterable[str]) -> set[str]:
    """The series names PromQL expressions read (``poolkeeper_*``; label names never match)."""
    return {name for expr in exprs for name in METRIC.findall(expr)}


def served(exposition: str) -> set[str]:
    """The series names a Prometheus scrape of ``exposition`` stores.

    Every sample's name (``x_total``, ``x_bucket``, ``x_count``, ``x_sum``, ...); a family with
    no sample yet (a labelled counter nothing has bumped) by the names its samples will have.
    """
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(s.name for s in family.samples)
        if not family.samples:
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


# --- the gauges the rules need that the exporters did not serve -------------------------


def test_the_oldest_lease_failed_row_has_a_gauge_of_its_age(store: PoolStore, make_row: Any) -> None:
    def gauge() -> float:
        found = {m.name: m for m in collectors.StoreCollector(store).collect()}
        return float(found["poolkeeper_oldest_lease_failed_seconds"].samples[0].value)

    assert gauge() == 0, "none waiting"
    make_row(RowState.LEASE_FAILED, updated_at=time.time() - 600)
    make_row(RowState.LEASE_FAILED, updated_at=time.time() - 60)
    make_row(RowState.RUNNING, updated_at=time.time() - 6000)  # another state: not counted
    assert 600 <= gauge() < 660


def test_each_pass_has_a_late_gauge_as_status_judges_it() -> None:
    settings = Settings(namespace="alerts", tick_seconds=5, reconcile_seconds=30, gc_seconds=3600)
    client = fakeredis.FakeRedis()
    for p in registry.PASSES:
        RedisCoordination(client, settings).record_scan(p.name, NOW - 3 * 5 - 1)  # tick passes late
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", lambda: NOW)
        found = {m.name: m for m in collectors.PlaneCollector(settings, client).collect()}
    late = {s.labels["pass_name"]: s.value for s in found["poolkeeper_pass_late"].samples}
    assert late == {"expire": 1, "lease_failures": 1, "results": 1, "reconcile": 0, "materialize": 1, "gc": 0}


# --- the rules: promtool checks them and runs their unit tests ------------------------


def test_promtool_checks_the_rules_and_the_example_configuration() -> None:
    for args in (("check", "rules", ALERTS), ("check", "config", PROMETHEUS / "prometheus.yml")):
        done = run_promtool(*args)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_unit_tests_pass() -> None:
    done = run_promtool("test", "rules", PROMETHEUS / "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_rule_that_would_stay_silent_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests can fail: quarantined rows paging only past 100 no longer fires for 40."""
    text = ALERTS.read_text()
    silenced = text.replace("(poolkeeper_quarantined_rows) > 0", "(poolkeeper_quarantined_rows) > 100")
    assert silenced != text
    (tmp_path / "alerts.yml").write_text(silenced)
    shutil.copy(PROMETHEUS / "alerts_test.yml", tmp_path)
    done = run_promtool("test", "rules", tmp_path / "alerts_test.yml")
    assert done.returncode != 0 and "PoolkeeperRowsQuarantined" in done.stdout + done.stderr


def test_every_rule_waits_has_a_severity_says_what_to_run_and_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for t in tests for case in t["alert_rule_test"]]
    for rule in rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"], name
        assert "`poolctl " in rule["annotations"]["description"], f"{name}: tells the operator what to run"
        mine = [case["exp_alerts"] for case in cases if case["alertname"] == name]
        assert any(mine), f"{name}: no case where it fires"
        assert [] in mine, f"{name}: no case where it stays quiet"


def test_the_rules_leave_dispatch_paused_to_its_own_change() -> None:
    # a pause, the pool's or one board's, is an operator's deliberate act: shown, never paged on
    assert "dispatch_paused" not in ALERTS.read_text()


def test_promtool_missing_skips_but_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        promtool()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI needs promtool"):
        promtool()


# --- the dashboard ---------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard_of_promql_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    [source] = dashboard["templating"]["list"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["title"] and set(p["gridPos"]) == {"h", "w", "x", "y"}, p
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"{p['title']}: no query"
        for t in p["targets"]:
            assert METRIC.search(t["expr"]) and t["refId"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_the_dashboards_queries_are_promql(tmp_path: Path) -> None:
    """promtool parses each query, as a recording rule (Grafana's ``$__rate_interval`` made 5m)."""
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    recorded = [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(exprs)
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]})
    )
    done = run_promtool("check", "rules", tmp_path / "queries.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x", "expr": "max(("}]}]})
    )
    assert run_promtool("check", "rules", tmp_path / "queries.yml").returncode != 0, "a broken query fails"


def test_metric_names_are_read_from_expressions_and_checked_against_a_scrape() -> None:
    exprs = [
        'sum by (le) (rate(poolkeeper_expiry_to_reoffer_seconds_bucket{pass_name="expire"}[5m]))',
        "time() - max by (pass_name) (poolkeeper_last_scan_timestamp_seconds) > 0",
    ]
    assert metric_names(exprs) == {
        "poolkeeper_expiry_to_reoffer_seconds_bucket",
        "poolkeeper_last_scan_timestamp_seconds",
    }
    exposition = "\n".join(  # families with no sample yet, and one with
        [
            "# TYPE poolkeeper_expiry_to_reoffer_seconds histogram",
            "# TYPE poolkeeper_lock_busy counter",
            "# TYPE poolkeeper_rows gauge",
            'poolkeeper_rows{state="ready"} 1.0',
            "",
        ]
    )
    names = served(exposition)
    assert {
        "poolkeeper_expiry_to_reoffer_seconds_bucket",
        "poolkeeper_lock_busy_total",
        "poolkeeper_rows",
    } <= names
    assert "poolkeeper_lock_busy" not in names and "poolkeeper_expiry_to_reoffer_seconds" not in names
    assert metric_names(["poolkeeper_rowz"]) - names == {"poolkeeper_rowz"}, "a typo is caught"


# --- every metric named is served: a real Celery worker and a real `poolctl serve` ---------


@pytest.fixture
def scraped(tmp_path: Path) -> Iterator[set[str]]:
    """The series names a Celery worker's exporter and ``poolctl serve`` serve, with work done."""
    server = RedisServer(tmp_path).start()
    settings = make_settings(tmp_path, server.url, pool_size=2, namespace="alerts")
    PoolStore.from_settings(settings).migrate()
    kanban = open_board(settings)
    kanban.migrate()
    kanban.add_task("b", "a task to claim", task_id="t1")  # materialize's outcome bumps a counter
    port = free_port()
    env = {**settings.env(), "POOL_METRICS_PORT": str(port)}
    procs = [CeleryProc("worker", env, tmp_path, "w1"), CeleryProc("beat", env, tmp_path, "beat")]
    serve = ServeProc(settings.env(), tmp_path, local_only=True)
    try:
        for proc in procs:
            proc.wait_ready()
        serve.wait_ready()

        def worker_text() -> str:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.TransportError:
                return ""
            return text if "poolkeeper_pass_outcomes_total{" in text else ""

        worker_metrics = str(wait_for("a pass outcome on the worker's exporter", worker_text, 60, every=0.5))
        httpx.get(f"{serve.url}/metrics", timeout=5)  # the next scrape counts this request
        serve_metrics = httpx.get(f"{serve.url}/metrics", timeout=5).text
        yield served(worker_metrics) | served(serve_metrics)
    finally:
        serve.stop()
        for proc in procs:
            proc.stop()
        kanban.close()
        server.stop()


@pytest.mark.integration
def test_every_metric_the_rules_and_the_dashboard_name_is_served(scraped: set[str]) -> None:
    rule_names = metric_names(rule["expr"] for rule in rules())
    dashboard_names = metric_names(dashboard_exprs(json.loads(DASHBOARD.read_text())))
    assert len(rule_names) >= 9 and len(dashboard_names) >= 15, "the parser found the names"
    assert rule_names - scraped == set(), "alerts.yml names metrics nothing serves"
    assert dashboard_names - scraped == set(), "poolkeeper.json names metrics nothing serves"
