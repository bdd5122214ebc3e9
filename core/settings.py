"""One validated settings object, read from ``POOL_*`` environment variables.

Each field is declared with ``setting(default, doc, rule...)``: its variable, its
default (stated here and nowhere else: ``default(name)`` hands it to a caller
that needs it without settings), what it means, and the rule its value must
keep, in the field's dataclass metadata. ``Settings.__post_init__`` applies
those rules field by field, so ``Settings(...)``, ``Settings.from_env()`` and
``dataclasses.replace`` are all validated the same way, and a bad value is
rejected at start-up with a message naming the variable before any row is
touched. (Field metadata rather than pydantic-settings: ``dataclasses.replace``
and keyword construction keep validating, the messages stay one line naming
the variable, and the ground floor gains no dependency; docs/design.md,
"Adding a setting".)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from core import logs, shapes, validate
from core.errors import InvalidInput, SettingsError, UnusableURL

# A namespace starts every Redis key, the queue and the task names: short, no separators of its own.
NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
MIN_SECRET_CHARS = 32

Bound = float | str | tuple[str, ...]  # a number, or the field(s) whose value (the largest) bounds this one
Rule = Callable[[Any, str], None]  # (value, variable) -> None, or SettingsError naming the variable


def setting(
    default: Any,
    doc: str,
    *,
    var: str | None = None,
    ge: Bound | None = None,
    gt: Bound | None = None,
    le: float | None = None,
    lt: float | None = None,
    expected: str | None = None,
    rule: Rule | None = None,
    secret: bool = False,
) -> Any:
    """A field of ``Settings``: its default, what it means, and the rule its value keeps.

    ``ge``/``gt``/``le``/``lt`` bound a number (``ge``/``gt`` may name other fields, which
    come earlier); ``expected`` words the bound in the message when the plain one would not
    read well; ``rule`` is any other check. ``var`` names the variable when it is not
    ``POOL_<FIELD>``. A ``secret`` is never echoed, in a message or by ``repr``.
    """
    meta = {"doc": doc, "var": var, "ge": ge, "gt": gt, "le": le, "lt": lt, "expected": expected}
    return field(default=default, repr=not secret, metadata={**meta, "rule": rule, "secret": secret})


def nonempty(value: str, var: str) -> None:
    if not value:
        raise SettingsError(f"{var}: must not be empty")


def check_database_url(url: str, var: str) -> None:
    """A URL SQLAlchemy can parse, of a dialect it knows. The URL is not echoed: it may hold a password."""
    from sqlalchemy import exc as sa_exc  # only here: reading the settings needs no SQLAlchemy
    from sqlalchemy.engine import make_url

    nonempty(url, var)
    try:
        make_url(url).get_dialect()
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ValueError) as err:
        raise UnusableURL(f"{var}: not a database URL SQLAlchemy can open ({err})") from None


def _namespace(value: str, var: str) -> None:
    if not NAMESPACE_RE.fullmatch(value):
        raise SettingsError(
            f"{var}: must be 1 to 32 letters, digits, '_' or '-', starting with a letter or digit,"
            f" got {value!r}"
        )


# Words that mark a value copied from an example file (deploy/.env.example) rather than generated.
PLACEHOLDER_WORDS = (
    "change-me",
    "changeme",
    "change_me",
    "replace-me",
    "replaceme",
    "placeholder",
    "example",
)
MIN_SECRET_DISTINCT = 10  # `openssl rand -hex 32` holds 16 distinct characters; "s" * 40 holds 1


def _server_secret(value: str, var: str) -> None:
    """Long enough, and not a placeholder or a pattern: anyone who guesses it mints operator tokens."""
    if not value:
        return
    generate = "(e.g. the output of `openssl rand -hex 32`)"  # the messages never hold the value
    if len(value) < MIN_SECRET_CHARS:
        raise SettingsError(f"{var}: must be at least {MIN_SECRET_CHARS} characters {generate}")
    lowered = value.lower()
    if any(word in lowered for word in PLACEHOLDER_WORDS):
        raise SettingsError(f"{var}: is the placeholder of an example file: put a generated one {generate}")
    units = range(1, min(len(value) // 2, 64) + 1)
    repeats = any(value == (value[:n] * (len(value) // n + 1))[: len(value)] for n in units)
    if len(set(value)) < MIN_SECRET_DISTINCT or repeats:
        raise SettingsError(
            f"{var}: too easy to guess (few distinct characters, or a repeated pattern) {generate}"
        )


def _board_token(value: str, var: str) -> None:
    """A server secret's rules, and fit for an ``Authorization`` header: visible ASCII only."""
    _server_secret(value, var)
    if value and not (value.isascii() and value.isprintable() and " " not in value):
        raise SettingsError(f"{var}: may hold only visible ASCII characters (no spaces)")


