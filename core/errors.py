"""The error classes that decide what a maintenance pass does with a failure.

| class            | meaning                                   | what the pass does                 |
| ---------------- | ----------------------------------------- | ---------------------------------- |
| TransientError   | store/board busy, connection lost, OSError | retry the row later, with backoff  |
| ProtocolError    | pool-side conflict: lost race, stale fence | nothing on the board; deferred     |
| CapabilityError  | the run itself cannot be served            | park exactly that run on the board |
| anything else    | a bug or poisoned data                     | recorded on that row; backoff      |

``InvalidInput`` and ``NotFound`` are refusals of a caller's request (a worker
envelope, an operator command): they name what was wrong and change nothing.
"""

from __future__ import annotations


class PoolError(Exception):
    """Base of every error poolkeeper raises on purpose."""


class SettingsError(PoolError, ValueError):
    """A ``POOL_*`` variable has a bad value; the message names the variable."""


class TransientError(PoolError):
    """Nothing changed; the same call may succeed later."""


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


class InvalidInput(PoolError, ValueError):
    """A request was malformed. ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NotFound(PoolError, LookupError):
    """An unknown row, board or task."""
