"""``poolctl serve`` as a real uvicorn process: the protocol round trip, auth, limits, error classes, schema.

Each test starts the server as a subprocess on a free loopback port (as an
operator would) and talks to it over HTTP; the store is read back directly.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from core.errors import DeliveryConflict, InvalidInput, LineageTooDeep, NotFound, StaleHolder
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import ServeProc, free_port, wait_for
from poolkeeper.workerhost.client import Grant, PoolClient
from store import PoolStore, audit, pause
from tests.factories import row_state

SECRET = "test-secret-" + "0123456789abcdef" * 3


@dataclass
class Served:
    proc: ServeProc
    store: PoolStore

    @property
    def url(self) -> str:
        return self.proc.url

    def client(self, ordinal: int | None = 0, **options: Any) -> PoolClient:
        token = tokens.operator_token(SECRET) if ordinal is None else tokens.ordinal_token(SECRET, ordinal)
        return PoolClient(self.url, token, **options)

    def post(
        self, path: str, body: Any, token: str | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        sent = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(f"{self.url}{path}", json=body, headers={**sent, **(headers or {})}, timeout=30)


def start(settings: Settings, tmp: Path, store: PoolStore, **options: Any) -> Iterator[Served]:
    proc = ServeProc(settings.env(), tmp, **options)
    try:
        yield Served(proc.wait_ready(), store)
    finally:
        proc.stop()


@pytest.fixture
def served(settings: Settings, store: PoolStore, tmp_path: Path) -> Iterator[Served]:
    """A server with a secret over the store of the backend under test (SQLite, then PostgreSQL)."""
    yield from start(settings, tmp_path, store, secret=SECRET)


@pytest.fixture
def sqlite_settings(tmp_path: Path) -> Settings:
    url = f"sqlite:///{tmp_path}/pool.db"
    return Settings(database_url=url, board_url=url, pool_size=3, lease_seconds=30)


@pytest.fixture
def sqlite_store(sqlite_settings: Settings) -> Iterator[PoolStore]:
    st = PoolStore.from_settings(sqlite_settings)
    st.migrate()
    yield st
    st.engine.dispose()


@pytest.fixture
def served_sqlite(sqlite_settings: Settings, sqlite_store: PoolStore, tmp_path: Path) -> Iterator[Served]:
    yield from start(
        replace(sqlite_settings, body_timeout_seconds=1.0), tmp_path, sqlite_store, secret=SECRET
    )


def given_assigned(store: PoolStore, ordinal: int = 0, task_id: str = "t1") -> int:
    store.add_run(board="b", task_id=task_id, run_id=1, ordinal=ordinal, payload={"title": task_id})
    with store.session(readonly=True) as s:
        found = s.execute(text("SELECT id FROM assignments WHERE task_id = :t"), {"t": task_id}).scalar_one()
    return int(found)


def taken(served: Served, ordinal: int = 0, task_id: str = "t1") -> tuple[int, Grant]:
    row = given_assigned(served.store, ordinal, task_id)
    with served.client(ordinal) as client:
        grant = client.offer(ordinal, owner=f"w{ordinal}")
    assert grant is not None
    return row, grant


# --- the protocol -------------------------------------------------------------------


def test_a_worker_takes_beats_and_delivers_over_http(served: Served) -> None:
    row = given_assigned(served.store)
    with served.client(0) as client:
        grant = client.offer(0, owner="w0")
        assert grant is not None and (grant.board, grant.task_id, grant.attempt) == ("b", "t1", 1)
        assert client.offer(0, owner="w0") == grant  # the same owner asking again: the same grant
        assert grant.payload == {"title": "t1"} and grant.lease_seconds == 30 and grant.protocol_version == 1
        assert client.heartbeat(grant, delivery_id="hb-1") == "applied"
        assert client.heartbeat(grant, delivery_id="hb-1") == "duplicate"  # a retried delivery
        assert client.deliver(grant, {"status": "done", "answer": 42}) == "applied"
    state = row_state(served.store, row)
    assert state["state"] == "result" and json.loads(state["result"]) == {"status": "done", "answer": 42}


def test_a_released_run_is_reoffered_at_once_with_the_next_attempt(served: Served) -> None:
    row, grant = taken(served)
    with served.client(0) as client:
        assert client.release(grant, delivery_id="rel-1") == "reoffered"
        assert client.release(grant, delivery_id="rel-1") == "duplicate"
        again = client.offer(0, owner="w0-restarted")
    assert again is not None and again.attempt == 2 and again.fence > grant.fence
    assert row_state(served.store, row)["owner"] == "w0-restarted"


def test_a_restarted_worker_fences_out_its_old_self(served: Served) -> None:
    _, old = taken(served)
    with served.client(0) as client:
        new = client.offer(0, owner="w0-new")
        assert new is not None and new.attempt == old.attempt and new.fence > old.fence
        with pytest.raises(StaleHolder, match="fence"):
            client.heartbeat(old)
        assert client.heartbeat(new) == "applied"


def test_a_heartbeat_reads_the_same_in_the_heartbeat_lane_and_on_the_route(served: Served) -> None:
    """The lane (``lane.HeartbeatLane``) takes a plain JSON heartbeat; any other goes to the route."""
    _, grant = taken(served)
    token = tokens.ordinal_token(SECRET, 0)
    charset = {"Content-Type": "application/json; charset=utf-8"}  # not the lane's: the route answers
    answers: list[list[tuple[int, Any, str, bytes]]] = []
    for headers in ({}, charset):
        applied = served.post("/v1/heartbeat", grant.envelope(f"hb-{len(answers)}"), token, headers)
        replay = served.post("/v1/heartbeat", grant.envelope("hb-0"), token, headers)
        stale = served.post("/v1/heartbeat", grant.envelope("hb-9", fence=grant.fence + 1), token, headers)
        other = served.post("/v1/heartbeat", grant.envelope("hb-8"), tokens.ordinal_token(SECRET, 1), headers)
        answers.append(
            [
                (r.status_code, r.json(), r.headers["content-type"], r.content)
                for r in (applied, replay, stale, other)
            ]
        )
    assert answers[0] == answers[1]  # the lane's answers prebuilt: byte for byte the route's
    assert [status for status, *_ in answers[0]] == [200, 200, 409, 403]
    assert answers[0][1][1] == {"outcome": "duplicate"} and answers[0][2][1]["error"] == "StaleHolder"


def test_a_heartbeat_repeating_a_header_the_lane_reads_is_answered_by_the_route(served: Served) -> None:
    """The route reads the first of a repeated header; the lane must not read another one."""
    _, grant = taken(served)
    mine, other = tokens.ordinal_token(SECRET, 0), tokens.ordinal_token(SECRET, 1)
    body = json.dumps(grant.envelope("hb-twice")).encode()
    bearer, json_type = ("Authorization", f"Bearer {mine}"), ("Content-Type", "application/json")
    cases = {  # the first header is the one the route reads, so each is refused
        "another ordinal's token first": (
            [("Authorization", f"Bearer {other}"), bearer, json_type],
            403,
        ),
        "not a bearer token first": (
            [("Authorization", "Basic eA=="), ("Authorization", f"Bearer {mine}")],
            401,
        ),
        "not JSON first": (
            [
                ("Authorization", f"Bearer {mine}"),
                ("Content-Type", "text/plain"),
                ("Content-Type", "application/json"),
            ],
            422,
        ),
    }
    for case, (headers, status) in cases.items():
        got = httpx.post(f"{served.url}/v1/heartbeat", content=body, headers=headers, timeout=30)
        assert got.status_code == status, (case, got.status_code, got.text)
    with served.store.session(readonly=True) as s:
        assert s.scalar(text("SELECT count(*) FROM deliveries WHERE delivery_id = 'hb-twice'")) == 0


def test_a_body_repeating_a_key_is_refused_whatever_header_comes_after(served: Served) -> None:
    """The route would keep the last of a repeated key: a body that does not mean one thing is 422."""
    _, grant = taken(served)
    envelope = json.dumps(grant.envelope("hb-repeated"))
    body = envelope[:-1] + ', "delivery_id": "hb-other"}'
    bearer = ("Authorization", f"Bearer {tokens.ordinal_token(SECRET, 0)}")
    for headers in (
        [bearer, ("Content-Type", "application/json")],
        [bearer, ("Content-Type", "application/json"), ("Content-Type", "text/plain")],
    ):
        got = httpx.post(f"{served.url}/v1/heartbeat", content=body, headers=headers, timeout=30)
        assert got.status_code == 422 and "the key delivery_id appears twice" in got.text, got.text
    with served.store.session(readonly=True) as s:
        assert s.scalar(text("SELECT count(*) FROM deliveries WHERE delivery_id LIKE 'hb-%'")) == 0


# --- child executions -----------------------------------------------------------------


def child_rows(store: PoolStore) -> dict[str, dict[str, Any]]:
    with store.session(readonly=True) as s:
        found = s.execute(text("SELECT * FROM child_executions ORDER BY id")).mappings()
        return {r["id"]: dict(r) for r in found}


def test_a_holder_registers_children_that_beat_and_deliver_over_http(served: Served) -> None:
    row, grant = taken(served)
    with served.client(0) as client:
        child = client.register_child(grant.ref(), key="step-1")
        assert (child.row_id, child.parent_id, child.depth, child.epoch) == (
            row,
            f"run:{row}",
            1,
            grant.fence,
        )
        assert client.register_child(grant.ref(), key="step-1") == child  # a retry: the same child
        nested = client.register_child(grant.ref(), under=child.child_id)
        assert nested.parent_id == child.child_id and nested.depth == 2
        assert client.child_heartbeat(nested, {"progress": 1}) == "applied"
        assert client.child_heartbeat(child) == "applied"
        assert client.child_result(child, {"answer": 1}) == "applied"
        assert client.child_result(child, {"answer": 1}) == "duplicate"
        with pytest.raises(DeliveryConflict):
            client.child_result(child, {"answer": 2})
        with pytest.raises(StaleHolder, match=r"^status: .* is terminal \(retired\)"):  # retired with it
            client.child_heartbeat(nested)
        lost = client.register_child(grant.ref())
        assert client.child_vanished(grant.ref(), lost.child_id) == 1
    got = child_rows(served.store)
    assert {c["status"] for c in got.values()} == {"terminal", "unknown"} and len(got) == 3


def test_another_ordinals_or_the_operators_token_cannot_act_for_a_child(served: Served) -> None:
    row, grant = taken(served)
    with served.client(0) as client:
        child = client.register_child(grant.ref())
    before = (row_state(served.store, row), child_rows(served.store))
    for token in (tokens.ordinal_token(SECRET, 1), tokens.operator_token(SECRET)):
        for path, body in (
            ("/v1/children", grant.ref().body()),
            ("/v1/children/heartbeat", {"child_id": child.child_id, "epoch": child.epoch}),
            ("/v1/children/result", {"child_id": child.child_id, "epoch": child.epoch, "payload": {}}),
            ("/v1/children/vanished", grant.ref().body(child_id=child.child_id)),
        ):
            answer = served.post(path, body, token)
            assert answer.status_code == 403 and answer.json()["error"] == "Forbidden", (path, answer.text)
    assert (row_state(served.store, row), child_rows(served.store)) == before


def test_child_refusals_name_the_field_and_change_nothing(served: Served) -> None:
    row, grant = taken(served)
    token = tokens.ordinal_token(SECRET, 0)
    with served.client(0) as client:
        child = client.register_child(grant.ref())
        with pytest.raises(StaleHolder, match=r"^fence: "):
            client.register_child(replace(grant, fence=grant.fence + 1).ref())
        with pytest.raises(StaleHolder, match=r"^epoch: "):
            client.child_heartbeat(replace(child, epoch=child.epoch + 1))
        with pytest.raises(NotFound, match=r"^child_id: no child execution"):
            client.child_heartbeat(replace(child, child_id=f"run:{row}/child:{'0' * 12}"))
        with pytest.raises(NotFound, match=r"no such row"):
            client.child_heartbeat(replace(child, child_id=f"run:{row + 50}/child:{'0' * 12}"))
        with pytest.raises(InvalidInput, match="credential"):
            client.child_result(child, {"password": "x"})
    before = child_rows(served.store)
    for path, body, field in (
        ("/v1/children/heartbeat", {"child_id": "run:1/child:../x", "epoch": 1}, "child_id"),
        ("/v1/children/heartbeat", {"child_id": "run:9999999999/child:" + "0" * 12, "epoch": 1}, "child_id"),
        ("/v1/children", grant.ref().body(key="a b"), "key"),
        ("/v1/children", grant.ref().body(under="run:1"), "under"),
        ("/v1/children/result", {"child_id": child.child_id, "epoch": child.epoch}, "payload"),
    ):
        answer = served.post(path, body, token)
        assert answer.status_code == 422, (body, answer.text)
        assert field in json.dumps(answer.json()["detail"]), (body, answer.text)
    assert child_rows(served.store) == before


def test_past_the_depth_cap_registering_is_a_409_naming_under(
    sqlite_settings: Settings, sqlite_store: PoolStore, tmp_path: Path
) -> None:
    given_assigned(sqlite_store)
    for served in start(replace(sqlite_settings, lineage_max_depth=2), tmp_path, sqlite_store, secret=SECRET):
        with served.client(0) as client:
            grant = client.offer(0, owner="w0")
            assert grant is not None
            top = client.register_child(grant.ref())
            deepest = client.register_child(grant.ref(), under=top.child_id)
            before = child_rows(sqlite_store)
            answer = served.post(
                "/v1/children", grant.ref().body(under=deepest.child_id), tokens.ordinal_token(SECRET, 0)
            )
            assert answer.status_code == 409 and answer.json()["error"] == "LineageTooDeep"
            assert answer.json()["detail"].startswith("under: a child of ")
            with pytest.raises(LineageTooDeep, match="past the cap of 2"):
                client.register_child(grant.ref(), under=deepest.child_id)
        assert child_rows(sqlite_store) == before


# --- child tokens: one grant's children, nothing else ----------------------------------


def refusal(answer: httpx.Response, status: int, error: str) -> str:
    """The refusal's detail, checked to be ``status``/``error`` and one line."""
    assert answer.status_code == status and answer.json()["error"] == error, answer.text
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and detail and "\n" not in detail, detail
    return detail


