"""Alerting that ships (issue 19, item 7): the rules of ``deploy/prometheus/``.

``promtool`` (Debian's ``prometheus`` package) checks the rules and runs their unit tests
(``alerts_test.yml``: each rule firing, and quiet where it must be). Without promtool its
tests skip, saying why, except under CI (``CI=true``), where that is an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the dev extra

from core.settings import Settings
from poolkeeper.embedded import ROOT
from store import PoolStore
from store.models import RowState
from tasks import collectors, registry
from tasks.plane import RedisCoordination
from tests.factories import NOW

PROMETHEUS = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
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
    assert "poolkeeper_dispatch_paused" not in ALERTS.read_text()


def test_promtool_missing_skips_but_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        promtool()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI needs promtool"):
        promtool()
