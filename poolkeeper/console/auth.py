"""Who may use the console, and proof that a form came from it (docs/design.md, "Console").

The operator signs in once with the operator token (``poolctl token --operator``,
checked by ``poolkeeper.tokens``), a viewer with the viewer token (``--viewer``: every
page, no action); the server answers with a session cookie that holds an expiry, a
random nonce (two sign-ins in one second are two sessions), the role and their HMAC
under the server secret, never the token itself:
HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it),
Secure when the request came over HTTPS, valid ``SESSION_SECONDS``. Rotating
the secret ends every session, as it revokes every token.

Signing out ends the session on the server, not only in the browser: its nonce
is kept in the pool store (``store.signouts``) until the session would have
expired, so every ``serve`` replica behind one name refuses the cookie. Only a
signed-in operator can sign out, so nobody else can grow that table.

Every state-changing form (sign-out too) carries a CSRF value, the HMAC of the session it was
rendered for; a POST is taken only with a live session, that value, and an
``Origin`` header (when the browser sends one) naming this server's host, and, but for
signing out, only from the operator's session: a viewer's is refused (403). Signing out
with a session cookie that expired or was signed out is held to the same value and
``Origin`` (and then records nothing); only a request with no cookie of ours has nothing to check.

A ``--local-only`` server has no secret and asks for no login, like its API; its
forms are still bound to a key of the process's own, and it answers only requests
addressed to a loopback ``Host`` (``limits.LoopbackHost``: no DNS rebinding).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Literal
from urllib.parse import urlsplit

from fastapi import Request, Response

from poolkeeper import tokens
from store import PoolStore, signouts

COOKIE = "poolkeeper_console"
SESSION_SECONDS = 12 * 3600
CSRF_FIELD = "csrf"
NONCE_BYTES = 8
Role = Literal["operator", "viewer"]
_ROLES: dict[str, Role] = {"o": "operator", "v": "viewer"}  # as the cookie spells them
VIEWER_REFUSED = "a viewer reads everything and changes nothing: sign in with the operator token to act"


class SignInRefused(Exception):
    """Why a token cannot sign in (one sentence)."""


def _mac(key: bytes, subject: str) -> str:
    return hmac.new(key, subject.encode(), hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    """A constant-time comparison with a MAC (hex); whatever ``given`` holds, never an exception."""
    # compare_digest raises TypeError on a str that is not ASCII: compare bytes
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


class ConsoleAuth:
    def __init__(self, secret: str, store: PoolStore) -> None:
        self.local_only = not secret
        self.secret = secret
        self.store = store  # where sign-outs are kept, for every replica
        # "console:" keeps these MACs apart from the tokens' ("operator", "ordinal:N")
        self.key = secret.encode() if secret else secrets.token_bytes(32)

    # --- signing in -------------------------------------------------------------

    def role_of(self, token: str) -> Role:
        """The role ``token`` signs in as (the operator's or the viewer's), else ``SignInRefused``."""
        token = token.strip()
        if not token:
            raise SignInRefused("no token given: paste the output of `poolctl token --operator`")
        who = tokens.verify(self.secret, token)
        if who is None:
            raise SignInRefused("that is not a token this server issued (see `poolctl token --operator`)")
        if not who.may_read or who.grant is not None:
            raise SignInRefused(
                f"a token of {who} cannot sign in to the console: it needs the operator's or the viewer's"
            )
        return "operator" if who.is_operator else "viewer"

    def start_session(
        self, request: Request, response: Response, role: Role = "operator", now: float | None = None
    ) -> None:
        expires = int((now or time.time()) + SESSION_SECONDS)
        nonce = secrets.token_hex(NONCE_BYTES)
        signed = f"{expires}.{nonce}.{role[0]}"
        value = f"{signed}.{_mac(self.key, f'console:session:{signed}')}"
        response.set_cookie(
            COOKIE,
            value,
            max_age=SESSION_SECONDS,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    def end_session(self, request: Request, response: Response, now: float | None = None) -> None:
        """Sign out: the browser drops the cookie, and this server refuses its value from now on."""
        session = self._session(request)
        now = now or time.time()
        if session is not None and session[0] > now:  # an expired cookie is refused anyway: nothing to keep
            expires, nonce, _ = session
            with self.store.session() as s:
                signouts.sign_out(s, nonce, expires, now)
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")

    def carries_session(self, request: Request) -> bool:
        """The request holds a cookie this server signed (live, expired or signed out); or local-only."""
        return self.local_only or self._session(request) is not None

    def signed_in(self, request: Request, now: float | None = None) -> bool:
        return self.role(request, now) is not None

    def role(self, request: Request, now: float | None = None) -> Role | None:
        """Whose live session the request carries (a --local-only server: the operator's), else None."""
        if self.local_only:
            return "operator"
        session = self._session(request)
        if session is None:
            return None
        expires, nonce, role = session
        if expires <= (now or time.time()):
            return None
        with self.store.session(readonly=True) as s:
            return None if signouts.signed_out(s, nonce) else role

    def _session(self, request: Request) -> tuple[int, str, Role] | None:
        """The expiry, nonce and role of the request's cookie if this server signed it, else None."""
        expires, _, rest = request.cookies.get(COOKIE, "").partition(".")
        nonce, _, rest = rest.partition(".")
        role, _, mac = rest.partition(".")
        if (
            not (expires.isascii() and expires.isdigit())
            or len(expires) > 12
            or len(nonce) != 2 * NONCE_BYTES
            or role not in _ROLES
        ):
            return None
        if not _same(mac, _mac(self.key, f"console:session:{expires}.{nonce}.{role}")):
            return None
        return int(expires), nonce, _ROLES[role]

    # --- forms ---------------------------------------------------------------------

    def csrf(self, request: Request) -> str:
        """The value a form rendered for this session carries."""
        session = "local" if self.local_only else request.cookies.get(COOKIE, "")
        return _mac(self.key, f"console:csrf:{session}")

    def form_refusal(
        self, request: Request, form: dict[str, str], *, acts: bool = True
    ) -> tuple[int, str] | None:
        """None when a POST may act (``acts``: change the pool; else sign out); else status and why not."""
        role = self.role(request)
        if role is None and (acts or not self.carries_session(request)):  # a dead session may sign out
            return 401, "you are not signed in: sign in with the operator token (`poolctl token --operator`)"
        origin = request.headers.get("origin")
        # host only: a TLS proxy in front changes the scheme the server sees, not the host
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
            return 403, "the form was sent from another site"
        if not _same(form.get(CSRF_FIELD, ""), self.csrf(request)):
            return 403, "the form's check value is missing or stale: reload the page and try again"
        if acts and role != "operator":
            return 403, VIEWER_REFUSED
        return None
