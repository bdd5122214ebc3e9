"""The Celery entry point (``celery -A tasks worker|beat``): the app and its two thin tasks.

The only module that does work at import: it reads the settings (a bad value
is one line and exit 2), points prometheus_client's multiprocess mode at a
directory of its own when the worker exports metrics, and builds the app.

Settings: JSON only, late acks, reject on worker lost, prefetch 1, soft and
hard time limits, a broker visibility timeout longer than any countdown,
results ignored, one queue, ``<POOL_NAMESPACE>.maintenance``. The task names,
kombu's own keys and the control and event exchanges carry the namespace too,
so deployments sharing one Redis never take each other's messages. A worker runs
without gossip, mingle and heartbeats whatever its command line says (the plane uses
none of them, and they end a worker when Redis restarts), and reconnects to its broker.

Start-up refuses to serve, with one line on stderr and a non-zero exit before
anything is consumed (and, for beat, before its schedule file is opened): a store
or board that does not answer (75) or is not migrated (78), and a worker told
(``-Q``) to consume another queue (2). Nothing
else runs at start-up: a worker or beat with poisoned rows in the store comes
up and serves.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from core import logs, tracing
from core.errors import PoolError, SettingsError, TransientError, exit_code
from core.settings import Settings


def _refuse(message: str, code: int) -> NoReturn:
    # sys.__stderr__: Celery may already have pointed sys.stderr at its log.
    print(f"poolkeeper: {message}", file=sys.__stderr__, flush=True)
    raise SystemExit(code)


def _settings() -> Settings:
    try:
        return Settings.from_env()
    except SettingsError as err:
        _refuse(str(err), (exit_code(err) or (2, ""))[0])


def _metrics_dir(settings: Settings) -> None:
    """Prefork children share counters through files; the directory goes when the worker does."""
    if not settings.metrics_port or "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return
    path = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="poolkeeper-metrics-")
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not in a forked child
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)


SETTINGS = _settings()
tracing.setup("poolkeeper-celery", now=False)  # each prefork child starts its own (process.pid)
_metrics_dir(SETTINGS)  # before prometheus_client is imported (below) it must be set

import redis  # noqa: E402
from celery import Celery, Task  # noqa: E402
from celery.beat import PersistentScheduler  # noqa: E402
from celery.exceptions import SoftTimeLimitExceeded  # noqa: E402
from celery.signals import (  # noqa: E402
    after_setup_logger,
    after_setup_task_logger,
    task_received,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
)
from celery.utils.log import get_multiprocessing_logger  # noqa: E402
from celery.worker.consumer import Consumer as CeleryConsumer  # noqa: E402
from kombu.entity import Queue  # noqa: E402
from kombu.transport import redis as kombu_redis  # noqa: E402

import beat_schedule  # noqa: E402
from core.retry import RetryPolicy  # noqa: E402
from store import PoolStore  # noqa: E402
from tasks import collectors, events, failures, metrics, registry, runner, scan  # noqa: E402
from tasks import plane as planes  # noqa: E402
from tasks.coordination import Coordination, process_task, queue_name, worker_redis_url  # noqa: E402
from tasks.redis_coordination import Beacon  # noqa: E402

log = logging.getLogger("poolkeeper.maintenance")
QUEUE = queue_name(SETTINGS)
PROCESS_TASK = process_task(SETTINGS)
# Celery's per-message lines ("Task … received", "… succeeded in …"): most of an
# INFO log, and nothing the project's own per-batch summaries do not say better.
# Their failures are logged at ERROR by the same loggers and still show.
CHATTY_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "httpx")  # httpx: a line per board call


def _not_a_due_task(record: logging.LogRecord) -> bool:
    """Beat's "Scheduler: Sending due task" is one line per pass per tick (~50 a minute at the
    defaults) saying only that the schedule runs; the scans' own "enqueued N keys" say more.
    Only that line goes: "beat: Starting..." and beat's warnings and errors stay."""
    due = str(record.msg).startswith("Scheduler: Sending due task")
    return not (due and record.levelno < logging.WARNING)


