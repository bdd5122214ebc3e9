"""The Trends page's charts as geometry and as SVG, without a browser (``console_trends``)."""

from __future__ import annotations

import re

import pytest

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


def test_a_percentile_chart_says_its_peaks_in_milliseconds_and_no_total() -> None:
    """Percentiles do not add up: their chart shows each line's peak to the millisecond, never a total."""
    p50: list[float | None] = [None] * 60
    p99: list[float | None] = [None] * 60
    p50[10], p99[10] = 0.0042, 0.0871
    drawn = console_trends.chart(
        "waits", "Wait", "seconds", STARTS, {"p50": p50, "p99": p99}, **console_trends.PERCENTILES
    )
    html = console_views.render(
        "_trends.html", charts=[drawn], now=NOW, poll=2, refresh=None, queue_depth=0, redis_error=None
    )
    assert "p50: peak 0.004 at" in html and "p99: peak 0.087 at" in html
    assert not re.search(r"total \d", html)  # in the description, the legend or anywhere
    assert '<td class="num">0.087</td>' in html and html.count('<td class="num">-</td>') == 2 * 59


def test_a_log_scale_puts_each_decade_an_equal_step_up_from_the_smallest_value() -> None:
    """1 ms at the bottom, 1 s at the top, 10 ms a third of the way up; no value on the bottom line."""
    p50: list[float | None] = [None] * 60
    p99: list[float | None] = [None] * 60
    p50[1], p99[1], p99[2] = 0.001, 1.0, 0.01
    drawn = console_trends.chart(
        "runs", "Run", "seconds", STARTS, {"p50": p50, "p99": p99}, log=True, digits=3
    )
    low, high = drawn["y_zero"], drawn["y_top"]
    fifty, ninety_nine = (ys(line.points) for line in drawn["lines"])
    assert (fifty[1], ninety_nine[1]) == (low, high) and drawn["bottom"] == 0.001
    assert ninety_nine[2] == pytest.approx(low - (low - high) / 3, abs=0.1)
    assert fifty[0] == ninety_nine[0] == low
    html = console_views.render(
        "_trends.html", charts=[drawn], now=NOW, poll=2, refresh=None, queue_depth=0, redis_error=None
    )
    assert 'text-anchor="end">0.001</text>' in html  # the bottom line is labelled with its value, not 0