def child_calls(grant: Grant, child_id: str, fence: int) -> list[tuple[str, dict[str, Any]]]:
    """Each /v1/children call for ``child_id`` under ``grant``'s holder, naming ``fence``."""
    held = replace(grant, fence=fence).ref()
    return [
        ("/v1/children", held.body()),
        ("/v1/children/heartbeat", {"child_id": child_id, "epoch": fence}),
        ("/v1/children/result", {"child_id": child_id, "epoch": fence, "payload": {}}),
        ("/v1/children/vanished", held.body(child_id=child_id)),
    ]


def test_a_grant_carries_a_child_token_that_acts_for_its_children(served: Served) -> None:
    row, grant = taken(served)
    assert grant.child_token == tokens.child_token(SECRET, row, grant.fence)
    assert grant.child_token not in repr(grant)  # never logged with the grant
    with PoolClient(served.url, grant.child_token) as child_client:
        child = child_client.register_child(grant.ref(), key="k")
        nested = child_client.register_child(grant.ref(), under=child.child_id)
        assert child_client.child_heartbeat(child, {"step": 1}) == "applied"
        assert child_client.child_result(nested, {"out": 1}) == "applied"
        assert child_client.child_vanished(grant.ref(), child.child_id) == 1
    got = child_rows(served.store)
    assert {c["id"]: c["status"] for c in got.values()} == {
        child.child_id: "unknown",
        nested.child_id: "terminal",
    }


