"""What the routes share, as FastAPI dependencies over ``app.state`` (``app.create_app`` sets it).

- ``Pool``: the ``PoolStore``; ``Write``: runs a store write under the app's write gate (on
  SQLite this process's writers queue on a mutex, elsewhere it is nothing); ``Heartbeats``:
  the group commit heartbeats share (``group``), under the same gate.
- ``Caller``: who the bearer token says the request acts for (``tokens.LOCAL`` on a
  ``--local-only`` server). ``AuthFirst`` routes check it before the body is even read, so
  a request without a token is 401 whatever it sends.
- ``Reader``: the caller, if it may read what the operator reads (the operator, or a viewer:
  ``poolctl token --viewer``; 403 otherwise).
- ``worker_of`` and ``holder_of``: "acts for this ordinal" and "acts for this grant's
  children", which a route's body dependency calls with the fields its model names (403
  before the store is called).

These dependencies are ``async``: they wait on nothing, so they run on the event loop
rather than taking a trip through the thread pool each. ``holder_of`` may read the store,
so the body dependencies that call it are plain functions.
"""

# No ``from __future__ import annotations``: FastAPI reads these annotations at run time.
import functools
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from core import validate
from core.errors import Forbidden, InvalidInput, Unauthenticated
from poolkeeper import tokens
from poolkeeper.api.group import GroupCommit
from poolkeeper.api.waits import OfferWaits
from poolkeeper.tokens import Principal
from store import Envelope, PoolStore, rows
from tasks.events import Events

Delivered = Literal["applied", "duplicate"]
P = ParamSpec("P")
T = TypeVar("T")
bearer = HTTPBearer(
    auto_error=False,
    description="`poolctl token --ordinal N` (acts for ordinal N only), `poolctl token --operator`,"
    " `poolctl token --viewer` (reads /v1/status only), or a grant's `child_token` (its /v1/children"
    " calls only).",
)


async def pool(request: Request) -> PoolStore:
    store: PoolStore = request.app.state.pool
    return store


class Writer:
    """Runs a store write under the app's write gate: ``write(pool.heartbeat, envelope)``."""

    def __init__(self, gate: AbstractContextManager[None]) -> None:
        self.gate = gate

    def __call__(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        with self.gate:
            return call(*args, **kwargs)


async def writing(request: Request) -> Writer:
    writer: Writer = request.app.state.writer
    return writer


async def heartbeats(request: Request) -> GroupCommit[Envelope, Delivered]:
    group: GroupCommit[Envelope, Delivered] = request.app.state.heartbeats
    return group


async def secret(request: Request) -> str | None:
    found: str | None = request.app.state.secret
    return found


Pool = Annotated[PoolStore, Depends(pool)]
Write = Annotated[Writer, Depends(writing)]
Heartbeats = Annotated[GroupCommit[Envelope, Delivered], Depends(heartbeats)]
Secret = Annotated[str | None, Depends(secret)]


def offer_waits(request: Request) -> OfferWaits:
    waits: OfferWaits = request.app.state.offer_waits
    return waits


Waits = Annotated[OfferWaits, Depends(offer_waits)]


def events(request: Request) -> Events:
    found: Events = request.app.state.events
    return found


PlaneEvents = Annotated[Events, Depends(events)]


def bearer_token(scheme: str, token: str) -> str | None:
    """The token of an ``Authorization`` header split at its first space; None unless a bearer's."""
    return token.strip() or None if scheme.lower() == "bearer" else None


def authenticate(key: str | None, token: str | None) -> Principal:
    """Who ``token`` acts for, under the server's ``key``; ``Unauthenticated`` if no one."""
    if not key:
        return tokens.LOCAL  # a --local-only server: the schema declares no security (app.create_app)
    if token is None:
        raise Unauthenticated("an Authorization: Bearer token is required")
    found = _verified(key, token) if tokens.well_formed(token) else None  # junk is not remembered
    if found is None:
        raise Unauthenticated("the bearer token is not one this server issued")
    return found


@functools.lru_cache(maxsize=4096)
def _verified(key: str, token: str) -> Principal | None:
    """``tokens.verify``, remembered: a token's MAC under a key never changes, and every worker
    sends the same token with each call (twice checked per request: ``AuthFirst``, ``Caller``)."""
    return tokens.verify(key, token)


async def caller(
    key: Secret, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Principal:
    return authenticate(key, None if creds is None else creds.credentials)


class AuthFirst(APIRoute):
    """A route that authenticates its caller before it reads the body.

    FastAPI reads and decodes a JSON body before it resolves any dependency, so a
    request with no token and a body that is not JSON was 422, not 401: an
    unauthenticated client learnt about the body and made the server parse it.
    ``Caller`` still names the principal (and declares the bearer scheme in the schema).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def authenticated(request: Request) -> Response:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            authenticate(request.app.state.secret, bearer_token(scheme, token))
            return await handle(request)

        return authenticated


Caller = Annotated[Principal, Depends(caller)]


def not_a_child(who: Principal) -> None:
    if who.grant is not None:
        raise Forbidden(f"a child token (of {who}) acts only on /v1/children for that grant, nothing else")


def _may(who: Principal, allowed: bool, what: str) -> Principal:
    not_a_child(who)
    if not allowed:
        raise Forbidden(f"a token of {who} cannot {what}")
    return who


async def reader(who: Caller) -> Principal:
    """The dependency of admin reads: the operator, or a viewer (who changes nothing)."""
    return _may(who, who.may_read, "read the pool's status")


Reader = Annotated[Principal, Depends(reader)]


async def board_caller(who: Caller) -> Principal:
    """The dependency of ``/v1/board-events``: a board's token, or the operator's."""
    return _may(who, who.board or who.is_operator, "report board events")


BoardCaller = Annotated[Principal, Depends(board_caller)]


def worker_of(ordinal: int, who: Principal) -> None:
    """The caller acts for ``ordinal``: its worker's token (or anyone, local-only); never a child's."""
    not_a_child(who)
    if not who.acts_for(ordinal):
        raise Forbidden(f"a token of {who} cannot act for ordinal {ordinal}")


def holder_of(store: PoolStore, row_id: int, fence: int, field: str, who: Principal) -> None:
    """A child call acts for its run's ordinal, or for the one grant a child token names.

    A worker token's ordinal must hold the row: a row's ordinal never changes,
    so reading it before the store call is enough. A child token must name the
    request's row and fence (or epoch); the store then refuses it as stale once
    that grant has ended, as it does the ordinal's token.
    """
    if who.anyone:
        return
    if who.is_operator:
        raise Forbidden(f"a token of {who} cannot act for a worker's children")
    if row_id > validate.INT32_MAX:
        raise InvalidInput(field, f"names row {row_id}, past the largest row id")
    if who.grant is not None:
        if who.grant != (row_id, fence):
            raise Forbidden(
                f"a child token of {who} cannot act for the grant of row {row_id} under fence {fence}"
            )
        return
    with store.session(readonly=True) as s:
        ordinal = rows.get_row(s, row_id).ordinal
    worker_of(ordinal, who)
