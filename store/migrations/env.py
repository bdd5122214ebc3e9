"""Alembic environment; migrations run through core.db.migrate (`poolctl init`)."""

from core.db import run_alembic_env

run_alembic_env()
