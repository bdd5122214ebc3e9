"""Searching the Kanban's tasks (SQLite FTS5, PostgreSQL pg_trgm): any text a person can type is taken
literally, never as query syntax, and what is found holds it.

The contract kit (``poolkeeper.testing.board_contract``) checks what every searching backend does;
these are the Kanban's own: arbitrary text over both databases, and the fault wrapper passing it on.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from board import Board, FlakyBoard, search_tasks
from board.protocol import SEARCH_MAX_CHARS, SEARCH_MIN_CHARS
from core.errors import InvalidInput
from tests.properties import budget

WORDS = ["deploy", "Canary", "ROLLBACK", "naïve", "Σίσυφος", "50% off", "a_b", 'say "hi"', "x' OR 1=1 --"]
ids = itertools.count()


def _holds(task_text: str, text: str) -> bool:
    return text.casefold() in task_text.casefold()


@budget(120, suppress=(HealthCheck.function_scoped_fixture,))
@given(text=st.text(max_size=SEARCH_MAX_CHARS + 20), before=st.sampled_from(WORDS), in_body=st.booleans())
def test_any_text_is_refused_in_one_line_or_finds_exactly_tasks_holding_it(
    kanban: Board, text: str, before: str, in_body: bool
) -> None:
    """Given tasks of many words and one holding ``text``; searching ``text`` never raises anything but
    a refusal naming ``q``, and finds that task, only tasks, each holding the text."""
    task_id = f"t{next(ids)}"
    holder = f"{before} {text} after"
    if "\x00" not in text:
        kanban.add_task("b", holder if not in_body else "plain", holder if in_body else "", task_id=task_id)
    try:
        found = search_tasks(kanban, text)
    except InvalidInput as err:
        assert err.field == "q"
        wanted = text.strip()
        assert "\x00" in text or not SEARCH_MIN_CHARS <= len(wanted) <= SEARCH_MAX_CHARS
        return
    assert found, "the task just added holds the text, and is the newest"
    assert found[0].id == task_id
    assert all(_holds(t.title, text.strip()) or _holds(t.body, text.strip()) for t in found)


def test_the_fault_wrapper_passes_search_on_untouched(kanban: Board) -> None:
    kanban.add_task("b", "rotate the keys", task_id="t1")
    flaky = FlakyBoard(kanban, busy_rate=1.0)  # the plane's calls would all fail; search is an operator read
    assert [t.id for t in search_tasks(flaky, "the key")] == ["t1"]
    with pytest.raises(InvalidInput, match=r"^q: too long"):
        search_tasks(flaky, "k" * (SEARCH_MAX_CHARS + 1))