def test_a_child_token_cannot_offer_beat_release_deliver_or_read_status(served: Served) -> None:
    row, grant = taken(served)
    token = grant.child_token
    before = row_state(served.store, row)
    for path, body in (
        ("/v1/offer", {"ordinal": 0, "owner": "w0"}),
        ("/v1/offer", {"ordinal": 0, "owner": "thief"}),
        ("/v1/heartbeat", grant.envelope()),
        ("/v1/release", grant.envelope()),
        ("/v1/result", grant.envelope(payload={"status": "done"})),
    ):
        detail = refusal(served.post(path, body, token), 403, "Forbidden")
        assert detail == (
            f"a child token (of the grant of row {row} under fence {grant.fence}) acts only on"
            " /v1/children for that grant, nothing else"
        ), path
    status = httpx.get(f"{served.url}/v1/status", headers={"Authorization": f"Bearer {token}"})
    assert refusal(status, 403, "Forbidden").startswith("a child token (of the grant of row ")
    assert row_state(served.store, row) == before  # nothing changed


def test_a_child_token_of_another_row_or_fence_or_a_forged_one_is_refused(served: Served) -> None:
    row, grant = taken(served)
    other_row, other = taken(served, ordinal=1, task_id="t2")
    with served.client(0) as client:
        child = client.register_child(grant.ref())
    before = (row_state(served.store, row), child_rows(served.store))
    wrong = {
        "another row": other.child_token,
        "another fence": tokens.child_token(SECRET, row, grant.fence + 1),
        "an older fence": tokens.child_token(SECRET, row, grant.fence - 1) if grant.fence > 1 else None,
    }
    for why, token in wrong.items():
        if token is None:
            continue
        for path, body in child_calls(grant, child.child_id, grant.fence):
            detail = refusal(served.post(path, body, token), 403, "Forbidden")
            assert detail.startswith("a child token of the grant of row ") and detail.endswith(
                f"cannot act for the grant of row {row} under fence {grant.fence}"
            ), (why, path, detail)
    forged = {
        "unsigned": f"c{row}.{grant.fence}." + "0" * 64,
        "another secret": tokens.child_token("another-secret-" + "x" * 32, row, grant.fence),
        "retargeted": f"c{other_row}.{other.fence}." + str(grant.child_token).rsplit(".", 1)[1],
        "leading zero": f"c0{row}.{grant.fence}." + str(grant.child_token).rsplit(".", 1)[1],
        "truncated": str(grant.child_token)[:-1],
        "upper case": str(grant.child_token).upper(),
    }
    for why, token in forged.items():
        for path, body in child_calls(grant, child.child_id, grant.fence):
            detail = refusal(served.post(path, body, token), 401, "Unauthenticated")
            assert detail == "the bearer token is not one this server issued", (why, path)
    assert (row_state(served.store, row), child_rows(served.store)) == before


