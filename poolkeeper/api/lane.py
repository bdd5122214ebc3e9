"""The heartbeat lane: ``POST /v1/heartbeat`` answered without the framework's work per request.

A heartbeat is the call a pool makes most (every worker, every few seconds), and
FastAPI's routing, dependency solving and response validation cost the server
more CPU than the store's own work (``bench/api_bench.py``). ``HeartbeatLane``
sits inside the body limit and the metrics: a heartbeat whose body is an
``Envelope`` (as the route's model validates it) under a token that acts for its
ordinal goes straight to the group commit, and its outcome or refusal is
answered exactly as the route answers it (``errors``). Anything else (no token,
another's ordinal, a body the model refuses, another content type) goes on to the
route itself, which answers it as ever: the lane only takes the one well-formed,
authorised case, so it can refuse nothing the route would accept.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import PoolError, Unauthenticated
from poolkeeper.api import deps
from poolkeeper.api.models import Envelope
from poolkeeper.http import errors

PATH = "/v1/heartbeat"
JSON = b"application/json"
ONCE = (b"authorization", b"content-type")  # the lane's headers: a request repeating one goes to the route


def _answer(outcome: str) -> tuple[Message, Message]:
    """The route's answer for ``outcome``, as the two ASGI messages ``JSONResponse`` would send."""
    response = JSONResponse({"outcome": outcome})
    start = {"type": "http.response.start", "status": 200, "headers": response.raw_headers}
    return start, {"type": "http.response.body", "body": response.body}


ANSWERS = {outcome: _answer(outcome) for outcome in ("applied", "duplicate")}  # built once, not per request


class HeartbeatLane:
    def __init__(self, app: ASGIApp, route: Any) -> None:
        self.app, self.route = app, route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        message = await receive()
        env = self._admitted(scope, message)
        if env is None:
            await self.app(scope, _replay(message, receive), send)
            return
        scope["route"] = self.route  # the route's label in the metrics
        state = scope["app"].state
        try:
            outcome = await state.heartbeats(env.checked(state.pool.pool_size))
        except PoolError as err:
            answer: Response = errors.pool_error(Request(scope), err)
        except SQLAlchemyError as err:
            answer = errors.database_error(Request(scope), err)
        else:
            start, body = ANSWERS[outcome]
            await send({**start, "headers": list(start["headers"])})  # a wrapper may add to them
            await send(dict(body))
            return
        await answer(scope, receive, send)

    def _admitted(self, scope: Scope, message: Message) -> Envelope | None:
        """The envelope, if the request is one the route would accept as it stands; else None."""
        if message["type"] != "http.request" or message.get("more_body", False):
            return None
        headers: dict[bytes, bytes] = {}
        for header, value in scope["headers"]:
            if header in headers and header in ONCE:
                return None  # the route reads the first of them: let it answer
            headers[header] = value
        if headers.get(b"content-type") != JSON:
            return None
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        try:
            who = deps.authenticate(scope["app"].state.secret, deps.bearer_token(scheme, token))
            env = Envelope.model_validate_json(message.get("body", b""))
        except (Unauthenticated, ValidationError):
            return None
        if who.grant is not None or not who.acts_for(env.worker_ordinal):
            return None
        return env


def _replay(first: Message, receive: Receive) -> Receive:
    """``receive``, giving ``first`` (already read) once before what follows."""
    pending: Message | None = first

    async def replay() -> Message:
        nonlocal pending
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replay