def make_app(settings: Settings) -> Celery:
    ns, queue = settings.namespace, queue_name(settings)
    broker = worker_redis_url(settings)
    redis_scheme = broker.partition(":")[0] in ("redis", "rediss")
    celery = Celery(ns, broker=broker)
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_time_limit=settings.task_time_limit,
        task_soft_time_limit=settings.task_time_limit * 0.8,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # kombu's bookkeeping of delivered, unacknowledged messages: per deployment,
            # so one never restores (redelivers) another's messages on its own timeout.
            "unacked_key": f"{ns}:unacked",
            "unacked_index_key": f"{ns}:unacked_index",
            "unacked_mutex_key": f"{ns}:unacked_mutex",
            "socket_connect_timeout": 5,
            "socket_timeout": 15,  # longer than kombu's blocking pops (1 s)
            "socket_keepalive": True,
        },
        broker_connection_retry_on_startup=True,
        # Broker loss: a running task's late ack cannot reach a broker that went away, so its
        # message is delivered again anyway; cancel it rather than do its work twice. Then the
        # worker reconnects (broker_connection_retry, every half tick: Consumer), and if it is
        # killed its supervisor restarts it (deploy/, poolkeeper.embedded.supervise). Bounded socket
        # timeouts make a broker that vanished without a reset an error, never a hang.
        broker_connection_retry=True,
        broker_connection_max_retries=None,  # a Redis outage is waited out, however long
        worker_consumer="tasks.celery:Consumer",
        broker_transport="tasks.celery:RedisTransport" if redis_scheme else None,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        task_default_queue=queue,
        task_queues=[Queue(queue)],
        control_exchange=ns,  # remote control and events reach this deployment's workers only
        event_exchange=f"{ns}.events",
        worker_hijack_root_logger=True,
        beat_schedule=beat_schedule.schedule(settings, registry.PASSES),
        beat_schedule_filename=schedule_file(settings),  # when beat is given no -s
        beat_scheduler="tasks.celery:CheckedScheduler",
    )
    return celery


# How a worker and beat try a lost broker again: every half tick. kombu's own pace (2 s, then
# 2 s more each time, up to 30 s) would leave them idle up to 30 s after a long outage ended;
# dispatch is to resume within 2 ticks of Redis being back.
BROKER_PACE = {"interval_start": SETTINGS.tick_seconds / 2, "interval_step": 0}
BROKER_PACE["interval_max"] = BROKER_PACE["interval_start"]


class Consumer(CeleryConsumer):  # type: ignore[misc]  # celery ships no types
    """Celery's consumer, which tries its lost broker again at ``BROKER_PACE``."""

    def ensure_connected(self, conn: Any) -> Any:
        conn.ensure_connection = functools.partial(conn.ensure_connection, **BROKER_PACE)
        return super().ensure_connected(conn)


class _RedisChannel(kombu_redis.Channel):
    """kombu's Redis channel, whose use after its connection is gone is a connection error.

    On a lost broker Celery collects the connection (which drops the transport's client) and
    then closes it, and a late ack may still reach a channel of the old connection; both build a
    new pool from that client, and ``'NoneType' object has no attribute 'hostname'`` (kombu#582)
    escaped every handler of connection errors and ended the worker. As a connection error it is
    what it is: the close is ignored, the ack logged ("Couldn't ack"), and the lost message's keys
    are sent again once their markers lapse (``tasks.plane``).
    """

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.ConnectionError("the broker connection is closed (lost, then collected)")
        return super()._connparams(asynchronous)


class RedisTransport(kombu_redis.Transport):
    """kombu's transport for ``redis://`` and ``rediss://`` (both aliases name it), over ``_RedisChannel``."""

    Channel = _RedisChannel


def schedule_file(settings: Settings) -> str:
    """Beat's default schedule file: the user's state directory, never the current one.

    ``$XDG_STATE_HOME/poolkeeper`` (``~/.local/state/poolkeeper``); only last-run times
    are kept there, so losing it runs each pass once more at start. ``-s`` still wins.
    """
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "poolkeeper", f"{settings.namespace}-celerybeat-schedule")


class CheckedScheduler(PersistentScheduler):  # type: ignore[misc]  # celery ships no types
    """Beat's scheduler, which refuses before it opens its schedule file and stops cleanly.

    Celery opens (creates) the schedule file before it sends ``beat_init``, so a beat
    refused there had already written it; here the store and board are checked first,
    and a refusal leaves nothing behind.

    Celery's own SIGTERM handler closes the schedule and raises inside whatever beat
    was doing: in the middle of sending a message, redis-py and kombu swallow the
    exit, beat ticks on over the closed schedule and exits 1. Here a stop that comes
    during a tick or a sync waits for its end; one that comes while beat sleeps ends it.
    A tick waiting for a Redis that is down ends at its next try (``BROKER_PACE``),
    outside any send: without that, beat ignored SIGTERM for as long as Redis was away.
    """

    _busy = False  # inside a tick or a sync, which a stop must not cut
    _stopping = False

    def setup_schedule(self) -> None:
        _refuse_unless_ready(SETTINGS)
        os.makedirs(os.path.dirname(os.path.abspath(self.schedule_filename)), mode=0o700, exist_ok=True)
        super().setup_schedule()
        Beacon.start(SETTINGS, "beat", f"beat@{socket.gethostname()}")
        if threading.current_thread() is threading.main_thread():  # an embedded beat keeps its host's
            signal.signal(signal.SIGTERM, self._stop)
            signal.signal(signal.SIGINT, self._stop)

    def _stop(self, *_: Any) -> None:
        self._stopping = True
        if not self._busy:
            raise SystemExit()

    def _whole(self, step: Callable[[], Any]) -> Any:
        self._busy = True
        try:
            return step()
        finally:
            self._busy = False
            if self._stopping:
                raise SystemExit()

    def _ensure_connected(self) -> Any:
        def retried(exc: Exception, interval: float) -> None:
            log.error("beat: Connection error: %s. Trying again in %.1f seconds...", exc, interval)

        def stop_if_told() -> None:  # between tries: no send is under way
            if self._stopping:
                raise SystemExit()

        max_retries = self.app.conf.broker_connection_max_retries
        return self.connection.ensure_connection(retried, max_retries, callback=stop_if_told, **BROKER_PACE)

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        return self._whole(lambda: super(CheckedScheduler, self).tick(*args, **kwargs))

    def _do_sync(self) -> None:
        self._whole(super()._do_sync)

    def close(self) -> None:
        self._busy = True  # the last thing beat does: nothing to stop after it
        super().close()


