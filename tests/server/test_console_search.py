"""The console's search, paged rows list and bulk actions, in process (TestClient) on both store backends.

The browser's side (typing a search, ticking all matching and confirming) is in test_console.py.
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from board import Board, TaskStatus
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.console import lists as console_lists
from poolkeeper.serve import create_app
from store import PoolStore, audit, pause
from store.models import EventKind, RowState
from tests.factories import RowFactory, WithoutSearch, row_state

SECRET = "search-test-secret-" + "0123456789abcdef" * 3
POISON = "ValueError: poisoned result: not JSON"
DASH = "\N{EN DASH}"  # the pager says "showing 1, a dash, 50 of 60"


@pytest.fixture
def http(settings: Settings, store: PoolStore, kanban: Board) -> Iterator[TestClient]:
    """The console over the ``store`` fixture's database, signed in as the operator."""
    app = create_app(dataclasses.replace(settings, server_secret=SECRET, redis_url=""))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        signed = client.post(
            "/ui/login", data={"token": tokens.operator_token(SECRET)}, follow_redirects=False
        )
        assert signed.status_code == 303
        yield client
    app.state.pool.engine.dispose()


def failing(store: PoolStore, row: int, error: str, *, quarantined: bool = True, owner: str = "") -> None:
    """The row's last error is ``error`` (and it is quarantined): as the failure path leaves it."""
    with store.session() as s:
        s.execute(
            text("UPDATE assignments SET last_error=:e, failures=3, quarantined=:q, owner=:o WHERE id=:r"),
            {"e": error, "q": quarantined, "o": owner or None, "r": row},
        )


def showing(page: str, pager: str = "rows-pager") -> str:
    found = re.search(rf'id="{pager}".*?data-field="showing">([^<]*)<', page, re.S)
    assert found, page[-2000:]
    return found.group(1)


def listed(page: str, table: str = "rows") -> list[int]:
    body = page.split(f'id="{table}"', 1)[1].split("</table>", 1)[0] if f'id="{table}"' in page else ""
    return [int(r) for r in re.findall(r'<tr data-row="(\d+)"', body)]


def csrf(client: TestClient) -> str:
    return str(client.get("/ui").text).split('name="csrf" value="', 1)[1].split('"', 1)[0]


# --- search ----------------------------------------------------------------------------------


def test_search_pages_through_rows_by_task_id_and_says_where_it_stands(
    http: TestClient, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.FINALIZED, task_id=f"job-{n:03d}") for n in range(60)]
    make_row(RowState.FINALIZED, task_id="other")
    first = http.get("/ui/search", params={"q": "JOB-", "size": "25"})
    assert first.status_code == 200
    assert showing(first.text) == f"showing 1{DASH}25 of 60"
    assert listed(first.text, "found-rows") == rows[::-1][:25]  # newest first
    assert 'id="rows-pager-next"' in first.text and 'id="rows-pager-previous"' not in first.text
    last = http.get("/ui/search", params={"q": "job-", "size": "25", "page": "3"})
    assert showing(last.text) == f"showing 51{DASH}60 of 60"
    assert listed(last.text, "found-rows") == rows[::-1][50:]
    assert 'id="rows-pager-next"' not in last.text and 'id="rows-pager-previous"' in last.text


def test_search_finds_a_row_by_id_run_owner_and_error_text_and_escapes_like(
    http: TestClient, store: PoolStore, make_row: RowFactory
) -> None:
    poisoned = make_row(RowState.RUNNING, ordinal=0, run_id=4242)
    failing(store, poisoned, POISON, owner="host-7:w0")
    other = make_row(RowState.RUNNING, ordinal=1)
    failing(store, other, "TimeoutError: 100% of the budget")
    for q, want in (
        ("poisoned result", [poisoned]),
        ("4242", [poisoned]),
        (str(other), [other]),
        ("host-7", [poisoned]),
        ("100%", [other]),
        ("0%_", []),  # % and _ are text, not wildcards
    ):
        assert listed(http.get("/ui/search", params={"q": q}).text, "found-rows") == want, q


