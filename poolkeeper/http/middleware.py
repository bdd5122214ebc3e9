"""Four ASGI middlewares: bounded request bodies, request counters by route, loopback Hosts only, and
a span for each request that carries a trace context.

``BodyLimit`` refuses a declared ``Content-Length`` over the limit before reading
a byte (413), reads a chunked body only up to the limit, and gives a client
``timeout`` seconds from the accept (``transport`` times the head) to send all of
it (408). A JSON body that repeats a key in one object is refused (422): the
framework's parser would keep the last one, so the text would not mean one thing.
The body is read here, on the event loop, so a slow sender holds its own
connection and no worker thread.

``LoopbackHost`` guards a ``--local-only`` server, which asks no one for a
token: a request whose ``Host`` header is not a loopback name or address is
refused (403) before it reaches a route, so another site's page that rebinds
its own name to 127.0.0.1 (DNS rebinding) cannot drive the API or the console.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from typing import Any

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core import tracing, validate

STARTED = "poolkeeper.request_started"  # set by ``transport.GuardedH11``: when the request's head began
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


async def reply(send: Send, status: int, error: str, detail: Any, *, retry_after: int | None = None) -> None:
    body = json.dumps({"error": error, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"request body larger than {self.max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await reply(send, 413, "BodyTooLarge", too_large)
            return
        chunks: list[bytes] = []
        size = 0
        # one deadline from the accept (or a reused connection's first byte) to the body's end:
        # the protocol (``transport``) says when the head began; in-process (tests) it is now
        started = scope.get("state", {}).get(STARTED, time.monotonic())
        deadline = started + self.timeout
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout_at(loop.time() + max(deadline - time.monotonic(), 0.001)):
                    message = await receive()  # a timeout, not ``wait_for``: no task per message
            except TimeoutError:
                await reply(send, 408, "RequestTimeout", f"request not received within {self.timeout:g}s")
                return
            if message["type"] == "http.disconnect":
                return  # the client left: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await reply(send, 413, "BodyTooLarge", too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)
        if body and (twice := _repeated_key(scope, body)):  # the framework would keep the last one
            await reply(
                send, 422, "ValidationError", [{"loc": ["body"], "msg": twice, "type": "json_invalid"}]
            )
            return

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)


def _repeated_key(scope: Scope, body: bytes) -> str | None:
    """A JSON body that repeats a key does not mean one thing: the sentence saying so, else None."""
    first = next((v for k, v in scope["headers"] if k == b"content-type"), b"")  # the one the route reads
    sent = first.split(b";")[0].strip().lower()
    return validate.repeated_key(body) if sent == b"application/json" else None


class RequestMetrics:
    """``poolkeeper_http_requests_total{route,method,status}`` and latency by route."""

    def __init__(self, app: ASGIApp, requests: Counter, seconds: Histogram) -> None:
        self.app, self.requests, self.seconds = app, requests, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route: Any = scope.get("route")
            label = getattr(route, "path", None) or "other"  # a route template: a bounded label
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.requests.labels(label, method, str(status)).inc()
            self.seconds.labels(label).observe(time.perf_counter() - started)


class LoopbackHost:
    """403 for a request addressed (``Host``) to anything but 127.0.0.1, [::1] or localhost, any port."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host")
        if host is not None and not loopback_host(host.decode("latin-1")):
            detail = (
                f"Host {host.decode('latin-1')[:80]!a} is not a loopback address: a --local-only server"
                " answers only requests addressed to 127.0.0.1, [::1] or localhost"
            )
            await reply(send, 403, "NotLoopback", detail)
            return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """An address to bind: 127.0.0.1 (any of 127/8), ::1 (bracketed or not) or localhost."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


# A Host header (RFC 9110 7.2, RFC 3986 3.2.2): a bracketed IPv6 literal or a name/IPv4, then an
# optional port; nothing may follow. "[::1].evil.example" or "127.0.0.1.evil" match no loopback.
_HOST = re.compile(
    r"\[(?P<v6>[0-9A-Fa-f:.]+)\](?::(?P<p6>[0-9]{1,5}))?|(?P<name>[^\[\]:]+)(?::(?P<port>[0-9]{1,5}))?"
)


def host_name(host: str) -> str | None:
    """The name or address in a ``Host`` header, without its port (``[::1]:8000`` is ``::1``);
    None when the header is not one well-formed host with an optional port."""
    found = _HOST.fullmatch(host)
    if found is None:
        return None
    port = found["p6"] or found["port"]
    if port is not None and int(port) > 65535:
        return None
    if found["v6"] is not None:
        try:
            ipaddress.IPv6Address(found["v6"])
        except ValueError:
            return None
        return found["v6"]
    return found["name"]


def loopback_host(header: str) -> bool:
    """A ``Host`` header addressed to loopback: ``[::1]``, ``127.x.y.z`` or ``localhost``, any port."""
    name = host_name(header)
    if name is None:
        return False
    if ":" in name:
        return ipaddress.IPv6Address(name).is_loopback
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.IPv4Address(name).is_loopback
    except ValueError:
        return False


class TraceRequests:
    """A request whose ``traceparent`` header names a trace is a server span in it (``core.tracing``),
    current while the request is answered (a route's own spans are its children), named by its route
    template; the answer carries the span's own ``traceparent``. A request without one starts no
    trace (probes, the console, a poll for work). Installed only with tracing on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parent = next((v for k, v in scope.get("headers", ()) if k == b"traceparent"), None)
        if scope["type"] != "http" or parent is None:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        with tracing.span(method, parent.decode("latin-1"), server=True) as named:
            here = (tracing.current() or "").encode()

            async def answer(message: Message) -> None:
                if message["type"] == "http.response.start" and here:
                    message = {**message, "headers": [*message.get("headers", ()), (b"traceparent", here)]}
                await send(message)

            try:
                await self.app(scope, receive, answer)
            finally:
                route = getattr(scope.get("route"), "path", None) or "other"
                named(f"{method} {route}")