def _named(max_len: int) -> Rule:
    """A name the board holds (a lane, an assignee): refused here, at start-up, not at every claim."""

    def rule(value: str, var: str) -> None:
        try:
            validate.name(var, value, max_len)
        except InvalidInput as err:  # a length problem already says how long; a pattern's, not what
            raise SettingsError(str(err) if "got" in err.problem else f"{err}, got {value!r}") from None

    return rule


def _log_format(value: str, var: str) -> None:
    if value not in logs.FORMATS:
        raise SettingsError(f"{var}: must be one of {', '.join(logs.FORMATS)}, got {value!r}")


DAY_SECONDS = 86400.0
YEAR_SECONDS = DAY_SECONDS * 365
SECRET_FILES = ("server_secret", "board_token")  # POOL_<NAME>_FILE may name a file holding each
SECRET_FILE_BYTES = 4096  # a secret's file (at least 32 characters) is never larger


@dataclass(frozen=True)
class Settings:
    database_url: str = setting(
        "sqlite:///pool.db",
        "The pool store (SQLAlchemy URL; SQLite file or PostgreSQL).",
        rule=check_database_url,
    )
    board_url: str = setting(
        "sqlite:///board.db",
        "The board; its scheme picks the backend (``board.open_board`` checks it): sqlite: or"
        " postgresql...: the built-in Kanban; http: or https: a board server (``poolctl board serve``).",
        rule=nonempty,
    )
    redis_url: str = setting(
        "", "Broker and lock server; empty: none configured (the demo then starts an embedded redis-server)."
    )
    pool_size: int = setting(3, "Number of worker ordinals 0..N-1.", var="POOL_SIZE", ge=1, le=100_000)
    lease_seconds: float = setting(
        90.0, "Lease granted by offer and extended by each heartbeat.", gt=0, le=86400
    )
    max_attempts: int = setting(3, "Fenced attempts before a row becomes lease_failed.", ge=1, le=100)
    retention_seconds: float = setting(
        7 * 24 * 3600.0,
        "Terminal rows and delivery records older than this are collected.",
        ge=3600,
        le=YEAR_SECONDS * 10,
    )
    lane: str = setting("pool", "The board lane the pool serves.", rule=_named(shapes.LANE_CHARS))
    assignee: str = setting(
        "poolkeeper", "The assignee the pool claims board tasks as.", rule=_named(shapes.ASSIGNEE_CHARS)
    )
    quarantine_after: int = setting(
        5, "Consecutive maintenance failures before a row is quarantined.", ge=1, le=1000
    )
    backoff_base_seconds: float = setting(
        2.0, "Exponential backoff (with jitter): the first delay.", gt=0, le=DAY_SECONDS
    )
    backoff_max_seconds: float = setting(
        300.0, "Exponential backoff: the longest delay.", ge="backoff_base_seconds", le=DAY_SECONDS
    )
    quarantine_retry_seconds: float = setting(
        900.0, "How often a quarantined row is still retried.", gt=0, le=DAY_SECONDS * 7
    )
    transient_retries: int = setting(5, "Celery retries of one row for a transient error.", ge=0, le=1000)
    tick_seconds: float = setting(
        5.0,
        "Beat interval of the fast scanners (expire, results, lease failures, dispatch).",
        gt=0,
        le=3600,
    )
    reconcile_seconds: float = setting(30.0, "Beat interval of reconcile.", gt=0, le=DAY_SECONDS)
    gc_seconds: float = setting(3600.0, "Beat interval of gc.", gt=0, le=DAY_SECONDS * 7)
    lineage_max_depth: int = setting(32, "How deep child executions may nest under a run.", ge=1, le=64)
    scan_limit: int = setting(2000, "Due rows one scanner tick enqueues at most.", ge=1, le=1_000_000)
    batch_size: int = setting(
        50,
        "Keys per message for passes that talk to the board (each key keeps its own lock and transactions).",
        ge=1,
        le=1000,
    )
    store_batch_size: int = setting(
        1000,
        "Row keys per message for store-only passes (expire): one set-based statement per batch, split only"
        " where it fails; each row keeps its lock.",
        ge=1,
        le=5000,
    )
    gc_batch: int = setting(500, "Rows deleted per GC transaction.", ge=1, le=100_000)
    task_time_limit: float = setting(
        120.0, "Hard Celery time limit per message; the soft limit is 80% of it.", ge=1, le=DAY_SECONDS
    )
    visibility_timeout: float = setting(
        3600.0,
        "Broker redelivery timeout; must exceed every countdown and the time limit.",
        gt=("backoff_max_seconds", "quarantine_retry_seconds", "task_time_limit"),
        le=DAY_SECONDS * 30,
    )
    metrics_port: int = setting(
        0, "Prometheus exporter port of a worker (0 = off).", ge=0, le=65535, expected="a port or 0"
    )
    http_host: str = setting("127.0.0.1", "The address the metrics exporter binds.")
    namespace: str = setting(
        "poolkeeper",
        "The deployment's name on a shared Redis: it starts every key, lock and marker, the queue and the"
        " Celery task names, so deployments never see each other's work.",
        rule=_namespace,
    )
    server_secret: str = setting(
        "",
        "What `poolctl serve` derives every bearer token from (at least 32 characters; never logged, never"
        " handed to a child by ``env()``). POOL_SERVER_SECRET_FILE names a file holding it instead (a mounted"
        " Secret); giving both is an error. Empty: no auth, and `serve` starts only with --local-only on a"
        " loopback address.",
        rule=_server_secret,
        secret=True,
    )
    board_token: str = setting(
        "",
        "The bearer token of the board API (docs/board-api.md): what an http(s) POOL_BOARD_URL sends, and"
        " what `poolctl board serve` asks of every caller (at least 32 characters; never logged, never handed"
        " to a child by ``env()``). POOL_BOARD_TOKEN_FILE names a file holding it instead (not both)."
        " Empty: none sent, and `board serve` starts only with --local-only on a loopback address.",
        rule=_board_token,
        secret=True,
    )
    serve_host: str = setting("127.0.0.1", "Where `poolctl serve` listens.")
    serve_port: int = setting(
        8080, "The port `poolctl serve` listens on.", ge=0, le=65535, expected="a port (0: any free one)"
    )
    max_body_bytes: int = setting(
        1024 * 1024,
        "The largest request body `serve` reads; past it, 413.",
        ge=1024,
        le=64 << 20,
        expected="1 KiB to 64 MiB",
    )
    offer_wait_seconds: float = setting(
        30.0,
        "The longest an idle worker's offer waits on `serve` for a run (answered as soon as one is"
        " assigned); keep it under a proxy's read timeout.",
        ge=0,
        le=validate.MAX_OFFER_WAIT_SECONDS,
    )
    body_timeout_seconds: float = setting(
        10.0,
        "A client has this long to send each part of its body (else 408), so a slow client holds only its"
        " own connection.",
        gt=0,
        le=600,
    )
    log_format: str = setting(
        "text",
        "How every process logs: ``text`` (each process's own layout) or ``json`` (one object a line with"
        " time, level, logger, message and the row, run, task, ordinal, fence, trace and span ids known).",
        rule=_log_format,
    )
    chaos_board_busy_rate: float = setting(
        0.0, "Fraction of the plane's board calls failing as busy (demo, fault tests).", ge=0, lt=1
    )
    chaos_poison_tasks: str = setting("", "Comma-separated task ids whose every board call fails.")

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(self, f.name, f.metadata)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every field from ``POOL_<FIELD>``; ``overrides`` win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(_var(f.name))
            if raw is None:
                continue
            kind = type(f.default)
            values[f.name] = _parse(_utf8(raw, _var(f.name)).strip(), kind, _var(f.name))
        for name in SECRET_FILES:
            var = _var(name)
            secret_file = _utf8(env.get(f"{var}_FILE", ""), f"{var}_FILE").strip()
            if secret_file:
                if env.get(var):
                    raise SettingsError(f"{var}_FILE: give it or {var}, not both")
                values[name] = read_secret_file(f"{var}_FILE", secret_file)
        values.update(overrides)
        return cls(**values)

    @property
    def poison_tasks(self) -> frozenset[str]:
        return frozenset(t.strip() for t in self.chaos_poison_tasks.split(",") if t.strip())

    def env(self) -> dict[str, str]:
        """The ``POOL_*`` variables that reproduce these settings in a child process.

        All but the server secret: a child that needs it (``serve``) is handed it on purpose.
        """
        return {_var(f.name): str(getattr(self, f.name)) for f in fields(self) if not f.metadata["secret"]}


