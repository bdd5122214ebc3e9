"""Is the plane alive? Each pass's last scan and the depth of the deployment's queue, read from Redis.

Writer: every scanner run (``tasks.scan.scan``) stamps its pass in the hash
``<POOL_NAMESPACE>:scans`` (field: pass name, value: epoch seconds) through
``Coordination.record_scan``. Redis, not the store: the scanner already talks
to Redis on every tick (pending markers), so the stamp is one more command and
no store write (SQLite has one writer), and readers (``poolctl serve``,
``poolctl status``) already know ``POOL_REDIS_URL``.

Reader: ``read`` gives each registered pass's last scan, whether it is late
(older than ``LATE_AFTER`` times its interval, or never seen since the plane's first
scan, ``<POOL_NAMESPACE>:scanning-since``, that long ago: a fresh deployment's hourly gc
is not late in its first hours), whether beat is
alive, and the queue depth. Beat is judged from the passes that should have run
by now: those at the tick interval (or shorter) run every tick, so beat is alive
only while none of them is late. A pass at a longer interval (gc, hourly) is
judged on its own (``late``) and does not speak for beat: one that scanned a
minute ago would otherwise keep beat "alive" for hours after beat died, and a
beat just started has not run it yet. The queue depth counts messages
waiting in ``<POOL_NAMESPACE>.maintenance`` (kombu keeps one list per priority
step; messages a worker already holds, such as retries with a countdown, are
not waiting). Each Celery worker and beat of the namespace stamps its own beacon
(``tasks.redis_coordination.Beacon``); one is online while its last stamp is within ``LATE_AFTER``
beacon intervals, else gone since that stamp. When Redis does not answer every one of these is ``None``
("unknown") and ``error`` says why; reading never raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis

from core.logs import mask_url
from core.settings import Settings
from tasks import registry
from tasks.coordination import (
    processes_key,
    queue_lists,
    scanning_since_key,
    scans_key,
    waiting_key,
    worker_redis_url,
)
from tasks.redis_coordination import beacon_seconds, stamped

LATE_AFTER = 3.0  # intervals without a scan before a pass counts as not scanning
READ_TIMEOUT_SECONDS = 1.0  # a page or a scrape waits this long at most for Redis


@dataclass(frozen=True)
class PassScan:
    name: str
    interval: float
    last: float | None  # epoch seconds of the last scan; None: never seen, or unknown
    late: bool | None  # None: Redis did not answer


@dataclass(frozen=True)
class ProcessSeen:
    """A Celery worker or beat of this namespace, by its beacon."""

    name: str
    kind: str  # "worker" or "beat"
    last: float | None  # its last stamp (None: unreadable)
    online: bool  # stamped within LATE_AFTER beacon intervals; else gone since ``last``


@dataclass(frozen=True)
class PlaneHealth:
    scans: tuple[PassScan, ...]
    queue_depth: int | None
    beat_alive: bool | None
    error: str | None = None  # why the rest is unknown
    processes: tuple[ProcessSeen, ...] | None = None  # None: Redis did not answer
    waiting_claims: int | None = None  # claimed runs waiting for an ordinal (None: unknown)

    def as_json(self, now: float) -> dict[str, object]:
        return {
            "queue_depth": self.queue_depth,
            "waiting_claims": self.waiting_claims,
            "beat_alive": self.beat_alive,
            "redis_error": self.error,
            "scans": {
                p.name: {
                    "last": p.last,
                    "age_seconds": None if p.last is None else round(max(0.0, now - p.last), 1),
                    "interval_seconds": p.interval,
                    "late": p.late,
                }
                for p in self.scans
            },
            "processes": None
            if self.processes is None
            else [
                {
                    "name": p.name,
                    "kind": p.kind,
                    "last": p.last,
                    "age_seconds": None if p.last is None else round(max(0.0, now - p.last), 1),
                    "online": p.online,
                }
                for p in self.processes
            ],
        }


def client_for(settings: Settings) -> redis.Redis:
    """A client for readers: short timeouts, so a page never waits long on a Redis that is away.

    ``ValueError`` for a URL redis-py cannot take (the caller reports it as the reason).
    """
    return redis.Redis.from_url(
        worker_redis_url(settings),
        socket_timeout=READ_TIMEOUT_SECONDS,
        socket_connect_timeout=READ_TIMEOUT_SECONDS,
    )


def read(client: redis.Redis | None, settings: Settings, now: float, *, error: str = "") -> PlaneHealth:
    """Scans and queue depth as Redis has them now; unknown (with the reason) when it does not answer."""
    intervals = [(p.name, p.interval(settings)) for p in registry.PASSES]
    unknown = PlaneHealth(tuple(PassScan(n, i, None, None) for n, i in intervals), None, None, error or None)
    if client is None:
        return unknown
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(scans_key(settings.namespace))
        pipe.hgetall(processes_key(settings.namespace))
        pipe.get(scanning_since_key(settings.namespace))
        pipe.zcard(waiting_key(settings.namespace))
        for name in queue_lists(settings):
            pipe.llen(name)
        stamps, beacons, since, waiting, *lengths = pipe.execute()
    except (redis.RedisError, OSError) as err:
        where = mask_url(worker_redis_url(settings))
        return PlaneHealth(unknown.scans, None, None, f"redis at {where}: {type(err).__name__}: {err}")
    scans, started = [], _number(since)
    for name, interval in intervals:
        last = _number(stamps.get(name.encode()))
        # never scanned: late once the plane has scanned for that long (or never at all)
        late = now - (last or started or -math.inf) > LATE_AFTER * interval
        scans.append(PassScan(name, interval, last, late))
    depth, seen = sum(int(n) for n in lengths), processes(beacons, settings, now)
    return PlaneHealth(tuple(scans), depth, beat_alive(scans, settings), None, seen, int(waiting))


def processes(beacons: dict[bytes, bytes], settings: Settings, now: float) -> tuple[ProcessSeen, ...]:
    """The beacons as workers and beats, beats first, each online or gone since its last stamp."""
    online_within = LATE_AFTER * beacon_seconds(settings)
    found = []
    for raw_name, raw in beacons.items():
        kind, last = stamped(raw)
        online = last is not None and now - last <= online_within
        found.append(ProcessSeen(raw_name.decode(errors="replace"), kind, last, online))
    return tuple(sorted(found, key=lambda p: (p.kind != "beat", p.name)))


def beat_alive(scans: list[PassScan], settings: Settings) -> bool:
    """No pass that runs every tick is late (the registry always has some: expire, results, ...)."""
    every_tick = [p for p in scans if p.interval <= settings.tick_seconds]
    return bool(every_tick) and not any(p.late for p in every_tick)


def _number(raw: bytes | None) -> float | None:
    try:
        return None if raw is None else float(raw)
    except ValueError:  # someone else's value under our key: not a scan we can read
        return None
