"""Reading one row, and the guarded UPDATE every transition is made of (docs/design.md, "Transitions")."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from core import validate
from core.errors import LostRace, NotFound
from store.models import Assignment

A = Assignment
# A transition is progress: the row's failure streak ends with it.
CLEAR_BOOKKEEPING: dict[str, Any] = {
    "failures": 0,
    "last_error": None,
    "next_attempt_at": 0.0,
    "quarantined": False,
}


def get_row(s: Session, row_id: int, *, for_update: bool = False) -> Assignment:
    """The row by id (locked with ``FOR UPDATE`` if asked); ``NotFound`` if there is none."""
    validate.integer("row", row_id, 1, validate.INT32_MAX)  # row ids are an ``Integer`` column
    row = s.get(A, row_id, populate_existing=True, with_for_update=for_update)
    if row is None:
        raise NotFound(f"row {row_id}: no such row")
    return row


def guarded(s: Session, row_id: int, what: str, expect: dict[Any, Any], **values: Any) -> None:
    """``UPDATE … WHERE id = ? AND <expect>``; ``LostRace`` when it matched nothing."""
    stmt = update(A).where(A.id == row_id, *[col == val for col, val in expect.items()]).values(**values)
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        described = ", ".join(f"{col.key}={val}" for col, val in expect.items())
        raise LostRace(f"{what}: row {row_id} changed under us (expected {described})")
