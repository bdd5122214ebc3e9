"""The whole Board contract kit over the example backend, and its entry point as packaged."""

from __future__ import annotations

import importlib
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from jsonboard import open_jsonboard

from board import Board
from core.settings import Settings
from poolkeeper.testing.board_contract import BoardContract, Busy, sqlite_write_lock


class TestJsonBoard(BoardContract):
    @pytest.fixture
    def open_handle(self, tmp_path: Path) -> Callable[[], Board]:
        # a short wait for the write lock keeps the busy test quick; contended calls are retried
        return lambda: open_jsonboard(f"jsonboard://{tmp_path}/board.db?timeout=0.5", Settings())

    @pytest.fixture
    def busy(self, tmp_path: Path) -> Busy:
        return sqlite_write_lock(f"{tmp_path}/board.db")


def test_the_packaged_entry_point_names_the_opener() -> None:
    project = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text())
    [(scheme, value)] = project["project"]["entry-points"]["poolkeeper.boards"].items()
    module, _, attr = value.partition(":")
    assert scheme == "jsonboard" and getattr(importlib.import_module(module), attr) is open_jsonboard
