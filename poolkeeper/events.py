"""The pool's own board write paths tell the plane at once when tasks turn ready (``tasks.events``).

``poolctl board add`` and ``unblock``, the console's actions and ``poolctl board serve``'s routes call
``task_ready`` after their write commits, so a dispatch is sent in milliseconds instead of at the next
tick; a board the pool does not write itself calls ``POST /v1/board-events`` instead.
"""

from __future__ import annotations

from core.settings import Settings
from tasks.coordination import worker_redis_url
from tasks.events import Events


def events_for(settings: Settings) -> Events:
    """The producer's events on the plane's Redis (the local one when none is set)."""
    return Events.from_settings(settings, worker_redis_url(settings))


def task_ready(events: Events) -> None:
    """Tasks turned ready: ask for a dispatch (a hint: lost, it costs at most a tick)."""
    events.scan_due("materialize")  # dispatch is materialize's scan


SETTLE_SECONDS = 10.0  # how long a pause waits for a dispatch round in flight


def dispatch_settled(settings: Settings, timeout: float = SETTLE_SECONDS) -> str | None:
    """After a pause is written: wait until no dispatch round is in flight (None), or say why not.

    A round reads the pause and claims under the ``dispatch`` lock, so once this process has
    taken the lock and let it go, every later round reads the pause: no claim follows a
    pause acknowledged this way. (A dispatcher frozen past its hold loses the lock without
    knowing and may still claim once when it thaws: the pause cannot fence the board.)
    """
    import time

    import redis

    from tasks import liveness
    from tasks.redis_coordination import lock_free

    deadline = time.monotonic() + timeout
    client = None
    try:
        client = liveness.client_for(settings)
        while not lock_free(client, settings.namespace, "dispatch"):
            if time.monotonic() > deadline:
                return f"a dispatch round still claimed after {timeout:.0f} s: its claims may land"
            time.sleep(0.05)
        return None
    except (redis.RedisError, OSError, ValueError) as err:
        return f"could not see whether a dispatch round is in flight ({err}): its claims may land"
    finally:
        if client is not None:
            client.close()
