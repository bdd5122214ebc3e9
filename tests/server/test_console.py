"""The operator console in a real browser: Debian's Chromium (Selenium) against a real ``poolctl serve``.

Each test starts the server as a subprocess over SQLite files, with a Redis of
the tests' own (namespaced per test), and drives the pages as an operator
would: sign in with the operator token, read, click, confirm. The store and the
board are read back directly. Without Chromium the browser tests are skipped,
except under CI (``CI=true``), where that is an error. Waits are deadline polls
on what the page shows, never sleeps.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy import text

from board import Board, TaskStatus, open_board
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import CeleryProc, RedisServer, ServeProc, free_port, wait_for
from poolkeeper.workerhost.client import PoolClient
from store import PoolStore, audit
from store.models import EventKind
from tasks import failures, materialize, registry
from tasks.coordination import LocalCoordination, queue_lists
from tasks.plane import Plane
from tasks.redis_coordination import RedisCoordination
from tests import browser
from tests.factories import envelope, row_state
from tests.helpers import DAY, staff

SECRET = "console-test-secret-" + "0123456789abcdef" * 3
POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]
POISON = "ValueError: poisoned result: not JSON"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    why = browser.missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the browser tests to run: {why}", pytrace=False)
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("chromium")
    d = browser.chromium(tmp / "profile", tmp / "chromedriver.log")
    yield d
    d.quit()


@dataclass
class Console:
    tmp: Path
    settings: Settings
    store: PoolStore
    kanban: Board
    serve: ServeProc

    @property
    def url(self) -> str:
        return self.serve.url

    @property
    def plane(self) -> Plane:
        return Plane(self.settings, self.store, self.kanban, LocalCoordination())

    def poolctl(self, *args: str) -> str:
        done = subprocess.run(
            [*POOLCTL, *args],
            env={**os.environ, **self.settings.env()},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def claimed_row(self, task_id: str, ordinal: int) -> int:
        """A board task the pool claimed, recorded on ``ordinal`` (state ``assigned``)."""
        self.kanban.add_task("b", f"task {task_id}", task_id=task_id)
        [claim] = self.kanban.claim_ready(1, assignee=self.settings.assignee, lane=self.settings.lane)
        self.store.add_run(
            board=claim.board, task_id=claim.task_id, run_id=claim.run_id, ordinal=ordinal, payload={"t": 1}
        )
        with self.store.session(readonly=True) as s:
            found = s.execute(text("SELECT id FROM assignments WHERE task_id = :t"), {"t": task_id})
            return int(found.scalar_one())

    def quarantined_row(
        self, task_id: str = "poisoned", ordinal: int = 0, error: str = "poisoned result: not JSON"
    ) -> int:
        """A granted row whose results pass failed until it was quarantined, through the real failure path."""
        row = self.claimed_row(task_id, ordinal)
        assert self.store.offer(ordinal, owner="w0") is not None
        results = registry.get("results")
        for _ in range(self.settings.quarantine_after):
            failures.handle(self.plane, results, row, ValueError(error), time.time())
        assert row_state(self.store, row)["quarantined"]
        return row


def start_console(tmp: Path, redis_url: str, **over: Any) -> Iterator[Console]:
    base: dict[str, Any] = dict(
        database_url=f"sqlite:///{tmp}/pool.db",
        board_url=f"sqlite:///{tmp}/board.db",
        redis_url=redis_url,
        namespace=f"console{uuid.uuid4().hex[:8]}",
        pool_size=3,
        lease_seconds=30,
        quarantine_after=3,
    )
    settings = Settings(**{**base, **over})
    store = PoolStore.from_settings(settings)
    store.migrate()
    kanban = open_board(settings)
    kanban.migrate()
    serve = ServeProc(settings.env(), tmp, secret=SECRET)
    try:
        yield Console(tmp, settings, store, kanban, serve.wait_ready())
    finally:
        serve.stop()
        store.engine.dispose()
        kanban.close()


@pytest.fixture
def console(tmp_path: Path, redis_server: RedisServer) -> Iterator[Console]:
    yield from start_console(tmp_path, redis_server.url)


# --- the browser's side ---------------------------------------------------------------


def until(
    what: str, check: Callable[[], object], timeout: float = 30, driver: WebDriver | None = None
) -> Any:
    """Poll what the page shows until ``check`` holds; a fragment swapped mid-read is read again.

    At the deadline the failure shows the page (``driver``), so it says what was there instead.
    """

    def attempt() -> object:
        try:
            return check()
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    try:
        return wait_for(what, attempt, timeout, every=0.2)
    except AssertionError as err:
        if driver is None:
            raise
        shown = driver.find_element(By.TAG_NAME, "body").text[:2000]
        raise AssertionError(f"{err}; {driver.current_url} shows:\n{shown}") from None


def metric(driver: WebDriver, name: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, f'[data-metric="{name}"]').text.strip())


def message(driver: WebDriver) -> str:
    return str(driver.find_element(By.ID, "message").text)


def sign_in(driver: WebDriver, console: Console, token: str | None = None, then: str = "/ui") -> None:
    driver.get(f"{console.url}/ui/login?next={then}")
    driver.delete_all_cookies()  # every test's server is on 127.0.0.1: cookies would carry over
    driver.get(f"{console.url}/ui/login?next={then}")
    driver.find_element(By.ID, "token").send_keys(token or tokens.operator_token(SECRET))
    driver.find_element(By.ID, "sign-in").click()


def signed_in(driver: WebDriver, console: Console, then: str = "/ui") -> None:
    sign_in(driver, console, then=then)
    until(f"the console to open {then}", lambda: driver.current_url == console.url + then)


def history_kinds(driver: WebDriver) -> list[str]:
    return [
        li.get_attribute("data-kind") or "" for li in driver.find_elements(By.CSS_SELECTOR, "#history li")
    ]


# --- the overview, live -------------------------------------------------------------------


def test_the_overview_follows_a_live_run_without_a_reload(
    driver: WebDriver, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Given a real worker and beat; when tasks arrive and a worker takes one, the open page shows it."""
    env = start_console(tmp_path, redis_server.url, tick_seconds=0.5, reconcile_seconds=2)
    console = next(env)
    staff(console.store, range(3), time.time() + DAY)  # workers on every ordinal, polling
    procs = [
        CeleryProc("worker", console.settings.env(), tmp_path, "w1").wait_ready(),
        CeleryProc("beat", console.settings.env(), tmp_path, "beat").wait_ready(),
    ]
    try:
        signed_in(driver, console)
        assert metric(driver, "rows.assigned") == "0"
        driver.execute_script("window.noReload = 'still the same page'")

        console.kanban.add_task("b", "first", task_id="t1")
        console.kanban.add_task("b", "second", task_id="t2")
        until("both rows on the page", lambda: metric(driver, "rows.assigned") == "2", 60)
        until("beat alive on the page", lambda: metric(driver, "beat_alive") == "alive", 30)
        assert metric(driver, "queue_depth").isdigit()
        assert metric(driver, "ordinals.held") == "2" and metric(driver, "ordinals.free") == "1"
        held = driver.find_elements(By.CSS_SELECTOR, '#ordinals a[data-field="row"]')
        assert len(held) == 2
        ordinal = int(held[0].find_element(By.XPATH, "./ancestor::tr").get_attribute("data-ordinal") or "")

        with PoolClient(console.url, tokens.ordinal_token(SECRET, ordinal)) as client:
            grant = client.offer(ordinal, owner="w0")
        assert grant is not None

        def running() -> bool:
            row = driver.find_element(By.CSS_SELECTOR, f'#ordinals tr[data-ordinal="{ordinal}"]')
            return str(row.find_element(By.CSS_SELECTOR, '[data-field="state"]').text) == "running"

        until(f"ordinal {ordinal}'s row running on the page", running)
        assert metric(driver, "rows.running") == "1"
        assert metric(driver, "scans.materialize").endswith("ago")
        assert driver.execute_script("return window.noReload") == "still the same page"
    finally:
        for proc in procs:
            proc.stop()
        next(env, None)


