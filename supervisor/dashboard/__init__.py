"""The HTTP dashboard: server-rendered pages at ``/`` and ``/runs/{run}`` (Jinja2), live
charts drawn by the vendored uPlot from the JSON API, no build step and no CDN.

``mount(app)`` adds the routes, the static files and the two small ASGI middlewares (the
read-only token cookie, and conditional GETs)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from trainwarden.supervisor.dashboard.auth import CookieAuth
from trainwarden.supervisor.dashboard.etag import ConditionalGet

STATIC = Path(__file__).resolve().parent / "static"


def mount(app: FastAPI) -> None:
    from trainwarden.supervisor.dashboard.routes import router

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    app.add_middleware(ConditionalGet)
    app.add_middleware(CookieAuth)