def test_search_finds_audit_events_by_reason_among_the_newest_only(
    http: TestClient, store: PoolStore, make_row: RowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = make_row(RowState.RUNNING)
    with store.session() as s:
        audit.append(s, [audit.Event(row, EventKind.REQUEUE, "operator", detail="deploy 42 broke it")], now=1)
        audit.append(s, [audit.Event(row, EventKind.GRANT, "worker:0", detail="unrelated")] * 3, now=2)
    page = http.get("/ui/search", params={"q": "Deploy 42"}).text
    assert 'id="found-events"' in page and "deploy 42 broke it" in page and f'href="/ui/rows/{row}"' in page
    second = http.get("/ui/search", params={"q": "unrelated", "size": "25"}).text
    assert 'id="events-pager-next"' not in second  # 3 of them: one page
    many = [audit.Event(row, EventKind.GRANT, "worker:0", detail="unrelated")] * 30
    with store.session() as s:
        audit.append(s, many, now=3)
    first = http.get("/ui/search", params={"q": "unrelated", "size": "25"}).text
    assert showing(first, "events-pager") == f"showing 1{DASH}25"  # not counted: "next (more…)"
    assert 'href="?q=unrelated&amp;page=1&amp;events_page=2&amp;size=25"' in first
    later = http.get("/ui/search", params={"q": "unrelated", "size": "25", "events_page": "2"}).text
    assert showing(later, "events-pager") == f"showing 26{DASH}33" and 'id="events-pager-next"' not in later
    monkeypatch.setattr(console_lists, "AUDIT_WINDOW", 3)  # the event is far from the newest: out of reach
    assert 'id="found-events"' not in http.get("/ui/search", params={"q": "deploy 42"}).text


def test_bad_paging_is_one_sentence(http: TestClient) -> None:
    for params, words in (
        ({"q": "x", "size": "7"}, "a page holds one of 25, 50, 100, 200 rows"),
        ({"q": "x", "page": "0"}, "a page is a whole number from 1"),
        ({"q": "x", "page": "²"}, "a page is a whole number from 1"),
    ):
        got = http.get("/ui/search", params=params)
        assert got.status_code == 422 and words in got.text, got.text[-400:]
    got = http.get("/ui/rows", params={"sort": "payload"})
    assert got.status_code == 422 and "sort by one of id, state, updated, attempt" in got.text


# --- the rows list -----------------------------------------------------------------------------


def test_the_rows_list_is_paged_sorted_and_keeps_its_filters(
    http: TestClient, store: PoolStore, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.STALE, attempt=1 + n % 3, updated_at=1000.0 - n) for n in range(30)]
    for row in rows[:12]:
        failing(store, row, "boom: disk full")
    failing(store, rows[12], "something else")
    page = http.get("/ui/rows", params={"quarantined": "1", "error": "DISK", "size": "25"}).text
    assert showing(page) == f"showing 1{DASH}12 of 12" and listed(page) == rows[:12]
    by_updated = http.get("/ui/rows", params={"sort": "updated", "size": "25"}).text
    assert listed(by_updated) == rows[::-1][:25] and showing(by_updated) == f"showing 1{DASH}25 of 30"
    assert 'href="?sort=updated&amp;order=asc&amp;page=2&amp;size=25"' in by_updated
    by_attempt = http.get("/ui/rows", params={"sort": "attempt", "order": "desc", "size": "25"}).text
    assert (
        listed(by_attempt)[:10] == [r for n, r in enumerate(rows) if n % 3 == 2][::-1]
    )  # ties: id, desc too
    filtered = http.get("/ui/rows", params={"error": "disk", "state": "stale", "sort": "id", "order": "desc"})
    assert (
        'href="?state=stale&amp;error=disk&amp;sort=id&amp;order=asc"' in filtered.text
    )  # sorting keeps filters