# --- workers ------------------------------------------------------------------------------------


def test_the_workers_page_says_who_serves_and_since_when_the_gone_are_gone(
    driver: WebDriver, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Given a pool worker polling on ordinal 0, a real Celery worker and beat; when the Celery worker
    stops, the open page says it is gone, and since when, without a reload."""
    env = start_console(tmp_path, redis_server.url, tick_seconds=0.5)
    console = next(env)
    worker = CeleryProc("worker", console.settings.env(), tmp_path, "w1").wait_ready()
    beat = CeleryProc("beat", console.settings.env(), tmp_path, "beat").wait_ready()
    try:
        with PoolClient(console.url, tokens.ordinal_token(SECRET, 0)) as client:
            assert client.offer(0, owner="pool-w0") is None  # nothing to do yet: it polls
        signed_in(driver, console)
        until("the overview's workers block", lambda: metric(driver, "celery.online") == "2", 30, driver)
        assert (metric(driver, "workers.polling"), metric(driver, "workers.gone")) == ("1", "2")
        driver.find_element(By.ID, "workers-more").send_keys(Keys.ENTER)
        until("the workers page", lambda: driver.current_url == f"{console.url}/ui/workers")
        driver.execute_script("window.noReload = 'still the same page'")

        def pool_worker(ordinal: int, field: str) -> str:
            row = driver.find_element(By.CSS_SELECTOR, f'#pool-workers tr[data-ordinal="{ordinal}"]')
            return str(row.find_element(By.CSS_SELECTOR, f'[data-field="{field}"]').text)

        assert (pool_worker(0, "state"), pool_worker(0, "owner")) == ("polling", "pool-w0")
        assert pool_worker(0, "call").startswith("offer ") and pool_worker(0, "holds") == "-"
        assert (pool_worker(1, "state"), pool_worker(1, "call")) == ("gone", "never")

        def celery(kind: str) -> str:
            rows = driver.find_elements(By.CSS_SELECTOR, "#celery tbody tr")
            found = [r for r in rows if r.find_element(By.TAG_NAME, "td").text == kind]
            return str(found[0].find_element(By.CSS_SELECTOR, '[data-field="state"]').text) if found else ""

        assert (celery("worker"), celery("beat")) == ("online", "online")
        worker.stop()
        until("the stopped worker gone", lambda: celery("worker").startswith("gone since "), 30, driver)
        assert "UTC" in celery("worker") and celery("beat") == "online"
        assert driver.execute_script("return window.noReload") == "still the same page"
        status = json.loads(console.poolctl("status", "--json"))
        kinds = {p["kind"]: p["online"] for p in status["processes"]}
        assert kinds == {"worker": False, "beat": True}
        assert [p["state"] for p in status["presence"]] == ["polling", "gone", "gone"]
    finally:
        worker.stop()
        beat.stop()
        next(env, None)


# --- a quarantined row ---------------------------------------------------------------------


def test_a_quarantined_row_opens_from_the_overview_with_its_errors(
    driver: WebDriver, console: Console
) -> None:
    row = console.quarantined_row()
    signed_in(driver, console)
    assert metric(driver, "quarantined") == "1" and metric(driver, "ordinals.quarantined") == "1"
    status = driver.find_element(By.CSS_SELECTOR, '#ordinals tr[data-ordinal="0"] [data-field="status"]')
    assert status.text == "held by a quarantined row"

    link = driver.find_element(By.ID, f"quarantined-{row}")
    link.send_keys(Keys.ENTER)  # from the keyboard
    until("the row page", lambda: driver.current_url == f"{console.url}/ui/rows/{row}")

    def field(name: str) -> str:
        return str(driver.find_element(By.CSS_SELECTOR, f'[data-field="{name}"]').text)

    assert field("failures") == "3" and field("last_error") == POISON
    assert field("quarantined") == "quarantined" and field("state").startswith("running")
    assert field("attempt") == "1 of 3" and field("fence").isdigit() and field("owner") == "w0"
    assert len(field("payload_digest")) == 64 and field("result_digest") == "-"
    assert field("backoff") != "-"  # still retried, slowly


def test_a_quarantined_rows_history_reads_as_a_timeline(driver: WebDriver, console: Console) -> None:
    """Needs the audit trail's writers (branch ``audit``): each transition appends its event."""
    row = console.quarantined_row()
    signed_in(driver, console, then=f"/ui/rows/{row}")
    kinds = history_kinds(driver)
    assert kinds[:2] == ["claim", "grant"], kinds
    assert kinds[-3:] == ["failure", "failure", "quarantine"], kinds
    last = driver.find_elements(By.CSS_SELECTOR, "#history li")[-1].text
    assert "quarantine" in last and "by " in last


# --- actions ----------------------------------------------------------------------------------


def test_requeue_from_the_page_clears_backoff_and_quarantine(driver: WebDriver, console: Console) -> None:
    row = console.quarantined_row()
    signed_in(driver, console, then=f"/ui/rows/{row}")
    driver.find_element(By.ID, "action-requeue").click()
    until("the confirmation", lambda: driver.current_url.endswith(f"/ui/rows/{row}/requeue"))
    assert row_state(console.store, row)["quarantined"]  # nothing happens before the confirmation
    driver.find_element(By.ID, "confirm").click()
    until("the notice", lambda: "Requeued" in driver.find_element(By.ID, "notice").text, driver=driver)
    got = row_state(console.store, row)
    assert (got["quarantined"], got["failures"], got["last_error"], got["state"]) == (
        False,
        0,
        None,
        "running",
    )


def test_abandon_from_the_page_parks_the_run_and_frees_the_ordinal(
    driver: WebDriver, console: Console
) -> None:
    row = console.quarantined_row(ordinal=1)
    signed_in(driver, console, then=f"/ui/rows/{row}")
    driver.find_element(By.ID, "action-abandon").click()
    until("the confirmation", lambda: driver.find_elements(By.ID, "reason"))
    driver.find_element(By.ID, "reason").send_keys("poisoned payload")
    driver.find_element(By.ID, "confirm").click()
    until("the notice", lambda: "Abandoned" in driver.find_element(By.ID, "notice").text, driver=driver)
    assert row_state(console.store, row)["state"] == "stale"
    task = console.kanban.get_task("b", "poisoned")
    assert task is not None and task.status is TaskStatus.BLOCKED
    assert (task.block_kind, task.block_reason) == ("operator", "abandoned by operator: poisoned payload")
    assert driver.find_elements(By.ID, "action-abandon") == []  # a settled row offers no action

    driver.get(f"{console.url}/ui")
    assert metric(driver, "ordinals.free") == "3" and metric(driver, "quarantined") == "0"


def test_pause_and_resume_dispatch_from_the_page_with_a_reason(driver: WebDriver, console: Console) -> None:
    signed_in(driver, console)
    assert metric(driver, "dispatch") == "running" and driver.find_elements(By.ID, "paused-banner") == []
    driver.find_element(By.ID, "dispatch-link").send_keys(Keys.ENTER)  # from the keyboard
    until("the dispatch page", lambda: driver.current_url == f"{console.url}/ui/dispatch")
    driver.find_element(By.ID, "reason").send_keys("deploy 42")
    driver.find_element(By.ID, "confirm-pause").click()
    until("the notice", lambda: "Paused" in driver.find_element(By.ID, "notice").text, driver=driver)
    assert "deploy 42" in driver.find_element(By.ID, "paused-banner").text
    status = json.loads(console.poolctl("status", "--json"))["dispatch"]
    assert (status["paused"], status["reason"], status["by"]) == (True, "deploy 42", "operator")
    history = driver.find_elements(By.CSS_SELECTOR, "#dispatch-history li")
    assert [li.get_attribute("data-kind") for li in history] == ["pause"]

    driver.get(f"{console.url}/ui")
    assert (
        metric(driver, "dispatch") == "paused"
        and "deploy 42" in driver.find_element(By.ID, "paused-banner").text
    )
    driver.find_element(By.ID, "paused-more").click()
    driver.find_element(By.ID, "confirm-resume").click()
    until("the notice", lambda: "Resumed" in driver.find_element(By.ID, "notice").text, driver=driver)
    assert json.loads(console.poolctl("status", "--json"))["dispatch"]["paused"] is False
    history = driver.find_elements(By.CSS_SELECTOR, "#dispatch-history li")
    assert [li.get_attribute("data-kind") for li in history] == ["resume", "pause"]  # newest first


def test_a_board_task_is_unblocked_and_cancelled_from_the_board_page(
    driver: WebDriver, console: Console
) -> None:
    row = console.claimed_row("t1", 0)
    console.kanban.add_task("b", "parked one", task_id="t2")
    [claim] = console.kanban.claim_ready(1, assignee=console.settings.assignee, lane=console.settings.lane)
    assert console.kanban.block_task("b", "t2", "needs a human", "capability", claim.run_id)
    signed_in(driver, console, then="/ui/board")
    assert driver.find_element(By.ID, "run-t1-1").text == f"row {row}"

    driver.find_element(By.ID, "unblock-t2").click()
    driver.find_element(By.ID, "confirm").click()
    until("the notice", lambda: "Unblocked" in driver.find_element(By.ID, "notice").text, driver=driver)
    assert console.kanban.get_task("b", "t2").status is TaskStatus.READY  # type: ignore[union-attr]

    driver.find_element(By.ID, "cancel-t1").click()
    driver.find_element(By.ID, "confirm").click()
    until("the notice", lambda: "Cancelled" in driver.find_element(By.ID, "notice").text, driver=driver)
    assert console.kanban.get_task("b", "t1").status is TaskStatus.DONE  # type: ignore[union-attr]
    assert row_state(console.store, row)["state"] == "stale"


def parked(console: Console, task_id: str, why: str = "the model server was down") -> None:
    """A task the pool claimed and parked on board b (``blocked``), as a capability failure leaves it."""
    console.kanban.add_task("b", f"task {task_id}", task_id=task_id)
    [claim] = console.kanban.claim_ready(1, assignee=console.settings.assignee, lane=console.settings.lane)
    assert console.kanban.block_task("b", task_id, why, "capability", claim.run_id)


def test_twelve_tasks_blocked_by_one_cause_are_unblocked_in_one_confirmed_action(
    driver: WebDriver, console: Console
) -> None:
    """Issue 29's twelve confirmations: filter the board to blocked, "Unblock all", confirm once."""
    tasks = [f"p{n:02d}" for n in range(12)]
    for task_id in tasks:
        parked(console, task_id)
    console.kanban.add_task("b", "waiting", task_id="ready1")
    signed_in(driver, console, then="/ui/board?board=b")
    driver.find_element(By.ID, "status-blocked").click()
    until("the blocked tasks", lambda: "status=blocked" in driver.current_url, driver=driver)
    shown = [tr.get_attribute("data-task") for tr in driver.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")]
    assert shown == tasks
    driver.find_element(By.ID, "bulk-all-unblock").click()
    until("the confirmation", lambda: "/ui/bulk/tasks/unblock?" in driver.current_url, driver=driver)
    assert driver.find_element(By.TAG_NAME, "h1").text == "Unblock 12 tasks of board b?"
    assert "12 tasks match on board b, status blocked" in driver.find_element(By.ID, "bulk-count").text
    listed = driver.find_elements(By.CSS_SELECTOR, "#bulk-tasks tbody tr")
    assert [tr.get_attribute("data-task") for tr in listed] == tasks
    driver.find_element(By.ID, "reason").send_keys("the model server is back")
    driver.find_element(By.ID, "confirm").click()
    until("the results", lambda: "12 unblocked, 0 refused" in message_of(driver), driver=driver)
    assert len(driver.find_elements(By.CSS_SELECTOR, '#bulk-results tr[data-done="yes"]')) == 12
    assert {t.id for t in console.kanban.list_tasks("b", TaskStatus.READY)} == {*tasks, "ready1"}
    driver.find_element(By.ID, "to-board").click()
    until("the board", lambda: driver.current_url == f"{console.url}/ui/board?board=b", driver=driver)


def message_of(driver: WebDriver) -> str:
    return str(driver.find_element(By.ID, "notice").text)


def test_ticked_tasks_stay_ticked_through_a_live_refresh_and_are_cancelled(
    driver: WebDriver, console: Console
) -> None:
    for task_id in ("t1", "t2", "t3"):
        console.kanban.add_task("b", f"task {task_id}", task_id=task_id)
    signed_in(driver, console, then="/ui/board?board=b")
    driver.find_element(By.ID, "tick-t1").click()
    driver.find_element(By.ID, "tick-t3").click()
    # a live refresh swaps the table in (a new task shows up): the ticks are kept
    console.kanban.add_task("b", "arrived meanwhile", task_id="t4")
    until("the refresh", lambda: driver.find_elements(By.ID, "tick-t4"), driver=driver)
    assert [driver.find_element(By.ID, f"tick-{t}").is_selected() for t in ("t1", "t2", "t3", "t4")] == [
        True,
        False,
        True,
        False,
    ]
    driver.find_element(By.ID, "bulk-cancel").click()
    until("the confirmation", lambda: "/ui/bulk/tasks/cancel?" in driver.current_url, driver=driver)
    listed = driver.find_elements(By.CSS_SELECTOR, "#bulk-tasks tbody tr")
    assert [tr.get_attribute("data-task") for tr in listed] == ["t1", "t3"]
    driver.find_element(By.ID, "reason").send_keys("duplicates")
    driver.find_element(By.ID, "confirm").click()
    until("the results", lambda: "2 cancelled, 0 refused" in message_of(driver), driver=driver)
    status = {t.id: t.status for t in console.kanban.list_tasks("b")}
    assert status == {
        "t1": TaskStatus.DONE,
        "t2": TaskStatus.READY,
        "t3": TaskStatus.DONE,
        "t4": TaskStatus.READY,
    }


def test_a_task_is_added_from_the_board_page_and_a_dispatch_is_asked_for(
    driver: WebDriver, console: Console, redis_server: RedisServer
) -> None:
    console.kanban.add_task("b", "first", task_id="t1")
    wanted = f"{console.settings.namespace}:wanted:materialize"
    redis_server.client().delete(wanted)
    signed_in(driver, console, then="/ui/board?board=b")
    driver.find_element(By.ID, "add-title").send_keys("resize the images")
    driver.find_element(By.ID, "add-body").send_keys('{"size": 512}')
    driver.find_element(By.ID, "add-task").click()
    until("the notice", lambda: "Added" in message_of(driver), driver=driver)
    [added] = [t for t in console.kanban.list_tasks("b") if t.id != "t1"]
    assert (added.title, added.body, added.status) == ("resize the images", '{"size": 512}', TaskStatus.READY)
    assert driver.find_elements(By.CSS_SELECTOR, f'#tasks tr[data-task="{added.id}"]')
    assert redis_server.client().exists(wanted), "no dispatch was asked for"
    # a blank title is refused in one sentence, and nothing is added
    driver.find_element(By.ID, "add-title").send_keys("   ")
    driver.find_element(By.ID, "add-task").click()
    until("the refusal", lambda: "title: must not be empty" in message(driver), driver=driver)
    assert "Nothing was changed" in message(driver) and len(console.kanban.list_tasks("b")) == 2


def test_a_board_is_paused_alone_from_its_page_and_resumed(driver: WebDriver, console: Console) -> None:
    console.kanban.add_task("b", "on b", task_id="t1")
    console.kanban.add_task("c", "on c", task_id="t2")
    signed_in(driver, console, then="/ui/board?board=b")
    driver.find_element(By.ID, "board-pause-reason").send_keys("moving b")
    driver.find_element(By.ID, "board-pause").click()
    until("the notice", lambda: "Paused this board alone" in message_of(driver), driver=driver)
    assert "moving b" in driver.find_element(By.ID, "board-paused").text
    status = json.loads(console.poolctl("status", "--json"))["dispatch"]
    assert status["paused"] is False and [b["board"] for b in status["boards"]] == ["b"]
    driver.get(f"{console.url}/ui/dispatch")
    assert "moving b" in driver.find_element(By.ID, "paused-board-b").text
    driver.find_element(By.ID, "resume-board-b").click()
    until("the notice", lambda: "Resumed this board" in message_of(driver), driver=driver)
    assert driver.find_elements(By.ID, "board-paused") == []
    assert json.loads(console.poolctl("status", "--json"))["dispatch"]["boards"] == []


def test_a_board_opens_at_its_path_as_at_its_query(console: Console) -> None:
    console.kanban.add_task("b", "a task at the path", task_id="atpath")
    with httpx.Client(base_url=console.url, follow_redirects=True) as http:
        http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
        got = http.get("/ui/board/b")
        assert (got.status_code, got.url.path, got.url.params["board"]) == (200, "/ui/board", "b")
        assert "a task at the path" in got.text
        assert http.get("/ui/board/nope").status_code == 404  # the query's own answer: no such board


def test_a_rows_timeline_tells_events_apart_below_the_second(console: Console) -> None:
    row = console.quarantined_row()
    with console.store.session(readonly=True) as s:
        ats = s.execute(
            text("SELECT at FROM audit_events WHERE row_id = :r ORDER BY id"), {"r": row}
        ).scalars()
        shown = [datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC" for at in ats]
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
        page = http.get(f"/ui/rows/{row}").text
    timeline = re.findall(r"<time datetime=\"[^\"]*\">([^<]*)</time>", page)
    assert timeline == shown and len(shown) > 3


def test_a_missing_or_wrong_token_is_refused_and_changes_nothing(driver: WebDriver, console: Console) -> None:
    row = console.quarantined_row()
    before = row_state(console.store, row)

    # no session: the page asks for the token first
    driver.get(f"{console.url}/ui/login")
    driver.delete_all_cookies()
    driver.get(f"{console.url}/ui/rows/{row}/requeue")
    assert driver.current_url.startswith(f"{console.url}/ui/login?next=")
    # a wrong token, then a worker's: refused, still signed out
    for token, why in (
        ("op." + "0" * 64, "not a token this server issued"),
        (tokens.ordinal_token(SECRET, 0), "a token of ordinal 0 cannot sign in"),
        ("   ", "no token given"),
    ):
        driver.find_element(By.ID, "token").clear()
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "sign-in").click()

        def refusal_shown(why: str = why) -> bool:
            return why in message(driver)

        until(f"the refusal ({why})", refusal_shown)
        assert driver.get_cookies() == []

    # signed in, but the session is gone when the form is sent
    signed_in(driver, console, then=f"/ui/rows/{row}/requeue")
    driver.delete_all_cookies()
    driver.find_element(By.ID, "confirm").click()
    until("the refusal", lambda: "not signed in" in message(driver))
    assert "Nothing was changed" in message(driver)

    # signed in, but the form's check value is forged
    signed_in(driver, console, then=f"/ui/rows/{row}/requeue")
    driver.execute_script("document.querySelector('main input[name=csrf]').value = 'forged'")
    driver.find_element(By.ID, "confirm").click()
    until("the refusal", lambda: "check value" in message(driver))

    # and outside the browser: no cookie, a forged one, another site's form
    cookie = {c["name"]: c["value"] for c in driver.get_cookies()}
    target = f"{console.url}/ui/rows/{row}/abandon"
    form = {"reason": "x", "csrf": "whatever"}
    assert httpx.post(target, data=form).status_code == 401
    assert (
        httpx.post(target, data=form, cookies={"poolkeeper_console": "9999999999.forged"}).status_code == 401
    )
    assert (
        httpx.post(target, data=form, cookies=cookie, headers={"Origin": "http://evil.test"}).status_code
        == 403
    )
    assert row_state(console.store, row) == before


def test_a_viewer_reads_every_page_and_every_action_is_refused_and_changes_nothing(console: Console) -> None:
    """The console's auth matrix for the viewer token: every page 200, every action 403, sign-out ok."""
    row = console.quarantined_row()
    console.kanban.add_task("b", "spare", task_id="t1")
    before = row_state(console.store, row)
    with httpx.Client(base_url=console.url) as http:
        signed = http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
        assert signed.status_code == 303, signed.text[-300:]
        pages = [
            "/ui",
            "/ui/workers",
            f"/ui/rows/{row}",
            "/ui/rows",
            "/ui/board",
            "/ui/dispatch",
            "/ui/trends",
        ]
        for page in pages:
            got = http.get(page)
            assert got.status_code == 200 and 'id="role"' in got.text, page  # says who is signed in
            assert "action-requeue" not in got.text and "confirm-pause" not in got.text, page
        fragments = ("/ui/live/overview", "/ui/live/workers", f"/ui/live/rows/{row}", "/ui/live/board")
        for page in (*fragments, "/ui/live/trends?window=day"):
            got = http.get(page)
            assert got.status_code == 200 and "action-requeue" not in got.text and "cancel-t1" not in got.text
        csrf = _csrf(http.get("/ui").text)
        for page in (f"/ui/rows/{row}/requeue", f"/ui/rows/{row}/abandon", "/ui/board/b/tasks/t1/cancel"):
            got = http.get(page)
            assert got.status_code == 403 and "changes nothing" in got.text, page
        for path, form in (
            (f"/ui/rows/{row}/requeue", {}),
            (f"/ui/rows/{row}/abandon", {"reason": "x"}),
            ("/ui/board/b/tasks/t1/cancel", {}),
            ("/ui/board/b/tasks/t1/unblock", {}),
            ("/ui/dispatch/pause", {"reason": "x"}),
            ("/ui/dispatch/resume", {}),
        ):
            got = http.post(path, data={"csrf": csrf, **form})
            assert got.status_code == 403 and "viewer reads everything and changes nothing" in got.text, path
            assert "Nothing was changed" in got.text
        assert row_state(console.store, row) == before
        assert console.kanban.get_task("b", "t1").status is TaskStatus.READY  # type: ignore[union-attr]
        assert json.loads(console.poolctl("status", "--json"))["dispatch"]["paused"] is False
        assert http.post("/ui/logout", data={"csrf": csrf}).status_code == 303  # signing out is no change
        assert http.get("/ui").status_code == 303


def test_a_viewer_sees_no_action_in_the_browser(driver: WebDriver, console: Console) -> None:
    row = console.quarantined_row()
    console.kanban.add_task("b", "spare", task_id="t1")
    sign_in(driver, console, token=tokens.viewer_token(SECRET), then=f"/ui/rows/{row}")
    until("the row page", lambda: driver.current_url == f"{console.url}/ui/rows/{row}", driver=driver)
    assert driver.find_element(By.ID, "role").text == "viewer"
    assert driver.find_element(By.CSS_SELECTOR, '[data-field="quarantined"]').text == "quarantined"
    assert driver.find_elements(By.CSS_SELECTOR, "#main .actions a") == []
    assert "changes nothing" in driver.find_element(By.ID, "viewer-no-actions").text
    driver.get(f"{console.url}/ui/board")
    assert driver.find_elements(By.CSS_SELECTOR, "#main a.button") == []
    assert (
        driver.find_elements(By.CSS_SELECTOR, "#main input[type=checkbox], #main form, #bulk-unblock") == []
    )
    driver.get(f"{console.url}/ui/dispatch")
    assert driver.find_elements(By.CSS_SELECTOR, "#main form, #reason") == []
    driver.get(f"{console.url}/ui/rows?quarantined=1")
    assert driver.find_elements(By.CSS_SELECTOR, "#main input[type=checkbox], #bulk-all, #bulk-requeue") == []
    driver.get(f"{console.url}/ui/bulk/requeue?all=1&quarantined=1")  # typed in by hand: refused
    assert "changes nothing" in message(driver) and driver.find_elements(By.ID, "confirm") == []
    driver.get(f"{console.url}/ui/rows/{row}/requeue")  # typed in by hand: refused
    assert "changes nothing" in message(driver) and driver.find_elements(By.ID, "confirm") == []
    # the operator, on the same pages, has them
    signed_in(driver, console, then=f"/ui/rows/{row}")
    assert driver.find_elements(By.ID, "action-requeue") and driver.find_elements(By.ID, "role") == []
    driver.get(f"{console.url}/ui/rows?quarantined=1")
    assert driver.find_elements(By.ID, f"tick-{row}") and driver.find_elements(By.ID, "bulk-all-requeue")


# --- search and bulk actions ---------------------------------------------------------------------


def test_a_row_is_found_by_its_error_text_from_the_keyboard_and_opened(
    driver: WebDriver, console: Console
) -> None:
    """Tab to the header's search box, type part of an error, Enter; the result opens from the keyboard."""
    console.claimed_row("healthy", 1)
    row = console.quarantined_row()
    signed_in(driver, console)
    driver.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)
    for _ in range(20):
        active = driver.switch_to.active_element
        if active.get_attribute("id") == "nav-search":
            break
        active.send_keys(Keys.TAB)
    assert driver.switch_to.active_element.get_attribute("id") == "nav-search"
    driver.switch_to.active_element.send_keys("Poisoned Result", Keys.ENTER)
    until("the results", lambda: "/ui/search?q=Poisoned+Result" in driver.current_url, driver=driver)
    found = driver.find_elements(By.CSS_SELECTOR, "#found-rows tbody tr")
    assert [tr.get_attribute("data-row") for tr in found] == [str(row)]
    assert (
        driver.find_element(By.CSS_SELECTOR, '#rows-pager [data-field="showing"]').text
        == "showing 1\u20131 of 1"
    )
    events = driver.find_elements(By.CSS_SELECTOR, "#found-events tbody tr")
    assert events and all(POISON.split(": ", 1)[1] in tr.text for tr in events)  # its failures' details
    driver.find_element(By.ID, f"found-rows-{row}").send_keys(Keys.ENTER)
    until("the row page", lambda: driver.current_url == f"{console.url}/ui/rows/{row}", driver=driver)
    assert driver.find_element(By.CSS_SELECTOR, '[data-field="last_error"]').text == POISON


def test_tasks_are_found_by_words_of_their_title_or_body_and_open_on_their_board(
    driver: WebDriver, console: Console
) -> None:
    """Type a word an operator knows in the header's search: the tasks whose title or body holds it are
    listed, newest first, with the row that runs one, and a task's link opens its board with it in view."""
    row = console.claimed_row("finance-sync", 0)  # title "task finance-sync", claimed and on ordinal 0
    console.kanban.add_task("b", "nightly report", "send it to the Finance team", task_id="report")
    console.kanban.add_task("b", "unrelated", task_id="other")
    signed_in(driver, console)
    driver.find_element(By.ID, "nav-search").send_keys("FINANCE", Keys.ENTER)
    until("the results", lambda: "/ui/search?q=FINANCE" in driver.current_url, driver=driver)
    found = driver.find_elements(By.CSS_SELECTOR, "#found-tasks tbody tr")
    assert [tr.get_attribute("data-task") for tr in found] == ["b/report", "b/finance-sync"]
    assert "send it to the Finance team" in found[0].text
    rows = driver.find_elements(By.CSS_SELECTOR, "#found-rows tbody tr")
    assert [tr.get_attribute("data-row") for tr in rows] == [str(row)]
    driver.find_element(By.ID, "found-task-1").send_keys(Keys.ENTER)
    until(
        "the board page", lambda: driver.current_url.endswith("/ui/board?board=b#task-report"), driver=driver
    )
    assert driver.find_element(By.ID, "task-report").get_attribute("data-task") == "report"


def test_forty_rows_quarantined_by_one_error_are_requeued_in_one_confirmed_action(
    driver: WebDriver, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Issue 19's 3 a.m.: find the rows by their error, tick all matching, confirm once, each row requeued."""
    env = start_console(tmp_path, redis_server.url, pool_size=42)
    console = next(env)
    try:
        poisoned = [
            console.quarantined_row(f"p{n:02d}", n, "bad deploy 7: no such column") for n in range(40)
        ]
        others = [console.quarantined_row(f"o{n}", 40 + n, "disk full") for n in range(2)]
        signed_in(driver, console, then="/ui/rows?quarantined=1")
        driver.find_element(By.ID, "filter-error").send_keys("no such column")
        driver.find_element(By.ID, "filter-go").click()
        shown = driver.find_element
        until("the filtered rows", lambda: "error=no+such+column" in driver.current_url, driver=driver)
        assert shown(By.CSS_SELECTOR, '#rows-pager [data-field="showing"]').text == "showing 1\u201340 of 40"
        assert "All 40 matching this filter" in shown(By.ID, "bulk-all").text
        shown(By.ID, "bulk-all-requeue").click()
        until("the confirmation", lambda: "/ui/bulk/requeue?" in driver.current_url, driver=driver)
        assert shown(By.TAG_NAME, "h1").text == "Requeue 40 rows?"
        assert "40 rows match, quarantined, last error holding" in shown(By.ID, "bulk-count").text
        listed = driver.find_elements(By.CSS_SELECTOR, "#bulk-rows tbody tr")
        assert [int(tr.get_attribute("data-row") or 0) for tr in listed] == poisoned
        assert all(row_state(console.store, r)["quarantined"] for r in poisoned)  # nothing before confirming
        shown(By.ID, "reason").send_keys("migration 12 rolled back")
        shown(By.ID, "confirm").click()
        until("the results", lambda: "40 requeued, 0 refused" in shown(By.ID, "notice").text, driver=driver)
        done = driver.find_elements(By.CSS_SELECTOR, '#bulk-results tr[data-done="yes"]')
        assert len(done) == 40
        for row in poisoned:
            got = row_state(console.store, row)
            assert (got["quarantined"], got["failures"], got["last_error"]) == (False, 0, None)
            with console.store.session(readonly=True) as s:
                last = audit.history(s, row)[-1]
            assert (last["kind"], last["actor"]) == ("requeue", "operator")
            assert last["detail"].startswith("migration 12 rolled back: cleared 3 failure(s) and quarantine")
        assert all(row_state(console.store, r)["quarantined"] for r in others)  # another error: untouched
    finally:
        next(env, None)


# --- the numbers --------------------------------------------------------------------------


def test_the_pages_numbers_equal_poolctl_status_json(
    driver: WebDriver, console: Console, redis_server: RedisServer
) -> None:
    console.quarantined_row("q1", ordinal=0)
    console.claimed_row("a1", ordinal=1)
    console.kanban.add_task("b", "waiting", task_id="r1")
    client = redis_server.client()
    coord = RedisCoordination(client, console.settings)
    now = time.time()
    for name in ("expire", "lease_failures", "results", "materialize"):  # every pass at the tick interval
        coord.record_scan(name, now - 1)
    coord.record_scan("gc", now - 4 * console.settings.gc_seconds)  # late
    first, *_, last = queue_lists(console.settings)
    client.rpush(first, "m1", "m2")
    client.rpush(last, "m3")  # a message of another priority step waits too

    signed_in(driver, console)
    status = json.loads(console.poolctl("status", "--json"))
    assert status["queue_depth"] == 3 and status["beat_alive"] is True and status["quarantined"] == 1

    expected = {f"rows.{k}": str(v) for k, v in status["rows"].items()}
    expected |= {f"board.{k}": str(v) for k, v in status["board"].items()}
    expected |= {f"ordinals.{k}": str(v) for k, v in status["ordinals"].items()}
    for key in ("quarantined", "pool_size", "live_children", "audit_events", "queue_depth"):
        expected[key] = str(status[key])
    expected["beat_alive"] = "alive" if status["beat_alive"] else "not scanning"
    for name, scan in status["scans"].items():
        never = "never" if scan["late"] else "not yet due"
        expected[f"scans.{name}"] = never if scan["last"] is None else "late" if scan["late"] else "ago"

    def shown() -> dict[str, str]:
        got = {key: metric(driver, key) for key in expected}
        for key in [k for k in got if k.startswith("scans.")]:
            text = got[key]
            got[key] = (
                text if text in ("never", "not yet due") else "late" if text.endswith("(late)") else "ago"
            )
        return got

    until("the page to show the numbers of `poolctl status --json`", lambda: shown() == expected, 10)
    assert expected["scans.gc"] == "late" and expected["scans.reconcile"] == "not yet due"  # the plane is new


def test_without_redis_the_plane_numbers_are_unknown_not_an_error(tmp_path: Path) -> None:
    """No browser needed: the page and `poolctl status` say "unknown" when Redis does not answer."""
    env = start_console(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    down = next(env)
    try:
        with httpx.Client(base_url=down.url) as http:
            http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
            page = http.get("/ui")
            metrics = http.get("/metrics").text
        assert page.status_code == 200
        assert (
            'data-metric="queue_depth">unknown<' in page.text
            and 'data-metric="beat_alive">unknown<' in page.text
        )
        assert "poolkeeper_redis_up 0.0" in metrics
        status = json.loads(down.poolctl("status", "--json"))
        assert (status["queue_depth"], status["beat_alive"]) == (None, None) and status["redis_error"]
    finally:
        next(env, None)


# --- bad input, keyboard, colours ------------------------------------------------------------


def test_bad_input_is_one_clear_page_never_a_traceback(console: Console) -> None:
    row = console.quarantined_row()
    before = row_state(console.store, row)
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
        csrf = _csrf(http.get(f"/ui/rows/{row}/abandon").text)
        cases = [
            (http.get("/ui/rows/abc"), 404, "a row id is a whole number"),
            (http.get("/ui/rows/99999999999"), 404, "a row id is a whole number"),
            (http.get("/ui/rows/777"), 404, "row 777: no such row"),
            (http.get(f"/ui/rows/{row}/explode"), 404, "no action"),
            (http.get("/ui/rows?state=melted"), 422, "unknown state"),
            (http.get("/ui/board?board=nope"), 404, "no such board"),
            (http.get("/ui/board/b/tasks/..%2F..%2Fx/cancel"), 404, "the console has no page"),
            (http.get("/ui/board/b/tasks/no%20such/cancel"), 404, "b/no such: no such task"),
            (http.get("/ui/board/b/tasks/t9/cancel"), 404, "b/t9: no such task"),
            (http.post(f"/ui/rows/{row}/abandon", data={"csrf": csrf, "reason": " "}), 422, "reason"),
            (http.post(f"/ui/rows/{row}/abandon", content=b"\xff\xfe", headers=_FORM), 403, "check value"),
        ]
        for got, status, words in cases:
            assert (got.status_code, words in got.text) == (status, True), got.text[-500:]
            assert "Traceback" not in got.text and "<html" in got.text
        stale = console.claimed_row("done1", 2)
        with console.store.session() as s:
            s.execute(text("UPDATE assignments SET state='stale', payload=NULL WHERE id=:r"), {"r": stale})
        refused = http.post(f"/ui/rows/{stale}/requeue", data={"csrf": csrf})
        assert refused.status_code == 422 and "a terminal row is never retried" in refused.text
    assert row_state(console.store, row) == before


_FORM = {"content-type": "application/x-www-form-urlencoded"}


def _csrf(page: str) -> str:
    return page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_the_pages_are_keyboard_reachable_and_readable_light_and_dark(
    driver: WebDriver, console: Console
) -> None:
    row = console.quarantined_row()
    signed_in(driver, console)
    wanted = {"nav-overview", "nav-board", "sign-out", "state-assigned", f"quarantined-{row}", "ord-0"}
    seen: list[str] = []

    # Tab goes to whatever has focus, as a keyboard's does: a live partial may swap the
    # focused element out between two presses, so no element is addressed by reference.
    def tab() -> None:
        ActionChains(driver).send_keys(Keys.TAB).perform()

    tab()
    while not wanted <= set(seen) and len(seen) < 40:
        active = driver.execute_script(
            "const a = document.activeElement, tag = a.tagName.toLowerCase();"
            " return [a.id || tag, tag, getComputedStyle(a).outlineStyle]"
        )
        seen.append(active[0])
        if active[1] in ("a", "button"):
            assert active[2] != "none", f"focus not visible on {seen[-1]}"
        tab()
    assert wanted <= set(seen), seen

    colours = {}
    for scheme in ("light", "dark"):
        browser.color_scheme(driver, scheme)
        driver.get(f"{console.url}/ui")
        colours[scheme] = driver.execute_script(
            "const s = getComputedStyle(document.body); return [s.backgroundColor, s.color]"
        )
    browser.color_scheme(driver, "light")
    assert colours["light"] == ["rgb(255, 255, 255)", "rgb(27, 31, 36)"]
    assert colours["dark"] == ["rgb(13, 17, 23)", "rgb(230, 237, 243)"]
    assert driver.execute_script("return document.documentElement.scrollWidth") <= browser.WIDTH


def test_the_console_ships_its_assets(console: Console) -> None:
    with httpx.Client(base_url=console.url) as http:
        js = http.get("/ui/static/htmx.min.js")
        css = http.get("/ui/static/console.css")
        login = http.get("/ui/login")
    assert js.status_code == 200 and js.text.startswith("/*! htmx 2.") and "0BSD" in js.text[:200]
    assert css.status_code == 200 and "prefers-color-scheme: dark" in css.text
    assert "script-src 'self'" in login.headers["content-security-policy"]
    assert 'src="http' not in login.text and 'href="http' not in login.text  # nothing from elsewhere


def _last_event(console: Console, row: int) -> tuple[str, str]:
    with console.store.session(readonly=True) as s:
        last = audit.history(s, row)[-1]
    return last["kind"], last["actor"]


def test_every_console_action_is_attributed_to_the_operator(console: Console) -> None:
    requeued, abandoned = console.quarantined_row("q1", 0), console.claimed_row("a1", 1)
    cancelled = console.claimed_row("c1", 2)
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
        csrf = _csrf(http.get(f"/ui/rows/{requeued}/requeue").text)
        for path, form in (
            (f"/ui/rows/{requeued}/requeue", {}),
            (f"/ui/rows/{abandoned}/abandon", {"reason": "gone"}),
            ("/ui/board/b/tasks/c1/cancel", {}),
            ("/ui/dispatch/pause", {"reason": "incident"}),
        ):
            got = http.post(path, data={"csrf": csrf, **form})
            assert got.status_code == 303, got.text[-500:]
    assert _last_event(console, requeued) == ("requeue", "operator")
    assert _last_event(console, abandoned)[1] == "operator"
    assert _last_event(console, cancelled)[1] == "operator"
    assert _last_event(console, audit.POOL) == ("pause", "operator")


# Raw (already percent-encoded) values: non-ASCII digits and letters, NUL and other control characters,
# bytes that are not UTF-8, a lone surrogate's bytes, huge, empty.
HOSTILE = [
    "%00",
    "a%00b",
    "%01",
    "%1B%5B31m",
    "%0D%0AX-Evil:%201",
    "%C3%A9",
    "%C2%B2",
    "%D9%A1",
    "%EF%BC%91",
    "%7F",
    "%C2%85",
    "%FF",
    "%ED%A0%80",
    "%E2%80%AE",
    "x" * 5000,
    "9" * 5000,
    "",
]
# Every console route, with {} for the slot the hostile value goes in (one slot at a time).
GETS = [
    "/ui?{}",
    "/ui/live/overview?x={}",
    "/ui/rows?state={}",
    "/ui/rows?quarantined={}",
    "/ui/rows/{}",
    "/ui/rows/{}?done=requeue",
    "/ui/rows/1?done={}",
    "/ui/live/rows/{}",
    "/ui/board?board={}",
    "/ui/board/{}",
    "/ui/board?done={}",
    "/ui/live/board?board={}",
    "/ui/trends?window={}",
    "/ui/live/trends?window={}",
    "/ui/login?next={}",
    "/ui/login?next=/ui{}",
    "/ui/rows/{}/requeue",
    "/ui/rows/{}/abandon",
    "/ui/rows/1/{}",
    "/ui/board/{}/tasks/t1/cancel",
    "/ui/board/b/tasks/{}/cancel",
    "/ui/board/b/tasks/t1/{}",
    "/ui/workers?x={}",
    "/ui/live/workers?x={}",
    "/ui/dispatch?done={}",
    "/ui/search?q={}",
    "/ui/search?q=x&page={}",
    "/ui/search?q=x&size={}",
    "/ui/search?q=x&events_page={}",
    "/ui/rows?error={}",
    "/ui/rows?sort={}",
    "/ui/rows?order={}",
    "/ui/rows?page={}",
    "/ui/bulk/{}",
    "/ui/bulk/requeue?row={}",
    "/ui/bulk/abandon?all=1&error={}",
    "/ui/{}",
    "/ui/static/{}",
    "/ui/{}/x",
]
POSTS = [
    ("/ui/rows/{}/requeue", "csrf={csrf}"),
    ("/ui/rows/{}/abandon", "csrf={csrf}&reason=r"),
    ("/ui/rows/1/{}", "csrf={csrf}"),
    ("/ui/rows/1/abandon", "csrf={csrf}&reason={}"),
    ("/ui/rows/1/requeue", "csrf={}"),
    ("/ui/rows/1/requeue", "csrf={csrf}&{}=1"),
    ("/ui/board/{}/tasks/t1/cancel", "csrf={csrf}"),
    ("/ui/board/b/tasks/{}/unblock", "csrf={csrf}"),
    ("/ui/board/b/tasks/t1/{}", "csrf={csrf}"),
    ("/ui/board/b/tasks/t1/cancel", "csrf={}"),
    ("/ui/dispatch/{}", "csrf={csrf}&reason=r"),
    ("/ui/dispatch/pause", "csrf={csrf}&reason={}"),
    ("/ui/bulk/{}", "csrf={csrf}&rows=1&digest=x&reason=r"),
    ("/ui/bulk/requeue", "csrf={csrf}&rows={}&digest=x&reason=r"),
    ("/ui/bulk/requeue", "csrf={csrf}&all=1&error={}&digest=x&reason=r"),
    ("/ui/bulk/abandon", "csrf={csrf}&rows=1&digest=x&reason={}"),
    ("/ui/login", "token={}"),
    ("/ui/login", "token=x&next={}"),
    ("/ui/login", "next=/ui{}"),
    ("/ui/logout", "csrf={}"),
]
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _one_sentence(got: httpx.Response, sent: str) -> None:
    where = f"{got.request.method} {sent} -> {got.status_code}"
    assert got.status_code < 500, where + got.text[-800:]
    assert "Traceback" not in got.text, where
    assert not _CONTROL.search(got.text), f"{where}: a control character echoed raw"
    assert not any(_CONTROL.search(v) for v in got.headers.values()), where
    if got.status_code >= 400 and got.request.url.path.startswith("/ui/static/"):
        return  # the static files' own 404, plain text
    if got.status_code >= 400 and got.headers["content-type"].startswith("application/json"):
        sentence = got.json()["detail"]  # a path no route matches (a line break in it): the app's 404
    elif got.status_code >= 400:
        shown = got.text.split('id="message"', 1)[1].split(">", 1)[1].split("</p>", 1)[0].strip()
        sentence = html.unescape(shown)
    if got.status_code >= 400:
        assert sentence and len(sentence) < 400 and sentence.count(". ") <= 1, f"{where}: {sentence!r}"


def test_hostile_input_on_every_console_route_is_one_sentence_never_a_5xx(console: Console) -> None:
    row = console.quarantined_row()
    console.kanban.add_task("b", "spare", task_id="t1")
    raw = httpx.URL  # the values are already encoded: sent as they are
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
        csrf = _csrf(http.get(f"/ui/rows/{row}/requeue").text)
        for value in HOSTILE:
            for path in GETS:
                sent = path.replace("{}", value)
                _one_sentence(http.get(raw(console.url + sent)), sent)
            for path, body in POSTS:
                at_path = "{}" in path
                target = path.replace("{}", value) if at_path else path
                form = body.replace("{csrf}", csrf).replace("{}", "" if at_path else value)
                got = http.post(raw(console.url + target), content=form.encode(), headers=_FORM)
                _one_sentence(got, f"{target} <- {form[:80]}")
                if "/ui/login" in target or "/ui/logout" in target:  # keep the session for the rest
                    http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
                    csrf = _csrf(http.get(f"/ui/rows/{row}/requeue").text)


@pytest.mark.parametrize(
    "cookie", [b"poolkeeper_console=1.\xe9", b"poolkeeper_console=\xb2\xb2.ab", b"poolkeeper_console=1.\x01"]
)
def test_a_hostile_session_cookie_is_signed_out_not_a_5xx(console: Console, cookie: bytes) -> None:
    for path in ("/ui", "/ui/live/overview", "/ui/rows/1"):
        got = httpx.get(console.url + path, headers={b"cookie": cookie})
        assert got.status_code in (303, 401), (path, got.status_code, got.text[-300:])
    got = httpx.post(
        console.url + "/ui/rows/1/requeue",
        content=b"csrf=x",
        headers={b"content-type": _FORM["content-type"].encode(), b"cookie": cookie},
    )
    assert got.status_code == 401 and "not signed in" in got.text


def test_non_ascii_digits_are_not_row_ids(console: Console) -> None:
    console.quarantined_row()
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
        csrf = _csrf(http.get("/ui/rows/1/requeue").text)
        for digit in ("²", "\u0661", "\uff11"):  # superscript two, Arabic-Indic one, fullwidth one
            for got in (
                http.get(f"/ui/rows/{digit}"),
                http.get(f"/ui/live/rows/{digit}"),
                http.get(f"/ui/rows/{digit}/requeue"),
                http.post(f"/ui/rows/{digit}/requeue", data={"csrf": csrf}),
            ):
                assert got.status_code == 404 and "a row id is a whole number" in got.text, got.text[-300:]
        # the form's check value compared as text: a non-ASCII one is refused, not a 500
        got = http.post("/ui/rows/1/requeue", data={"csrf": "é"})
        assert got.status_code == 403 and "check value" in got.text


def test_sign_out_is_a_checked_form_and_another_site_cannot_sign_the_operator_out(console: Console) -> None:
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.operator_token(SECRET)})
        page = http.get("/ui")
        sign_out = page.text.split('action="/ui/logout"', 1)[1].split("</form>", 1)[0]
        assert f'name="csrf" value="{_csrf(page.text)}"' in sign_out  # the form carries its check value
        for form, headers in (
            ({}, {}),
            ({"csrf": "forged"}, {}),
            ({"csrf": _csrf(page.text)}, {"Origin": "http://evil.test"}),
        ):
            got = http.post("/ui/logout", data=form, headers=headers)
            assert got.status_code == 403 and "Nothing was changed" in got.text, got.text[-300:]
            assert http.get("/ui").status_code == 200  # still signed in
        got = http.post("/ui/logout", data={"csrf": _csrf(page.text)})
        assert got.status_code == 303 and got.headers["location"] == "/ui/login"
        assert http.get("/ui").status_code == 303  # signed out: to the sign-in page
        assert http.post("/ui/logout").status_code == 303  # signed out already: nothing to check


def test_two_sign_ins_in_the_same_second_get_different_sessions(store: PoolStore) -> None:
    from starlette.requests import Request
    from starlette.responses import Response

    from poolkeeper.console.auth import COOKIE, ConsoleAuth

    auth = ConsoleAuth(SECRET, store)
    scope = {"type": "http", "scheme": "http", "method": "POST", "path": "/ui/login", "headers": []}
    cookies = []
    for _ in range(2):
        response = Response()
        auth.start_session(Request(scope), response, now=1_700_000_000.0)
        cookies.append(response.headers["set-cookie"].split(";", 1)[0].split("=", 1)[1])
    assert cookies[0] != cookies[1]
    for value in cookies:
        signed = Request({**scope, "headers": [(b"cookie", f"{COOKIE}={value}".encode())]})
        assert auth.signed_in(signed, now=1_700_000_001.0)
    flipped = cookies[0][:-1] + ("1" if cookies[0].endswith("0") else "0")
    forged = Request({**scope, "headers": [(b"cookie", f"{COOKIE}={flipped}".encode())]})
    assert not auth.signed_in(forged, now=1_700_000_001.0)


# --- trends -----------------------------------------------------------------------------------


def in_page(driver: WebDriver, expression: str) -> Any:
    """``expression`` evaluated in the page in one step: the Trends page redraws its charts on
    each refresh, so an element found first and read after may be gone by then (stale)."""
    return driver.execute_script(f"return {expression}")


def series(driver: WebDriver, chart: str, name: str, field: str) -> str:
    line = f"""document.querySelector('#chart-{chart} polyline[data-series="{name}"]')"""
    return str(in_page(driver, f"{line}.getAttribute('data-{field}')"))


def test_the_trends_page_shows_a_failure_spike_without_a_reload(driver: WebDriver, console: Console) -> None:
    """Given the Trends page open; when 40 failures are recorded, its chart shows the spike in place."""
    row = console.claimed_row("t1", 0)
    signed_in(driver, console, then="/ui/trends")
    assert series(driver, "events", "failures", "total") == "0"
    assert series(driver, "rows", "assigned", "last") == "1"
    role, drawn = in_page(
        driver, "(s => [s.getAttribute('role'), s.innerHTML])(document.querySelector('#chart-events svg'))"
    )
    assert role == "img" and "Transitions per minute" in drawn
    driver.execute_script("window.noReload = 'still the same page'")

    with console.store.session() as s:
        events = [audit.Event(row, EventKind.FAILURE, "test", "assigned", "assigned", detail=POISON)] * 40
        audit.append(s, events, now=time.time())
    until(
        "the spike on the chart", lambda: series(driver, "events", "failures", "peak") == "40", driver=driver
    )
    assert series(driver, "events", "failures", "total") == "40"
    described = in_page(driver, "document.querySelector('#chart-events desc').textContent")
    assert "failures: total 40, peak 40" in described
    cells = in_page(
        driver, "[...document.querySelectorAll('#chart-events table tbody td')].map(c => c.textContent)"
    )
    assert "40" in cells  # the table says it too
    assert driver.execute_script("return window.noReload") == "still the same page"

    colours = {}
    for scheme in ("light", "dark"):
        browser.color_scheme(driver, scheme)
        line = """document.querySelector('#chart-events polyline[data-series="failures"]')"""
        colours[scheme] = in_page(driver, f"getComputedStyle({line}).stroke")
    browser.color_scheme(driver, "light")
    assert colours["light"] != colours["dark"], colours


def test_the_trends_page_charts_wait_and_run_percentiles_read_from_the_store(console: Console) -> None:
    """Given a task ready 3 s before materialize claims it, granted then, its result 0.2 s later: a
    serve's Trends page draws p50, p95 and p99 of both, from the store (not its own metrics)."""
    console.kanban.add_task("b", "timed", task_id="timed")
    [c] = console.kanban.claim_ready(1, assignee=console.settings.assignee, lane=console.settings.lane)
    now = time.time()
    with console.kanban.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("UPDATE tasks SET ready_at = :at WHERE id = 'timed'"), {"at": now - 3})
    claim = {"board": c.board, "task_id": c.task_id, "run_id": c.run_id, "ordinal": 0}
    assert materialize.run(console.plane, claim, now) == "added"
    offer = console.store.offer(0, owner="w", now=now)
    assert offer is not None
    console.store.accept_result({**envelope(offer, "r"), "payload": {"status": "done"}}, now=now + 0.2)
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
        page = http.get("/ui/trends").text
    for key, p50 in (("waits", "3.75"), ("runs", "0.175")):  # one value each, read within its bucket
        chart = page[page.index(f'id="chart-{key}"') :].split("</section>", 1)[0]
        peaks = dict(re.findall(r'data-series="(p\d\d)" data-total="[^"]*" data-peak="([^"]*)"', chart))
        assert set(peaks) == {"p50", "p95", "p99"} and peaks["p50"] == p50, (key, peaks)
        assert float(peaks["p50"]) < float(peaks["p95"]) < float(peaks["p99"])
        assert (
            f"p50: peak {p50} at" in chart and "total" not in chart.split("<desc", 1)[1].split("</desc>")[0]
        )