def read_one(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting alone, checked by its rule: for a process that reads no other (``poolctl worker``).

    Only for a field whose rule names no other field."""
    f = Settings.__dataclass_fields__[name]
    var, env = _var(name), os.environ if environ is None else environ
    raw = env.get(var)
    value = f.default if raw is None else _parse(_utf8(raw, var).strip(), type(f.default), var)
    if f.metadata["rule"] is not None:
        f.metadata["rule"](value, var)
    return value


def read_secret_file(var: str, path: str) -> str:
    """A secret kept in a file (``var`` names the setting that points there), without surrounding space."""
    try:
        return validate.read_file(path, SECRET_FILE_BYTES).strip()
    except UnicodeDecodeError as err:  # a ValueError too: its bytes are not echoed
        raise SettingsError(f"{var}: cannot read {path}: {type(err).__name__}") from None
    except ValueError as err:
        raise SettingsError(f"{var}: cannot read {path}: {err}") from None
    except OSError as err:
        raise SettingsError(f"{var}: cannot read {path}: {type(err).__name__}") from None


def _utf8(raw: str, var: str) -> str:
    """``raw`` if it is text: Python hands an environment's non-UTF-8 bytes over as lone surrogates
    (``os.environb`` holds the bytes), which nothing downstream can encode. The value is not echoed."""
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SettingsError(
            f"{var}: not UTF-8 text (a byte that is not UTF-8 at position {err.start})"
        ) from None
    return raw


def default(name: str) -> Any:
    """The default of the setting ``name``: for a caller that takes values, not the settings."""
    return Settings.__dataclass_fields__[name].default


def _var(field_name: str) -> str:
    return Settings.__dataclass_fields__[field_name].metadata["var"] or "POOL_" + field_name.upper()


def _parse(raw: str, kind: type, var: str) -> Any:
    try:
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise SettingsError(
            f"{var}: expected {'an integer' if kind is int else 'a number'}, got {raw!r}"
        ) from None
    return raw


_OPS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "ge": (lambda v, b: v >= b, ">="),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="),
    "lt": (lambda v, b: v < b, "<"),
}


def _check(settings: Settings, name: str, meta: Mapping[str, Any]) -> None:
    """The field's rule and bounds; the first one broken is a ``SettingsError`` naming the variable."""
    value, var = getattr(settings, name), _var(name)
    if meta["rule"] is not None:
        meta["rule"](value, var)
    for op, (ok, _) in _OPS.items():
        bound = meta[op]
        if bound is None:
            continue
        limit = max(getattr(settings, b) for b in _names(bound)) if _names(bound) else bound
        if not ok(value, limit):  # NaN fails every bound
            raise SettingsError(f"{var}: must be {meta['expected'] or _expected(meta)}, got {value!r}")


def _names(bound: Bound) -> tuple[str, ...]:
    return (bound,) if isinstance(bound, str) else bound if isinstance(bound, tuple) else ()


def _expected(meta: Mapping[str, Any]) -> str:
    """The bounds in words: "between 1 and 64", "in (0, 600]", ">= 3600", ">= POOL_X", "greater than ..."."""
    ge, gt, le, lt = (meta[op] for op in ("ge", "gt", "le", "lt"))
    low = ge if ge is not None else gt
    high = le if le is not None else lt
    if low is not None and _names(low):
        names = [_var(n) for n in _names(low)]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        words = f">= {listed}" if ge is not None else f"greater than {listed}"
        return words if high is None else f"{words} and {'<=' if le is not None else '<'} {high:.0f}"
    if low is None or high is None:
        op = next(op for op in ("ge", "gt", "le", "lt") if meta[op] is not None)
        return f"{_OPS[op][1]} {meta[op]}"
    if ge is not None and le is not None and isinstance(ge, int) and isinstance(le, int):
        return f"between {ge} and {le}"
    return f"in {'[' if ge is not None else '('}{low}, {high}{']' if le is not None else ')'}"
