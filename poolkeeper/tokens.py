"""Bearer tokens of the wire protocol, derived from the server secret (docs/design.md, "Wire protocol").

A token names its subject and carries the HMAC-SHA256 of that subject under the
server secret: ``o3.<hex>`` acts for ordinal 3 only, ``op.<hex>`` is the
operator's, ``view.<hex>`` the viewer's (reads what the operator reads, changes
nothing), ``board.<hex>`` a board's (it may only tell the pool that tasks turned ready:
``POST /v1/board-events``), ``c12.40.<hex>`` is a child token: it acts only on the child
executions of row 12's grant under fence 40 (``poolctl worker`` hands it to its
command instead of the ordinal's token). Nothing is stored: the server
recomputes the MAC for the subject a token names and compares in constant time,
so a token is checked without trying every ordinal, and rotating the secret
revokes every token at once.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(
    r"(?:o(0|[1-9][0-9]{0,5})|(op|view|board)|c([1-9][0-9]{0,9})\.([1-9][0-9]{0,18}))\.([0-9a-f]{64})"
)


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: one ordinal's worker, one grant's children, the operator or a viewer."""

    ordinal: int | None = None  # the one ordinal a worker token acts for
    operator: bool = False
    viewer: bool = False  # reads everything the operator reads; changes nothing
    board: bool = False  # a board telling the pool its tasks turned ready (/v1/board-events), nothing else
    anyone: bool = False  # a --local-only server with no secret: every ordinal, and the operator
    grant: tuple[int, int] | None = None  # a child token's (row id, fence): that grant's children only

    def acts_for(self, ordinal: int) -> bool:
        return self.anyone or self.ordinal == ordinal

    @property
    def is_operator(self) -> bool:
        return self.anyone or self.operator

    @property
    def may_read(self) -> bool:
        """May read what an operator reads (status, the console's pages): the operator or a viewer."""
        return self.is_operator or self.viewer

    def __str__(self) -> str:
        if self.grant is not None:
            return f"the grant of row {self.grant[0]} under fence {self.grant[1]}"
        if self.viewer:
            return "viewer"
        if self.board:
            return "board"
        return "local caller" if self.anyone else "operator" if self.operator else f"ordinal {self.ordinal}"


OPERATOR = Principal(operator=True)
VIEWER = Principal(viewer=True)
BOARD = Principal(board=True)
LOCAL = Principal(anyone=True)


def _mac(secret: str, subject: str) -> str:
    return hmac.new(secret.encode(), subject.encode(), hashlib.sha256).hexdigest()


def _subject(who: Principal) -> tuple[str, str]:
    """A principal's name in its token and the subject its MAC is over (one per principal)."""
    if who.operator:
        return "op", "operator"
    if who.viewer:
        return "view", "viewer"
    if who.board:
        return "board", "board-events"
    if who.grant is not None:
        row_id, fence = who.grant
        return f"c{row_id}.{fence}", f"child:{row_id}:{fence}"
    return f"o{who.ordinal}", f"ordinal:{who.ordinal}"


def issue(secret: str, who: Principal) -> str:
    name, subject = _subject(who)
    return f"{name}.{_mac(secret, subject)}"


def ordinal_token(secret: str, ordinal: int) -> str:
    return issue(secret, Principal(ordinal=ordinal))


def operator_token(secret: str) -> str:
    return issue(secret, OPERATOR)


def viewer_token(secret: str) -> str:
    """Reads what the operator's reads (``/v1/status``, the console), changes nothing."""
    return issue(secret, VIEWER)


def board_token(secret: str) -> str:
    """What a board (a third party's, or ``board serve``) calls ``POST /v1/board-events`` with."""
    return issue(secret, BOARD)


def child_token(secret: str, row_id: int, fence: int) -> str:
    """What a grant's command and its children act with: that grant's /v1/children calls only."""
    return issue(secret, Principal(grant=(row_id, fence)))


def well_formed(token: str) -> bool:
    """Whether ``token`` has the form of one (``o3.<hex>``, ``op.<hex>``, ``view.<hex>``, ``board.<hex>``,
    ``c12.40.<hex>``), MAC unchecked."""
    return _TOKEN_RE.fullmatch(token) is not None


def verify(secret: str, token: str) -> Principal | None:
    """The principal a token proves, or ``None`` for anything else (constant-time MAC check)."""
    found = _TOKEN_RE.fullmatch(token)
    if found is None:
        return None
    ordinal, role, row_id, fence, mac = found.groups()
    if ordinal is not None:
        who = Principal(ordinal=int(ordinal))
    elif row_id is not None:
        who = Principal(grant=(int(row_id), int(fence)))
    else:
        who = {"op": OPERATOR, "view": VIEWER, "board": BOARD}[role]
    return who if hmac.compare_digest(mac, _mac(secret, _subject(who)[1])) else None
