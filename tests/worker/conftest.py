"""A real ``poolctl serve`` over the test's store for the workers to talk to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from core.settings import Settings
from poolkeeper.embedded import ServeProc
from store import PoolStore
from tests.factories import serving
from tests.helpers import SECRET


@pytest.fixture
def server(settings: Settings, store: PoolStore, tmp_path: Path) -> Iterator[ServeProc]:
    """A server whose leases last 1.5 s: a run outlives its lease only if the worker heartbeats."""
    with serving(settings, tmp_path, secret=SECRET, lease_seconds=1.5) as proc:
        yield proc
