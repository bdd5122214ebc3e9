"""How `poolctl` shows what a command found: Rich tables and trees over plain data.

The commands query and build the data (what ``--json`` prints as it is); these functions
only lay it out, so a new column touches one function and no query.

Every text that came from the board or the store (titles, ids, errors, owners) goes
through ``safe``: a ``Text`` (never Rich markup) whose control characters are shown
escaped (``\x1b``), so a task title cannot clear the operator's screen or move the
cursor. Ids are never cut: their columns do not wrap and keep their whole width.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from core import validate

if TYPE_CHECKING:
    from board import BoardTask


def safe(value: object, style: str = "") -> Text:
    """``value`` as plain text for the terminal: no markup, no control character it did not make."""
    return Text(validate.shown("" if value is None else str(value)), style=style)


def line(template: str, *values: object) -> Text:
    """A one-line message: the project's own words, with each value made ``safe``."""
    return Text(template.format(*(safe(v).plain for v in values)))


Cell = str | Text


def fitted(
    headers: list[str], cells: list[list[Cell]], width: int, *, wrap: tuple[str, ...] = (), title: Cell = ""
) -> Table:
    """A table whose columns are never cut, or, when they do not fit ``width``, one block per row.

    Only the ``wrap`` columns (free text: errors, details, titles) may wrap, never below 20
    characters; every other cell (ids above all) keeps its whole width. When those do not fit
    across the terminal, each row becomes lines of ``header: value``, so an id is still one
    piece to copy, whatever the width.
    """
    wide = [max([len(h)] + [len(str(row[i])) for row in cells]) for i, h in enumerate(headers)]
    least = [min(w, 20) if h in wrap else w for h, w in zip(headers, wide, strict=True)]
    need = sum(least) + 2 * len(headers) - 2  # padding between columns, none at the edges
    if need <= width:
        table = Table(title=title or None, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for h in headers:
            if h in wrap:
                table.add_column(h, overflow="fold", min_width=min(20, len(h)), ratio=1)
            else:
                table.add_column(h, no_wrap=True, min_width=wide[headers.index(h)])
        for row in cells:
            table.add_row(*row)
        return table
    blocks = Table.grid()
    if title:
        blocks.add_row(title)
    for row in cells:
        block = Text()
        for h, value in zip(headers, row, strict=True):
            block.append(f"{h}: ", style="bold")
            block.append(value if isinstance(value, Text) else Text(value))
            block.append("\n")
        blocks.add_row(block)
    return blocks


def _paused(d: dict[str, Any], then: str) -> Text:
    """A pause (``poolkeeper.status.dispatch_view``'s) as `status` shows it, in red."""
    since = f"{_utc(d['since'])} UTC" if d["since"] else "?"
    return safe(f"PAUSED by {d['by']} since {since}: {d['reason']} ({then})", style="red")


def status(data: dict[str, Any], pool_size: int) -> Table:
    """``poolctl status``: the pool's numbers (``poolkeeper.status.snapshot``)."""
    free, counts = data["free_ordinals"], data["rows"]
    table = Table(title="poolkeeper", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    d = data["dispatch"]
    table.add_row("dispatch", _paused(d, "no new claims; `poolctl resume`") if d["paused"] else "running")
    for b in d["boards"]:
        name = b["board"]
        table.add_row(
            f"dispatch of {name}", _paused(b, f"no claims from it; `poolctl resume --board {name}`")
        )
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
    unknown = safe(f"unknown ({data['redis_error']})")
    depth = data["queue_depth"]
    table.add_row("queue depth", unknown if depth is None else str(depth))
    waiting = data["waiting_claims"]
    table.add_row("claims waiting for an ordinal", unknown if waiting is None else str(waiting))
    alive = data["beat_alive"]
    table.add_row("beat", unknown if alive is None else "alive" if alive else "NOT SCANNING")
    for name, scan in data["scans"].items():
        age = scan["age_seconds"]
        seen = (
            "unknown"
            if scan["late"] is None
            else f"{age:.0f}s ago"
            if age is not None
            else ("never" if scan["late"] else "not yet due")
        )
        table.add_row(f"last scan {name}", seen + (" (late)" if scan["late"] and age is not None else ""))
    _processes(table, data, unknown)
    if data["board"] is None:
        table.add_row("board", safe(f"unknown ({data['board_error']})"))
    else:
        for st, n in data["board"].items():
            table.add_row(safe(f"board {st}"), str(n))
    if data["unknown"]:
        table.add_row("not read", safe(", ".join(data["unknown"]), style="red"))
    return table


def _processes(table: Table, data: dict[str, Any], unknown: Text) -> None:
    """The Celery workers and beats of the namespace, by their beacons: online, or gone since when."""
    found = data["processes"]
    if found is None:
        table.add_row("celery workers and beats", unknown)
        return
    if not found:
        table.add_row("celery workers and beats", Text("none seen", style="red"))
    for p in found:
        age = "?" if p["age_seconds"] is None else f"{p['age_seconds']:.0f}s ago"
        since = "?" if p["last"] is None else _utc(p["last"])
        state = f"online (stamped {age})" if p["online"] else f"GONE since {since} UTC ({age})"
        style = "" if p["online"] else "red"
        table.add_row(safe(f"celery {p['kind']} {p['name']}"), safe(state, style=style))


def _presence(table: Table, data: dict[str, Any]) -> None:
    """Each ordinal's last worker call; a warning for ordinals without one for over a lease."""
    lease, missing = data["lease_seconds"], set(data["ordinals_without_worker"])
    for p in data["presence"]:
        age, h = p["age_seconds"], p["holds"]
        seen = "no worker call seen" if age is None else f"{p['call']} {age:.0f}s ago by {p['owner'] or '?'}"
        holds = f", holds row {h['row']} ({h['board']}/{h['task_id']} run {h['run_id']})" if h else ""
        warn = f" (WARNING: no worker for over a lease, {lease:.0f}s)" if p["ordinal"] in missing else ""
        shown = f"{p['state']}: {seen}{holds}{warn}"
        table.add_row(f"ordinal {p['ordinal']} worker", safe(shown, style="red" if warn else ""))
    waiting = data["waiting_assigned"]
    listed = ", ".join(f"row {w['id']} on ordinal {w['ordinal']} {w['waited_seconds']:.0f}s" for w in waiting)
    flag = Text(f"WARNING: {listed} (no worker takes them)", style="red") if waiting else Text("-")
    table.add_row("assigned longer than a lease", flag)


def rows(found: list[dict[str, Any]], width: int) -> Table:
    """``poolctl rows``: one line per row (a block per row when that cannot fit); ids whole."""
    headers = ["id", "board/task", "run", "ord", "state", "att", "fence", "fail", "last error"]
    cells: list[list[Cell]] = [
        [
            str(r["id"]),
            safe(f"{r['board']}/{r['task_id']}"),
            str(r["run_id"]),
            str(r["ordinal"]),
            r["state"] + (" (Q)" if r["quarantined"] else ""),
            str(r["attempt"]),
            str(r["fence"] or "-"),
            str(r["failures"]),
            safe((r["last_error"] or "")[:200]),
        ]
        for r in found
    ]
    return fitted(headers, cells, width, wrap=("last error",))


def row_tree(row_id: int, data: dict[str, Any]) -> Tree:
    """``poolctl rows ROW``: the row and its child executions, nested."""
    root = Tree(safe(f"row {row_id} {data['board']}/{data['task_id']} run {data['run_id']}: {data['state']}"))

    def add(branch: Tree, children: list[dict[str, Any]]) -> None:
        for c in children:
            outcome = f" ({c['outcome']})" if c["outcome"] else ""
            label = f"{c['id'].rsplit('/', 1)[1]} {c['status']}{outcome} epoch {c['epoch']}"
            add(branch.add(safe(label)), c["children"])

    _detail(root, data)
    add(root, data["children"])
    return root


SHOWN_CHARS = 2000  # of a payload or an output tail on the terminal (``--json`` has them whole)
TAILS = ("stdout_tail", "stderr_tail")


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text)} characters)"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _detail(root: Tree, data: dict[str, Any]) -> None:
    """What the row ran and what came of it (``poolkeeper.status.row_detail``), above its children."""
    d = data["detail"]
    times = ", ".join(
        f"{name} {'-' if d[key] is None else f'{d[key]:.3f}s'}"
        for name, key in (("waited", "wait_seconds"), ("ran", "run_seconds"), ("total", "total_seconds"))
    )
    root.add(f"attempt {data['attempt']} of {d['max_attempts']}; {times}")
    if d["compacted"]:
        root.add("payload: compacted (the row is terminal; its digest stays)")
    else:
        root.add(Text.assemble("payload: ", safe(_cut(_json(d["payload"])))))
    _result(root, d["result"])


