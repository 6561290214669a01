"""`GET /dashboard`: one page, served by the gateway, that works offline (no CDN, no build step).

The page (`static/dashboard.html`, `.js`, `.css`, hand-written) asks for the caller's key or the
admin token in a login field, keeps it in the tab's sessionStorage, and reads everything from the
gateway's own API (`/gateway/stats`, `/gateway/conversations…`): the server adds no data here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page talks only to the gateway that served it; nothing else may load or run.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _read(name: str) -> bytes:
    return resources.files("gateway").joinpath("static", name).read_bytes()


def add_routes(app: web.Application) -> None:
    files = {name: _read(name) for name in ("dashboard.html", *ASSETS)}  # read once, at start-up
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=files["dashboard.html"], content_type="text/html", charset="utf-8", headers=headers)

    def asset(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=files[name], content_type=ASSETS[name], charset="utf-8", headers=headers)

        return handler

    app.router.add_get("/dashboard", page, allow_head=False)
    for name in ASSETS:
        app.router.add_get(f"/dashboard/{name}", asset(name), allow_head=False)
