"""`GET /dashboard`: the live dashboard, one static HTML page (dashboard.html) that polls
`/metrics` from the browser. Like /metrics it needs no API key: it shows nothing /metrics
does not already expose."""
from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse


@cache
def dashboard_html() -> str:
    return files("tokenmill.server").joinpath("dashboard.html").read_text(encoding="utf-8")


def add_dashboard_route(app: FastAPI) -> None:
    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})