# --- bulk actions -------------------------------------------------------------------------------


def test_a_bulk_requeue_reports_each_refused_row_and_why(
    http: TestClient, store: PoolStore, make_row: RowFactory
) -> None:
    q1, q2 = make_row(RowState.RUNNING, ordinal=0), make_row(RowState.RUNNING, ordinal=1)
    settled = make_row(RowState.STALE)
    for row in (q1, q2, settled):
        failing(store, row, POISON)
    ticked = [q1, settled, q2, 99_999]
    confirm = http.get("/ui/bulk/requeue", params={"row": [str(r) for r in ticked]})
    assert confirm.status_code == 200 and "Requeue 4 rows?" in confirm.text
    assert listed(confirm.text, "bulk-rows") == sorted(ticked) and "no such row" in confirm.text
    assert row_state(store, q1)["quarantined"]  # nothing before the POST
    digest = confirm.text.split('name="digest" value="', 1)[1].split('"', 1)[0]
    rows_field = ",".join(map(str, sorted(ticked)))
    form = {"csrf": csrf(http), "rows": rows_field, "digest": digest, "reason": "bad deploy 17"}
    done = http.post("/ui/bulk/requeue", data=form)
    assert done.status_code == 200 and "2 requeued, 2 refused" in done.text, done.text[-800:]
    results = dict(re.findall(r'<tr data-row="(\d+)" data-done="(yes|no)"', done.text))
    assert results == {str(q1): "yes", str(q2): "yes", str(settled): "no", "99999": "no"}
    assert f"row {settled} is stale: a terminal row is never retried" in done.text
    assert "99999: no such row" in done.text
    for row in (q1, q2):
        assert not row_state(store, row)["quarantined"]
        with store.session(readonly=True) as s:
            last = audit.history(s, row)[-1]
        assert (last["kind"], last["actor"]) == ("requeue", "operator")
        assert last["detail"].startswith("bad deploy 17: cleared 3 failure(s) and quarantine")
    assert row_state(store, settled)["quarantined"]


def test_all_matching_acts_only_on_the_rows_confirmed(
    http: TestClient, store: PoolStore, make_row: RowFactory
) -> None:
    matching = [make_row(RowState.RUNNING, ordinal=o) for o in range(2)]
    spared = make_row(RowState.RUNNING, ordinal=2)
    for row in matching:
        failing(store, row, POISON)
    failing(store, spared, "another error")
    query = {"all": "1", "quarantined": "1", "error": "poisoned"}
    confirm = http.get("/ui/bulk/requeue", params=query).text
    assert "2 rows match, quarantined, last error holding “poisoned”" in confirm
    digest = confirm.split('name="digest" value="', 1)[1].split('"', 1)[0]
    form = {**query, "csrf": csrf(http), "digest": digest, "reason": "fixed"}
    failing(store, spared, POISON)  # a third row matches now: the confirmation named two
    stale = http.post("/ui/bulk/requeue", data=form)
    assert stale.status_code == 409 and "changed since the confirmation" in stale.text
    assert all(row_state(store, r)["quarantined"] for r in [*matching, spared])
    failing(store, spared, "another error")
    done = http.post("/ui/bulk/requeue", data=form)
    assert done.status_code == 200 and "2 requeued, 0 refused" in done.text
    assert [row_state(store, r)["quarantined"] for r in [*matching, spared]] == [False, False, True]


