"""Mount the console on an app: the search and rows routes first, then the pages (``pages.install``)."""

from __future__ import annotations

from fastapi import FastAPI

from core.settings import Settings
from poolkeeper.console import pages, search
from store import PoolStore


def install(app: FastAPI, settings: Settings, store: PoolStore) -> None:
    app.include_router(search.router)  # before the pages' catch-all
    pages.install(app, settings, store)
