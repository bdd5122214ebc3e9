"""One validated settings object: defaults, POOL_* parsing, bad values named."""

from __future__ import annotations

import pytest

from core.errors import SettingsError
from core.settings import Settings


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
        ("POOL_RETENTION_SECONDS", "60", "POOL_RETENTION_SECONDS: must be >= 3600"),
        ("POOL_VISIBILITY_TIMEOUT", "10", "POOL_VISIBILITY_TIMEOUT: must be greater than"),
        ("POOL_DATABASE_URL", "", "POOL_DATABASE_URL: must not be empty"),
        ("POOL_LINEAGE_MAX_DEPTH", "0", "POOL_LINEAGE_MAX_DEPTH: must be between 1 and 64"),
        ("POOL_LINEAGE_MAX_DEPTH", "65", "POOL_LINEAGE_MAX_DEPTH: must be between 1 and 64"),
    ],
)
def test_bad_values_name_the_variable(var: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({var: value})
    assert message in str(refused.value)


def test_env_round_trips_for_child_processes() -> None:
    s = Settings(pool_size=5, lease_seconds=2.5, redis_url="redis://x:1/0")
    assert Settings.from_env(s.env()) == s