def test_a_child_token_stops_writing_once_its_grant_is_regranted(served: Served) -> None:
    row, old = taken(served)
    with PoolClient(served.url, old.child_token) as stale_client:
        child = stale_client.register_child(old.ref())
        assert stale_client.child_heartbeat(child) == "applied"
        with served.client(0) as client:
            new = client.offer(0, owner="w0-restarted")  # a restart: the same run under a new fence
        assert new is not None and new.fence > old.fence and new.child_token != old.child_token
        before = (row_state(served.store, row), child_rows(served.store))
        for path, body in child_calls(old, child.child_id, old.fence):  # the old grant: stale
            assert "stale" in refusal(served.post(path, body, old.child_token), 409, "StaleHolder"), path
        for path, body in child_calls(new, child.child_id, new.fence):  # the new grant: not its token
            refusal(served.post(path, body, old.child_token), 403, "Forbidden")
        assert (row_state(served.store, row), child_rows(served.store)) == before
    with PoolClient(served.url, new.child_token) as fresh:
        assert fresh.register_child(new.ref()).epoch == new.fence


# --- auth ---------------------------------------------------------------------------


def test_no_or_foreign_token_is_401(served: Served) -> None:
    given_assigned(served.store)
    body = {"ordinal": 0, "owner": "w"}
    for token in (None, "o0." + "0" * 64, tokens.ordinal_token("another-secret-" + "x" * 32, 0), "garbage"):
        answer = served.post("/v1/offer", body, token)
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"] == "Unauthenticated" and answer.headers["www-authenticate"] == "Bearer"
    assert served.post("/v1/offer", body, headers={"Authorization": "Basic dTpw"}).status_code == 401


