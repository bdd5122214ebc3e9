"""The Trends page's charts as geometry and as SVG, without a browser (``console_trends``)."""

from __future__ import annotations

import re

from poolkeeper.console import trends as console_trends
from poolkeeper.console import views as console_views
from tests.factories import NOW

STARTS = [NOW // 60 * 60 + 60 * i for i in range(-59, 1)]


def ys(points: str) -> list[float]:
    return [float(p.split(",")[1]) for p in points.split()]


def test_a_spike_is_drawn_at_the_top_of_its_bucket_and_the_rest_on_the_zero_line() -> None:
    values = [0] * 60
    values[41] = 40
    drawn = console_trends.chart("events", "Transitions", "events", STARTS, {"failures": values})
    [line] = drawn["lines"]
    heights = ys(line.points)
    assert heights[41] == drawn["y_top"] and {h for i, h in enumerate(heights) if i != 41} == {
        drawn["y_zero"]
    }
    assert (line.total, line.peak, drawn["top"]) == (40, 40, 40)
    assert line.peak_at == drawn["clocks"][41]


def test_an_empty_window_draws_flat_lines_and_a_latency_gap_reads_as_no_value() -> None:
    drawn = console_trends.chart("latency", "Wait", "seconds", STARTS, {"mean": [None] * 60})
    [line] = drawn["lines"]
    assert set(ys(line.points)) == {drawn["y_zero"]} and line.peak == 0 and line.peak_at == ""
    html = console_views.render(
        "_trends.html", charts=[drawn], now=NOW, poll=2, refresh=None, queue_depth=None, redis_error="down"
    )
    assert re.search(r'<svg[^>]+role="img"[^>]+aria-labelledby="t-latency d-latency"', html)
    assert '<title id="t-latency">Wait</title>' in html
    assert html.count('<td class="num">-</td>') == 60  # the table says "no value", not 0
    assert 'data-metric="queue_depth">unknown' in html
