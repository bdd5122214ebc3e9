"""core.logs: the JSON line, the ids bound where a row is handled, and what is masked in both formats."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from core import logs
from poolkeeper import tokens

SECRET = "k" + "0123456789abcdefghijklmnopqrstuvwxyz"  # a server secret's shape (>= 32 characters)


@pytest.fixture
def captured() -> Iterator[logging.LoggerAdapter[logging.Logger]]:
    """A logger of its own whose one handler is the test's: ``handler.lines`` after each call."""
    logger = logging.getLogger("poolkeeper.test_logs")
    logger.propagate, logger.level = False, logging.INFO
    handler = Lines()
    logger.addHandler(handler)
    try:
        yield logging.LoggerAdapter(logger, {})
    finally:
        logger.removeHandler(handler)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _handler(adapter: logging.LoggerAdapter[logging.Logger]) -> Lines:
    handler = adapter.logger.handlers[0]
    assert isinstance(handler, Lines)
    return handler


def every_token() -> list[str]:
    return [
        tokens.ordinal_token(SECRET, 3),
        tokens.operator_token(SECRET),
        tokens.viewer_token(SECRET),
        tokens.board_token(SECRET),
        tokens.child_token(SECRET, 12, 40),
    ]


def test_a_json_line_has_time_level_logger_message_and_the_ids_bound(
    captured: logging.LoggerAdapter[logging.Logger],
) -> None:
    logs.install("json", captured.logger)
    with logs.bound(row_id=7, ordinal=2), logs.bound(fence=41, task_id="T-9", run_id=None):
        captured.info("results %d: finalized", 7)
    captured.warning("after")
    first, second = (json.loads(line) for line in _handler(captured).lines)
    assert first["time"].endswith("Z") and first["time"][10] == "T"
    assert {k: v for k, v in first.items() if k != "time"} == {
        "level": "INFO",
        "logger": "poolkeeper.test_logs",
        "message": "results 7: finalized",
        "row_id": 7,
        "task_id": "T-9",
        "ordinal": 2,
        "fence": 41,
    }
    assert set(second) == {"time", "level", "logger", "message"}  # the ids went with their block


def test_an_exception_is_one_json_line_too(captured: logging.LoggerAdapter[logging.Logger]) -> None:
    logs.install("json", captured.logger)
    try:
        raise RuntimeError(f"refused {tokens.ordinal_token(SECRET, 1)}")
    except RuntimeError:
        captured.exception("offer failed")
    (line,) = _handler(captured).lines
    assert "\n" not in line
    got = json.loads(line)
    assert "RuntimeError: refused o1.***" in got["exception"]


def test_only_ids_it_knows_may_be_bound() -> None:
    with pytest.raises(TypeError, match="not a log id: password"), logs.bound(password="x"):
        pass


@pytest.mark.parametrize("fmt", logs.FORMATS)
def test_no_token_secret_or_password_reaches_either_format(
    fmt: str, captured: logging.LoggerAdapter[logging.Logger]
) -> None:
    _handler(captured).setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logs.install(fmt, captured.logger, secrets=[SECRET])
    for token in every_token():
        captured.info("asked with %s, and 'Authorization: Bearer %s'", token, token)
    captured.info("store at postgresql://pool:hunter2hunter2@db:5432/pool; secret %s", SECRET)
    lines = _handler(captured).lines
    text = "\n".join(lines)
    for token in every_token():
        assert token.rsplit(".", 1)[1] not in text
    assert "hunter2" not in text and SECRET not in text
    assert "o3.***" in lines[0] and "c12.40.***" in lines[4] and "pool:***@db" in lines[5]
    captured.info("auth: bearer tokens; Authorization: Bearer %s", SECRET[::-1])
    assert "auth: bearer tokens; Authorization: Bearer ***" in _handler(captured).lines[-1]
    if fmt == "text":  # today's layout, masked
        assert lines[0].startswith("INFO asked with o3.***")


def test_text_keeps_the_handler_s_own_layout_once(captured: logging.LoggerAdapter[logging.Logger]) -> None:
    _handler(captured).setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    logs.install("text", captured.logger)
    logs.install("text", captured.logger)  # a second set-up wraps nothing twice
    captured.info("hello")
    assert _handler(captured).lines == ["[INFO] hello"]
    assert isinstance(_handler(captured).formatter, logs.Masked)
    assert not isinstance(_handler(captured).formatter.inner, logs.Masked)  # type: ignore[union-attr]


def test_a_json_line_inside_a_span_carries_its_trace_and_span_ids(
    captured: logging.LoggerAdapter[logging.Logger],
) -> None:
    trace = pytest.importorskip("opentelemetry.trace")
    logs.install("json", captured.logger)
    context = trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0x00F067AA0BA902B7, is_remote=False
    )
    with trace.use_span(trace.NonRecordingSpan(context)):
        captured.info("inside")
    captured.info("outside")
    inside, outside = (json.loads(line) for line in _handler(captured).lines)
    assert (inside["trace_id"], inside["span_id"]) == ("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7")
    assert "trace_id" not in outside


def test_setting_up_json_logs_imports_nothing_of_opentelemetry() -> None:
    """Only the first JSON line formatted asks for it (and a process without the package runs alike)."""
    script = (
        "import sys, logging; from core import logs; logs.basic('json');print('opentelemetry' in sys.modules)"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"
    blocked = (  # the package absent: the line is written, without ids
        "import sys; sys.modules['opentelemetry'] = None; import logging; from core import logs;"
        "logs.basic('json'); logging.getLogger('x').info('hi')"
    )
    ran = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, check=True)
    assert json.loads(ran.stderr)["message"] == "hi"
