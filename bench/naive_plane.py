"""The naive plane of ``bench/storm.py``: one message, one lock, one connection per row.

A Celery app of its own (``celery -A bench.naive_plane worker``): each message
carries one row id; the task opens a fresh database connection (no pool),
takes the row's Redis lock, expires the row in its own transaction, releases.
"""

from __future__ import annotations

import time

import redis
from celery import Celery
from sqlalchemy.pool import NullPool

from core import db
from core.settings import Settings
from store import transitions
from tasks.redis_coordination import RedisCoordination

settings = Settings.from_env()
app = Celery("naive", broker=settings.redis_url)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue="maintenance",
)


@app.task(name="naive.expire")  # type: ignore[untyped-decorator]  # celery ships no hints
def expire_one(row_id: int) -> None:
    coord = RedisCoordination(redis.Redis.from_url(settings.redis_url), settings)
    [token] = coord.lock_many([f"row:{row_id}"])
    if token is None:
        return
    engine = db.make_engine(settings.database_url, poolclass=NullPool)
    try:
        with db.transaction(engine) as s:
            transitions.expire_many(s, [row_id], max_attempts=settings.max_attempts, now=time.time())
    finally:
        engine.dispose()
        coord.unlock_many({f"row:{row_id}": token})