def _result(root: Tree, result: dict[str, Any] | None) -> None:
    """A run's result: its fields on one line (exit code, status, reason), then each output tail's lines."""
    if result is None:
        root.add("result: none yet")
        return
    rest = {k: v for k, v in result.items() if k not in TAILS}
    root.add(Text.assemble("result: ", safe(_cut(_json(rest)))))
    for key in TAILS:
        if result.get(key):
            branch = root.add(key.replace("_", " "))
            for line in _cut(str(result[key])).splitlines():
                branch.add(safe(line))


def task_detail(data: dict[str, Any]) -> Tree:
    """``poolctl board show``: one task, its body and result, and each run with its pool row."""
    root = Tree(safe(f"{data['board']}/{data['id']}: {data['status']} (lane {data['lane']})"))
    root.add(Text.assemble("title: ", safe(data["title"])))
    body = root.add("body" if data["body"] else "body: -")
    for line in _cut(data["body"]).splitlines():
        body.add(safe(line))
    if data["block_reason"]:
        root.add(Text.assemble("blocked: ", safe(data["block_reason"])))
    _result(root, data["result"])
    runs = root.add(f"runs: {len(data['runs'])}")
    for run in data["runs"]:
        took = f"{run['ended_at'] - run['started_at']:.3f}s" if run["ended_at"] and run["started_at"] else "-"
        row = f"row {run['row']}" if run["row"] is not None else "no pool row"
        started = _utc(run["started_at"], 3) if run["started_at"] else "-"
        outcome = run["outcome"] or "running"
        runs.add(safe(f"run {run['run_id']}: {outcome}, started {started} UTC, took {took}; {row}"))
    return root