def test_a_rows_page_shows_what_the_run_was_and_printed_escaped(console: Console) -> None:
    row = console.claimed_row("printed", 1)
    offer = console.store.offer(1, owner="w1")
    assert offer is not None and offer.row_id == row
    result = {
        "status": "done",
        "exit_code": 3,
        "stdout_tail": "line one\nline <two>\n",
        "stderr_tail": "\x1b[2Jgone",
    }
    console.store.accept_result({**envelope(offer, "r1"), "payload": result})
    with httpx.Client(base_url=console.url) as http:
        http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
        page = http.get(f"/ui/rows/{row}").text
    run = page[page.index('id="h-run"') : page.index('id="h-children"')]
    assert '<dd data-field="result-exit_code">3</dd>' in run
    assert "line one\nline &lt;two&gt;\n" in run and "\\x1b[2Jgone" in run and "\x1b" not in page
    assert "{&#34;t&#34;: 1}" in run  # the payload (claimed_row's)
    assert re.search(r'data-field="times">waited \d+\.\d{3}s, ran \d+\.\d{3}s, total \d+\.\d{3}s<', run)


def test_signing_out_with_an_expired_session_is_checked_and_records_nothing(console: Console) -> None:
    from sqlalchemy import func, select
    from starlette.requests import Request
    from starlette.responses import Response

    from poolkeeper.console.auth import COOKIE, SESSION_SECONDS, ConsoleAuth
    from store.models import ConsoleSignout

    auth = ConsoleAuth(SECRET, console.store)
    scope = {"type": "http", "scheme": "http", "method": "POST", "path": "/ui/login", "headers": []}
    response = Response()
    auth.start_session(Request(scope), response, now=time.time() - SESSION_SECONDS - 60)
    expired = response.headers["set-cookie"].split(";", 1)[0].split("=", 1)[1]
    check = auth.csrf(Request({**scope, "headers": [(b"cookie", f"{COOKIE}={expired}".encode())]}))

    def signouts() -> int:
        with console.store.session(readonly=True) as s:
            return int(s.scalar(select(func.count()).select_from(ConsoleSignout)) or 0)

    with httpx.Client(base_url=console.url, cookies={COOKIE: expired}) as http:
        for form, headers in (
            ({}, {}),
            ({"csrf": "forged"}, {}),
            ({"csrf": check}, {"Origin": "http://evil.test"}),
        ):
            got = http.post("/ui/logout", data=form, headers=headers)
            assert got.status_code == 403 and "Nothing was changed" in got.text, got.text[-300:]
        assert signouts() == 0
        got = http.post("/ui/logout", data={"csrf": check})  # its own check value: the cookie goes
        assert got.status_code == 303 and got.headers["location"] == "/ui/login"
    assert signouts() == 0  # an expired session needs no sign-out kept
