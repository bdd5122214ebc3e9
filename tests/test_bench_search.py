"""bench/search_bench.py at a tiny size, on SQLite and PostgreSQL: each search finds what the corpus
holds (the bench asserts it), and every figure parses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\| (id lookup|rare|some|common) \| (\d+\.\d\d) \| (\d+\.\d\d) \| (\d+\.\dx) \|$")


@pytest.mark.postgres
def test_a_tiny_run_finds_what_it_loaded_on_both_databases_and_cleans_up() -> None:
    pg = os.environ.get("POOL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    schemas = "SELECT count(*) FROM information_schema.schemata WHERE schema_name LIKE 'search_bench_%'"
    try:
        engine = create_engine(pg, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            before = conn.scalar(text(schemas))
    except Exception as err:  # any failure to connect means: no server here
        pytest.skip(f"no PostgreSQL server answers at {pg}: {str(err).splitlines()[0][:100]}")
    argv = ["--tasks", "600", "--repeat", "3", "--postgres", pg]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "search_bench.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, out
    assert "sqlite: 600 tasks loaded" in done.stdout and "postgresql: 600 tasks loaded" in done.stdout, out
    figures = [
        LINE.match(line) for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line
    ]
    rows = [m.group(1) for m in figures if m]
    assert rows == ["id lookup", "rare", "some", "common"] * 2, out
    assert re.search(r"^worst search p50 / id lookup: \d+\.\dx \(target <= 20x\)$", done.stdout, re.M), out
    with engine.connect() as conn:
        assert conn.scalar(text(schemas)) == before  # its schema dropped with all it held
    engine.dispose()
