"""One validated settings object: defaults, POOL_* parsing, bad values named."""

from __future__ import annotations

import os
from dataclasses import Field, fields, replace
from pathlib import Path
from typing import Any

import pytest

from core.errors import SettingsError
from core.settings import Settings, _var, default, read_one


def test_defaults_are_the_reference_deployment() -> None:
    s = Settings.from_env({})
    assert (s.pool_size, s.lease_seconds, s.max_attempts) == (3, 90.0, 3)


def test_environment_is_parsed_by_field_type() -> None:
    s = Settings.from_env(
        {"POOL_SIZE": "8", "POOL_LEASE_SECONDS": "0.5", "POOL_DATABASE_URL": "postgresql+psycopg://h/db"}
    )
    assert (s.pool_size, s.lease_seconds, s.database_url) == (8, 0.5, "postgresql+psycopg://h/db")


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("POOL_SIZE", "three", "POOL_SIZE: expected an integer, got 'three'"),
        ("POOL_SIZE", "0", "POOL_SIZE: must be between 1 and 100000"),
        ("POOL_LEASE_SECONDS", "-1", "POOL_LEASE_SECONDS: must be in (0, 86400]"),
        ("POOL_LEASE_SECONDS", "nan", "POOL_LEASE_SECONDS"),
        ("POOL_RETENTION_SECONDS", "60", "POOL_RETENTION_SECONDS: must be in [3600, "),
        ("POOL_VISIBILITY_TIMEOUT", "10", "POOL_VISIBILITY_TIMEOUT: must be greater than"),
        ("POOL_DATABASE_URL", "", "POOL_DATABASE_URL: must not be empty"),
        ("POOL_DATABASE_URL", "pool.db", "POOL_DATABASE_URL: not a database URL SQLAlchemy can open"),
        ("POOL_BOARD_URL", "", "POOL_BOARD_URL: must not be empty"),  # its scheme: board.open_board
        ("POOL_NAMESPACE", "", "POOL_NAMESPACE: must be 1 to 32 letters"),
        ("POOL_NAMESPACE", "a:b", "POOL_NAMESPACE: must be 1 to 32 letters"),
        ("POOL_NAMESPACE", "n" * 33, "POOL_NAMESPACE: must be 1 to 32 letters"),
        ("POOL_LINEAGE_MAX_DEPTH", "0", "POOL_LINEAGE_MAX_DEPTH: must be between 1 and 64"),
        ("POOL_LINEAGE_MAX_DEPTH", "65", "POOL_LINEAGE_MAX_DEPTH: must be between 1 and 64"),
        ("POOL_LOG_FORMAT", "JSON", "POOL_LOG_FORMAT: must be one of text, json, got 'JSON'"),
        ("POOL_LOG_FORMAT", "", "POOL_LOG_FORMAT: must be one of text, json, got ''"),
        ("POOL_LANE", "a b", "POOL_LANE: may hold only letters"),
        ("POOL_LANE", "", "POOL_LANE: must be 1 to 64 characters"),
        ("POOL_ASSIGNEE", "x" * 65, "POOL_ASSIGNEE: must be 1 to 64 characters"),
        ("POOL_ASSIGNEE", "a\x00b", "POOL_ASSIGNEE: may hold only letters"),
    ],
)
def test_bad_values_name_the_variable(var: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({var: value})
    assert message in str(refused.value)


NUMBERS = [f for f in fields(Settings) if f.type in ("int", "float")]


@pytest.mark.parametrize("number", NUMBERS, ids=lambda f: f.name)
def test_every_number_has_an_upper_bound(number: Field[Any]) -> None:
    """A value past any bound (inf, 10**20) is refused at start-up, naming the variable, before
    it overflows a timer, a SQL integer or Celery's countdown at every tick."""
    assert number.metadata["le"] is not None or number.metadata["lt"] is not None, "its upper bound"
    var = _var(number.name)
    for huge in ("inf", "1e300", str(10**20)) if number.type == "float" else (str(10**20),):
        with pytest.raises(SettingsError, match=f"^{var}: must be"):
            Settings.from_env({var: huge})


def test_env_round_trips_for_child_processes() -> None:
    s = Settings(pool_size=5, lease_seconds=2.5, redis_url="redis://x:1/0")
    assert Settings.from_env(s.env()) == s


def test_a_database_url_with_a_password_is_never_echoed() -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"POOL_DATABASE_URL": "nodialect://user:hunter2@h/db"})
    assert "hunter2" not in str(refused.value)


SECRET = "settings-test-secret-" + "0123456789abcdef" * 2  # long, and not a pattern (core.settings)


