"""The pool's numbers, read in one transaction: the one function ``poolctl status``, the console,
``/v1/status`` and the store gauges of ``/metrics`` build them with, so no two can disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from store import lineage, queries
from store.models import RowState


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

    @property
    def ordinals(self) -> dict[str, int]:
        """Ordinals free, held by a healthy live row, held by a quarantined one: they sum to the pool."""
        return queries.ordinal_counts(self.free_ordinals, self.held_by_quarantined, self.pool_size)


def read(s: Session, pool_size: int) -> PoolNumbers:
    return PoolNumbers(
        rows=queries.counts_by_state(s),
        pool_size=pool_size,
        free_ordinals=queries.free_ordinals(s, pool_size),
        quarantined=queries.quarantined_count(s),
        held_by_quarantined=queries.quarantined_ordinals(s),
        oldest_lease_failed_at=queries.oldest_in_state(s, RowState.LEASE_FAILED),
        live_children=lineage.live_count(s),
        audit_events=queries.audit_events_written(s),
    )