def history(row_id: int, data: dict[str, Any], width: int) -> Table | Text:
    """``poolctl rows ROW --history``: its audit trail, oldest first."""
    title = safe(f"row {row_id} {data['board']}/{data['task_id']} run {data['run_id']}: {data['state']}")
    if not data["history"]:
        return Text.assemble(title, "\nno recorded events (none yet, or all older than the retention)")
    headers = ["time (UTC)", "kind", "from → to", "att", "fence", "actor", "detail"]
    cells: list[list[Cell]] = [
        [
            _utc(e["at"], 3),
            e["kind"],
            f"{e['from'] or '-'} → {e['to'] or '-'}",
            str(e["attempt"] or "-"),
            str(e["fence"] or "-"),
            safe(e["actor"]),
            safe(e["detail"]),
        ]
        for e in data["history"]
    ]
    return fitted(headers, cells, width, wrap=("detail",), title=title)


def outcomes(data: Mapping[str, Mapping[Any, int]]) -> Table:
    """``poolctl maintain --once``: each pass's outcomes."""
    table = Table("pass", "outcomes")
    for name, outcomes in data.items():
        table.add_row(name, " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "-")
    return table


def tasks(found: list[BoardTask], width: int) -> Table:
    """``poolctl board list``: one line per task (a block per task when that cannot fit)."""
    headers = ["board", "id", "title", "status", "lane", "run", "block reason"]
    cells: list[list[Cell]] = [
        [
            safe(t.board),
            safe(t.id),
            safe(t.title[:40]),
            t.status.value,
            safe(t.lane),
            str(t.current_run_id or "-"),
            safe(t.block_reason),
        ]
        for t in found
    ]
    return fitted(headers, cells, width, wrap=("title", "block reason"))


def flags_without_types() -> None:
    """``--help`` shows no ``<bool>`` after a flag: it takes no value, so it has no type to show.

    typer 0.29 prints every option's type, flags included; a flag's "type" is whether it
    was given. Patched once on typer's option class (by ``poolkeeper.cli.main``), for every
    command and ``--help`` itself.
    """
    from typer import core

    shown = core.TyperOption.display_type_rich
    if getattr(shown, "poolkeeper_flags", False):
        return

    def display_type_rich(self: core.TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich.poolkeeper_flags = True  # type: ignore[attr-defined]
    core.TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def _utc(at: float, digits: int = 0) -> str:
    """``at`` in UTC to the second, or to ``digits`` decimals of it (an audit trail's events)."""
    whole = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    scale = 10**digits
    return f"{whole}.{int(at * scale) % scale:0{digits}d}" if digits else whole
