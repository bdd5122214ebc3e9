"""Searching 100,000 board tasks through the index, against a plain indexed id lookup in the same run.

Loads ``--tasks`` tasks into the built-in Kanban's tables (5,000 a transaction, one multi-row
INSERT each, past the Kanban's per-task checks: the load is not what is measured; SQLite's
triggers still feed the FTS5 index as any writer's would) on SQLite and on PostgreSQL, then
times ``search_tasks`` for three kinds of text, each asked ``--repeat`` times:

- ``rare``: a word one task holds;
- ``some``: a word about one task in a hundred holds;
- ``common``: a word nearly every task holds (the search stops at its first 50, newest first).

The baseline is ``get_task`` (the primary key) on the same board, the same
number of times: the same transaction, connection and decoding, with a lookup in place of
the search. Prints p50 and p95 in milliseconds, and each kind's p50 as a ratio to the
baseline's. Targets (issue 29): p50 under 200 ms, ratio at most 20x.

    python bench/search_bench.py [--tasks N] [--repeat N] [--postgres URL | --no-postgres]

PostgreSQL runs in a schema of its own (``search_bench_<random>``) in the database the URL
names (by default ``test`` at 127.0.0.1), dropped afterwards with what it holds; ``pg_trgm``
is created there if the database has none yet.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project root on the path, as `python -m` would
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert, text
from sqlalchemy.engine import make_url

from board import Board, open_board, search_tasks
from board.schema import boards, tasks
from core import db
from core.settings import Settings

POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BATCH = 5_000
WORDS = [
    f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "po", "ri", "su", "te") for b in ("ba", "de", "fo", "gu")
]
KINDS = ("rare", "some", "common")


def corpus(n: int, seed: int = 29) -> Iterator[list[dict[str, object]]]:
    """``n`` tasks in batches: titles and bodies of made-up words; the middle one alone holds
    ``needle``, one in a hundred ``quarantine``, 49 in 50 ``deploy``."""
    rng = random.Random(seed)
    batch: list[dict[str, object]] = []
    for i in range(n):
        words = rng.choices(WORDS, k=12)
        marks = ["needle" * (i == n // 2), "quarantine" * (i % 100 == 7), "deploy" * (i % 50 != 3)]
        title = " ".join([*words[:4], marks[2]]).strip()
        body = " ".join([*words[4:], *marks[:2]]).strip() + f" step {i}"
        at = 1_800_000_000.0 + i
        batch.append(
            {
                **{"board": "bench", "id": f"t{i:06d}", "title": title, "body": body},
                **{"status": "ready", "lane": "pool", "created_at": at, "updated_at": at},
            }
        )
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def load(board: Board, n: int, url: str) -> float:
    """``n`` tasks into a migrated board; the seconds it took."""
    start = time.perf_counter()
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(boards).values(name="bench", created_at=0.0))
    for batch in corpus(n):
        with engine.begin() as conn:
            conn.execute(insert(tasks), batch)
    if url.startswith("postgresql"):  # as autovacuum would after such a load
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE tasks"))
    engine.dispose()
    return time.perf_counter() - start


def timed(call: Callable[[], object], repeat: int) -> list[float]:
    """Milliseconds of each of ``repeat`` calls, after one warm-up."""
    call()
    spent = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        spent.append((time.perf_counter() - start) * 1000)
    return spent


def measure(board: Board, n: int, repeat: int) -> dict[str, list[float]]:
    texts = {"rare": "needle", "some": "quarantine", "common": "deploy"}
    found = {kind: len(search_tasks(board, t)) for kind, t in texts.items()}
    assert found == {"rare": 1, "some": min(50, (n + 92) // 100), "common": min(50, n - (n + 46) // 50)}, (
        found
    )
    ids = [f"t{i:06d}" for i in random.Random(7).choices(range(n), k=repeat)]
    lookups = iter(ids * 2)
    figures = {"id lookup": timed(lambda: board.get_task("bench", next(lookups)), repeat)}
    for kind, t in texts.items():
        figures[kind] = timed(partial(search_tasks, board, t), repeat)
    return figures


@contextmanager
def sqlite_board(tmp: str) -> Iterator[tuple[Board, str]]:
    url = f"sqlite:///{tmp}/board.db"
    board = open_board(Settings(board_url=url))
    board.migrate()
    yield board, url
    board.close()


@contextmanager
def postgres_board(url: str) -> Iterator[tuple[Board, str]]:
    """A board in a schema of its own in ``url``'s database, dropped (with all it holds) afterwards."""
    schema = f"search_bench_{uuid.uuid4().hex[:8]}"
    admin = db.make_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    own = make_url(url).update_query_dict({"options": f"-csearch_path={schema},public"})
    board = open_board(Settings(board_url=own.render_as_string(hide_password=False)))
    try:
        board.migrate()
        yield board, own.render_as_string(hide_password=False)
    finally:
        board.close()
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()


def report(name: str, loaded: float, n: int, figures: dict[str, list[float]]) -> list[str]:
    base = statistics.median(figures["id lookup"])
    lines = [f"{name}: {n:,} tasks loaded in {loaded:.1f} s"]
    lines += ["| what | p50 ms | p95 ms | p50 / id lookup |", "| --- | --- | --- | --- |"]
    for what, spent in figures.items():
        p50, p95 = statistics.median(spent), statistics.quantiles(spent, n=20)[-1]
        ratio = "1.0x" if what == "id lookup" else f"{p50 / base:.1f}x"
        lines.append(f"| {what} | {p50:.2f} | {p95:.2f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--postgres", default=POSTGRES, help="a PostgreSQL URL (its database is used)")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        backends: list[tuple[str, Callable[[], AbstractContextManager[tuple[Board, str]]]]] = [
            ("sqlite", lambda: sqlite_board(tmp))
        ]
        if not args.no_postgres:
            backends.append(("postgresql", lambda: postgres_board(args.postgres)))
        worst = 0.0
        for name, opened in backends:
            with opened() as (board, url):
                loaded = load(board, args.tasks, url)
                figures = measure(board, args.tasks, args.repeat)
            print("\n".join(report(name, loaded, args.tasks, figures)), flush=True)
            base = statistics.median(figures["id lookup"])
            worst = max(worst, *(statistics.median(figures[k]) / base for k in KINDS))
    print(f"worst search p50 / id lookup: {worst:.1f}x (target <= 20x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
