"""The pool's numbers, read in one transaction: the one function ``poolctl status``, the console,
``/v1/status`` and the store gauges of ``/metrics`` build them with, so no two can disagree.

Worker presence is judged here too, against one lease: an ordinal whose last worker
call is older than a lease (or never seen) has no worker (``gone``); one whose row is
``running`` holds a grant (``busy``); any other is ``polling`` for one. An ``assigned``
row older than a lease waits for a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy.orm import Session

from store import lineage, pause, presence, queries
from store.models import RowState


class WorkerState(StrEnum):
    """An ordinal's pool worker, as its calls and its row say."""

    POLLING = "polling"  # calls within a lease and holds no grant: asking offer for one
    BUSY = "busy"  # calls within a lease and its ordinal's row is running: it holds the grant
    GONE = "gone"  # no call for longer than a lease (or none ever seen)


@dataclass(frozen=True)
class PoolNumbers:
    rows: dict[str, int]  # every state, zero included
    pool_size: int
    free_ordinals: list[int]
    quarantined: int  # rows, in any state
    held_by_quarantined: list[int]  # ordinals held by a quarantined live row
    oldest_lease_failed_at: float | None  # when the longest-waiting lease_failed row got there
    live_children: int
    audit_events: int  # written since init (the highest event id)
    presence: list[presence.Seen]  # every ordinal's last worker call, by ordinal
    assigned_since: list[queries.Waiting]  # assigned rows, with when they became assigned
    held: dict[int, queries.Held]  # each held ordinal's live row
    dispatch: pause.Pause  # paused by an operator (no new claims), or not
    paused_boards: dict[str, pause.Pause]  # boards paused on their own (no new claims from them)

    def without_worker(self, now: float, lease_seconds: float) -> list[int]:
        """Ordinals with no worker call for longer than a lease (or none ever seen)."""
        return [p.ordinal for p in self.presence if p.at is None or now - p.at > lease_seconds]

    def worker_states(self, now: float, lease_seconds: float) -> dict[int, WorkerState]:
        """Every ordinal's worker: gone (as ``without_worker``), else busy or polling."""
        gone = set(self.without_worker(now, lease_seconds))
        running = {o for o, h in self.held.items() if h.state == RowState.RUNNING}
        return {
            p.ordinal: WorkerState.GONE
            if p.ordinal in gone
            else WorkerState.BUSY
            if p.ordinal in running
            else WorkerState.POLLING
            for p in self.presence
        }

    def waiting_assigned(self, now: float, lease_seconds: float) -> list[queries.Waiting]:
        """``assigned`` rows that have waited longer than a lease for their ordinal's worker."""
        return [w for w in self.assigned_since if now - w.since > lease_seconds]

    @property
    def ordinals(self) -> dict[str, int]:
        """Ordinals free, held by a healthy live row, held by a quarantined one: they sum to the pool."""
        return queries.ordinal_counts(self.free_ordinals, self.held_by_quarantined, self.pool_size)


def read(s: Session, pool_size: int) -> PoolNumbers:
    held = {h.ordinal: h for h in queries.held(s)}
    return PoolNumbers(
        rows=queries.counts_by_state(s),
        pool_size=pool_size,
        free_ordinals=[o for o in range(pool_size) if o not in held],
        quarantined=queries.quarantined_count(s),
        held_by_quarantined=queries.quarantined_ordinals(s),
        oldest_lease_failed_at=queries.oldest_in_state(s, RowState.LEASE_FAILED),
        live_children=lineage.live_count(s),
        audit_events=queries.audit_events_written(s),
        presence=presence.read(s, pool_size),
        assigned_since=queries.assigned_since(s),
        held=held,
        dispatch=pause.read(s),
        paused_boards=pause.boards(s),
    )