def test_a_bulk_action_is_capped_and_says_so(
    http: TestClient, store: PoolStore, make_row: RowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console_lists, "BULK_CAP", 2)
    rows = [make_row(RowState.RUNNING, ordinal=o) for o in range(3)]
    for row in rows:
        failing(store, row, POISON)
    confirm = http.get("/ui/bulk/abandon", params={"all": "1", "quarantined": "1"}).text
    assert "Abandon 2 rows?" in confirm and "3 rows match" in confirm
    assert "the first 2 by id (at most 2 rows per action" in confirm
    assert listed(confirm, "bulk-rows") == rows[:2]
    reasonless = {"all": "1", "quarantined": "1", "csrf": csrf(http), "digest": "x", "reason": " "}
    got = http.post("/ui/bulk/abandon", data=reasonless)
    assert got.status_code == 409  # the digest is checked first; a blank reason is refused below
    digest = confirm.split('name="digest" value="', 1)[1].split('"', 1)[0]
    got = http.post("/ui/bulk/abandon", data={**reasonless, "digest": digest})
    assert got.status_code == 422 and "needs a reason" in got.text
    assert all(row_state(store, r)["state"] == "running" for r in rows)


def test_a_viewer_sees_no_bulk_control_and_is_refused(
    http: TestClient, store: PoolStore, make_row: RowFactory
) -> None:
    row = make_row(RowState.RUNNING)
    failing(store, row, POISON)
    operator_page = http.get("/ui/rows").text
    assert 'id="bulk-all-requeue"' in operator_page and f'id="tick-{row}"' in operator_page
    http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
    page = http.get("/ui/rows").text
    assert "bulk" not in page and 'type="checkbox"' not in page
    assert http.get("/ui/search", params={"q": "poisoned"}).status_code == 200
    for action in ("requeue", "abandon"):
        got = http.get(f"/ui/bulk/{action}", params={"row": str(row)})
        assert got.status_code == 403 and "changes nothing" in got.text
        form = {"csrf": csrf(http), "rows": str(row), "digest": "x", "reason": "r"}
        got = http.post(f"/ui/bulk/{action}", data=form)
        assert got.status_code == 403 and "changes nothing" in got.text
    assert row_state(store, row)["quarantined"]


def test_a_bulk_abandon_parks_each_run_with_the_reason_and_refuses_a_settled_row(
    http: TestClient, settings: Settings, store: PoolStore, kanban: Board, make_row: RowFactory
) -> None:
    live = []
    for n in range(2):
        kanban.add_task("b", f"task {n}", task_id=f"t{n}")
        [claim] = kanban.claim_ready(1, assignee=settings.assignee, lane=settings.lane)
        store.add_run(board="b", task_id=claim.task_id, run_id=claim.run_id, ordinal=n, payload={"t": 1})
        with store.session(readonly=True) as s:
            live.append(
                int(
                    s.execute(
                        text("SELECT id FROM assignments WHERE task_id=:t"), {"t": f"t{n}"}
                    ).scalar_one()
                )
            )
    settled = make_row(RowState.FINALIZED, task_id="done")
    ticked = {"rows": ",".join(map(str, sorted([*live, settled])))}
    confirm = http.get("/ui/bulk/abandon", params={"row": ticked["rows"].split(",")}).text
    digest = confirm.split('name="digest" value="', 1)[1].split('"', 1)[0]
    form = {**ticked, "csrf": csrf(http), "digest": digest, "reason": "poisoned payload"}
    done = http.post("/ui/bulk/abandon", data=form)
    assert done.status_code == 200 and "2 abandoned, 1 refused" in done.text, done.text[-800:]
    assert f"row {settled} is finalized: a settled row is never abandoned" in done.text
    for n, row in enumerate(live):
        assert row_state(store, row)["state"] == "stale"
        task = kanban.get_task("b", f"t{n}")
        assert task is not None and task.block_reason == "abandoned by operator: poisoned payload"
        with store.session(readonly=True) as s:
            last = audit.history(s, row)[-1]
        assert (last["kind"], last["actor"]) == ("abandon", "operator") and "poisoned payload" in last[
            "detail"
        ]
    assert row_state(store, settled)["state"] == "finalized"


# --- tasks, through the board's index --------------------------------------------------------


