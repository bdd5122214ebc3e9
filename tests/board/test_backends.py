"""``open_board`` finds backends by URL scheme: entry points of ``poolkeeper.boards``, the built-ins.

Each test installs its packages for real: a ``*.dist-info`` folder on ``sys.path``, the way pip
leaves one, so ``importlib.metadata`` finds them as it would a third party's.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import board
from board import ENTRY_POINT_GROUP, open_board, open_kanban
from core.errors import UnusableURL
from core.settings import Settings
from poolkeeper.embedded import ROOT
from tests.helpers import POOLCTL

OPENER = """
from board import Board

opened = []

class MemoBoard(Board):  # every method the protocol declares (each a no-op)
    def __init__(self, url):
        self.url = url

def open_board(url, settings):
    opened.append((url, settings.pool_size))
    return MemoBoard(url)
"""

# A backend without ``require_creatable`` and ``list_runs`` (finding 7 of issue 28).
MINI = """
from board import Board

class MiniBoard:
    pass

LEFT_OUT = ("require_creatable", "list_runs")
for name, value in vars(Board).items():
    if callable(value) and not name.startswith("_") and name not in LEFT_OUT:
        setattr(MiniBoard, name, lambda self, *a, **k: None)

def open_board(url, settings):
    return MiniBoard()
"""


def install(site: Path, package: str, points: dict[str, str], module: str | None = None) -> None:
    """A package in ``site`` declaring ``points`` (scheme -> "module:attr"), with ``module``'s code."""
    info = site / f"{package}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    lines = "".join(f"{scheme} = {value}\n" for scheme, value in points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    if module is not None:
        name = points[next(iter(points))].partition(":")[0]
        (site / f"{name}.py").write_text(module)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` to install packages into, gone with the test."""
    monkeypatch.syspath_prepend(tmp_path)
    return tmp_path


def test_the_built_in_schemes_are_declared_as_entry_points() -> None:
    points = entry_points(group=ENTRY_POINT_GROUP)
    declared = {p.name: p.value for p in points if p.value.startswith("board:")}
    assert declared == {"sqlite": "board:open_kanban", "postgresql": "board:open_kanban"}
    assert {p.name: p.load() for p in points}["sqlite"] is open_kanban


def test_an_installed_backend_is_opened_by_its_scheme_with_the_url_and_settings(site: Path) -> None:
    module = f"memo_{uuid.uuid4().hex[:8]}"
    install(site, "memo-board", {"memo": f"{module}:open_board"}, OPENER)
    url = "memo+v2://user:secret@host/b"
    opened = open_board(Settings(board_url=url, pool_size=7))
    assert getattr(opened, "url", None) == url
    assert __import__(module).opened == [(url, 7)]


def test_an_unknown_scheme_names_every_installed_one_and_not_the_url(site: Path) -> None:
    install(site, "memo-board", {"memo": "nowhere:open_board"})
    with pytest.raises(UnusableURL) as err:
        open_board(Settings(board_url="tracker://user:secret@host/b"))
    assert str(err.value) == (
        "POOL_BOARD_URL: not a board URL of a known scheme (http:, https:, memo:, postgresql:, sqlite:);"
        " got scheme 'tracker:'"
    )


def test_a_backend_that_fails_to_load_is_one_line_naming_its_entry_point_and_package(site: Path) -> None:
    module = f"broken_{uuid.uuid4().hex[:8]}"
    install(site, "broken-board", {"broken": f"{module}:open_board"}, "import no_such_module_here\n")
    with pytest.raises(UnusableURL) as err:
        open_board(Settings(board_url="broken://user:secret@host/b"))
    message = str(err.value)
    assert message.startswith(
        f"POOL_BOARD_URL: board backend broken = {module}:open_board (package broken-board) failed to load: "
        "ModuleNotFoundError: No module named 'no_such_module_here'"
    )
    assert "\n" not in message and "secret" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no traceback chained on


def test_a_backend_missing_protocol_methods_is_one_line_naming_it_its_entry_point_and_each_method(
    site: Path,
) -> None:
    module = f"mini_{uuid.uuid4().hex[:8]}"
    install(site, "mini-board", {"mini": f"{module}:open_board"}, MINI)
    with pytest.raises(UnusableURL) as err:
        open_board(Settings(board_url="mini://user:secret@host/x"))
    assert str(err.value) == (
        f"POOL_BOARD_URL: board backend mini = {module}:open_board (package mini-board) opened a MiniBoard"
        " without the Board methods require_creatable, list_runs"
    )
    assert err.value.exit_code == 78


def test_poolctl_init_on_a_backend_missing_a_method_exits_78_with_that_line(site: Path) -> None:
    module = f"mini_{uuid.uuid4().hex[:8]}"
    install(site, "mini-board", {"mini": f"{module}:open_board"}, MINI)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "POOL_BOARD_URL": "mini:///x"}
    env["POOL_DATABASE_URL"] = f"sqlite:///{site}/pool.db"
    done = subprocess.run([*POOLCTL, "init"], env=env, cwd=site, capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"board backend mini = {module}:open_board (package mini-board)" in line
    assert line.endswith("without the Board methods require_creatable, list_runs")
    assert "internal error" not in line and "Traceback" not in done.stderr


def test_a_backend_that_is_not_callable_is_refused_by_name(site: Path) -> None:
    module = f"flat_{uuid.uuid4().hex[:8]}"
    install(site, "flat-board", {"flat": f"{module}:open_board"}, "open_board = 42\n")
    named = rf"backend flat = {module}:open_board \(package flat-board\) is not callable"
    with pytest.raises(UnusableURL, match=named):
        open_board(Settings(board_url="flat://host/b"))


def test_two_packages_claiming_one_scheme_are_named_both(site: Path) -> None:
    install(site, "one-board", {"twice": "one:open_board"})
    install(site, "other-board", {"twice": "other:open_board"})
    with pytest.raises(UnusableURL) as err:
        open_board(Settings(board_url="twice://host/b"))
    assert str(err.value) == (
        "POOL_BOARD_URL: scheme 'twice:' has 2 backends: twice = one:open_board (package one-board);"
        " twice = other:open_board (package other-board)"
    )


@pytest.fixture
def no_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if poolkeeper ran from a source checkout that is not installed: no package metadata at all."""
    monkeypatch.setattr(board, "entry_points", lambda group: [])


@pytest.mark.usefixtures("no_entry_points")
def test_the_built_in_kanban_opens_without_entry_points(tmp_path: Path) -> None:
    kanban = open_board(Settings(board_url=f"sqlite:///{tmp_path}/board.db"))
    kanban.migrate()
    assert kanban.list_boards() == [] and kanban.location().endswith("board.db")
    kanban.close()
    with pytest.raises(
        UnusableURL, match=r"scheme \(http:, https:, postgresql:, sqlite:\); got scheme 'ftp:'"
    ):
        open_board(Settings(board_url="ftp://host/b"))
