"""The chat page served at `/`: one static HTML file (inline JS and CSS, no build step, nothing fetched
from elsewhere) shipped as package data. See docs/server-endpoints.md."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

# the page runs only its own inline script and talks only to this server
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def page() -> str:
    return files(__name__).joinpath("index.html").read_text(encoding="utf-8")


def webui_router() -> APIRouter:
    html = page()
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"}
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    return router