def found_tasks(page: str) -> list[str]:
    body = page.split('id="found-tasks"', 1)[1].split("</table>", 1)[0] if 'id="found-tasks"' in page else ""
    return re.findall(r'<tr data-task="([^"]+)"', body)


def test_search_finds_tasks_by_title_or_body_and_the_rows_that_run_them(
    http: TestClient, kanban: Board, make_row: RowFactory
) -> None:
    kanban.add_task("b", "Rotate the TLS certificates", "every proxy", task_id="t1")
    kanban.add_task("b", "Renew certs", '{"ask": "the vault for Certificates"}', task_id="t2")
    kanban.add_task("b", "Unrelated", task_id="t3")
    row = make_row(RowState.RUNNING, task_id="t2")
    make_row(RowState.RUNNING, task_id="t3", ordinal=1)
    page = http.get("/ui/search", params={"q": "CERTIFICATE"})
    assert page.status_code == 200
    assert found_tasks(page.text) == ["b/t2", "b/t1"]  # newest first
    assert 'href="/ui/board?board=b#task-t2"' in page.text
    assert listed(page.text, "found-rows") == [row]  # found by its payload: its task's body
    assert 'id="tasks-note"' not in page.text


def test_search_text_is_literal_and_bounded(http: TestClient, kanban: Board) -> None:
    kanban.add_task("b", "50% off", 'say "hi" AND NEAR(x)', task_id="t1")
    kanban.add_task("b", "500 off", task_id="t2")
    assert found_tasks(http.get("/ui/search", params={"q": "50%"}).text) == ["b/t1"]
    assert found_tasks(http.get("/ui/search", params={"q": '"hi" AND NEAR('}).text) == ["b/t1"]
    short = http.get("/ui/search", params={"q": "50"})
    assert short.status_code == 200 and found_tasks(short.text) == []
    assert "Tasks are not searched: too short: tasks are searched by 3 characters or more." in short.text
    long = http.get("/ui/search", params={"q": "x" * 201})  # past the task index: rows still answer
    assert long.status_code == 200 and found_tasks(long.text) == []
    assert "Tasks are not searched: too long: at most 200 characters." in long.text
    huge = http.get("/ui/search", params={"q": "x" * 501})  # the console's bound on any parameter
    assert huge.status_code == 422 and "the query parameter q is longer than 500 characters" in huge.text
    assert "Traceback" not in huge.text


def test_an_error_pasted_whole_finds_its_row(
    http: TestClient, store: PoolStore, make_row: RowFactory
) -> None:
    error = "ValueError: " + "a long traceback line " * 20  # 452 characters: past the task index's 200
    row = make_row(RowState.RUNNING, task_id="t-long")
    failing(store, row, error)
    page = http.get("/ui/search", params={"q": error})
    assert page.status_code == 200 and listed(page.text, "found-rows") == [row]


def test_a_board_that_cannot_search_says_so_and_rows_are_still_found(
    http: TestClient, make_row: RowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = make_row(RowState.RUNNING, task_id="job-7")
    pages = http.app.state.console.pages  # type: ignore[attr-defined]
    monkeypatch.setattr(pages, "board", WithoutSearch(pages.board))
    page = http.get("/ui/search", params={"q": "job-7"})
    assert page.status_code == 200 and listed(page.text, "found-rows") == [row]
    note = page.text.split('id="tasks-note">', 1)[1].split("<", 1)[0]
    assert note == "Tasks are not searched: this board (WithoutSearch) cannot search its tasks."


# --- bulk actions on board tasks ---------------------------------------------------------------


def blocked(kanban: Board, settings: Settings, board: str, task_id: str, why: str = "needs a human") -> None:
    """A task the pool claimed and parked (``blocked``), as a capability failure leaves it."""
    kanban.add_task(board, f"task {task_id}", task_id=task_id)
    [claim] = kanban.claim_ready(1, assignee=settings.assignee, lane=settings.lane)
    assert claim.task_id == task_id and kanban.block_task(board, task_id, why, "capability", claim.run_id)


def digest_of(page: str) -> str:
    return page.split('name="digest" value="', 1)[1].split('"', 1)[0]


def tasks_listed(page: str, table: str = "bulk-tasks") -> list[str]:
    body = page.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<tr data-task="([^"]+)"', body)


