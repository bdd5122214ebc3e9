"""Screenshots of the console for docs/console.md: ``python -m tests.screenshots [OUTDIR [NAME.png ...]]``
(default docs/, every picture; names given: only those).

Seeds a small pool through the real code paths (board tasks claimed and
materialized by ``maintain_once`` over a Redis of its own, grants, a row
quarantined by the failure path, a parked task, a board whose tasks one cause
parked), starts ``poolctl serve`` and takes, at 1280 by 800 in Debian's Chromium:
the overview (light and dark), a quarantined row's page, the board page, the
workers page, a search, a bulk requeue's confirmation, a bulk unblock's of a
board's blocked tasks and the trends (light and dark). Run it by hand when the pages
change; no test writes into the tree.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from selenium.webdriver.common.by import By

from board import Board, open_board
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import RedisServer, ServeProc, wait_for
from store import PoolStore, queries
from tasks import failures, registry
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tasks.redis_coordination import Beacon, RedisCoordination
from tests import browser
from tests.helpers import DAY, staff

SECRET = "screenshot-secret-" + "0123456789abcdef" * 3
TITLES = [
    "Resize product images",
    "Rebuild search index",
    "Send weekly digest",
    "Reconcile invoices",
    "Export audit log",
    "Warm CDN cache",
    "Compact event store",
]


def seed(settings: Settings, store: PoolStore, kanban: Board, redis: RedisServer) -> int:
    """The pool as an operator might find it; returns the quarantined row's id."""
    for i, title in enumerate(TITLES):
        kanban.add_task("payments", title, task_id=f"pay-{i + 1:03d}")
    plane = Plane(settings, store, kanban, RedisCoordination(redis.client(), settings))
    staff(store, range(settings.pool_size), time.time() + DAY)  # dispatch fills ordinals with a worker
    maintain_once(plane, time.time())  # claims and materializes: one row per free ordinal
    for ordinal in (0, 1):
        store.offer(ordinal, owner=f"worker-{ordinal}")
    with store.session(readonly=True) as s:
        poisoned = next(r.id for r in queries.live_rows(s) if r.ordinal == 2)
    for _ in range(settings.quarantine_after):
        error = ValueError("result payload is not JSON: b'\\x89PNG\\r\\n'")
        failures.handle(plane, registry.get("results"), poisoned, error, time.time())
    [parked] = kanban.claim_ready(1, assignee=settings.assignee, lane=settings.lane)
    kanban.block_task(
        parked.board, parked.task_id, "exit code 2: credentials expired", "capability", parked.run_id
    )
    kanban.add_task("payments", "Migrate legacy accounts", task_id="pay-900", lane="manual")
    for i, title in enumerate(["Thumbnail batch 1", "Thumbnail batch 2", "Thumbnail batch 3"]):
        kanban.add_task("images", title, task_id=f"img-{i + 1:03d}")
    for claim in kanban.claim_ready(
        3, assignee=settings.assignee, lane=settings.lane, skip_boards=["payments"]
    ):
        why = "exit code 75: the model server did not answer"
        kanban.block_task(claim.board, claim.task_id, why, "capability", claim.run_id)
    now = time.time()
    for kind, name, at in (("beat", "beat@ops-1", now), ("worker", "maint@ops-1", now),
                           ("worker", "maint@ops-2", now - 600)):  # fmt: skip
        Beacon(redis.client(), settings, kind, name).stamp(at)  # one worker host went away
    return poisoned


def main(outdir: Path, only: set[str]) -> None:
    why = browser.missing()
    if why:
        sys.exit(f"screenshots: {why}")
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="poolkeeper-screens-") as scratch:
        tmp = Path(scratch)
        redis = RedisServer(tmp).start()
        settings = Settings(
            database_url=f"sqlite:///{tmp}/pool.db",
            board_url=f"sqlite:///{tmp}/board.db",
            redis_url=redis.url,
            namespace="screens",
            pool_size=4,
            quarantine_after=3,
        )
        store, kanban = PoolStore.from_settings(settings), open_board(settings)
        store.migrate()
        kanban.migrate()
        row = seed(settings, store, kanban, redis)
        serve = ServeProc(settings.env(), tmp, secret=SECRET).wait_ready()
        driver = browser.chromium(tmp / "profile", tmp / "chromedriver.log")
        try:
            driver.get(f"{serve.url}/ui/login")
            driver.find_element(By.ID, "token").send_keys(tokens.operator_token(SECRET))
            driver.find_element(By.ID, "sign-in").click()
            wait_for("the overview", lambda: driver.current_url == f"{serve.url}/ui", 30)
            shots = [
                ("/ui", "console-overview.png", "light"),
                ("/ui", "console-overview-dark.png", "dark"),
                (f"/ui/rows/{row}", "console-row.png", "light"),
                ("/ui/board?board=payments", "console-board.png", "light"),
                ("/ui/workers", "console-workers.png", "light"),
                ("/ui/search?q=not+JSON", "console-search.png", "light"),
                ("/ui/bulk/requeue?all=1&quarantined=1", "console-bulk.png", "light"),
                (
                    "/ui/bulk/tasks/unblock?board=images&all=1&status=blocked",
                    "console-board-bulk.png",
                    "light",
                ),
                ("/ui/trends", "console-trends.png", "light"),
                ("/ui/trends", "console-trends-dark.png", "dark"),
            ]
            for path, name, scheme in [shot for shot in shots if not only or shot[1] in only]:
                browser.color_scheme(driver, scheme)
                driver.get(serve.url + path)
                driver.find_element(By.ID, "main")
                driver.save_screenshot(str(outdir / name))
                print(f"wrote {outdir / name}")
        finally:
            driver.quit()
            serve.stop()
            redis.stop()
            store.engine.dispose()
            kanban.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs"), set(sys.argv[2:]))
