"""The board is the source of truth; the store and the tasks depend only on this protocol.

Every call may raise ``TransientError`` (other writers share the board's
database). ``block_task`` and ``complete_task`` are compare-and-set on the
task's current run: they act on exactly that run or return ``False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol


class TaskStatus(StrEnum):
    READY = "ready"
    RUNNING = "running"
    BLOCKED = "blocked"
    DONE = "done"


@dataclass(frozen=True)
class BoardTask:
    board: str
    id: str
    title: str
    body: str
    status: TaskStatus
    assignee: str | None
    current_run_id: int | None
    lane: str
    block_reason: str | None = None
    block_kind: str | None = None
    result: dict[str, Any] | None = None


@dataclass(frozen=True)
class Claim:
    """A board run that ``claim_ready`` just moved to ``running`` for the pool."""

    board: str
    task_id: str
    run_id: int


class Board(Protocol):
    def list_boards(self, include_archived: bool = False) -> list[str]: ...

    def running_tasks(self, board: str) -> list[BoardTask]: ...

    def get_task(self, board: str, task_id: str) -> BoardTask | None: ...

    def claim_ready(self, limit: int, *, assignee: str, lane: str) -> list[Claim]: ...

    def block_task(self, board: str, task_id: str, reason: str, kind: str, expected_run_id: int) -> bool: ...

    def complete_task(
        self, board: str, task_id: str, expected_run_id: int, result: dict[str, Any]
    ) -> bool: ...