def task_results(page: str) -> dict[str, str]:
    return dict(re.findall(r'<tr data-task="([^"]+)" data-done="(yes|no)"', page))


def test_all_blocked_tasks_of_a_board_are_unblocked_in_one_confirmed_action(
    http: TestClient, settings: Settings, kanban: Board
) -> None:
    # Given twelve tasks parked by one cause on board b, one ready there, and one parked on board c
    parked = [f"p{n:02d}" for n in range(12)]
    for task_id in parked:
        blocked(kanban, settings, "b", task_id, "the model server was down")
    blocked(kanban, settings, "c", "elsewhere")
    kanban.add_task("b", "waiting", task_id="ready1")
    board_page = http.get("/ui/board", params={"board": "b", "status": "blocked"}).text
    assert 'id="bulk-all-unblock"' in board_page and 'id="tick-p00"' in board_page
    assert 'data-task="ready1"' not in board_page  # the filter shows the blocked ones only
    # When the operator confirms "unblock all blocked" once, with a reason
    query = {"board": "b", "all": "1", "status": "blocked"}
    confirm = http.get("/ui/bulk/tasks/unblock", params=query)
    assert confirm.status_code == 200 and "Unblock 12 tasks of board b?" in confirm.text
    assert "12 tasks match on board b, status blocked" in confirm.text
    assert tasks_listed(confirm.text) == parked
    assert all(t.status.value == "blocked" for t in kanban.list_tasks("b") if t.id != "ready1")  # not yet
    form = {**query, "csrf": csrf(http), "digest": digest_of(confirm.text), "reason": "model server back"}
    done = http.post("/ui/bulk/tasks/unblock", data=form)
    # Then each of the twelve is ready again, each reported; the other board's is untouched
    assert done.status_code == 200 and "12 unblocked, 0 refused" in done.text, done.text[-800:]
    assert task_results(done.text) == dict.fromkeys(parked, "yes")
    assert {t.id for t in kanban.list_tasks("b", TaskStatus.READY)} == {*parked, "ready1"}
    assert kanban.get_task("c", "elsewhere").status is TaskStatus.BLOCKED  # type: ignore[union-attr]
    # and the same confirmation again names nothing it named: refused, nothing changed
    again = http.post("/ui/bulk/tasks/unblock", data=form)
    assert again.status_code == 409 and "tasks this names changed since the confirmation" in again.text


