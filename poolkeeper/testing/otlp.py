"""A small OTLP/HTTP trace receiver: what the tests and ``bench --trace`` export to.

``Receiver`` listens on a loopback port and decodes each ``POST /v1/traces`` (protobuf
``ExportTraceServiceRequest``, as ``opentelemetry-exporter-otlp-proto-http`` sends it) into
``Span`` records; ``tree`` renders one trace as indented text. Needs the ``otel`` extra
(``opentelemetry-proto`` comes with the exporter).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    start: int  # ns since the epoch
    end: int
    service: str
    pid: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[str, ...] = ()  # span ids


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, decode: bool = True) -> None:
        """``decode`` False only counts the requests and their spans' bytes (a benchmark's sink)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Span] = []
        self.requests = self.bytes = 0
        lock = threading.Lock()
        answer = ExportTraceServiceResponse().SerializeToString()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                got: list[Span] = []
                if decode:
                    if self.headers.get("content-encoding") == "gzip":
                        body = gzip.decompress(body)
                    request = ExportTraceServiceRequest.FromString(body)
                    got = [s for r in request.resource_spans for s in _spans(r)]
                with lock:
                    receiver.spans.extend(got)
                    receiver.requests += 1
                    receiver.bytes += len(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                return None

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def env(self, delay_ms: int | None = 100) -> dict[str, str]:
        """The ``OTEL_*`` variables that export a process's spans here (each batch within ``delay_ms``;
        None: the SDK's default, 5 s)."""
        found = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
        }
        return found if delay_ms is None else {**found, "OTEL_BSP_SCHEDULE_DELAY": str(delay_ms)}

    def trace(self, trace_id: str) -> list[Span]:
        return sorted((s for s in list(self.spans) if s.trace_id == trace_id), key=lambda s: s.start)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _spans(resource_spans: Any) -> Iterable[Span]:
    attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
    service, pid = str(attrs.get("service.name", "")), int(attrs.get("process.pid", 0))
    for scope in resource_spans.scope_spans:
        for s in scope.spans:
            yield Span(
                trace_id=s.trace_id.hex(),
                span_id=s.span_id.hex(),
                parent_id=s.parent_span_id.hex(),
                name=s.name,
                start=s.start_time_unix_nano,
                end=s.end_time_unix_nano,
                service=service,
                pid=pid,
                attributes={a.key: _value(a.value) for a in s.attributes},
                links=tuple(link.span_id.hex() for link in s.links),
            )


def tree(spans: list[Span]) -> str:
    """One trace as an indented tree: name, process, start (ms after the root's) and duration."""
    if not spans:
        return "(no spans)"
    by_parent: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: s.start):
        by_parent.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    t0 = min(s.start for s in spans)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in by_parent.get(parent, []):
            at, took = (s.start - t0) / 1e6, (s.end - s.start) / 1e6
            where = f"{s.service}[{s.pid}]"
            lines.append(f"{'  ' * depth}{s.name:<{40 - 2 * depth}} {where:<28} +{at:8.1f} ms {took:8.1f} ms")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
