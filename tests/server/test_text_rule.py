"""One text rule for every API (SPEC): what a store would refuse is refused at the door, 422 naming the field.

The fields come from each API's OpenAPI schema (the worker protocol's and the board
API's), so a field added later is covered without an edit here: every text field (a
body's string, nested ones too, a path or query parameter) and every JSON document is
sent each class of bad text (NUL, a lone surrogate, one character past its bound) and
must be refused with a 422 whose issue names that field. A text field without a bound
fails the test. Then the board's own cases, end to end on SQLite and PostgreSQL: refused,
nothing stored, every read of the task still answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from board import open_board
from core.settings import Settings
from poolkeeper.api.app import create_app
from poolkeeper.boardserver.app import create_board_app
from store import PoolStore
from tests.properties import budget

TOKEN = "board-token-" + "0123456789abcdef" * 2


@dataclass(frozen=True)
class Leaf:
    """One text field of one route: where it goes (``body``, ``path``, ``query``) and how to reach it."""

    method: str
    route: str
    where: str
    steps: tuple[str, ...]  # the body's keys down to the field, or the parameter's name
    schema: dict[str, Any]
    fixed: tuple[tuple[tuple[str, ...], Any], ...]  # discriminators on the way (payload.status: blocked)

    @property
    def document(self) -> bool:
        return self.schema.get("type") == "object"

    def __str__(self) -> str:
        return f"{self.method.upper()} {self.route} {self.where}.{'.'.join(self.steps)}"


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _walk(
    spec: dict[str, Any], schema: dict[str, Any], steps: tuple[str, ...], fixed: tuple[Any, ...]
) -> Iterator[tuple[tuple[str, ...], dict[str, Any], tuple[Any, ...]]]:
    """Every text field and document under ``schema`` (after its $refs, unions and arrays)."""
    schema = _resolve(spec, schema)
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key, ()):
            yield from _walk(spec, branch, steps, fixed)
    if schema.get("type") == "array":
        yield from _walk(spec, schema.get("items", {}), steps, fixed)
    if schema.get("type") == "string" and "enum" not in schema and "const" not in schema:
        yield steps, schema, fixed
    if schema.get("type") == "object":
        properties = schema.get("properties", {})
        if not properties:
            yield steps, schema, fixed  # a JSON document: dict[str, Any]
        consts = tuple(
            ((*steps, k), _resolve(spec, v)["const"])
            for k, v in properties.items()
            if "const" in _resolve(spec, v)
        )
        for name, sub in properties.items():
            yield from _walk(spec, sub, (*steps, name), fixed + consts)


def leaves(spec: dict[str, Any]) -> list[Leaf]:
    found: list[Leaf] = []
    for route, operations in spec["paths"].items():
        for method, op in operations.items():
            for param in op.get("parameters", ()):
                for _, schema, _ in _walk(spec, param["schema"], (), ()):
                    found.append(Leaf(method, route, param["in"], (param["name"],), schema, ()))
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                for steps, schema, fixed in _walk(spec, body["schema"], (), ()):
                    found.append(Leaf(method, route, "body", steps, schema, fixed))
    return found


def _bad(leaf: Leaf, kind: str, around: str) -> Any:
    if leaf.document:
        return {"note": f"{around}\ud800{around}"} if kind != "key" else {f"k\udfff{around}": 1}
    if kind == "nul":
        return f"{around}\x00{around}"
    if kind == "surrogate":
        return f"{around}\udc80{around}"
    return "a" * ((_bound(leaf) or 0) + 1)


def _send(client: TestClient, leaf: Leaf, value: Any, headers: dict[str, str]) -> Any:
    """The route, ``value`` in the field, the other path parameters well-formed, other fields absent."""
    route, params = leaf.route, {}
    body: dict[str, Any] | None = None
    for name in [p.strip("{}") for p in route.split("/") if p.startswith("{")]:
        filler = value if (leaf.where, leaf.steps) == ("path", (name,)) else "x1"
        route = route.replace("{" + name + "}", quote(filler, safe=""))
    if leaf.where == "query":
        params = {leaf.steps[0]: value}
    if leaf.where == "body":
        body = {}
        for steps, const in [*leaf.fixed, (leaf.steps, value)]:
            into = body
            for step in steps[:-1]:
                into = into.setdefault(step, {})
            into[steps[-1]] = const
    content = None if body is None else json.dumps(body).encode()  # \ud800 escaped: valid JSON
    headers = {**headers, "content-type": "application/json"}
    return client.request(leaf.method.upper(), route, params=params, content=content, headers=headers)


@pytest.fixture
def apps(tmp_path: Path) -> Iterator[list[tuple[TestClient, dict[str, str], list[Leaf]]]]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/pool.db", board_url=f"sqlite:///{tmp_path}/board.db", pool_size=3
    )
    store = PoolStore.from_settings(settings)
    store.migrate()
    board = open_board(settings)
    board.migrate()
    api = create_app(settings, local_only=True, store=store)
    kanban = create_board_app(Settings(**{**settings.__dict__, "board_token": TOKEN}), board)
    with (
        TestClient(api, base_url="http://127.0.0.1") as api_client,
        TestClient(kanban, base_url="http://127.0.0.1") as board_client,
    ):
        yield [
            (api_client, {}, leaves(api.openapi())),
            (board_client, {"Authorization": f"Bearer {TOKEN}"}, leaves(kanban.openapi())),
        ]
    board.close()
    store.engine.dispose()


def test_the_schemas_name_the_fields_this_test_must_cover(
    apps: list[tuple[TestClient, dict[str, str], list[Leaf]]],
) -> None:
    named = {str(leaf) for _, _, found in apps for leaf in found}
    for expected in (
        "POST /v1/result body.payload.reason",
        "POST /v1/children/heartbeat body.receipt",
        "POST /v1/claims body.assignee",
        "POST /v1/claims body.lane",
        "POST /v1/boards/{name}/tasks/{task_id}/block body.reason",
        "POST /v1/boards/{name}/tasks/{task_id}/block body.kind",
        "POST /v1/boards/{name}/tasks/{task_id}/complete body.result",
        "GET /v1/boards/{name}/tasks/{task_id} path.task_id",
    ):
        assert expected in named, sorted(named)
    unbounded = [str(leaf) for _, _, found in apps for leaf in found if _bound(leaf) is None]
    assert unbounded == [], "every text field states its bound"


def _bound(leaf: Leaf) -> int | None:
    """The field's longest text: its maxLength, or a pattern of fixed length (a digest's {64})."""
    if leaf.document:
        return 0
    if "maxLength" in leaf.schema:
        return int(leaf.schema["maxLength"])
    pattern = leaf.schema.get("pattern", "")
    fixed = re.fullmatch(r"\^\[[^]]*\]\{(\d+)\}\$", pattern)
    return int(fixed.group(1)) if fixed else None


@pytest.mark.property
def test_every_text_field_of_every_api_refuses_what_its_store_would(
    apps: list[tuple[TestClient, dict[str, str], list[Leaf]]],
) -> None:
    every = [(client, headers, leaf) for client, headers, found in apps for leaf in found]

    @given(
        st.sampled_from(every),
        st.sampled_from(["nul", "surrogate", "long", "key"]),
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=5),
    )
    @budget(300)
    def refused(case: tuple[TestClient, dict[str, str], Leaf], kind: str, around: str) -> None:
        client, headers, leaf = case
        if leaf.where != "body" and kind == "surrogate":
            kind = "nul"  # a URL cannot carry a lone surrogate: it arrives as valid text or not at all
        if leaf.where == "path":
            around = around.replace("/", "")  # %2F arrives as a slash: another route, not this field
        got = _send(client, leaf, _bad(leaf, kind, around), headers)
        assert got.status_code == 422, (str(leaf), kind, got.status_code, got.text[:300])
        issues = got.json()["detail"]
        field = leaf.steps[-1]
        named = (
            [i for i in issues if field in i["loc"] and i["type"] != "missing"]
            if isinstance(issues, list)
            else ([issues] if field in issues else [])
        )
        assert named, (str(leaf), kind, issues)

    refused()


def test_the_boards_bad_text_is_refused_and_every_read_still_answers(settings: Settings) -> None:
    """On SQLite and PostgreSQL: a lone surrogate in a result (valid JSON), NUL in a claim's assignee and
    lane and a block's reason and kind are 422 naming the field (never 503), and nothing is stored."""
    board = open_board(settings)
    board.migrate()
    board.add_task("b", "x", task_id="t1")
    app = create_board_app(Settings(**{**settings.__dict__, "board_token": TOKEN}), board)
    headers = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    try:
        with TestClient(app, base_url="http://127.0.0.1") as http:

            def post(route: str, body: dict[str, Any]) -> list[str]:
                got = http.post(route, content=json.dumps(body).encode(), headers=headers)
                assert got.status_code == 422, got.text
                return [str(i["loc"][-1]) for i in got.json()["detail"]]

            claim = {"request_id": "r1", "limit": 5, "assignee": "pool", "lane": "pool"}
            assert post("/v1/claims", {**claim, "assignee": "po\x00ol"}) == ["assignee"]
            assert post("/v1/claims", {**claim, "lane": "po\x00ol"}) == ["lane"]
            assert board.get_task("b", "t1").status.value == "ready"  # type: ignore[union-attr]
            got = http.post("/v1/claims", content=json.dumps({**claim, "request_id": "r2"}), headers=headers)
            [run] = [c["run_id"] for c in got.json()["claims"]]
            done = {"expected_run_id": run, "result": {"status": "done", "note": "\ud800"}}
            assert post("/v1/boards/b/tasks/t1/complete", done) == ["result"]
            block = {"expected_run_id": run, "reason": "stuck", "kind": "worker"}
            assert post("/v1/boards/b/tasks/t1/block", {**block, "reason": "st\x00uck"}) == ["reason"]
            assert post("/v1/boards/b/tasks/t1/block", {**block, "kind": "wor\x00ker"}) == ["kind"]
            read = http.get("/v1/boards/b/tasks/t1", headers=headers)
            assert read.status_code == 200 and read.json()["task"]["status"] == "running", read.text
            listed = http.get("/v1/tasks", headers=headers)
            assert listed.status_code == 200 and len(listed.json()["tasks"]) == 1
    finally:
        board.close()
