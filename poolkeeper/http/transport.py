"""``poolctl serve``'s connections: a deadline on every request, and caps per client and in all.

uvicorn has no header-read timeout (its keep-alive timer runs only after a
response) and its ``limit_concurrency`` answers in ``text/plain``, so a client
that connects and sends nothing, or drips header lines, holds a connection for
ever, and enough of them turn every worker away. ``GuardedH11`` is uvicorn's h11
protocol with three additions:

- **One deadline from accept to the end of the body**: the head must arrive
  within ``timeout`` seconds of the accept (on a reused connection, of the
  request's first byte); the time it started goes to the request's scope
  (``STARTED``) so ``limits.BodyLimit`` holds the body to the same deadline.
  Past it: a 408 if the client sent part of a request, else the connection is
  closed (nothing was asked).
- **Connections bounded per client address and in all**. When a client is at
  its cap, or the server at its total, the oldest *idle* connection (no request
  under way: an idle keep-alive, or a head still arriving) of that client (or
  of the client holding the most) is closed to make room, so an idle flood
  only churns its own sockets and never locks a holder out. Only when every
  connection in the way is serving a request is the new one refused: its
  request gets 503 ``Overloaded`` with ``Retry-After``.
- **Every answer is JSON** ``{"error", "detail"}``, h11's own 400 for a request
  it cannot parse included.

The per-client cap keys on the peer address. Workers that reach the server
through one proxy share that proxy's address: give that deployment a
per-client cap as large as the total (``--max-connections-per-client``) and
let the proxy bound its own clients. Forwarded-for headers are not trusted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, ClassVar

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from poolkeeper.http import middleware as limits
from poolkeeper.http.middleware import STARTED

log = logging.getLogger("poolkeeper.server")
RETRY_AFTER_SECONDS = 1


def _raw(status: int, reason: str, error: str, detail: str) -> bytes:
    """A whole JSON answer, for a connection whose request h11 never parsed (no response cycle)."""
    body = json.dumps({"error": error, "detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class Guard:
    """The connections a server holds, by client address, and the caps and deadline they keep."""

    def __init__(self, *, timeout: float, max_connections: int, max_per_client: int) -> None:
        self.timeout = timeout
        self.max_connections = max_connections
        self.max_per_client = min(max_per_client, max_connections)
        self.by_client: dict[str, list[GuardedH11]] = {}
        self.total = 0

    def admit(self, conn: GuardedH11) -> bool:
        """Count ``conn`` in, closing an idle connection to make room; False: refuse it (all busy)."""
        mine = self.by_client.get(conn.peer, [])
        if len(mine) >= self.max_per_client and not self._evict(mine):
            return False
        if self.total >= self.max_connections:
            crowded = sorted(self.by_client.values(), key=len, reverse=True)
            if not any(self._evict(conns) for conns in crowded):
                return False
        self.by_client.setdefault(conn.peer, []).append(conn)
        self.total += 1
        return True

    def leave(self, conn: GuardedH11) -> None:
        conns = self.by_client.get(conn.peer)
        if conns is None or conn not in conns:
            return
        conns.remove(conn)
        self.total -= 1
        if not conns:
            del self.by_client[conn.peer]

    def _evict(self, conns: list[GuardedH11]) -> bool:
        for old in conns:  # oldest first
            if old.idle():
                self.leave(old)
                old.transport.close()
                return True
        return False


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol under a ``Guard`` (a subclass per server binds it: ``protocol``)."""

    guard: ClassVar[Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peer = ""
        self.deadline: asyncio.TimerHandle | None = None
        self.heard = False  # a byte of the current request has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else "unknown"
        if not self.guard.admit(self):
            self.app = overloaded  # answer its request, then close; it holds no place meanwhile
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.leave(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.deadline is None and self.conn.their_state is h11.IDLE and self.idle():
            self._arm()  # the first byte of the next request on a kept-alive connection
        self.heard = self.heard or bool(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is in: the body's part of the deadline is BodyLimit's

    def on_response_complete(self) -> None:
        self.heard = False
        super().on_response_complete()

    def idle(self) -> bool:
        """No request under way: nothing would be lost by closing this connection."""
        return self.cycle is None or self.cycle.response_complete

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw(400, "Bad Request", "BadRequest", msg))
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        # per connection: uvicorn copies this dict into each request's scope["state"]
        self.app_state = {**self.app_state, STARTED: time.monotonic()}
        self.deadline = self.loop.call_later(self.guard.timeout, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.transport.is_closing() or not self.idle():
            return
        if self.heard:
            detail = f"request not received within {self.guard.timeout:g}s"
            self.transport.write(_raw(408, "Request Timeout", "RequestTimeout", detail))
        self.transport.close()


async def overloaded(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    detail = "the server is at its connection limit, every connection serving a request: try again"
    await limits.reply(send, 503, "Overloaded", detail, retry_after=RETRY_AFTER_SECONDS)


def protocol(guard: Guard) -> type[GuardedH11]:
    """The protocol class uvicorn builds each connection with (``uvicorn.Config(http=...)``)."""
    return type("GuardedH11", (GuardedH11,), {"guard": guard})
