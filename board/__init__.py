"""The board (source of truth): the ``Board`` protocol, and ``open_board`` to get one.

``open_board`` is the one place that knows the backends: ``POOL_BOARD_URL``'s
scheme (before any ``+driver``) names one registered under the entry-point group
``poolkeeper.boards`` (``pyproject.toml`` declares the built-in Kanban's there too),
so a backend installed as a package is found without code changes; a backend's
entry point is a ``BoardOpener``. ``BUILT_IN`` serves the built-in schemes (the
Kanban's, and ``http``/``https``: ``board.http``) when no entry point names them (a
source checkout on ``sys.path``, not installed). Nothing
outside ``board/`` names a backend's class (``tests/test_architecture.py`` checks).
``with_faults`` adds the chaos faults the settings ask for (``board.faults``), for
the maintenance plane. How to write a backend: docs/board-backends.md.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from board.faults import FlakyBoard
from board.kanban import KanbanBoard
from board.protocol import Board, BoardTask, Claim, Searching, TaskSpec, TaskStatus, add_tasks, search_tasks
from core.errors import UnusableURL
from core.settings import Settings, check_database_url

__all__ = [
    "ENTRY_POINT_GROUP",
    "Board",
    "BoardOpener",
    "BoardTask",
    "Claim",
    "FlakyBoard",
    "Searching",
    "TaskSpec",
    "TaskStatus",
    "add_tasks",
    "open_board",
    "open_kanban",
    "search_tasks",
    "with_faults",
]

ENTRY_POINT_GROUP = "poolkeeper.boards"

# What an entry point of ENTRY_POINT_GROUP names: the URL and the settings -> a board (not yet migrated).
BoardOpener = Callable[[str, Settings], Board]


def open_kanban(url: str, settings: Settings) -> Board:
    """The built-in Kanban on the database at ``url`` (entry points ``sqlite`` and ``postgresql``)."""
    check_database_url(url, "POOL_BOARD_URL")
    return KanbanBoard(url)


def _open_http(url: str, settings: Settings) -> Board:
    """``board.http.open_http``, imported only for an ``http(s):`` URL: httpx costs every CLI command."""
    from board.http import open_http

    return open_http(url, settings)


# The fallback for the schemes pyproject.toml declares, when the package's entry points are not visible.
BUILT_IN: dict[str, BoardOpener] = {
    "sqlite": open_kanban,
    "postgresql": open_kanban,
    "http": _open_http,
    "https": _open_http,
}


def open_board(settings: Settings) -> Board:
    """The board at ``POOL_BOARD_URL``; an unknown scheme, or a backend that will not load, is one line.

    Both are ``UnusableURL`` (a setting that cannot work); the URL is never echoed: it may hold a password.
    """
    url = settings.board_url
    scheme, colon, _ = url.partition(":")
    name = scheme.partition("+")[0].lower()
    registered = _registered()
    if not colon or (name not in registered and name not in BUILT_IN):
        known = ", ".join(f"{s}:" for s in sorted({*registered, *BUILT_IN}))
        got = f"scheme {scheme + ':'!r}" if colon else "no scheme"
        raise UnusableURL(f"POOL_BOARD_URL: not a board URL of a known scheme ({known}); got {got}")
    if name in registered:
        opener, where = _load(name, registered[name])
    else:
        opener, where = BUILT_IN[name], f"{name} (built in)"
    return _checked(opener(url, settings), where)


# What a backend must have: every method the protocol declares.
BOARD_METHODS = tuple(n for n, v in vars(Board).items() if callable(v) and not n.startswith("_"))


def _checked(opened: Board, where: str) -> Board:
    """``opened``, unless it lacks a ``Board`` method: then one line naming each one (a backend
    author's fix), at load rather than as an ``AttributeError`` in the middle of a command."""
    missing = [n for n in BOARD_METHODS if not callable(getattr(opened, n, None))]
    if missing:
        kind = type(opened).__name__
        raise UnusableURL(
            f"POOL_BOARD_URL: board backend {where} opened a {kind} without the Board "
            f"method{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        )
    return opened


def _registered() -> dict[str, list[EntryPoint]]:
    """The installed entry points of the group by scheme; one entry point seen twice counts once."""
    found: dict[str, list[EntryPoint]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        same = found.setdefault(point.name.lower(), [])
        if all(p.value != point.value for p in same):
            same.append(point)
    return found


def _load(scheme: str, points: list[EntryPoint]) -> tuple[BoardOpener, str]:
    """The opener one entry point names, and how to name it; two packages claiming the scheme, or a
    failed import, is one line."""
    where = [f"{p.name} = {p.value} (package {p.dist.name if p.dist else 'unknown'})" for p in points]
    if len(points) > 1:
        backends = "; ".join(where)
        raise UnusableURL(f"POOL_BOARD_URL: scheme '{scheme}:' has {len(points)} backends: {backends}")
    try:
        opener = points[0].load()
    except Exception as err:  # the backend's own import: any error there is its package's, not ours
        problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        raise UnusableURL(f"POOL_BOARD_URL: board backend {where[0]} failed to load: {problem}") from None
    if not callable(opener):
        raise UnusableURL(f"POOL_BOARD_URL: board backend {where[0]} is not callable")
    return opener, where[0]


def with_faults(board: Board, settings: Settings) -> Board:
    """``board`` with the chaos faults ``POOL_CHAOS_*`` ask for (the maintenance plane's calls only)."""
    if settings.chaos_board_busy_rate or settings.poison_tasks:
        return FlakyBoard(board, busy_rate=settings.chaos_board_busy_rate, poison=settings.poison_tasks)
    return board
