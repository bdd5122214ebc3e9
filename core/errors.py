"""The error classes that decide what a maintenance pass does with a failure.

| class            | meaning                                   | what the pass does                 |
| ---------------- | ----------------------------------------- | ---------------------------------- |
| TransientError   | store/board busy, connection lost, OSError | retry the row later, with backoff  |
| ProtocolError    | pool-side conflict: lost race, stale fence | nothing on the board; deferred     |
| CapabilityError  | the run itself cannot be served            | park exactly that run on the board |
| anything else    | a bug or poisoned data                     | recorded on that row; backoff      |

A ``TransientError`` that is ``Unavailable`` (a server refused or dropped the
connection) is retried the same way; ``poolctl`` reports it apart from "busy".
A ``ConfigError`` (a database file or URL that cannot work) is never retried.

``InvalidInput`` and ``NotFound`` are refusals of a caller's request (a worker
envelope, an operator command): they name what was wrong and change nothing, as
``Denied`` does (a server refused the caller's token: 401 or 403).
"""

from __future__ import annotations


class PoolError(Exception):
    """Base of every error poolkeeper raises on purpose."""


class SettingsError(PoolError, ValueError):
    """A ``POOL_*`` variable has a bad value; the message names the variable."""


class TransientError(PoolError):
    """Nothing changed; the same call may succeed later."""


class Unavailable(TransientError):
    """A server refused or dropped the connection (PostgreSQL or Redis down, wrong port).

    The maintenance plane retries it like any transient error; the message names the
    server's URL with the password masked.
    """


class ConfigError(PoolError):
    """A database or Redis URL, or a database file, that cannot work as configured.

    Not a URL, no driver, a missing directory, not a database, read-only, not
    initialised: retrying will not help. The message names the URL (password masked).
    """


class ProtocolError(PoolError):
    """A pool-side conflict. Never turned into a board mutation."""


class LostRace(ProtocolError):
    """A conditional update matched nothing: another writer got there first."""


class StaleHolder(ProtocolError):
    """A heartbeat or result from an attempt or fence that is no longer current."""


class OrdinalTaken(ProtocolError):
    """The ordinal already holds a live row."""


class DuplicateIdentity(ProtocolError):
    """The run already has a row that differs from the one being added."""


class DeliveryConflict(ProtocolError):
    """A delivery id replayed with other content, or a second different result."""


class LineageTooDeep(ProtocolError):
    """Registering the child would pass the lineage depth cap (``POOL_LINEAGE_MAX_DEPTH``)."""


class LineageLive(ProtocolError):
    """A reset was asked while a child execution of the run is still live."""


class CapabilityError(PoolError):
    """The run itself cannot be turned into work (e.g. no valid payload)."""


class CorruptRow(PoolError):
    """A stored row cannot be read back (poisoned data): refused, nothing granted; ``row_id`` names it."""

    def __init__(self, row_id: int, problem: str) -> None:
        super().__init__(f"row {row_id}: {problem}")
        self.row_id = row_id


class InvalidInput(PoolError, ValueError):
    """A request was malformed. ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NotFound(PoolError, LookupError):
    """An unknown row, board or task."""


class Denied(PoolError):
    """A server refused the caller itself (401 not authenticated, 403 not allowed): a wrong or foreign
    token, which retrying will not change."""


class UnusableURL(SettingsError, ConfigError):
    """A ``POOL_*_URL`` no database driver or HTTP client can open: named by its variable, never echoed."""


# What a command-line process exits with, by error class (first match wins): `poolctl`,
# and a worker or beat that refuses to start. Anything not ours is 1 too, reported as an
# internal error with a hint to the traceback.
EXIT_CODES: tuple[tuple[type[Exception] | tuple[type[Exception], ...], int, str], ...] = (
    (ConfigError, 78, ""),  # first: an unusable URL is a setting and a configuration error
    ((SettingsError, InvalidInput, NotFound, Denied), 2, ""),  # a refused request: fix it, not retry
    (Unavailable, 69, ""),
    (TransientError, 75, "busy, try again: "),
    (LostRace, 75, "changed concurrently, try again: "),
    (PoolError, 1, ""),  # any other refusal of ours (a stale grant or child): one plain line
)


def exit_code(err: Exception) -> tuple[int, str] | None:
    """The exit code and one-line message for a refusal of ours, or None for anything else."""
    for kinds, code, prefix in EXIT_CODES:
        if isinstance(err, kinds):
            return code, f"{prefix}{err}"
    return None
