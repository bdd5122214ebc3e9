"""Every process's log lines: today's text or one JSON object a line, ids attached, secrets masked.

``POOL_LOG_FORMAT`` picks the format (``text``, the default, keeps each process's own
layout; ``json`` writes ``time``, ``level``, ``logger``, ``message`` and the ids known
where the line was logged). Code that handles one row says so with ``bound(row_id=…)``
(a context variable: the pass runner per key, ``serve`` per request, the worker per
grant), and every line logged inside carries those ids; nothing is parsed out of a
message. ``trace_id``/``span_id`` come from the current OpenTelemetry span, when the
package is installed and a span is recording: ``opentelemetry.trace`` is imported by the
first JSON line formatted, never at start-up.

Both formats mask what must never reach a log (``mask``): a wire token's MAC
(``o3.***``), a bearer credential, a URL's password, and the secrets a process names
(``install(..., secrets=…)``: the server secret, the board token).

``install`` points the handlers a process already has at these formatters (Celery's and
uvicorn's loggers keep their handlers, levels and files); ``basic`` sets up a process that
has none.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.shapes import Offer

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the servers' and the worker's own
IDS = ("row_id", "run_id", "task_id", "ordinal", "fence")  # what ``bound`` may attach, in line order

_ids: ContextVar[Mapping[str, Any]] = ContextVar("poolkeeper_log_ids", default=MappingProxyType({}))

# A wire token is its subject, a dot, and 64 hex digits of MAC (poolkeeper.tokens): the MAC goes.
_TOKEN_MAC = re.compile(r"\b((?:o[0-9]+|op|view|board|c[0-9]+\.[0-9]+)\.)[0-9a-f]{64}\b")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{16,}")  # a credential, not "bearer tokens"
_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@")
MASK = "***"


def mask_url(url: object) -> str:
    """A URL fit for a message: its password, if any, replaced by ``***``."""
    return _URL_PASSWORD.sub(rf"\1{MASK}@", str(url))


def mask(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without token MACs, bearer credentials, URL passwords and the given ``secrets``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    text = _TOKEN_MAC.sub(rf"\1{MASK}", text)
    text = _BEARER.sub(rf"\1{MASK}", text)
    return mask_url(text)


@contextmanager
def bound(**ids: Any) -> Iterator[None]:
    """Lines logged inside carry ``ids`` (names from ``IDS``; ``None`` values are left out)."""
    token = attach(**ids)
    try:
        yield
    finally:
        _ids.reset(token)


def attach(**ids: Any) -> Token[Mapping[str, Any]]:
    """Lines logged from here to the end of this context carry ``ids`` too: for a request's own task
    (``serve``'s handlers, whose access line is logged after they return); elsewhere, ``bound``."""
    unknown = set(ids) - set(IDS)
    if unknown:
        raise TypeError(f"not a log id: {', '.join(sorted(unknown))}")
    return _ids.set({**_ids.get(), **{k: v for k, v in ids.items() if v is not None}})


def grant_ids(grant: Offer) -> dict[str, Any]:
    """The ids of a grant's lines: its row, run, task, ordinal and fence."""
    return {
        "row_id": grant.row_id,
        "run_id": grant.run_id,
        "task_id": grant.task_id,
        "ordinal": grant.ordinal,
        "fence": grant.fence,
    }


def current() -> Mapping[str, Any]:
    """The ids bound here (``bound``)."""
    return _ids.get()


class Masked(logging.Formatter):
    """Another formatter's line (Celery's, uvicorn's, ``TEXT_FORMAT``), masked (``mask``)."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.inner, self.secrets = inner, tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        return mask(self.inner.format(record), self.secrets)


class Json(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the ids known, masked."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": mask(record.getMessage(), self.secrets),
        }
        ids = current()
        line.update((name, ids[name]) for name in IDS if name in ids)
        line.update(_span())
        if record.exc_info:
            line["exception"] = mask(self.formatException(record.exc_info), self.secrets)
        elif record.exc_text:
            line["exception"] = mask(record.exc_text, self.secrets)
        if record.stack_info:
            line["stack"] = mask(self.formatStack(record.stack_info), self.secrets)
        return json.dumps(line, default=str, ensure_ascii=False)


def _iso(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


_otel: list[Any] = []  # [opentelemetry.trace or None], once the first JSON line has asked


def _span() -> dict[str, str]:
    """The current OpenTelemetry span's ids (W3C hex), if the API is installed and a span is current."""
    if not _otel:
        try:
            from opentelemetry import trace as api
        except ImportError:
            api = None  # type: ignore[assignment]
        _otel.append(api)
    trace = _otel[0]
    if trace is None:
        return {}
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return {}
    return {"trace_id": f"{span.trace_id:032x}", "span_id": f"{span.span_id:016x}"}


def formatter(fmt: str, text: logging.Formatter | None, secrets: Iterable[str] = ()) -> logging.Formatter:
    """What a handler formats with: ``Json``, or its ``text`` formatter masked."""
    if fmt == "json":
        return Json(secrets)
    if isinstance(text, Masked):
        return text
    return Masked(text or logging.Formatter(TEXT_FORMAT), secrets)


def install(fmt: str, *loggers: logging.Logger | str, secrets: Iterable[str] = ()) -> None:
    """Every handler of ``loggers`` (the root logger when none) formats as ``fmt``, masked."""
    secrets = tuple(secrets)
    for logger in loggers or (logging.getLogger(),):
        handlers = (logging.getLogger(logger) if isinstance(logger, str) else logger).handlers
        for handler in handlers:
            handler.setFormatter(formatter(fmt, handler.formatter, secrets))


def basic(fmt: str, secrets: Iterable[str] = ()) -> None:
    """A process without logging of its own: INFO lines on stderr, as ``fmt`` (``TEXT_FORMAT`` for text)."""
    logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)
    install(fmt, secrets=secrets)
