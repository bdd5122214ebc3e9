"""Fault injection for the demo and the fault tests: a board that is sometimes busy.

Wraps any ``Board``. A call of the maintenance plane fails with
``TransientError`` (as a locked SQLite board would) at ``busy_rate``. Such
calls about a poisoned task id always fail with an unexpected error, as
corrupt data would. Setting up, operator moves and reads pass straight
through. It is enabled only through the ``POOL_CHAOS_*`` settings
(``board.with_faults``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from board.protocol import (
    SEARCH_LIMIT,
    Board,
    BoardTask,
    Claim,
    TaskSpec,
    TaskStatus,
    add_tasks,
    search_tasks,
)
from core.errors import TransientError
from core.settings import default


class PoisonedTask(RuntimeError):
    """Not a PoolError on purpose: it stands for a bug or corrupt data."""


class FlakyBoard:
    def __init__(
        self,
        inner: Board,
        *,
        busy_rate: float = 0.0,
        poison: frozenset[str] = frozenset(),
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.busy_rate = busy_rate
        self.poison = poison
        self.rng = rng or random.Random()

    def _maybe_fail(self, task_id: str | None = None) -> None:
        if task_id is not None and task_id in self.poison:
            raise PoisonedTask(f"board: task {task_id} is poisoned (chaos)")
        if self.busy_rate and self.rng.random() < self.busy_rate:
            raise TransientError("board: database is locked (chaos)")

    def list_boards(self, include_archived: bool = False) -> list[str]:
        self._maybe_fail()
        return self.inner.list_boards(include_archived)

    def running_tasks(self, board: str) -> list[BoardTask]:
        self._maybe_fail()
        return self.inner.running_tasks(board)

    def get_task(self, board: str, task_id: str) -> BoardTask | None:
        self._maybe_fail(task_id)
        return self.inner.get_task(board, task_id)

    def claim_ready(
        self,
        limit: int,
        *,
        assignee: str,
        lane: str,
        request_id: str | None = None,
        skip_boards: Sequence[str] = (),
    ) -> list[Claim]:
        self._maybe_fail()
        return self.inner.claim_ready(
            limit, assignee=assignee, lane=lane, request_id=request_id, skip_boards=skip_boards
        )

    def block_task(self, board: str, task_id: str, reason: str, kind: str, expected_run_id: int) -> bool:
        self._maybe_fail(task_id)
        return self.inner.block_task(board, task_id, reason, kind, expected_run_id)

    def complete_task(self, board: str, task_id: str, expected_run_id: int, result: dict[str, Any]) -> bool:
        self._maybe_fail(task_id)
        return self.inner.complete_task(board, task_id, expected_run_id, result)

    # --- passed through unchanged ----------------------------------------------------

    def migrate(self) -> None:
        self.inner.migrate()

    def require_creatable(self) -> None:
        self.inner.require_creatable()

    def require_schema(self, *, writable: bool = False) -> None:
        self.inner.require_schema(writable=writable)

    def location(self) -> str:
        return self.inner.location()

    def close(self) -> None:
        self.inner.close()

    def add_task(
        self,
        board: str,
        title: str,
        body: str = "",
        *,
        lane: str = default("lane"),
        task_id: str | None = None,
    ) -> str:
        return self.inner.add_task(board, title, body, lane=lane, task_id=task_id)

    def add_tasks(self, board: str, specs: Sequence[TaskSpec]) -> list[str]:
        return add_tasks(self.inner, board, specs)

    def unblock_task(self, board: str, task_id: str) -> BoardTask:
        return self.inner.unblock_task(board, task_id)

    def cancel_task(self, board: str, task_id: str) -> BoardTask:
        return self.inner.cancel_task(board, task_id)

    def reassign_task(self, board: str, task_id: str, *, assignee: str, lane: str) -> BoardTask:
        return self.inner.reassign_task(board, task_id, assignee=assignee, lane=lane)

    def delete_task(self, board: str, task_id: str) -> None:
        self.inner.delete_task(board, task_id)

    def archive_board(self, board: str) -> None:
        self.inner.archive_board(board)

    def has_board(self, board: str) -> bool:
        return self.inner.has_board(board)

    def list_tasks(
        self, board: str | None = None, status: TaskStatus | None = None, limit: int = 10_000
    ) -> list[BoardTask]:
        return self.inner.list_tasks(board, status, limit)

    def counts_by_status(self) -> dict[str, int]:
        return self.inner.counts_by_status()

    def pool_runs(self, assignee: str) -> list[tuple[str, str, int, str]]:
        return self.inner.pool_runs(assignee)

    def list_runs(self, board: str, task_ids: list[str]) -> list[dict[str, Any]]:
        return self.inner.list_runs(board, task_ids)

    def search_tasks(self, text: str, *, limit: int = SEARCH_LIMIT) -> list[BoardTask]:
        """The inner board's search, or its ``Unsupported`` when it has none."""
        return search_tasks(self.inner, text, limit)
