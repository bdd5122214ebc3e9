"""Console sessions signed out before they expired, shared by every ``serve`` replica.

A sign-out adds the session's nonce and expiry and sweeps the ones past their
expiry (a cookie past it is refused anyway), so the table holds at most the
sessions signed out within one session's life.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from store.models import ConsoleSignout


def sign_out(s: Session, nonce: str, expires: float, now: float) -> None:
    s.execute(delete(ConsoleSignout).where(ConsoleSignout.expires <= now))
    s.merge(ConsoleSignout(nonce=nonce, expires=expires))  # signed out twice: once


def signed_out(s: Session, nonce: str) -> bool:
    return s.scalar(select(ConsoleSignout.nonce).where(ConsoleSignout.nonce == nonce)) is not None
