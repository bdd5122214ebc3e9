"""Three ASGI middlewares: bounded request bodies, request counters by route, and loopback Hosts only.

``BodyLimit`` refuses a declared ``Content-Length`` over the limit before reading
a byte (413), reads a chunked body only up to the limit, and gives a client
``timeout`` seconds to send all of it (408). The body is read here, on the event
loop, so a slow sender holds its own connection and no worker thread.

``LoopbackHost`` guards a ``--local-only`` server, which asks no one for a
token: a request whose ``Host`` header is not a loopback name or address is
refused (403) before it reaches a route, so another site's page that rebinds
its own name to 127.0.0.1 (DNS rebinding) cannot drive the API or the console.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from typing import Any

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


async def reply(send: Send, status: int, error: str, detail: str) -> None:
    body = json.dumps({"error": error, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
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
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                await reply(
                    send, 408, "RequestTimeout", f"request body not received within {self.timeout:g}s"
                )
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

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)


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
        if host is not None and not is_loopback(host_name(host.decode("latin-1"))):
            detail = (
                f"Host {host.decode('latin-1')[:80]!a} is not a loopback address: a --local-only server"
                " answers only requests addressed to 127.0.0.1, [::1] or localhost"
            )
            await reply(send, 403, "NotLoopback", detail)
            return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """127.0.0.1 (any of 127/8), ::1 (bracketed or not) or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8000`` is ``::1``."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host
