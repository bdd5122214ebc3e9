"""Alembic environment; migrations run through poolkeeper.db.migrate (`poolctl init`)."""

from poolkeeper.db import run_alembic_env

run_alembic_env()
