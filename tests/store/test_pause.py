"""Pause and resume dispatch (``store.pause``): one guarded row, an audit event per change."""

from __future__ import annotations

import pytest
from sqlalchemy import exc, text

from core.errors import InvalidInput
from store import PoolStore, audit, numbers, pause
from tasks.collectors import StoreCollector
from tests.factories import NOW


def _events(store: PoolStore) -> list[tuple[str, str, str | None, float]]:
    with store.session(readonly=True) as s:
        return [(e["kind"], e["actor"], e["detail"], e["at"]) for e in audit.history(s, audit.POOL)]


def test_a_fresh_store_dispatches(store: PoolStore) -> None:
    with store.session(readonly=True) as s:
        assert pause.read(s) == pause.Pause(False)
        assert numbers.read(s, store.pool_size).dispatch.paused is False


def test_pause_then_resume_each_change_once_and_each_leaves_one_event(store: PoolStore) -> None:
    with store.session() as s:
        assert pause.pause(s, "  deploy 42 ", now=NOW, actor=audit.OPERATOR) is True
    with store.session() as s:
        assert pause.pause(s, "another reason", now=NOW + 1, actor=audit.OPERATOR) is False  # already
        assert pause.read(s) == pause.Pause(True, "deploy 42", "operator", NOW)
    assert _events(store) == [("pause", "operator", "deploy 42", NOW)]

    with store.session() as s:
        assert pause.resume(s, now=NOW + 5, actor=audit.OPERATOR) is True
    with store.session() as s:
        assert pause.resume(s, now=NOW + 6, actor=audit.OPERATOR) is False  # not paused
        assert pause.read(s).paused is False
    assert _events(store)[-1] == ("resume", "operator", None, NOW + 5) and len(_events(store)) == 2


@pytest.mark.parametrize("reason", ["", "   ", "x" * (pause.MAX_REASON_CHARS + 1), "a\x00b"])
def test_a_pause_needs_a_reason_a_database_holds(store: PoolStore, reason: str) -> None:
    with store.session() as s, pytest.raises(InvalidInput, match="reason"):
        pause.pause(s, reason, now=NOW, actor=audit.OPERATOR)
    with store.session(readonly=True) as s:
        assert pause.read(s).paused is False
    assert _events(store) == []


def test_the_schema_refuses_a_second_row_and_a_pause_without_its_reason(store: PoolStore) -> None:
    for sql in (
        "INSERT INTO dispatch_pause (id, paused) VALUES (2, false)",
        "UPDATE dispatch_pause SET paused = true WHERE id = 1",
    ):
        with pytest.raises(exc.IntegrityError), store.session() as s:
            s.execute(text(sql))


def test_the_gauge_says_whether_dispatch_is_paused(store: PoolStore) -> None:
    def gauge() -> float:
        found = {m.name: m for m in StoreCollector(store).collect()}
        return float(found["poolkeeper_dispatch_paused"].samples[0].value)

    assert gauge() == 0
    with store.session() as s:
        pause.pause(s, "incident", now=NOW, actor=audit.OPERATOR)
    assert gauge() == 1


def test_a_board_pauses_and_resumes_on_its_own_and_the_pool_apart(store: PoolStore) -> None:
    # Given the pool paused and board "b" paused on its own
    with store.session() as s:
        assert pause.pause(s, "deploy", now=NOW, actor=audit.OPERATOR)
        assert pause.pause(s, " move b ", now=NOW + 1, actor=audit.OPERATOR, board="b") is True
        assert pause.pause(s, "again", now=NOW + 2, actor=audit.OPERATOR, board="b") is False
    # When the pool resumes, "b" stays paused, with its own reason, actor and time
    with store.session() as s:
        assert pause.resume(s, now=NOW + 3, actor=audit.OPERATOR)
        assert pause.boards(s) == {"b": pause.Pause(True, "move b", "operator", NOW + 1)}
        assert numbers.read(s, store.pool_size).paused_boards.keys() == {"b"}
        assert pause.resume(s, now=NOW + 4, actor=audit.OPERATOR, board="c") is False  # never paused
    # Then resuming "b" ends it; each change left one event, a board's naming it
    with store.session() as s:
        assert pause.resume(s, now=NOW + 5, actor=audit.OPERATOR, board="b") is True
        assert pause.boards(s) == {}
    assert [(kind, detail) for kind, _, detail, _ in _events(store)] == [
        ("pause", "deploy"),
        ("pause", "board b: move b"),
        ("resume", None),
        ("resume", "board b"),
    ]


def test_no_more_boards_are_paused_alone_than_a_dispatch_round_skips(
    store: PoolStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pause, "MAX_PAUSED_BOARDS", 3)  # the bound itself, at a size a test can fill
    with store.session() as s:
        for name in ("b1", "b2", "b3"):
            assert pause.pause(s, "maintenance", now=NOW, actor=audit.OPERATOR, board=name)
    with store.session() as s, pytest.raises(InvalidInput, match="3 boards are paused on their own already"):
        pause.pause(s, "one more", now=NOW, actor=audit.OPERATOR, board="b4")
    with store.session() as s:  # every paused board is read, so every one is skipped; b3 again is no change
        assert sorted(pause.boards(s)) == ["b1", "b2", "b3"]
        assert pause.pause(s, "again", now=NOW, actor=audit.OPERATOR, board="b3") is False


@pytest.mark.parametrize("board", ["", "a b", "x" * 65, "a\x00b"])
def test_a_board_pause_names_a_board_that_can_exist(store: PoolStore, board: str) -> None:
    with store.session() as s, pytest.raises(InvalidInput, match="board"):
        pause.pause(s, "why", now=NOW, actor=audit.OPERATOR, board=board)
    assert _events(store) == []


def test_the_board_gauge_names_each_paused_board(store: PoolStore) -> None:
    def paused() -> dict[str, float]:
        found = {m.name: m for m in StoreCollector(store).collect()}
        return {m.labels["board"]: m.value for m in found["poolkeeper_board_dispatch_paused"].samples}

    assert paused() == {}
    with store.session() as s:
        pause.pause(s, "incident", now=NOW, actor=audit.OPERATOR, board="b")
    assert paused() == {"b": 1}
    with store.session() as s:
        pause.resume(s, now=NOW, actor=audit.OPERATOR, board="b")
    assert paused() == {}
