"""One validated settings object, read from ``POOL_*`` environment variables.

Every field documents its variable and default next to it. ``Settings.from_env``
rejects a bad value at start-up with a message naming the variable, so a typo in
a deployment fails loudly before any row is touched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from core.errors import SettingsError, UnusableURL

T = TypeVar("T")
# A namespace starts every Redis key, the queue and the task names: short, no separators of its own.
NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
MIN_SECRET_CHARS = 32


@dataclass(frozen=True)
class Settings:
    # POOL_DATABASE_URL: the pool store (SQLAlchemy URL; SQLite file or PostgreSQL).
    database_url: str = "sqlite:///pool.db"
    # POOL_BOARD_URL: the built-in Kanban board's database.
    board_url: str = "sqlite:///board.db"
    # POOL_REDIS_URL: broker and lock server; empty means "none configured"
    # (the demo then starts an embedded redis-server).
    redis_url: str = ""
    # POOL_SIZE: number of worker ordinals 0..N-1.
    pool_size: int = 3
    # POOL_LEASE_SECONDS: lease granted by offer and extended by each heartbeat.
    lease_seconds: float = 90.0
    # POOL_MAX_ATTEMPTS: fenced attempts before a row becomes lease_failed.
    max_attempts: int = 3
    # POOL_RETENTION_SECONDS: terminal rows and delivery records older than this are collected.
    retention_seconds: float = 7 * 24 * 3600.0
    # POOL_LANE / POOL_ASSIGNEE: the board lane the pool serves and the assignee it claims as.
    lane: str = "pool"
    assignee: str = "poolkeeper"
    # POOL_QUARANTINE_AFTER: consecutive maintenance failures before a row is quarantined.
    quarantine_after: int = 5
    # POOL_BACKOFF_BASE_SECONDS / POOL_BACKOFF_MAX_SECONDS: exponential backoff with jitter.
    backoff_base_seconds: float = 2.0
    backoff_max_seconds: float = 300.0
    # POOL_QUARANTINE_RETRY_SECONDS: how often a quarantined row is still retried.
    quarantine_retry_seconds: float = 900.0
    # POOL_TRANSIENT_RETRIES: Celery retries of one row for a transient error.
    transient_retries: int = 5
    # POOL_TICK_SECONDS: beat interval of the fast scanners (expire, results,
    # lease failures, dispatch).
    tick_seconds: float = 5.0
    # POOL_RECONCILE_SECONDS / POOL_GC_SECONDS: beat intervals of the slow passes.
    reconcile_seconds: float = 30.0
    gc_seconds: float = 3600.0
    # POOL_LINEAGE_MAX_DEPTH: how deep child executions may nest under a run (1 to 64).
    lineage_max_depth: int = 32
    # POOL_SCAN_LIMIT: due rows one scanner tick enqueues at most.
    scan_limit: int = 2000
    # POOL_BATCH_SIZE: keys per message for passes that talk to the board (each key
    # keeps its own lock and transactions).
    batch_size: int = 50
    # POOL_STORE_BATCH_SIZE: row keys per message for store-only passes (expire): one
    # set-based statement per batch, split only where it fails; each row keeps its lock.
    store_batch_size: int = 1000
    # POOL_GC_BATCH: rows deleted per GC transaction.
    gc_batch: int = 500
    # POOL_TASK_TIME_LIMIT: hard Celery time limit per message; the soft limit is 80% of it.
    task_time_limit: float = 120.0
    # POOL_VISIBILITY_TIMEOUT: broker redelivery timeout; must exceed every countdown.
    visibility_timeout: float = 3600.0
    # POOL_METRICS_PORT: Prometheus exporter port of a worker (0 = off).
    metrics_port: int = 0
    # POOL_HTTP_HOST: the address the metrics exporter binds.
    http_host: str = "127.0.0.1"
    # POOL_NAMESPACE: the deployment's name on a shared Redis: it starts every key, lock and
    # marker, the queue and the Celery task names, so deployments never see each other's work.
    namespace: str = "poolkeeper"
    # POOL_SERVER_SECRET: what `poolctl serve` derives every bearer token from (at least 32
    # characters; never logged, never handed to a child by ``env()``). POOL_SERVER_SECRET_FILE
    # names a file holding it instead (a mounted Secret); giving both is an error. Empty: no auth,
    # and `serve` starts only with --local-only on a loopback address.
    server_secret: str = field(default="", repr=False)
    # POOL_SERVE_HOST / POOL_SERVE_PORT: where `poolctl serve` listens.
    serve_host: str = "127.0.0.1"
    serve_port: int = 8080
    # POOL_MAX_BODY_BYTES: the largest request body `serve` reads; past it, 413.
    max_body_bytes: int = 1024 * 1024
    # POOL_BODY_TIMEOUT_SECONDS: a client has this long to send each part of its body (else 408),
    # so a slow client holds only its own connection.
    body_timeout_seconds: float = 10.0
    # POOL_CHAOS_BOARD_BUSY_RATE: fraction of board calls failing as "busy" (demo, fault tests).
    chaos_board_busy_rate: float = 0.0
    # POOL_CHAOS_POISON_TASKS: comma-separated task ids whose every board call fails.
    chaos_poison_tasks: str = ""

    def __post_init__(self) -> None:
        _check(self.pool_size, "POOL_SIZE", lambda v: 1 <= v <= 100_000, "between 1 and 100000")
        _check(self.lease_seconds, "POOL_LEASE_SECONDS", lambda v: 0 < v <= 86400, "in (0, 86400]")
        _check(self.max_attempts, "POOL_MAX_ATTEMPTS", lambda v: 1 <= v <= 100, "between 1 and 100")
        _check(self.retention_seconds, "POOL_RETENTION_SECONDS", lambda v: v >= 3600, ">= 3600")
        _check(self.quarantine_after, "POOL_QUARANTINE_AFTER", lambda v: v >= 1, ">= 1")
        _check(self.backoff_base_seconds, "POOL_BACKOFF_BASE_SECONDS", lambda v: v > 0, "> 0")
        _check(
            self.backoff_max_seconds,
            "POOL_BACKOFF_MAX_SECONDS",
            lambda v: v >= self.backoff_base_seconds,
            ">= POOL_BACKOFF_BASE_SECONDS",
        )
        _check(self.quarantine_retry_seconds, "POOL_QUARANTINE_RETRY_SECONDS", lambda v: v > 0, "> 0")
        _check(self.transient_retries, "POOL_TRANSIENT_RETRIES", lambda v: v >= 0, ">= 0")
        _check(self.tick_seconds, "POOL_TICK_SECONDS", lambda v: v > 0, "> 0")
        _check(self.reconcile_seconds, "POOL_RECONCILE_SECONDS", lambda v: v > 0, "> 0")
        _check(self.gc_seconds, "POOL_GC_SECONDS", lambda v: v > 0, "> 0")
        _check(self.lineage_max_depth, "POOL_LINEAGE_MAX_DEPTH", lambda v: 1 <= v <= 64, "between 1 and 64")
        _check(self.scan_limit, "POOL_SCAN_LIMIT", lambda v: v >= 1, ">= 1")
        _check(self.batch_size, "POOL_BATCH_SIZE", lambda v: 1 <= v <= 1000, "between 1 and 1000")
        _check(self.store_batch_size, "POOL_STORE_BATCH_SIZE", lambda v: 1 <= v <= 5000, "between 1 and 5000")
        _check(self.gc_batch, "POOL_GC_BATCH", lambda v: v >= 1, ">= 1")
        _check(self.task_time_limit, "POOL_TASK_TIME_LIMIT", lambda v: v >= 1, ">= 1")
        longest_countdown = max(self.backoff_max_seconds, self.quarantine_retry_seconds)
        _check(
            self.visibility_timeout,
            "POOL_VISIBILITY_TIMEOUT",
            lambda v: v > max(longest_countdown, self.task_time_limit),
            "greater than POOL_BACKOFF_MAX_SECONDS, POOL_QUARANTINE_RETRY_SECONDS and POOL_TASK_TIME_LIMIT",
        )
        _check(self.metrics_port, "POOL_METRICS_PORT", lambda v: 0 <= v <= 65535, "a port or 0")
        _check(self.serve_port, "POOL_SERVE_PORT", lambda v: 0 <= v <= 65535, "a port (0: any free one)")
        _check(self.max_body_bytes, "POOL_MAX_BODY_BYTES", lambda v: 1024 <= v <= 64 << 20, "1 KiB to 64 MiB")
        _check(self.body_timeout_seconds, "POOL_BODY_TIMEOUT_SECONDS", lambda v: 0 < v <= 600, "in (0, 600]")
        if self.server_secret and len(self.server_secret) < MIN_SECRET_CHARS:
            # never _check: its message would print the value
            raise SettingsError(
                f"POOL_SERVER_SECRET: must be at least {MIN_SECRET_CHARS} characters"
                " (e.g. the output of `openssl rand -hex 32`)"
            )
        _check(self.chaos_board_busy_rate, "POOL_CHAOS_BOARD_BUSY_RATE", lambda v: 0 <= v < 1, "in [0, 1)")
        _check(
            self.namespace,
            "POOL_NAMESPACE",
            lambda v: bool(NAMESPACE_RE.fullmatch(v)),
            "1 to 32 letters, digits, '_' or '-', starting with a letter or digit",
        )
        for name in ("database_url", "board_url"):
            if not getattr(self, name):
                raise SettingsError(f"{_var(name)}: must not be empty")
        # The board URL's scheme picks its backend; ``board.open_board`` checks it.
        check_database_url(self.database_url, "POOL_DATABASE_URL")

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
            values[f.name] = _parse(raw.strip(), kind, _var(f.name))
        secret_file = env.get("POOL_SERVER_SECRET_FILE", "").strip()
        if secret_file:
            if env.get("POOL_SERVER_SECRET"):
                raise SettingsError("POOL_SERVER_SECRET_FILE: give it or POOL_SERVER_SECRET, not both")
            values["server_secret"] = read_secret_file("POOL_SERVER_SECRET_FILE", secret_file)
        values.update(overrides)
        return cls(**values)

    @property
    def lock_ttl_seconds(self) -> float:
        """A row lock outlives the hard time limit, so a live holder never loses it."""
        return self.task_time_limit + 30.0

    @property
    def poison_tasks(self) -> frozenset[str]:
        return frozenset(t.strip() for t in self.chaos_poison_tasks.split(",") if t.strip())

    def env(self) -> dict[str, str]:
        """The ``POOL_*`` variables that reproduce these settings in a child process.

        All but the server secret: a child that needs it (``serve``) is handed it on purpose.
        """
        return {_var(f.name): str(getattr(self, f.name)) for f in fields(self) if f.name != "server_secret"}


def read_secret_file(var: str, path: str) -> str:
    """A secret kept in a file (``var`` names the setting that points there), without surrounding space."""
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise SettingsError(f"{var}: cannot read {path}: {type(err).__name__}") from None


def _var(field_name: str) -> str:
    special = {"pool_size": "POOL_SIZE"}
    return special.get(field_name, "POOL_" + field_name.upper())


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


def check_database_url(url: str, var: str) -> None:
    """A URL SQLAlchemy can parse, of a dialect it knows. The URL is not echoed: it may hold a password."""
    try:
        make_url(url).get_dialect()
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ValueError) as err:
        raise UnusableURL(f"{var}: not a database URL SQLAlchemy can open ({err})") from None


def _check(value: T, var: str, ok: Callable[[T], bool], expected: str) -> None:
    if not ok(value):
        raise SettingsError(f"{var}: must be {expected}, got {value!r}")
