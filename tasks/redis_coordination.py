"""The Redis driver of ``tasks.coordination.Coordination``: its Lua scripts, and the keeper.

Row locks (and the ``dispatch`` lock) are ``SET key token NX PX hold``, released only by
their token; pending markers and ordinal reservations are keys beside them.

Whatever a process holds lives ``hold_seconds`` (half a tick) and is renewed by that
process's ``Keeper`` while it lives, in one round trip for everything it holds, so what a
dead process held is free again within half a tick. Markers and reservations are held
so by the process that sends their message until it is sent (a scanner or dispatcher that
dies in between frees them within a hold); from then on they stand for a message in the
queue and are not held by any process: the queue keeps the message, and
it lives ``queued_seconds`` (past any redelivery), unless the queue has been seen dry
for ``adrift_seconds`` while it stood: then it is adrift (its message was taken by a
worker that died before holding it) and the next scan sends its key again. The worker
that receives the message holds them from then on (``Coordination.hold``).

Beside them, not coordination but a report: each Celery worker's and beat's ``Beacon``
stamps ``HSET <ns>:processes <name>`` every ``beacon_seconds``, so the console and
``poolctl status`` say which are online and since when the others are gone
(``tasks.liveness`` reads it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable

import redis

import beat_schedule
from core.errors import TransientError, Unavailable
from core.logs import mask_url
from core.settings import Settings
from tasks.coordination import (
    holder_token,
    processes_key,
    queue_lists,
    scanning_since_key,
    scans_key,
    waiting_key,
    worker_redis_url,
)

log = logging.getLogger("poolkeeper.maintenance")

# Each script takes a whole batch in one round trip: a key prefix and the batch's names as
# one JSON array (ARGV), the keys composed inside the script. One argument per batch, not
# one per key: packing a thousand keys cost the client more than Redis spent on them.
# (A single Redis server allows keys a script composes; the Celery broker is one anyway.)
#
# A queued marker or reservation stands for a message in the queue, or for one a worker
# has taken off it and is about to hold (``task_received``). kombu takes a message with
# BRPOP and records it as unacknowledged only afterwards, and a live worker out of credit
# keeps a popped message unread until its running task ends: so a taken message goes
# unheld for up to a time limit, and for ever if its worker dies in between.
#
# ``watch`` reads the queue on every call that names one (ARGV's last item, a JSON object:
# the queued lifetime, ``window``, ``lead``, the queue's lists, the scan task's name, and
# ``stamp``, the key holding when the queue was last seen turning dry; ``stamp:read`` holds
# the last read). A list holding any message but beat's scan messages (every tick has some)
# deletes the stamp; a dry queue stamps it where it is not, and stamps it anew where the
# last read is more than ``lead`` old: nothing is known of the queue in between (a backlog
# keeps the scans that read it waiting). ``adrift`` then says a queued key stands for
# nothing any more: the queue has been seen dry, at reads never ``lead`` apart, for
# ``window`` + ``lead`` seconds, and the key has been queued as long. Its message was
# pushed right after its marker: it was in the queue at a read (which restarted the
# window) unless it was popped within ``lead`` of its queueing, ``window`` ago at least.
# A scan reads it whenever it submits keys and dispatch whenever it reserves, so a lost
# key's own scan (its row stays due) reads it every tick.
_ADRIFT = """
local function watch(json)
  if not json then return nil, -1 end
  local a = cjson.decode(json)
  local t = redis.call('time')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local last = tonumber(redis.call('get', a.stamp .. ':read'))
  redis.call('set', a.stamp .. ':read', string.format('%.6f', now), 'EX', a.queued)
  for _, list in ipairs(a.lists) do
    local n = redis.call('llen', list)
    local wet = n > 64
    for i = 0, wet and -1 or n - 1 do  -- a scan message is small: a big one is read no further
      local raw = redis.call('lindex', list, i)
      local ok, msg = pcall(cjson.decode, #raw <= 4096 and raw or 'null')
      local headers = ok and type(msg) == 'table' and msg.headers
      if not (type(headers) == 'table' and headers.task == a.scan) then
        wet = true
        break
      end
    end
    if wet then
      redis.call('del', a.stamp)
      return a, -1
    end
  end
  local since = tonumber(redis.call('get', a.stamp))
  if not since or not last or now - last > a.lead then
    since = now
    redis.call('set', a.stamp, string.format('%.6f', now), 'EX', a.queued)
  end
  return a, now - since
end
local function adrift(key, a, dry)
  if not a or dry < a.window + a.lead or redis.call('get', key) ~= 'queued' then return false end
  local ttl = redis.call('pttl', key)
  local age = ttl < 0 and a.queued or a.queued - ttl / 1000
  return age >= a.window + a.lead
end
"""
# Locks (and reservations): one token per batch; the indexes (1-based) of the names it did
# NOT win come back (in a storm, none: a reply of a thousand won indexes cost more to parse
# than the locking). ARGV[5] 'NX' takes free keys; 'XX' takes over keys that exist (a
# received message's markers and reservations: one already gone is not made again). With
# ARGV[6] (reservations), 'NX' also takes a key left adrift (``_ADRIFT``).
_LOCK = (
    _ADRIFT
    + """
local busy = {}
local a, dry = watch(ARGV[6])
for i, name in ipairs(cjson.decode(ARGV[4])) do
  local key = ARGV[3] .. name
  if not redis.call('set', key, ARGV[1], ARGV[5], 'PX', ARGV[2]) then
    if adrift(key, a, dry) then
      redis.call('set', key, ARGV[1], 'PX', ARGV[2])
    else
      busy[#busy + 1] = i
    end
  end
end
return busy
"""
)
# Let go only where the token still holds: deleted, or (ARGV[4], seconds) handed to the
# queue: the key then stands for a queued message (value 'queued') for that long.
_UNLOCK = """
local n = 0
for _, name in ipairs(cjson.decode(ARGV[3])) do
  local key = ARGV[2] .. name
  if redis.call('get', key) == ARGV[1] then
    if ARGV[4] then redis.call('set', key, 'queued', 'EX', ARGV[4]) else redis.call('del', key) end
    n = n + 1
  end
end
return n
"""
# Waiting claims: a sorted set of names by the time each began to wait (ZADD NX keeps the first)
# beside a hash of each one's claim. KEYS[1] the set, KEYS[2] the hash.
_WAIT = """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local bodies = cjson.decode(ARGV[2])
for i, name in ipairs(cjson.decode(ARGV[1])) do
  redis.call('zadd', KEYS[1], 'NX', now + i / 1000000, name)  -- a batch in its order
  redis.call('hsetnx', KEYS[2], name, bodies[i])
end
redis.call('expire', KEYS[1], ARGV[3])
redis.call('expire', KEYS[2], ARGV[3])
"""
_TAKE_WAITING = """
local out = {}
for _, name in ipairs(redis.call('zrange', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  local claim = redis.call('hget', KEYS[2], name)
  if claim then out[#out + 1] = claim end
  redis.call('zrem', KEYS[1], name)
  redis.call('hdel', KEYS[2], name)
end
return out
"""
_FORGET = """
local n = 0
for _, name in ipairs(cjson.decode(ARGV[2])) do n = n + redis.call('del', ARGV[1] .. name) end
return n
"""
# A batch's end, in one round trip: its locks let go where its token (ARGV[1]) still holds
# them, and its finished keys' pending markers deleted. A few calls for the whole batch (MGET,
# DEL of many keys), not one to three per key: per call, Redis's Lua costs more than the
# command itself. Locks: prefix ARGV[2], names ARGV[3]; markers: prefix ARGV[4], names ARGV[5].
_FINISH = """
local function keys(prefix, names)
  local out = {}
  for i, name in ipairs(cjson.decode(names)) do out[i] = prefix .. name end
  return out
end
local function each_chunk(list, fn)
  for first = 1, #list, 1000 do fn(unpack(list, first, math.min(first + 999, #list))) end
end
local locks, mine = keys(ARGV[2], ARGV[3]), {}
each_chunk(locks, function(...)
  local names = {...}
  for i, value in ipairs(redis.call('mget', ...)) do
    if value == ARGV[1] then mine[#mine + 1] = names[i] end
  end
end)
each_chunk(mine, function(...) redis.call('del', ...) end)
each_chunk(keys(ARGV[4], ARGV[5]), function(...) redis.call('del', ...) end)
return #mine
"""
# The keeper's renewal: [[name, token], ...]; each key whose token still holds lives another
# hold; the indexes of those lost (gone, or taken over by another holder) come back.
_RENEW = """
local lost = {}
for i, held in ipairs(cjson.decode(ARGV[3])) do
  local key = ARGV[2] .. held[1]
  if redis.call('get', key) ~= held[2] or redis.call('pexpire', key, ARGV[1]) == 0 then
    lost[#lost + 1] = i
  end
end
return lost
"""
# Below a second, a loaded machine's scheduling alone could make a live holder miss a renewal.
MIN_HOLD_SECONDS = 1.0


def hold_seconds(settings: Settings) -> float:
    """How long what a process holds outlives its last renewal: half a tick (at least a second).

    Its keeper renews every third of it, so a live holder misses two renewals before it
    loses anything, and a dead one's hold is free within half a tick: the next tick's scan
    then finds the key again, so recovery takes 1.5 ticks, leaving half a tick of the
    2-tick bound for the work itself (messages, the scan, a busy machine).
    """
    return max(settings.tick_seconds / 2, MIN_HOLD_SECONDS)


def queued_seconds(settings: Settings) -> float:
    """How long a marker or reservation of a message that no worker holds yet lives.

    The message is in the queue, or delivered to a worker that died before it held it;
    kombu redelivers the latter within the visibility timeout, so nothing needs a second
    message before then.
    """
    return settings.visibility_timeout + settings.task_time_limit


def adrift_seconds(settings: Settings) -> float:
    """How long the queue must have been seen dry before a queued key can be adrift.

    Longer than any live path from the queue to the receiver's hold: a worker out of
    credit keeps a popped message unread until its running task ends (a time limit), and
    one that received it waits up to another for a free child; a tick on top. A live
    message later still (its hold failed) is at worst sent twice, which the row's lock
    and the store's conditional updates make harmless.
    """
    return 2 * settings.task_time_limit + settings.tick_seconds


def adrift_lead(settings: Settings) -> float:
    """How far apart the queue's reads may be for it to count as seen dry, and how much longer
    than ``adrift_seconds`` it must have been dry and a key queued: two ticks (at least two
    seconds), as scans read it every tick."""
    return 2 * max(settings.tick_seconds, MIN_HOLD_SECONDS)


def _by_token(held: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """(name, token) pairs as each token's names: one script call per token a batch holds."""
    by_token: dict[str, list[str]] = {}
    for name, token in held:
        by_token.setdefault(token, []).append(name)
    return by_token


def _batch(names: list[str] | list[list[str]]) -> str:
    """A batch's names as the scripts read them (UTF-8 as is, as redis-py would send a key)."""
    return json.dumps(names, ensure_ascii=False, separators=(",", ":"))


class Keeper:
    """Renews every key this process holds, in one round trip every third of a hold.

    A daemon thread, started with the first hold; it renews nothing once nothing is
    held. A killed process's renewals die with it (its keys lapse within a hold); a hung
    Celery child is killed at the task time limit, and its keeper with it. A forked child
    inherits neither its parent's holdings nor its thread.
    """

    def __init__(self, client: redis.Redis, prefix: str, hold_s: float) -> None:
        self._renew = client.register_script(_RENEW)
        self.prefix, self.hold_ms, self.every = prefix, int(hold_s * 1000), hold_s / 3
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._mu = threading.Lock()
        self._held: dict[str, tuple[str, float]] = {}  # name -> (token, until: monotonic)
        self._thread: threading.Thread | None = None

    def _mine(self) -> None:
        if os.getpid() != self._pid:  # a forked child: nothing of the parent's is held here
            self._reset()

    def add(self, names: Iterable[str], token: str, until: float = math.inf) -> None:
        self._mine()
        with self._mu:
            self._held.update((name, (token, until)) for name in names)
            if self._thread is None and self._held:
                self._thread = threading.Thread(target=self._run, name="poolkeeper-keeper", daemon=True)
                self._thread.start()

    def discard(self, names: Iterable[str]) -> None:
        self._mine()
        with self._mu:
            for name in names:
                self._held.pop(name, None)

    def token(self, name: str) -> str | None:
        self._mine()
        with self._mu:
            held = self._held.get(name)
        return held[0] if held else None

    def held(self) -> dict[str, str]:
        """What this process holds now: name -> token."""
        self._mine()
        with self._mu:
            return {name: token for name, (token, _) in self._held.items()}

    def renew(self) -> None:
        """Extend every held key whose token still holds; forget the others and the overdue."""
        now = time.monotonic()
        with self._mu:
            for name in [n for n, (_, until) in self._held.items() if until <= now]:
                del self._held[name]
            items = [[name, token] for name, (token, _) in self._held.items()]
        if not items:
            return
        try:
            lost = self._renew(args=[self.hold_ms, self.prefix, _batch(items)])
        except redis.RedisError as err:  # the next renewal tries again; a lapse is harmless
            log.debug("keeper: renewal failed: %s", err)
            return
        with self._mu:
            for i in lost:
                name, token = items[int(i) - 1]
                if self._held.get(name, ("",))[0] == token:
                    del self._held[name]

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            self.renew()


# A process's beacon: how many names the hash keeps, and for how long a gone one is still shown.
MAX_PROCESSES = 64
FORGET_PROCESS_SECONDS = 24 * 3600.0


def beacon_seconds(settings: Settings) -> float:
    """How often a worker or beat stamps its beacon: every tick (at least a second)."""
    return max(settings.tick_seconds, MIN_HOLD_SECONDS)


class Beacon:
    """A Celery worker's or beat's own heartbeat: ``HSET <ns>:processes <name> "<kind> <epoch>"``.

    One hash field per process name, written from a daemon thread of the process's own
    (a killed process stops stamping with it), so the stamp outlives the process: a
    reader says "gone since" its last stamp. The hash is kept bounded by the writers:
    past ``MAX_PROCESSES`` names, or for names silent for ``FORGET_PROCESS_SECONDS``, the
    oldest go. Redis trouble is logged at debug and tried again at the next stamp.
    """

    def __init__(self, client: redis.Redis, settings: Settings, kind: str, name: str) -> None:
        self.client = client
        self.key, self.kind, self.name = processes_key(settings.namespace), kind, name
        self.every = beacon_seconds(settings)
        self.stamps = 0

    def stamp(self, now: float) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, self.name, f"{self.kind} {now!r}")
        pipe.hlen(self.key)
        _, size = pipe.execute()
        self.stamps += 1
        if size > MAX_PROCESSES or self.stamps % 100 == 1:  # the cleanup reads the whole hash: seldom
            self.forget_old(now)

    def forget_old(self, now: float) -> None:
        seen = sorted((stamped(v)[1] or 0.0, k) for k, v in self.client.hgetall(self.key).items())
        old = [k for at, k in seen if now - at > FORGET_PROCESS_SECONDS]
        kept = len(seen) - len(old)
        old += [k for _, k in seen[len(old) :][: max(0, kept - MAX_PROCESSES)]]
        if old:
            self.client.hdel(self.key, *old)

    @classmethod
    def start(cls, settings: Settings, kind: str, name: str) -> Beacon:
        """This process's beacon, stamping from a daemon thread (short Redis timeouts)."""
        url = worker_redis_url(settings)
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        beacon = cls(client, settings, kind, name)
        threading.Thread(target=beacon._run, name="poolkeeper-beacon", daemon=True).start()
        return beacon

    def _run(self) -> None:
        while True:
            try:
                self.stamp(time.time())
            except (redis.RedisError, OSError) as err:
                log.debug("beacon: stamp failed: %s", err)
            time.sleep(self.every)


def stamped(raw: bytes | str) -> tuple[str, float | None]:
    """A beacon's value read back: its kind and epoch (someone else's value: "?", None)."""
    kind, _, at = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).partition(" ")
    try:
        return kind, float(at)
    except ValueError:
        return "?", None


def lock_free(client: redis.Redis, namespace: str, name: str) -> bool:
    """Whether lock ``name`` is free now: taken for a moment (``SET NX``, as ``lock_many``) and let go
    by its token (``_UNLOCK``), with no keeper: a probe, for a process that holds nothing."""
    key, token = f"{namespace}:lock:{name}", holder_token()
    if not client.set(key, token, nx=True, px=int(MIN_HOLD_SECONDS * 1000)):
        return False
    client.eval(_UNLOCK, 0, token, f"{namespace}:lock:", _batch([name]))
    return True


class RedisCoordination:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.r = client
        self.prefix = settings.namespace
        # EVALSHA: each script is sent once, then named by its digest
        scripts = (_LOCK, _UNLOCK, _FORGET)
        self._lock, self._unlock, self._forget = (client.register_script(s) for s in scripts)
        self.hold_ms = int(hold_seconds(settings) * 1000)
        self.queued_s = math.ceil(queued_seconds(settings))
        adrift = {
            "queued": self.queued_s,
            "window": adrift_seconds(settings),
            "lead": adrift_lead(settings),
            "lists": queue_lists(settings),
            "scan": beat_schedule.scan_task(settings),
            "stamp": f"{self.prefix}:queue-dry-since",
        }
        self.adrift = json.dumps(adrift, separators=(",", ":"))  # _ADRIFT's argument
        self._finish = client.register_script(_FINISH)
        self._wait, self._take_waiting = client.register_script(_WAIT), client.register_script(_TAKE_WAITING)
        self.waiting_keys = [waiting_key(self.prefix), f"{waiting_key(self.prefix)}:claims"]
        self.keeper = Keeper(client, f"{self.prefix}:", hold_seconds(settings))
        self.where = f"redis at {mask_url(settings.redis_url)}"

    def _take(self, kind: str, names: list[str], adrift: str | None = None) -> list[str | None]:
        """``SET NX`` each name for this process (its keeper renews them); None where taken.

        With ``adrift`` (markers, reservations), a queued key left adrift is taken too (``_ADRIFT``).
        """
        if not names:
            return []
        token = holder_token()
        args: list[str | int] = [token, self.hold_ms, f"{self.prefix}:{kind}:", _batch(names), "NX"]
        args += [adrift] if adrift else []
        with _redis_errors():
            busy = set(self._lock(args=args))
        won = [None if i in busy else token for i in range(1, len(names) + 1)]
        self.keeper.add((f"{kind}:{n}" for n, t in zip(names, won, strict=True) if t), token)
        return won

    def lock_many(self, keys: list[str]) -> list[str | None]:
        return self._take("lock", keys)

    def unlock_many(self, held: dict[str, str]) -> None:
        self.keeper.discard(f"lock:{key}" for key in held)
        with _redis_errors():
            for token, names in _by_token(held.items()).items():
                self._unlock(args=[token, f"{self.prefix}:lock:", _batch(names)])

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]:
        """Held by this process (a hold, renewed) until ``queue_pending``: a scanner that dies
        between marking and sending frees them within a hold, not an adrift window."""
        keys = list(keys)
        won = self._take(f"pending:{pass_name}", keys, self.adrift)
        return [k for k, token in zip(keys, won, strict=True) if token]

    def queue_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        self._queue(f"pending:{pass_name}", list(keys))

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        names = list(keys)
        if names:
            self.keeper.discard(f"pending:{pass_name}:{n}" for n in names)
            with _redis_errors():
                self._forget(args=[f"{self.prefix}:pending:{pass_name}:", _batch(names)])

    def finish(self, held: dict[str, str], pass_name: str, done: Iterable[str]) -> None:
        names = list(done)
        self.keeper.discard(f"lock:{key}" for key in held)
        self.keeper.discard(f"pending:{pass_name}:{n}" for n in names)
        batches = list(_by_token(held.items()).items()) or [("", [])]  # one call even with no lock held
        pending = f"{self.prefix}:pending:{pass_name}:"
        with _redis_errors():
            for i, (token, locks) in enumerate(batches):
                markers = _batch(names) if i == 0 else "[]"
                self._finish(args=[token, f"{self.prefix}:lock:", _batch(locks), pending, markers])

    def reserve(self, ordinals: Iterable[int]) -> list[int]:
        wanted = list(ordinals)
        won = self._take("reserved", [str(o) for o in wanted], self.adrift)
        return [o for o, token in zip(wanted, won, strict=True) if token]

    def queue_reserved(self, ordinals: Iterable[int]) -> None:
        self._queue("reserved", [str(o) for o in ordinals])

    def _queue(self, kind: str, names: list[str]) -> None:
        """What this process holds of ``names`` now stands for a message in the queue: held by
        no process, it lives ``queued_seconds`` (one a receiver already holds is left to it)."""
        held = ((n, token) for n in names if (token := self.keeper.token(f"{kind}:{n}")))
        by_token = _by_token(held)
        self.keeper.discard(f"{kind}:{n}" for mine in by_token.values() for n in mine)
        with _redis_errors():
            for token, mine in by_token.items():
                self._unlock(args=[token, f"{self.prefix}:{kind}:", _batch(mine), self.queued_s])

    def release(self, ordinals: Iterable[int]) -> None:
        names = [str(o) for o in ordinals]
        if names:
            self.keeper.discard(f"reserved:{n}" for n in names)
            with _redis_errors():
                self._forget(args=[f"{self.prefix}:reserved:", _batch(names)])

    def wait_for_ordinal(self, claims: dict[str, str]) -> None:
        """They wait ``queued_seconds`` at most (a claim never served is reconcile's orphan anyway)."""
        if claims:
            with _redis_errors():
                names, bodies = list(claims), list(claims.values())
                self._wait(keys=self.waiting_keys, args=[_batch(names), _batch(bodies), self.queued_s])

    def take_waiting(self, at_most: int) -> list[str]:
        if at_most <= 0:
            return []
        with _redis_errors():
            return [c.decode() for c in self._take_waiting(keys=self.waiting_keys, args=[at_most])]

    def hold(self, pass_name: str, names: Iterable[str], ordinals: Iterable[int], seconds: float) -> None:
        keys = [f"pending:{pass_name}:{n}" for n in names] + [f"reserved:{o}" for o in ordinals]
        if not keys:
            return
        token = holder_token()
        with _redis_errors():
            gone = set(self._lock(args=[token, self.hold_ms, f"{self.prefix}:", _batch(keys), "XX"]))
        kept = [k for i, k in enumerate(keys, 1) if i not in gone]
        self.keeper.add(kept, token, until=time.monotonic() + seconds)

    def ping(self) -> None:
        with _redis_errors(self.where):
            self.r.ping()

    def record_scan(self, pass_name: str, now: float) -> None:
        with _redis_errors(self.where):
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(scans_key(self.prefix), pass_name, repr(now))
            pipe.setnx(scanning_since_key(self.prefix), repr(now))  # the plane's first scan
            pipe.execute()


class _redis_errors:
    """Redis trouble is transient: retry the row later. Cannot reach it (refused, timeout): Unavailable."""

    def __init__(self, where: str = "redis") -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: object) -> None:
        if isinstance(err, redis.ConnectionError | redis.TimeoutError | OSError):
            raise Unavailable(f"{self.where} is unavailable: {err}") from err
        if isinstance(err, redis.RedisError):
            raise TransientError(f"{self.where}: {err}") from err
