"""The console's Trends page: ``store.trends`` drawn as inline SVG on the server.

Every chart is geometry computed here (points, ticks, labels) and drawn by
``_trends.html`` as an ``<svg role="img">`` with a ``<title>``, a one-line summary and
the same numbers in a table: no script draws anything, nothing is loaded from
elsewhere, and the colours are the stylesheet's variables, light and dark. The page's
live part is polled like every other console fragment.

Queue depth has no history source: it is Redis's ``LLEN`` as the page is drawn.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput
from poolkeeper.console.views import Pages
from store import queries, trends
from tasks import liveness

WINDOWS = {w.name: w for w in (trends.HOUR, trends.DAY)}
WIDTH, HEIGHT = 640, 160  # the SVG's own units; CSS scales it to the column
LEFT, BOTTOM, TOP = 44, 20, 8  # room for the y labels, the x labels, the top line
# The hour refreshes at the console's poll; the day's buckets are 10 minutes, and reading it
# walks the whole day's range (bench/trends.py), so it refreshes once a minute.
DAY_REFRESH_SECONDS = 60
# wait and run time: p50, p95, p99 in seconds, from milliseconds to hours
PERCENTILES: dict[str, Any] = {"summed": False, "digits": 3, "log": True}
LOG_DECADES = 6


@dataclass(frozen=True)
class Line:
    name: str
    points: str  # the polyline's "x,y x,y …"
    total: float
    peak: float
    peak_at: str  # the peak's bucket, "HH:MM" (UTC)
    values: list[float | None]


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%H:%M")


def chart(
    key: str,
    title: str,
    unit: str,
    starts: list[float],
    series: dict[str, list[Any]],
    *,
    summed: bool = True,
    digits: int = 1,
    log: bool = False,
) -> dict[str, Any]:
    """A line chart's geometry: one polyline per series over the buckets, a gap-free line (None as 0).

    ``summed``: a series' total means something (counts do; percentiles do not, and say only their
    peak); ``digits``: the decimals its numbers are shown with; ``log``: a logarithmic y axis from
    the smallest value drawn (at most ``LOG_DECADES`` below the top), for values that span
    milliseconds to hours; no value (None, 0) lies on the bottom line.
    """
    n = len(starts)
    drawn = [v for values in series.values() for v in values if v]
    top = max(drawn or [0])
    scale = top if top > 0 else 1
    bottom = max(min(drawn), top / 10**LOG_DECADES) if log and drawn else 0.0
    decades = math.log10(top / bottom) if bottom and top > bottom else 1.0
    span_x, span_y = WIDTH - LEFT - 4, HEIGHT - BOTTOM - TOP

    def x(i: int) -> float:
        return LEFT + (span_x * i / (n - 1) if n > 1 else 0)

    def y(v: float | None) -> float:
        if not bottom:
            return TOP + span_y * (1 - (v or 0) / scale)
        if not v:
            return TOP + span_y
        return TOP + span_y * (1 - max(0.0, math.log10(v / bottom)) / decades) if top > bottom else TOP

    lines = []
    for name, values in series.items():
        numbers = [v or 0 for v in values]
        peak = max(numbers, default=0)
        lines.append(
            Line(
                name=name,
                points=" ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values)),
                total=sum(numbers),
                peak=peak,
                peak_at=_clock(starts[numbers.index(peak)]) if peak else "",
                values=list(values),
            )
        )
    ticks = [(x(i), _clock(starts[i])) for i in (0, n // 2, n - 1)]
    return {
        "key": key,
        "title": title,
        "unit": unit,
        "lines": lines,
        "top": top,
        "bottom": bottom,
        "x_ticks": ticks,
        "y_top": TOP,
        "y_zero": TOP + span_y,
        "left": LEFT,
        "right": WIDTH - 4,
        "width": WIDTH,
        "height": HEIGHT,
        "clocks": [_clock(ts) for ts in starts],
        "summed": summed,
        "digits": digits,
    }


def page(pages: Pages, window: str, now: float) -> dict[str, Any]:
    """The Trends page's charts for ``window`` (``hour``: per minute, ``day``: per 10 minutes)."""
    chosen = WINDOWS.get(window)
    if chosen is None:
        raise InvalidInput("window", f"unknown window {window[:40]!r}; one of {', '.join(WINDOWS)}")
    with pages.store.session(readonly=True) as s:
        found = trends.read(s, chosen, now, queries.counts_by_state(s))
    plane = liveness.read(pages.client, pages.settings, now, error=pages.redis_problem)
    per = "minute" if chosen.seconds == 60 else f"{chosen.seconds // 60} minutes"
    starts = found.starts
    latency = {"mean": found.latency_mean, "longest": found.latency_max}
    return {
        "window": chosen.name,
        "refresh": DAY_REFRESH_SECONDS if chosen is trends.DAY else None,
        "windows": list(WINDOWS),
        "per": per,
        "now": now,
        "charts": [
            chart("events", f"Transitions per {per}", "events", starts, dict(found.events)),
            chart("rows", f"Rows by state, at the end of each {per}", "rows", starts, dict(found.rows)),
            chart("latency", f"Expiry → re-grant, per {per}", "seconds", starts, latency),
            # the store's, not this process's histograms: every replica draws the same
            chart(
                "waits",
                f"Wait, ready → claimed, per {per} (log scale)",
                "seconds",
                starts,
                found.waits,
                **PERCENTILES,
            ),
            chart(
                "runs",
                f"Run time, grant → result, per {per} (log scale)",
                "seconds",
                starts,
                found.runs,
                **PERCENTILES,
            ),
        ],
        "queue_depth": plane.queue_depth,
        "redis_error": plane.error,
    }
