"""Tracing: one trace per run, through the OpenTelemetry API (docs/tracing.md).

Off unless the standard ``OTEL_*`` variables ask for traces: ``OTEL_TRACES_EXPORTER`` set to
something other than ``none``, or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and ``OTEL_SDK_DISABLED`` not ``true``. Off, every
helper returns at once and nothing of OpenTelemetry is imported (``poolctl --version`` starts
as fast as ever). On, the first span sets the SDK up (the ``otel`` extra): a tracer provider
whose resource comes from ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the service
name defaults to the process's role, given to ``setup``), a batch processor, and the exporter
``OTEL_TRACES_EXPORTER`` names (``otlp``, over HTTP/protobuf, the default; or ``console``).
With the SDK absent it says so in one line and stays off.

Context travels as a W3C ``traceparent``: in a claim and on its row (the ``traceparent``
column, set at materialize, which the passes a beat scan starts later take as their parent),
as the ``traceparent`` header of HTTP requests and answers, in a grant, and to the command as
``TRACEPARENT``. The rest of the code calls this module, never the SDK.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

log = logging.getLogger("poolkeeper.tracing")

ENV = "TRACEPARENT"  # the command's (and a child process's) parent, as in the W3C trace-context env spec
HEADER = "traceparent"
TRACEPARENT_CHARS = 55  # version 00: 2 + 1 + 32 + 1 + 16 + 1 + 2
_SHAPE = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
Rename = Callable[[str], None]  # what ``span`` yields: names the span once its name is known


def _keep_name(_: str) -> None:
    return None


_NULL: AbstractContextManager[Rename] = nullcontext(_keep_name)

_state: dict[str, Any] = {"service": "poolkeeper"}
_lock = threading.Lock()


def configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the ``OTEL_*`` variables ask for traces (nothing is imported to tell)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


_on = configured()


def enabled() -> bool:
    return _on


def setup(service: str, *, now: bool = True) -> None:
    """Name this process's role (the default ``service.name``) and, with tracing on, start the SDK
    ``now``, at start-up, rather than inside the first span. A process that forks its workers
    (Celery's prefork pool) starts it in each child instead (``start``): the resource names the pid."""
    _state["service"] = service
    if now:
        start()


def start() -> None:
    """With tracing on, set the SDK up now (once per process); off, nothing."""
    if _on:
        _api()


def valid(traceparent: object) -> str | None:
    """``traceparent`` if it is a W3C version-00 one this module can continue, else None."""
    if isinstance(traceparent, str) and _SHAPE.fullmatch(traceparent):
        return traceparent
    return None


def span(
    name: str,
    parent: str | None = None,
    attributes: Mapping[str, Any] | None = None,
    *,
    join_only: bool = False,
    server: bool = False,
    links: Sequence[str | None] = (),
    start: float | None = None,
) -> AbstractContextManager[Rename]:
    """A span, current while the block runs (it yields a function that renames it): child of
    ``parent`` (a traceparent), else of the current span, else (unless ``join_only``) the root of a
    new trace. ``start``: when it began (``time.time()``), if before the block. Off, a no-op."""
    if not _on:
        return _NULL
    return _span(name, parent, join_only, server, links, start, attributes or {})


@contextmanager
def _span(
    name: str,
    parent: str | None,
    join_only: bool,
    server: bool,
    links: Sequence[str | None],
    start: float | None,
    attributes: Mapping[str, Any],
    fresh: bool = False,
) -> Iterator[Rename]:
    api = _api()
    if api is None:
        yield _keep_name
        return
    trace = api
    above = _span_context(trace, parent)
    context = None if above is None else trace.set_span_in_context(trace.NonRecordingSpan(above))
    if fresh:
        from opentelemetry.context import Context

        context = Context()
    if context is None and join_only and not trace.get_current_span().get_span_context().is_valid:
        yield _keep_name
        return
    linked = [trace.Link(c) for c in (_span_context(trace, t) for t in links) if c is not None]
    with _tracer(trace).start_as_current_span(
        name,
        context=context,
        kind=trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL,
        attributes={k: v for k, v in attributes.items() if v is not None},
        links=linked,
        start_time=None if start is None else int(start * 1e9),
    ) as opened:
        yield opened.update_name


def root(
    name: str, start: float, attributes: Mapping[str, Any] | None = None, links: Sequence[str | None] = ()
) -> str | None:
    """A finished root span from ``start`` until now (a new trace); its traceparent. Off: None."""
    if not _on:
        return None
    with _span(name, None, False, False, links, start, attributes or {}, fresh=True):
        return current()


def current() -> str | None:
    """The current span's traceparent; else ``TRACEPARENT`` of this process's environment (it was
    started inside a trace: a command, ``poolctl child``). Off: None."""
    if not _on:
        return None
    api = _state.get("api")  # no span yet in this process: none is current, and the SDK need not start
    if api is None:
        return valid(os.environ.get(ENV))
    trace = api
    here = trace.get_current_span().get_span_context()
    if here.is_valid:
        return f"00-{here.trace_id:032x}-{here.span_id:016x}-{int(here.trace_flags):02x}"
    return valid(os.environ.get(ENV))


def headers() -> dict[str, str]:
    """``{"traceparent": …}`` for an outgoing request or message, or ``{}``."""
    tp = current() if _on else None
    return {HEADER: tp} if tp else {}


def install(provider: Any) -> None:
    """Trace into ``provider`` (an SDK ``TracerProvider``), whatever ``OTEL_*`` says: for tests and
    for a program that embeds the plane and owns its provider. ``install(None)`` turns tracing off."""
    global _on
    for name in ("api", "tracer", "provider", "failed"):
        _state.pop(name, None)
    _on = provider is not None
    if provider is None:
        return
    from opentelemetry import trace

    _state.update(api=trace, provider=provider)
    _state["tracer"] = provider.get_tracer("poolkeeper")


def flush(timeout_seconds: float = 5.0) -> None:
    """Export what is pending (a process about to end that may skip ``atexit``: a Celery child)."""
    provider = _state.get("provider")
    if provider is not None:
        provider.force_flush(int(timeout_seconds * 1000))


def _span_context(trace: Any, traceparent: str | None) -> Any:
    """The remote span a W3C traceparent names (read by hand: a storm's links parse thousands)."""
    if not (tp := valid(traceparent)):
        return None
    flags = trace.TraceFlags(int(tp[53:55], 16))
    return trace.SpanContext(int(tp[3:35], 16), int(tp[36:52], 16), is_remote=True, trace_flags=flags)


def _tracer(trace: Any) -> Any:
    tracer = _state.get("tracer")
    return tracer if tracer is not None else trace.get_tracer("poolkeeper")


def _api() -> Any:
    """The API's ``trace`` module, with the SDK set up once; None without the SDK."""
    api = _state.get("api")
    if api is not None or _state.get("failed"):
        return api
    with _lock:
        if "api" not in _state and not _state.get("failed"):
            try:
                _state["api"] = _start()
            except ImportError as err:
                _state["failed"] = True
                log.warning("OTEL_* asks for traces but the SDK is not installed (%s): tracing off", err.name)
            except ValueError as err:  # an OTEL_BSP_* or OTEL_EXPORTER_* value the SDK refuses
                _state["failed"] = True
                log.warning("an OTEL_* setting is refused by the SDK (%s): tracing off", err)
    return _state.get("api")


def _start() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    defaults = {"service.name": _state["service"], "process.pid": os.getpid()}
    resource = Resource.create({k: v for k, v in defaults.items() if k != "service.name"})
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        resource = resource.merge(Resource({"service.name": _state["service"]}))
    provider = TracerProvider(resource=resource)
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    exporter: SpanExporter
    if kind == "console":
        exporter = ConsoleSpanExporter()
    else:
        if kind != "otlp":
            log.warning("OTEL_TRACES_EXPORTER=%s: not one poolkeeper knows; exporting over OTLP", kind)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    # Not the global provider: FastAPI (0.165+) traces every request on its own once one is set,
    # a trace per poll and probe; spans here are poolkeeper's, and a request is one when it
    # carries a trace (poolkeeper.http.middleware.TraceRequests). The current span is still the
    # API's (``trace.get_current_span``), for log formatters and the command's own code.
    _state["provider"], _state["tracer"] = provider, provider.get_tracer("poolkeeper")
    return trace
