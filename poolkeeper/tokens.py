"""Bearer tokens of the wire protocol, derived from the server secret (docs/design.md, "Wire protocol").

A token names its subject and carries the HMAC-SHA256 of that subject under the
server secret: ``o3.<hex>`` acts for ordinal 3 only, ``op.<hex>`` is the
operator's. Nothing is stored: the server recomputes the MAC for the subject a
token names and compares in constant time, so a token is checked without
trying every ordinal, and rotating the secret revokes every token at once.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"(?:o(0|[1-9][0-9]{0,5})|op)\.([0-9a-f]{64})")


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: one ordinal's worker, or the operator."""

    ordinal: int | None = None  # the one ordinal a worker token acts for
    operator: bool = False
    anyone: bool = False  # a --local-only server with no secret: every ordinal, and the operator

    def acts_for(self, ordinal: int) -> bool:
        return self.anyone or self.ordinal == ordinal

    @property
    def is_operator(self) -> bool:
        return self.anyone or self.operator

    def __str__(self) -> str:
        return "local caller" if self.anyone else "operator" if self.operator else f"ordinal {self.ordinal}"


OPERATOR = Principal(operator=True)
LOCAL = Principal(anyone=True)


def _mac(secret: str, subject: str) -> str:
    return hmac.new(secret.encode(), subject.encode(), hashlib.sha256).hexdigest()


def ordinal_token(secret: str, ordinal: int) -> str:
    return f"o{ordinal}.{_mac(secret, f'ordinal:{ordinal}')}"


def operator_token(secret: str) -> str:
    return f"op.{_mac(secret, 'operator')}"


def verify(secret: str, token: str) -> Principal | None:
    """The principal a token proves, or ``None`` for anything else (constant-time MAC check)."""
    found = _TOKEN_RE.fullmatch(token)
    if found is None:
        return None
    number, mac = found.groups()
    principal = OPERATOR if number is None else Principal(ordinal=int(number))
    subject = "operator" if number is None else f"ordinal:{number}"
    return principal if hmac.compare_digest(mac, _mac(secret, subject)) else None
