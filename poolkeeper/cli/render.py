"""How `poolctl` shows what a command found: Rich tables and trees over plain data.

The commands query and build the data (what ``--json`` prints as it is); these functions
only lay it out, so a new column touches one function and no query.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from board import BoardTask


def status(data: dict[str, Any], pool_size: int) -> Table:
    """``poolctl status``: the pool's numbers (``poolkeeper.status.snapshot``)."""
    free, counts = data["free_ordinals"], data["rows"]
    table = Table(title="poolkeeper", show_header=False)
    for state, n in counts.items():
        table.add_row(f"rows {state}", str(n))
    table.add_row("free ordinals", f"{len(free)}/{pool_size} {free}")
    oldest = data["oldest_lease_failed_seconds"]
    table.add_row("oldest lease_failed", "-" if oldest is None else f"{oldest:.0f}s ago")
    table.add_row("quarantined", str(data["quarantined"]))
    held_by_quarantined = data["held_by_quarantined"]
    stuck = f"{held_by_quarantined} (see `poolctl abandon`)" if held_by_quarantined else "-"
    table.add_row("ordinals held by quarantined rows", stuck)
    table.add_row("live child executions", str(data["live_children"]))
    table.add_row("audit events written", str(data["audit_events"]))
    _presence(table, data)
    unknown = f"unknown ({data['redis_error']})"
    depth = data["queue_depth"]
    table.add_row("queue depth", unknown if depth is None else str(depth))
    alive = data["beat_alive"]
    table.add_row("beat", unknown if alive is None else "alive" if alive else "NOT SCANNING")
    for name, scan in data["scans"].items():
        age = scan["age_seconds"]
        seen = "unknown" if scan["late"] is None else "never" if age is None else f"{age:.0f}s ago"
        table.add_row(f"last scan {name}", seen + (" (late)" if scan["late"] and age is not None else ""))
    for st, n in data["board"].items():
        table.add_row(f"board {st}", str(n))
    return table


def _presence(table: Table, data: dict[str, Any]) -> None:
    """Each ordinal's last worker call; a warning for ordinals without one for over a lease."""
    lease, missing = data["lease_seconds"], set(data["ordinals_without_worker"])
    for p in data["presence"]:
        age = p["age_seconds"]
        seen = "no worker call seen" if age is None else f"{p['call']} {age:.0f}s ago by {p['owner'] or '?'}"
        warn = f" (WARNING: no worker for over a lease, {lease:.0f}s)" if p["ordinal"] in missing else ""
        table.add_row(f"ordinal {p['ordinal']} worker", Text(seen + warn, style="red" if warn else ""))
    waiting = data["waiting_assigned"]
    listed = ", ".join(f"row {w['id']} on ordinal {w['ordinal']} {w['waited_seconds']:.0f}s" for w in waiting)
    flag = Text(f"WARNING: {listed} (no worker takes them)", style="red") if waiting else Text("-")
    table.add_row("assigned longer than a lease", flag)


def rows(found: list[dict[str, Any]]) -> Table:
    """``poolctl rows``: one line per row."""
    table = Table("id", "board/task", "run", "ord", "state", "att", "fence", "failures", "last error")
    for r in found:
        table.add_row(
            str(r["id"]),
            f"{r['board']}/{r['task_id']}",
            str(r["run_id"]),
            str(r["ordinal"]),
            r["state"] + (" (Q)" if r["quarantined"] else ""),
            str(r["attempt"]),
            str(r["fence"] or "-"),
            str(r["failures"]),
            (r["last_error"] or "")[:60],
        )
    return table


def row_tree(row_id: int, data: dict[str, Any]) -> Tree:
    """``poolctl rows ROW``: the row and its child executions, nested."""
    root = Tree(f"row {row_id} {data['board']}/{data['task_id']} run {data['run_id']}: {data['state']}")

    def add(branch: Tree, children: list[dict[str, Any]]) -> None:
        for c in children:
            outcome = f" ({c['outcome']})" if c["outcome"] else ""
            label = f"{c['id'].rsplit('/', 1)[1]} {c['status']}{outcome} epoch {c['epoch']}"
            add(branch.add(label), c["children"])

    add(root, data["children"])
    return root


def history(row_id: int, data: dict[str, Any]) -> Table | Text:
    """``poolctl rows ROW --history``: its audit trail, oldest first."""
    title = f"row {row_id} {data['board']}/{data['task_id']} run {data['run_id']}: {data['state']}"
    if not data["history"]:
        return Text(f"{title}\nno recorded events (none yet, or all older than the retention)")
    table = Table("time (UTC)", "kind", "from → to", "att", "fence", "actor", "detail", title=Text(title))
    for e in data["history"]:
        table.add_row(
            _utc(e["at"]),
            e["kind"],
            f"{e['from'] or '-'} → {e['to'] or '-'}",
            str(e["attempt"] or "-"),
            str(e["fence"] or "-"),
            Text(e["actor"]),
            Text(e["detail"] or ""),  # text, never markup: an error may hold brackets
        )
    return table


def outcomes(data: Mapping[str, Mapping[Any, int]]) -> Table:
    """``poolctl maintain --once``: each pass's outcomes."""
    table = Table("pass", "outcomes")
    for name, outcomes in data.items():
        table.add_row(name, " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "-")
    return table


def tasks(found: list[BoardTask]) -> Table:
    """``poolctl board list``: one line per task."""
    table = Table("board", "id", "title", "status", "lane", "run", "block reason")
    for t in found:
        table.add_row(
            t.board,
            t.id,
            t.title[:40],
            t.status.value,
            t.lane,
            str(t.current_run_id or "-"),
            t.block_reason or "",
        )
    return table


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
