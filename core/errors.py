"""The project's exception tree. Each class carries what it means to the edges, as attributes:

``exit_code`` (what ``poolctl``, a Celery worker or beat exits with), ``http_status``
(what ``poolctl serve`` answers, and what ``poolkeeper.workerhost.client`` maps back to the class),
and ``hint`` (words put before the message on the command line). The CLI, the server,
the console and the client read these attributes; nothing keeps a table of its own.
What a maintenance pass does with each class (``tasks.failures.classify``) and the
table of every class with its codes: docs/design.md, section 6 ("Error classes").
"""

from __future__ import annotations

from typing import ClassVar


class PoolError(Exception):
    """Base of every error poolkeeper raises on purpose: a refusal with no code of its own."""

    exit_code: ClassVar[int] = 1
    http_status: ClassVar[int] = 409
    hint: ClassVar[str] = ""

    def line(self) -> str:
        """The one line the command line prints: the hint, then the message."""
        return f"{self.hint}: {self}" if self.hint else str(self)


class SettingsError(PoolError, ValueError):
    """A ``POOL_*`` variable (or a server option) has a bad value; the message names it."""

    exit_code = 2


class TransientError(PoolError):
    """Nothing changed; the same call may succeed later."""

    exit_code = 75
    http_status = 503
    hint = "busy, try again"


class Unavailable(TransientError):
    """A server refused or dropped the connection (PostgreSQL or Redis down, wrong port).

    The maintenance plane retries it like any transient error; the message names the
    server's URL with the password masked.
    """

    exit_code = 69
    hint = ""


class ConfigError(PoolError):
    """A database or Redis URL, or a database file, that cannot work as configured.

    Not a URL, no driver, a missing directory, not a database, read-only, not
    initialised: retrying will not help. The message names the URL (password masked).
    """

    exit_code = 78  # sysexits.h EX_CONFIG; systemd units do not restart on it
    # a server meeting it mid-request is not ready (its store went away): 503 with Retry-After, as
    # /readyz says; not 409, which tells a client its own request conflicted
    http_status = 503


class ProtocolError(PoolError):
    """A pool-side conflict. Never turned into a board mutation."""


class LostRace(ProtocolError):
    """A conditional update matched nothing: another writer got there first."""

    exit_code = 75
    hint = "changed concurrently, try again"


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

    exit_code = 2
    http_status = 422

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NotFound(PoolError, LookupError):
    """An unknown row, board or task."""

    exit_code = 2
    http_status = 404


class Unsupported(PoolError):
    """The backend lacks the capability asked for (a board that cannot search): asking again will not help."""

    exit_code = 2
    http_status = 501


class Denied(PoolError):
    """A server refused the caller itself (401 not authenticated, 403 not allowed): a wrong or foreign
    token, which retrying will not change."""

    exit_code = 2
    http_status = 403


class Unauthenticated(Denied):
    """No bearer token, or one this server did not issue (``poolctl serve`` answers 401)."""

    http_status = 401


class Forbidden(Denied):
    """A valid token acting beyond its ordinal, grant or role (``poolctl serve`` answers 403)."""


class UnusableURL(SettingsError, ConfigError):
    """A ``POOL_*_URL`` no database driver or HTTP client can open: named by its variable, never echoed."""

    exit_code = ConfigError.exit_code  # a setting, and first of all one that cannot work


def exit_code(err: Exception) -> tuple[int, str] | None:
    """The exit code and one-line message for a refusal of ours, or None for anything else (exit 1)."""
    return (err.exit_code, err.line()) if isinstance(err, PoolError) else None