def test_a_token_acts_only_for_its_own_ordinal(served: Served) -> None:
    row, grant = taken(served)
    before = row_state(served.store, row)
    other, operator = tokens.ordinal_token(SECRET, 1), tokens.operator_token(SECRET)
    for token in (other, operator, tokens.viewer_token(SECRET)):
        for path, body in (
            ("/v1/offer", {"ordinal": 0, "owner": "thief"}),
            ("/v1/heartbeat", grant.envelope()),
            ("/v1/release", grant.envelope()),
            ("/v1/result", grant.envelope(payload={"status": "done"})),
        ):
            answer = served.post(path, body, token)
            assert answer.status_code == 403, (path, answer.text)
            assert answer.json()["error"] == "Forbidden"
    assert row_state(served.store, row) == before  # nothing changed


def test_the_operator_token_guards_admin_reads(served: Served) -> None:
    taken(served)
    worker = httpx.get(
        f"{served.url}/v1/status", headers={"Authorization": f"Bearer {tokens.ordinal_token(SECRET, 0)}"}
    )
    assert worker.status_code == 403
    for token in (tokens.operator_token(SECRET), tokens.viewer_token(SECRET)):  # a viewer reads it too
        op = httpx.get(f"{served.url}/v1/status", headers={"Authorization": f"Bearer {token}"})
        assert op.status_code == 200 and op.json()["rows"]["running"] == 1, op.text
        assert op.json()["free_ordinals"] == [1, 2] and op.json()["dispatch_paused"] is False
        assert op.json()["paused_boards"] == []
    with served.store.session() as s:
        pause.pause(s, "move b", now=time.time(), actor=audit.OPERATOR, board="b")
    op = httpx.get(
        f"{served.url}/v1/status", headers={"Authorization": f"Bearer {tokens.viewer_token(SECRET)}"}
    )
    assert (op.json()["dispatch_paused"], op.json()["paused_boards"]) == (False, ["b"])
    forged = httpx.get(f"{served.url}/v1/status", headers={"Authorization": "Bearer view." + "0" * 64})
    assert forged.status_code == 401