def test_ticked_tasks_are_acted_on_each_and_every_refusal_says_why(
    http: TestClient, settings: Settings, store: PoolStore, kanban: Board
) -> None:
    # Given a parked task, a ready one, one that is done, a running one with its pool row, and a typo
    blocked(kanban, settings, "b", "parked")
    kanban.add_task("b", "in flight", task_id="live")
    [claim] = kanban.claim_ready(1, assignee=settings.assignee, lane=settings.lane)
    kanban.add_task("b", "waiting", task_id="waiting")
    kanban.add_task("b", "finished", task_id="finished")
    kanban.cancel_task("b", "finished")
    store.add_run(board="b", task_id="live", run_id=claim.run_id, ordinal=0, payload={"t": 1})
    with store.session(readonly=True) as s:
        row = int(s.execute(text("SELECT id FROM assignments WHERE task_id='live'")).scalar_one())
    failing(store, row, POISON)
    ticked = ["parked", "waiting", "finished", "live", "no-such"]
    # When they are unblocked, each refusal is its task's own
    confirm = http.get("/ui/bulk/tasks/unblock", params={"board": "b", "task": ticked}).text
    assert "5 tasks ticked" in confirm and tasks_listed(confirm) == sorted(ticked)
    assert "no such task" in confirm
    fields = {"board": "b", "tasks": ",".join(sorted(ticked)), "csrf": csrf(http), "reason": "retry"}
    done = http.post("/ui/bulk/tasks/unblock", data={**fields, "digest": digest_of(confirm)}).text
    assert "1 unblocked, 4 refused" in done
    assert task_results(done) == {
        "finished": "no",
        "live": "no",
        "no-such": "no",
        "parked": "yes",
        "waiting": "no",
    }
    assert "b/no-such: no such task" in done
    # and requeued: only the running task's row is, the others are refused with the board's reason
    confirm = http.get("/ui/bulk/tasks/requeue", params={"board": "b", "task": ticked}).text
    done = http.post("/ui/bulk/tasks/requeue", data={**fields, "digest": digest_of(confirm)}).text
    assert task_results(done)["live"] == "yes" and "1 requeued, 4 refused" in done
    assert "b/finished is not requeued: it is done: the board has no move out of done" in done
    assert "b/waiting is not requeued: it is ready already" in done
    assert not row_state(store, row)["quarantined"]
    with store.session(readonly=True) as s:
        last = audit.history(s, row)[-1]
    assert (last["kind"], last["actor"]) == ("requeue", "operator") and last["detail"].startswith("retry: ")
    # and cancelled: the running one's row turns stale with the reason on its trail; done stays done
    confirm = http.get("/ui/bulk/tasks/cancel", params={"board": "b", "task": ["live", "finished"]}).text
    fields = {**fields, "tasks": "finished,live", "reason": "not wanted any more"}
    done = http.post("/ui/bulk/tasks/cancel", data={**fields, "digest": digest_of(confirm)}).text
    assert task_results(done) == {"finished": "no", "live": "yes"}
    assert row_state(store, row)["state"] == "stale"
    with store.session(readonly=True) as s:
        last = audit.history(s, row)[-1]
    assert last["kind"] == EventKind.CANCEL and "not wanted any more" in last["detail"]


def test_a_bulk_on_tasks_is_capped_needs_a_reason_and_refuses_bad_names(
    http: TestClient, settings: Settings, kanban: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console_lists, "BULK_CAP", 2)
    for n in range(3):
        blocked(kanban, settings, "b", f"t{n}")
    query = {"board": "b", "all": "1", "status": "blocked"}
    confirm = http.get("/ui/bulk/tasks/cancel", params=query).text
    assert "Cancel 2 tasks of board b?" in confirm and "more than 2 tasks match" in confirm
    assert "the first 2 by age (at most 2 tasks per action" in confirm and tasks_listed(confirm) == [
        "t0",
        "t1",
    ]
    reasonless = {**query, "csrf": csrf(http), "digest": digest_of(confirm), "reason": " "}
    got = http.post("/ui/bulk/tasks/cancel", data=reasonless)
    assert got.status_code == 422 and "needs a reason" in got.text
    assert all(t.status is TaskStatus.BLOCKED for t in kanban.list_tasks("b"))
    for params, why in (
        ({"board": "b", "task": "a b"}, "task"),
        ({"board": "", "task": "t0"}, "board"),
        ({"board": "b"}, "no task selected"),
        ({"board": "b", "all": "1", "status": "stuck"}, "unknown status 'stuck'; one of ready, running"),
    ):
        got = http.get("/ui/bulk/tasks/unblock", params=params)
        assert got.status_code == 422 and why in html.unescape(got.text), (params, got.text[-500:])
    assert http.get("/ui/bulk/tasks/abandon", params={"board": "b", "task": "t0"}).status_code == 404


