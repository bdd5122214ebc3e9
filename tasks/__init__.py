"""The maintenance plane: passes, registry, runner, scanners, coordination.

Importing this package (or any module in it) defines names and does nothing
else. The Celery app is ``tasks.celery``, which ``celery -A tasks`` finds by
itself; it is the only module that reads the environment at import.
"""
