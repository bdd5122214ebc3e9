"""The board is the source of truth; everything outside ``board/`` depends only on this protocol.

Every call may raise ``TransientError`` (other writers share the board's
database). ``block_task`` and ``complete_task`` are compare-and-set on the
task's current run: they act on exactly that run or return ``False``.
Boards are opened by ``board.open_board(settings)``, which picks the backend
from ``POOL_BOARD_URL``'s scheme; ``tests/board/test_contract.py`` holds every
backend to this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from core import validate
from core.errors import InvalidInput, Unsupported
from core.settings import default


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
    # When the task last turned ready (epoch seconds): where its claim's wait starts; None when the
    # board does not say (then the wait is not measured, never guessed).
    ready_at: float | None = None


@dataclass(frozen=True)
class TaskSpec:
    """A task to add (``add_tasks``): its id is made up when not given."""

    title: str
    body: str = ""
    lane: str = default("lane")
    task_id: str | None = None


@dataclass(frozen=True)
class Claim:
    """A board run that ``claim_ready`` just moved to ``running`` for the pool."""

    board: str
    task_id: str
    run_id: int


# What a task search takes: the index is of 3-character pieces (trigrams), so fewer match nothing.
SEARCH_MIN_CHARS = 3
SEARCH_MAX_CHARS = 200
SEARCH_LIMIT = 50  # tasks one search answers at most, unless asked for fewer


class Board(Protocol):
    # --- setting up: `poolctl init`, readiness checks ------------------------------

    def migrate(self) -> None:
        """Create or bring the board's schema to head (a no-op when current)."""

    def require_creatable(self) -> None:
        """``ConfigError`` unless ``migrate`` could set this board up here (creates nothing)."""

    def require_schema(self, *, writable: bool = False) -> None:
        """``ConfigError`` unless ``migrate`` has set this board up (creates nothing)."""

    def location(self) -> str:
        """Where the board lives, fit to print (no password)."""

    def close(self) -> None:
        """Let go of connections; the board may be used again afterwards."""

    # --- the maintenance plane's calls ---------------------------------------------

    def list_boards(self, include_archived: bool = False) -> list[str]: ...

    def running_tasks(self, board: str) -> list[BoardTask]: ...

    def get_task(self, board: str, task_id: str) -> BoardTask | None: ...

    def claim_ready(
        self,
        limit: int,
        *,
        assignee: str,
        lane: str,
        request_id: str | None = None,
        skip_boards: Sequence[str] = (),
    ) -> list[Claim]:
        """Atomically claim up to ``limit`` ready tasks of ``lane``, none of the boards ``skip_boards``
        names (at most ``shapes.SKIP_BOARDS``: those paused on their own); a ``request_id`` already
        used returns the claims that request made and claims nothing more (a retry after a lost answer)."""

    def block_task(self, board: str, task_id: str, reason: str, kind: str, expected_run_id: int) -> bool: ...

    def complete_task(
        self, board: str, task_id: str, expected_run_id: int, result: dict[str, Any]
    ) -> bool: ...

    # --- operator moves: the CLI, the console, the demo ------------------------------
    # A move the task's status does not allow is ``InvalidInput``; an unknown task ``NotFound``.

    def add_task(
        self,
        board: str,
        title: str,
        body: str = "",
        *,
        lane: str = default("lane"),
        task_id: str | None = None,
    ) -> str:
        """A new ``ready`` task (its board is created on first use); returns its id."""

    def unblock_task(self, board: str, task_id: str) -> BoardTask:
        """A parked task goes back to ``ready`` (its next claim gets a new run id), ``ready_at`` now."""

    def cancel_task(self, board: str, task_id: str) -> BoardTask:
        """End a task for good: it is ``done`` with result ``{"cancelled": true}``."""

    def reassign_task(self, board: str, task_id: str, *, assignee: str, lane: str) -> BoardTask:
        """Hand a running task to someone else: a new run starts, the old one has moved on; the new
        run's wait starts now (``ready_at``), for the lane it is handed to."""

    def delete_task(self, board: str, task_id: str) -> None: ...

    def archive_board(self, board: str) -> None: ...

    # --- reads: `poolctl status`/`board list`, the console, the demo's checks ------------

    def has_board(self, board: str) -> bool: ...

    def list_tasks(
        self, board: str | None = None, status: TaskStatus | None = None, limit: int = 10_000
    ) -> list[BoardTask]: ...

    def counts_by_status(self) -> dict[str, int]:
        """Tasks per status, every status present (0 when none)."""

    def pool_runs(self, assignee: str) -> list[tuple[str, str, int, str]]:
        """Every run ever claimed as ``assignee``: (board, task_id, run_id, outcome)."""

    def list_runs(self, board: str, task_ids: list[str]) -> list[dict[str, Any]]:
        """Every run of these tasks, oldest first: task_id, run_id, assignee, outcome, started_at, ended_at
        (a dict each)."""