def test_a_viewer_token_cannot_act_for_a_worker_or_its_children(served: Served) -> None:
    row, grant = taken(served)
    with served.client(0) as client:
        child = client.register_child(grant.ref())
    before = (row_state(served.store, row), child_rows(served.store))
    viewer = tokens.viewer_token(SECRET)
    for path, body in child_calls(grant, child.child_id, grant.fence):
        refusal(served.post(path, body, viewer), 403, "Forbidden")
    assert (row_state(served.store, row), child_rows(served.store)) == before


def poolctl(
    tmp: Path, *args: str, env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("POOL_SERVER_SECRET")}
    return subprocess.run(
        [sys.executable, "-c", "from poolkeeper.cli import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env={**base, "POOL_DATABASE_URL": f"sqlite:///{tmp}/pool.db", **env},
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "POOL_SERVER_SECRET (or POOL_SERVER_SECRET_FILE) is not set"),
        (("--local-only", "--host", "0.0.0.0"), {}, "--local-only: 0.0.0.0 is not a loopback address"),
        ((), {"POOL_SERVER_SECRET": "short"}, "POOL_SERVER_SECRET: must be at least 32 characters"),
    ],
)
def test_serve_refuses_to_start_without_auth_in_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    done = poolctl(tmp_path, "serve", "--port", str(free_port()), *args, env=env)
    assert done.returncode == 2  # a setting to fix (docs/design.md section 6)
    assert done.stderr.strip().splitlines() == [f"poolctl: {done.stderr.strip().removeprefix('poolctl: ')}"]
    assert message in done.stderr and "short" not in done.stderr  # a secret is never echoed