def test_the_server_secret_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert Settings.from_env({"POOL_SERVER_SECRET": SECRET}).server_secret == SECRET
    (tmp_path / "secret").write_text(SECRET + "\n")
    assert Settings.from_env({"POOL_SERVER_SECRET_FILE": str(tmp_path / "secret")}).server_secret == SECRET


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("device", "not a regular file"),
        ("fifo", "not a regular file"),
        ("directory", "not a regular file"),
        ("huge", "larger than 4096 bytes"),
    ],
)
def test_a_secret_file_is_read_bounded_never_without_end(tmp_path: Path, kind: str, message: str) -> None:
    path = {"device": Path("/dev/zero"), "fifo": tmp_path / "fifo", "directory": tmp_path}.get(kind)
    path = path or tmp_path / "huge"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: an open that waited for one would hang here
    elif kind == "huge":
        path.write_text(SECRET * 200)
    opened = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # and a refusal leaves no descriptor open
        with pytest.raises(SettingsError, match=f"^POOL_SERVER_SECRET_FILE: cannot read {path}: {message}$"):
            Settings.from_env({"POOL_SERVER_SECRET_FILE": str(path)})
    assert len(os.listdir("/proc/self/fd")) < opened + 5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"POOL_SERVER_SECRET": "short"}, "POOL_SERVER_SECRET: must be at least 32 characters"),
        ({"POOL_SERVER_SECRET_FILE": "/nonexistent/secret"}, "POOL_SERVER_SECRET_FILE: cannot read"),
        ({"POOL_SERVER_SECRET": SECRET, "POOL_SERVER_SECRET_FILE": "/x"}, "not both"),
        ({"POOL_MAX_BODY_BYTES": "10"}, "POOL_MAX_BODY_BYTES: must be 1 KiB to 64 MiB"),
    ],
)
def test_bad_server_settings_are_named_without_the_secret(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    assert message in str(refused.value) and "short" not in str(refused.value)  # never the value


def test_the_secret_is_never_shown_nor_handed_to_children() -> None:
    s = Settings(server_secret=SECRET)
    assert SECRET not in repr(s) and "POOL_SERVER_SECRET" not in s.env()


def test_every_setting_documents_itself_beside_its_rule() -> None:
    for f in fields(Settings):
        assert f.metadata["doc"].strip(), f"{f.name} has no doc"


def test_every_setting_has_its_configuration_row() -> None:
    """docs/configuration.md names every variable in its table (docs/how-to-add.md, "A setting")."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    table = page.split("\n| variable |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `POOL_")]
    missing = [_var(f.name) for f in fields(Settings) if not any(f"`{_var(f.name)}`" in r for r in rows)]
    assert missing == [], "settings without a row in docs/configuration.md's table"


def test_replace_and_keyword_construction_are_validated_like_the_environment() -> None:
    with pytest.raises(SettingsError, match=r"^POOL_SIZE: must be between 1 and 100000, got 0$"):
        replace(Settings(), pool_size=0)
    with pytest.raises(SettingsError, match=r"^POOL_BODY_TIMEOUT_SECONDS: must be in \(0, 600\]"):
        Settings(body_timeout_seconds=601)
    with pytest.raises(SettingsError, match=r"^POOL_CHAOS_BOARD_BUSY_RATE: must be in \[0, 1\)"):
        Settings(chaos_board_busy_rate=1.0)


def test_a_bound_set_by_another_setting_names_that_variable() -> None:
    with pytest.raises(SettingsError, match=r"^POOL_BACKOFF_MAX_SECONDS: must be >= POOL_BACKOFF_BASE_SEC"):
        Settings(backoff_base_seconds=10, backoff_max_seconds=5)
    with pytest.raises(SettingsError, match=r"POOL_TASK_TIME_LIMIT and <= 2592000, got 300$"):
        Settings(task_time_limit=400, visibility_timeout=300)


def test_a_default_is_stated_once_and_read_by_name() -> None:
    s = Settings()
    assert all(default(f.name) == getattr(s, f.name) for f in fields(Settings))


def test_one_setting_is_read_alone_by_its_own_rule() -> None:
    """``poolctl worker`` reads POOL_LOG_FORMAT and nothing else: another variable's bad value is not its."""
    assert read_one("log_format", {"POOL_SIZE": "zero"}) == "text"
    assert read_one("log_format", {"POOL_LOG_FORMAT": " json "}) == "json"
    with pytest.raises(SettingsError, match=r"^POOL_LOG_FORMAT: must be one of text, json, got 'xml'$"):
        read_one("log_format", {"POOL_LOG_FORMAT": "xml"})