app = make_app(SETTINGS)


def _refuse_unless_ready(settings: Settings) -> None:
    try:
        planes.check_ready(settings)
    except PoolError as err:
        code, message = exit_code(err) or (1, str(err))
        _refuse(f"{message} (nothing consumed)", code)


@worker_process_init.connect
def _fresh_plane_in_child(**_: Any) -> None:
    planes.forget_after_fork()
    tracing.start()  # before the first message, not inside its first span


_main_coord: Coordination | None = None


@task_received.connect
def _hold_received(request: Any = None, **_: Any) -> None:
    """The worker (main process) that receives a message holds its keys' markers and reservations.

    While it lives its keeper renews them; if it dies with the message unacknowledged,
    they lapse within a hold and the next scan sends the keys again, instead of waiting
    for the broker's visibility timeout. It holds them at most as long as a live worker
    can keep a message: its countdown, then two time limits (one waiting for a child).
    """
    global _main_coord
    if request is None or request.task_name != PROCESS_TASK:
        return
    try:
        pass_name, keys = request.args[0], request.args[1]
        p = registry.get(pass_name)
        eta = request.eta.timestamp() - time.time() if request.eta else 0.0
        if _main_coord is None:
            _main_coord = planes.coordination(replace(SETTINGS, redis_url=worker_redis_url(SETTINGS)))
        ordinals = [p.reserves(k) for k in keys] if p.reserves else []
        longest = max(eta, 0.0) + 2 * SETTINGS.task_time_limit
        _main_coord.hold(p.name, [p.key_name(k) for k in keys], ordinals, longest)
    except Exception as err:  # never the consumer's problem: the keys then lapse as queued ones
        log.warning("could not hold a received message's keys: %s", err)


@worker_init.connect
def _worker_start(sender: Any = None, **_: Any) -> None:
    """Before the worker consumes anything: refuse to serve what this deployment cannot.

    And gossip, mingle and the worker heartbeat are off, whatever the command line says:
    the plane uses none of them, and with them on a Redis restart under in-flight messages
    ends the worker (kombu#582: the gossip consumer's channel is closed over a connection
    already gone, ``'NoneType' object has no attribute 'hostname'``).
    """
    if sender is not None:  # the options the consumer's bootsteps are built from, just below
        sender.options.update(without_gossip=True, without_mingle=True, without_heartbeat=True)
    consumed = sorted(sender.app.amqp.queues.consume_from) if sender is not None else [QUEUE]
    if consumed != [QUEUE]:
        _refuse(
            f"-Q {','.join(consumed)}: this deployment's queue is {QUEUE} "
            f"(POOL_NAMESPACE={SETTINGS.namespace}); start the worker without -Q",
            2,
        )
    _refuse_unless_ready(SETTINGS)
    if SETTINGS.metrics_port:
        host, port = SETTINGS.http_host, SETTINGS.metrics_port
        try:
            collectors.start_exporter(port, host, PoolStore.from_settings(SETTINGS), SETTINGS)
        except OSError as err:
            _refuse(f"POOL_METRICS_PORT: cannot serve metrics on {host}:{port}: {err}", 2)


