"""The maintenance plane: per-key Celery tasks, scanners, locks (``celery -A tasks worker``)."""

from tasks.celery_app import app

__all__ = ["app"]
