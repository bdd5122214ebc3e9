"""Who may use the console, and proof that a form came from it (docs/design.md, "Console").

The operator signs in once with the operator token (``poolctl token --operator``,
checked by ``poolkeeper.tokens``); the server answers with a session cookie that
holds an expiry, a random nonce (two sign-ins in one second are two sessions) and
their HMAC under the server secret, never the token itself:
HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it),
Secure when the request came over HTTPS, valid ``SESSION_SECONDS``. Rotating
the secret ends every session, as it revokes every token.

Signing out ends the session on the server, not only in the browser: its nonce
is kept in the pool store (``store.signouts``) until the session would have
expired, so every ``serve`` replica behind one name refuses the cookie. Only a
signed-in operator can sign out, so nobody else can grow that table.

Every state-changing form (sign-out too) carries a CSRF value, the HMAC of the session it was
rendered for; a POST is taken only with a live session, that value, and an
``Origin`` header (when the browser sends one) naming this server's host.

A ``--local-only`` server has no secret and asks for no login, like its API; its
forms are still bound to a key of the process's own, and it answers only requests
addressed to a loopback ``Host`` (``limits.LoopbackHost``: no DNS rebinding).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from urllib.parse import urlsplit

from fastapi import Request, Response

from poolkeeper import tokens
from store import PoolStore, signouts

COOKIE = "poolkeeper_console"
SESSION_SECONDS = 12 * 3600
CSRF_FIELD = "csrf"
NONCE_BYTES = 8


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

    def check_token(self, token: str) -> str | None:
        """None when ``token`` is the operator's, else why it is refused (one sentence)."""
        token = token.strip()
        if not token:
            return "no token given: paste the output of `poolctl token --operator`"
        who = tokens.verify(self.secret, token)
        if who is None:
            return "that is not a token this server issued (see `poolctl token --operator`)"
        if not who.is_operator:
            return f"a token of {who} cannot sign in to the console: it needs the operator token"
        return None

    def start_session(self, request: Request, response: Response, now: float | None = None) -> None:
        expires = int((now or time.time()) + SESSION_SECONDS)
        nonce = secrets.token_hex(NONCE_BYTES)
        value = f"{expires}.{nonce}.{_mac(self.key, f'console:session:{expires}.{nonce}')}"
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
        if session is not None:
            expires, nonce = session
            with self.store.session() as s:
                signouts.sign_out(s, nonce, expires, now or time.time())
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")

    def signed_in(self, request: Request, now: float | None = None) -> bool:
        if self.local_only:
            return True
        session = self._session(request)
        if session is None:
            return False
        expires, nonce = session
        if expires <= (now or time.time()):
            return False
        with self.store.session(readonly=True) as s:
            return not signouts.signed_out(s, nonce)

    def _session(self, request: Request) -> tuple[int, str] | None:
        """The expiry and nonce of the request's cookie if this server signed it, else None."""
        expires, _, rest = request.cookies.get(COOKIE, "").partition(".")
        nonce, _, mac = rest.partition(".")
        if (
            not (expires.isascii() and expires.isdigit())
            or len(expires) > 12
            or len(nonce) != 2 * NONCE_BYTES
        ):
            return None
        if not _same(mac, _mac(self.key, f"console:session:{expires}.{nonce}")):
            return None
        return int(expires), nonce

    # --- forms ---------------------------------------------------------------------

    def csrf(self, request: Request) -> str:
        """The value a form rendered for this session carries."""
        session = "local" if self.local_only else request.cookies.get(COOKIE, "")
        return _mac(self.key, f"console:csrf:{session}")

    def form_refusal(self, request: Request, form: dict[str, str]) -> tuple[int, str] | None:
        """None when a POST may act; else its status and why it is refused."""
        if not self.signed_in(request):
            return 401, "you are not signed in: sign in with the operator token (`poolctl token --operator`)"
        origin = request.headers.get("origin")
        # host only: a TLS proxy in front changes the scheme the server sees, not the host
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
            return 403, "the form was sent from another site"
        if not _same(form.get(CSRF_FIELD, ""), self.csrf(request)):
            return 403, "the form's check value is missing or stale: reload the page and try again"
        return None