def add_tasks(board: Board, name: str, specs: Sequence[TaskSpec]) -> list[str]:
    """Add ``specs`` to board ``name``: in one call where the backend has ``add_tasks`` (the Kanban:
    one transaction), else one ``add_task`` each (a backend need not have the bulk form).

    An archived board is refused (``InvalidInput``): the pool never claims from one, so its new
    tasks would wait for ever while the operator believed them queued. The Kanban refuses in its
    add's own transaction; for a backend without the bulk form it is asked here first."""
    bulk = getattr(board, "add_tasks", None)
    if bulk is not None:
        added: list[str] = bulk(name, specs)
        return added
    if name in set(board.list_boards(include_archived=True)) - set(board.list_boards()):
        raise archived(name)
    return [board.add_task(name, s.title, s.body, lane=s.lane, task_id=s.task_id) for s in specs]


def archived(name: str) -> InvalidInput:
    """The refusal of a task for an archived board."""
    return InvalidInput("board", f"{name} is archived: the pool claims none of its tasks")


class Searching(Protocol):
    """The optional capability to search tasks (the Kanban has it; a backend need not)."""

    def search_tasks(self, text: str, *, limit: int = SEARCH_LIMIT) -> list[BoardTask]:
        """At most ``limit`` tasks whose title or body holds ``text`` (any case), newest first, through an
        index: bounded in time however many tasks the board holds. ``text`` is ``search_text``'s."""


def search_text(text: str, *, shortest: int = SEARCH_MIN_CHARS) -> str:
    """``text`` stripped, if a task search can take it; else ``InvalidInput`` naming ``q``, one line.

    Any text a person can type is searched for as it is: nothing in it is query syntax. The console
    searches rows by shorter text (a row id), so it asks for ``shortest=1``.
    """
    found = validate.text("q", text).strip()
    if not found:
        raise InvalidInput("q", "empty: give a piece of a task's title or body to look for")
    if len(found) < shortest:
        raise InvalidInput("q", f"too short: tasks are searched by {SEARCH_MIN_CHARS} characters or more")
    if len(found) > SEARCH_MAX_CHARS:
        raise InvalidInput("q", f"too long: at most {SEARCH_MAX_CHARS} characters")
    return found


def search_tasks(board: Board, text: str, limit: int = SEARCH_LIMIT) -> list[BoardTask]:
    """``board``'s tasks holding ``text`` (``Searching.search_tasks``); ``Unsupported`` in one line when
    the backend has no search, ``InvalidInput`` for text ``search_text`` refuses."""
    text = search_text(text)
    validate.integer("limit", limit, 1, SEARCH_LIMIT)
    search = getattr(board, "search_tasks", None)
    if search is None:
        raise Unsupported(f"this board ({type(board).__name__}) cannot search its tasks")
    found: list[BoardTask] = search(text, limit=limit)
    return found