def test_a_viewer_sees_no_bulk_or_add_control_on_a_board_and_is_refused(
    http: TestClient, settings: Settings, kanban: Board
) -> None:
    blocked(kanban, settings, "b", "t1")
    http.post("/ui/login", data={"token": tokens.viewer_token(SECRET)})
    page = http.get("/ui/board", params={"board": "b"}).text
    assert "bulk" not in page and 'type="checkbox"' not in page and 'id="add-form"' not in page
    assert 'id="board-pause-form"' not in page
    for action in ("unblock", "requeue", "cancel"):
        got = http.get(f"/ui/bulk/tasks/{action}", params={"board": "b", "task": "t1"})
        assert got.status_code == 403 and "changes nothing" in got.text
        form = {"csrf": csrf(http), "board": "b", "tasks": "t1", "digest": "x", "reason": "r"}
        got = http.post(f"/ui/bulk/tasks/{action}", data=form)
        assert got.status_code == 403 and "changes nothing" in got.text
    got = http.post("/ui/board/tasks", data={"csrf": csrf(http), "board": "b", "title": "sneaky"})
    assert got.status_code == 403 and [t.id for t in kanban.list_tasks("b")] == ["t1"]
    assert kanban.get_task("b", "t1").status is TaskStatus.BLOCKED  # type: ignore[union-attr]


# --- adding a task, pausing a board ------------------------------------------------------------


def test_a_task_is_added_from_the_board_page_and_bad_input_is_refused_in_one_line(
    http: TestClient, kanban: Board
) -> None:
    form = {"csrf": csrf(http), "board": "b", "title": "resize the images", "body": '{"size": 512}'}
    got = http.post("/ui/board/tasks", data=form, follow_redirects=False)
    assert got.status_code == 303 and got.headers["location"] == "/ui/board?board=b&done=add"
    [task] = kanban.list_tasks("b")
    assert (task.title, task.body, task.status) == ("resize the images", '{"size": 512}', TaskStatus.READY)
    assert "Added: the task is ready" in http.get(got.headers["location"]).text
    for changed, why in (
        ({"title": "  "}, "title: must not be empty"),
        ({"body": "{not json"}, "body: not JSON"),
        ({"board": "a b"}, "board"),
        ({"title": "x" * 4001}, "the form field title is longer than 4000 characters"),
    ):
        got = http.post("/ui/board/tasks", data={**form, **changed})
        assert got.status_code == 422 and why in got.text and "Nothing was changed" in got.text, got.text[
            -600:
        ]
        assert "Traceback" not in got.text
    assert len(kanban.list_tasks()) == 1


def test_a_board_is_paused_and_resumed_from_its_page_and_named_on_the_dispatch_page(
    http: TestClient, store: PoolStore, kanban: Board
) -> None:
    kanban.add_task("b", "a task", task_id="t1")
    form = {"csrf": csrf(http), "board": "b", "reason": "moving b"}
    got = http.post("/ui/dispatch/pause", data=form, follow_redirects=False)
    assert got.status_code == 303 and got.headers["location"] == "/ui/board?board=b&done=pause-board"
    page = http.get(got.headers["location"]).text
    assert "Paused this board alone" in page and "Dispatch of board b is paused</strong> by operator" in page
    assert 'id="board-resume"' in page
    with store.session(readonly=True) as s:
        assert list(pause.boards(s)) == ["b"] and not pause.read(s).paused
    dispatch = http.get("/ui/dispatch").text
    assert 'id="paused-board-b"' in dispatch and "moving b" in dispatch
    missing = http.post("/ui/dispatch/pause", data={**form, "board": "nosuch"})
    assert missing.status_code == 404 and "nosuch: no such board" in missing.text
    got = http.post("/ui/dispatch/resume", data={"csrf": form["csrf"], "board": "b"}, follow_redirects=False)
    assert got.headers["location"] == "/ui/board?board=b&done=resume-board"
    with store.session(readonly=True) as s:
        assert pause.boards(s) == {}
        assert [(e["kind"], e["detail"]) for e in audit.history(s, audit.POOL)] == [
            ("pause", "board b: moving b"),
            ("resume", "board b"),
        ]