def test_tokens_come_from_the_secret_file(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    env = {"POOL_SERVER_SECRET_FILE": str(tmp_path / "secret")}
    done = poolctl(tmp_path, "token", "--ordinal", "2", env=env)
    assert done.returncode == 0 and done.stdout.strip() == tokens.ordinal_token(SECRET, 2)
    assert poolctl(tmp_path, "token", "--operator", env=env).stdout.strip() == tokens.operator_token(SECRET)
    viewer = poolctl(tmp_path, "token", "--viewer", env=env).stdout.strip()
    assert viewer == tokens.viewer_token(SECRET) and viewer.startswith("view.")
    assert tokens.verify(SECRET, viewer) == tokens.VIEWER
    both = poolctl(tmp_path, "token", "--operator", "--viewer", env=env)
    assert both.returncode == 2
    assert "exactly one of --ordinal N, --operator, --viewer and --board" in both.stderr
    assert poolctl(tmp_path, "token", "--ordinal", "3", env=env).returncode == 2  # POOL_SIZE is 3
    assert poolctl(tmp_path, "token", "--ordinal", "0", env={}).returncode == 2


def test_local_only_serves_loopback_without_tokens(
    sqlite_settings: Settings, sqlite_store: PoolStore, tmp_path: Path
) -> None:
    given_assigned(sqlite_store)
    for served in start(sqlite_settings, tmp_path, sqlite_store, local_only=True):
        with PoolClient(served.url) as client:
            grant = client.offer(0, owner="local")
            assert grant is not None and client.heartbeat(grant) == "applied"
        assert "auth: none (--local-only)" in served.proc.text()


def test_local_only_answers_only_requests_addressed_to_loopback(
    sqlite_settings: Settings, sqlite_store: PoolStore, tmp_path: Path
) -> None:
    """No token is asked, so a page elsewhere must not reach it by rebinding its name to 127.0.0.1."""
    row = given_assigned(sqlite_store)
    for served in start(sqlite_settings, tmp_path, sqlite_store, local_only=True):
        port = served.proc.port
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io", "10.0.0.1", "[::2]"):
            for method, path in (
                ("GET", "/ui"),
                ("GET", "/ui/login"),
                ("POST", "/v1/offer"),
                ("GET", "/healthz"),
            ):
                got = httpx.request(
                    method, f"{served.url}{path}", json={"ordinal": 0, "owner": "x"}, headers={"Host": host}
                )
                assert got.status_code == 403, (host, path, got.text)
                assert got.json()["error"] == "NotLoopback" and "loopback" in got.json()["detail"]
        for host in (
            f"127.0.0.1:{port}",
            "localhost",
            f"localhost:{port}",
            "[::1]",
            f"[::1]:{port}",
            "127.0.0.2",
        ):
            for path in ("/healthz", "/ui/login"):
                assert httpx.get(f"{served.url}{path}", headers={"Host": host}).status_code == 200, host
        assert row_state(sqlite_store, row)["state"] == "assigned"  # nothing was offered


def test_a_forwarded_for_header_never_names_the_client(served_sqlite: Served) -> None:
    """The log names the peer that connected: a header any client can send (even from the
    machine itself, which uvicorn trusts by default) is not taken for its address."""
    for forged in ("203.0.113.9", "for=203.0.113.9"):
        got = httpx.post(
            f"{served_sqlite.url}/ui/login",
            data={"token": "not-a-token", "next": "/ui"},
            headers={"X-Forwarded-For": forged, "Forwarded": forged, "X-Forwarded-Proto": "https"},
        )
        assert got.status_code == 401, got.text
    wait_for("the refusal logged", lambda: "sign-in refused from" in served_sqlite.proc.text(), 10)
    log = served_sqlite.proc.text()
    assert "sign-in refused from 127.0.0.1" in log and "203.0.113.9" not in log


# --- limits and error classes ------------------------------------------------------


def test_an_oversized_body_is_413_before_it_is_read(served_sqlite: Served) -> None:
    token = tokens.ordinal_token(SECRET, 0)
    big = {"ordinal": 0, "owner": "w", "pad": "x" * (1024 * 1024)}
    answer = served_sqlite.post("/v1/offer", big, token)
    assert answer.status_code == 413 and answer.json()["error"] == "BodyTooLarge"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 65536

    chunked = httpx.post(
        f"{served_sqlite.url}/v1/offer", content=chunks(), headers={"Authorization": f"Bearer {token}"}
    )
    assert chunked.status_code == 413


def test_a_slow_client_blocks_nobody_and_times_out_alone(served_sqlite: Served) -> None:
    given_assigned(served_sqlite.store)
    slow = socket.create_connection(("127.0.0.1", served_sqlite.proc.port))
    slow.sendall(
        b"POST /v1/offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{"
    )
    try:
        started = time.monotonic()
        with served_sqlite.client(0) as client:
            assert client.offer(0, owner="w0") is not None
        assert time.monotonic() - started < 0.5
        slow.settimeout(5)
        assert slow.recv(4096).startswith(b"HTTP/1.1 408")  # POOL_BODY_TIMEOUT_SECONDS=1 here
    finally:
        slow.close()


def test_refusals_are_json_by_class(served: Served) -> None:
    row, grant = taken(served)
    with served.client(0) as client:
        assert client.heartbeat(grant, delivery_id="d1") == "applied"
        with pytest.raises(DeliveryConflict):  # 409: same delivery id, other content
            client.deliver(grant, {"status": "done"}, delivery_id="d1")
        with pytest.raises(StaleHolder, match="fence"):  # 409: a stale fence
            client.heartbeat(replace(grant, fence=grant.fence + 1))
        with pytest.raises(NotFound):  # 404: no such run
            client.heartbeat(replace(grant, task_id="nope"))
        with pytest.raises(InvalidInput, match="credential"):  # 422 from the store's own checks
            client.deliver(grant, {"status": "done", "api_key": "x"})
    token = tokens.ordinal_token(SECRET, 0)
    for body in (
        {"ordinal": "0", "owner": "w"},
        {"ordinal": 0},
        {"ordinal": 0, "owner": "w", "x": 1},
        [1],
        "{",
    ):
        answer = served.post("/v1/offer", body, token)
        assert answer.status_code == 422 and answer.json()["error"] == "ValidationError", body
    bad = httpx.post(
        f"{served.url}/v1/offer",
        content=b"{not json",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    assert bad.status_code == 422
    assert served.post("/v1/result", grant.envelope(payload={"status": "blocked"}), token).status_code == 422
    assert httpx.get(f"{served.url}/v1/nowhere").json() == {"error": "NotFound", "detail": "Not Found"}
    assert httpx.get(f"{served.url}/v1/offer").status_code == 405
    assert row_state(served.store, row)["state"] == "running"


def test_a_locked_store_is_503_with_retry_after(served_sqlite: Served, tmp_path: Path) -> None:
    given_assigned(served_sqlite.store)
    lock = sqlite3.connect(tmp_path / "pool.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        answer = served_sqlite.post(
            "/v1/offer", {"ordinal": 0, "owner": "w"}, tokens.ordinal_token(SECRET, 0)
        )
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"] == "TransientError"
    with served_sqlite.client(0) as client:  # and the client rides it out
        assert client.offer(0, owner="w") is not None


def test_serve_refuses_a_store_init_has_not_set_up_then_is_ready_once_it_has(tmp_path: Path) -> None:
    """No file: exit 78, nothing created (test_hostile.py has the cases); after `init`, ready."""
    url = f"sqlite:///{tmp_path}/fresh.db"
    settings = Settings(database_url=url, board_url=url)
    refused = ServeProc(settings.env(), tmp_path, secret=SECRET)
    assert refused.proc.wait(60) == 78 and "poolctl init" in refused.text()
    assert not (tmp_path / "fresh.db").exists()
    store = PoolStore.from_settings(settings)
    store.migrate()
    for served in start(settings, tmp_path, store, secret=SECRET):
        assert httpx.get(f"{served.url}/readyz").json() == {"status": "ready"}
    store.engine.dispose()


def test_metrics_count_requests_and_read_the_store(served: Served) -> None:
    taken(served)
    text = httpx.get(f"{served.url}/metrics").text
    assert 'poolkeeper_http_requests_total{method="POST",route="/v1/offer",status="200"} 1.0' in text
    assert 'poolkeeper_rows{state="running"} 1.0' in text and "poolkeeper_store_up 1.0" in text
    assert SECRET not in text and SECRET not in served.proc.text()


def test_schema_is_openapi_31_and_the_docs_load_nothing_from_elsewhere(served_sqlite: Served) -> None:
    schema = httpx.get(f"{served_sqlite.url}/openapi.json").json()
    assert schema["openapi"].startswith("3.1")
    assert {
        "/v1/offer",
        "/v1/heartbeat",
        "/v1/result",
        "/v1/release",
        "/v1/children",
        "/v1/children/heartbeat",
        "/v1/children/result",
        "/v1/children/vanished",
        "/healthz",
        "/readyz",
        "/metrics",
    } <= set(schema["paths"])
    page = httpx.get(f"{served_sqlite.url}/docs").text
    assert "http://" not in page and "https://" not in page
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert f"/docs/assets/{asset}" in page
        assert httpx.get(f"{served_sqlite.url}/docs/assets/{asset}").status_code == 200


# --- generated input: schemathesis over the served schema ---------------------------


@pytest.mark.parametrize("auth", ["local-only", "token"])
def test_no_generated_input_gets_a_5xx_or_breaks_the_schema(
    auth: str, sqlite_settings: Settings, sqlite_store: PoolStore, tmp_path: Path
) -> None:
    """Positive and negative input on every operation: no 5xx (503 aside), answers match the schema."""
    for i in range(3):
        given_assigned(sqlite_store, ordinal=i, task_id=f"t{i}")
    options: dict[str, Any] = {"local_only": True} if auth == "local-only" else {"secret": SECRET}
    header = (
        [] if auth == "local-only" else ["-H", f"Authorization: Bearer {tokens.ordinal_token(SECRET, 0)}"]
    )
    # An offer on an ordinal with no run waits up to POOL_OFFER_WAIT_SECONDS: short here, under the timeout
    waiting = replace(sqlite_settings, offer_wait_seconds=0.2)
    for served in start(waiting, tmp_path, sqlite_store, **options):
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name("st")),
                "run",
                f"{served.url}/openapi.json",
                *header,
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,"
                "response_schema_conformance,response_headers_conformance,negative_data_rejection",
                "--max-examples",
                "50",
                "--phases",
                "examples,coverage,fuzzing",
                "--seed",
                "1",
                "--workers",
                "2",
                "--request-timeout",
                "10",
                "--suppress-health-check",
                "all",
            ],
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,  # its report folder lands there
        )
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        assert "Traceback" not in served.proc.text()