@worker_ready.connect
def _worker_serving(sender: Any = None, **_: Any) -> None:
    # The main process's beacon: the console's workers page says it is online (tasks.liveness).
    name = getattr(sender, "hostname", None) or f"celery@{socket.gethostname()}"
    Beacon.start(SETTINGS, "worker", name)
    _listen()
    # Logged here, not in worker_init: only now has Celery set up logging.
    if SETTINGS.metrics_port:
        log.info("metrics on http://%s:%d/metrics", SETTINGS.http_host, SETTINGS.metrics_port)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    """Celery's handlers (its stderr or ``--logfile``, in the worker and in beat) write POOL_LOG_FORMAT:
    the root's, the task logger's and billiard's own (a pool child's exit, logged at shutdown)."""
    if logger is not None:
        also = (get_multiprocessing_logger(),) if logger is logging.getLogger() else ()
        secrets = (SETTINGS.server_secret, SETTINGS.board_token)
        logs.install(SETTINGS.log_format, logger, *also, secrets=secrets)


@after_setup_logger.connect
def _quiet_celery(**_: Any) -> None:
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    beat = logging.getLogger("celery.beat")
    if _not_a_due_task not in beat.filters:
        beat.addFilter(_not_a_due_task)


@worker_process_shutdown.connect
def _forget_child_metrics(pid: int | None = None, **_: Any) -> None:
    metrics.child_exited(pid or os.getpid())
    tracing.flush()  # a prefork child ends without atexit: its spans go now


def _enqueue(pass_name: str, keys: list[Any]) -> None:
    # The sender's trace context rides in the message's headers (``traceparent``): ``process``
    # continues it. A key that is a run's (a claim) carries its own, as a batch mixes runs.
    process.apply_async((pass_name, keys), headers=tracing.headers() or None)


def _listen() -> None:
    """The main process pops the deployment's wake-ups (``tasks.events``): each sends its pass's scan."""
    settings = replace(SETTINGS, redis_url=worker_redis_url(SETTINGS))

    def handle(event: events.Event) -> None:
        scan_pass.apply_async((registry.get(event["scan"]).name,), {"event": True})

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    events.Listener(client, settings.namespace, handle).start()


@app.task(name=beat_schedule.scan_task(SETTINGS))
def scan_pass(pass_name: str, event: bool = False) -> None:
    """Beat (or an ``event``): run one pass's scanner and enqueue the keys it finds.

    Storage faults skip the tick; anything else surfaces loudly.
    """
    try:
        n = scan.scan(planes.current(), pass_name, time.time(), _enqueue, record=not event)
    except TransientError as err:  # once per distinct detail, not on every tick it lasts
        failures.reporter.once(pass_name, "scan", f"skipped this tick: {failures.describe(err)}")
        return
    failures.reporter.succeeded(pass_name, "scan")
    if n:
        log.info("%s: enqueued %d keys", pass_name, n)


@app.task(name=PROCESS_TASK, bind=True, max_retries=None)
def process(self: Task, pass_name: str, keys: list[Any]) -> None:
    """Run each key of one pass in isolation; split out transient failures and retry them alone."""
    plane = planes.current()
    p = registry.get(pass_name)
    policy = RetryPolicy.from_settings(plane.settings)
    now = time.time()
    again: list[Any] = []

    def settle(result: runner.BatchResult) -> list[Any]:
        """The keys that are done with (their markers go with their locks); ``again`` the others."""
        finished = [key for key, _ in result.done]
        for key, err in result.transient:
            if self.request.retries < plane.settings.transient_retries:
                with logs.bound(**p.log_ids(key)):
                    failures.reporter.once(
                        pass_name, p.key_name(key), f"busy, retried: {failures.describe(err)}"
                    )
                again.append(key)
            else:
                failures.give_up(plane, p, key, err, now)
                finished.append(key)
        return finished

    try:
        with tracing.span(
            f"{pass_name} batch", _traceparent(self.request), {"pool.keys": len(keys)}, join_only=True
        ):
            result = runner.run_batch(
                plane, pass_name, keys, now, abort=(SoftTimeLimitExceeded,), settle=settle
            )
    except SoftTimeLimitExceeded:
        log.warning("%s: soft time limit hit; the unfinished keys are rescanned", pass_name)
        _clear(plane, p.name, [p.key_name(k) for k in keys])
        return
    events.after_batch(plane.events, p.reserves, result.done, plane.settings.pool_size)
    if len(keys) == 1 and again:  # keep the marker: this message stays pending
        raise self.retry(countdown=policy.backoff(self.request.retries + 1))
    for key in again:  # a failing key is split out and retried alone
        process.apply_async((pass_name, [key]), countdown=policy.backoff(1))


def _traceparent(request: Any) -> str | None:
    """The sender's trace context from the message's headers (Celery puts them on the request)."""
    found = getattr(request, tracing.HEADER, None) or (getattr(request, "headers", None) or {}).get(
        tracing.HEADER
    )
    return tracing.valid(found)


def _clear(plane: planes.Plane, pass_name: str, names: list[str]) -> None:
    try:
        plane.coord.clear_pending(pass_name, names)
    except TransientError as err:
        log.warning("%s: pending markers left to expire: %s", pass_name, err)
