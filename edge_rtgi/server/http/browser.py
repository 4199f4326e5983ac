"""The browser client: plain HTML, CSS and JavaScript files served from ``static/``.

No build step and nothing from a CDN: the page works offline. It talks the native protocol
(docs/protocol.md) over ``/v1/native``; docs/daemon.md describes it.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).resolve().parent / "static"


async def index(request: web.Request) -> web.FileResponse:
    """``GET /``: the page."""
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def add_routes(router: web.UrlDispatcher) -> None:
    """``/static/*``: the page's scripts, styles and audio worklet."""
    router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
