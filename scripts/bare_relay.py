"""A bare 30-line aiohttp relay: the floor the overhead bench compares the gateway with.

    python scripts/bare_relay.py UPSTREAM_BASE PORT        # e.g. http://127.0.0.1:9000 8081

It forwards each POST's body and Authorization to UPSTREAM_BASE + path with one pooled aiohttp
client session and relays the answer (SSE chunk by chunk): what any Python reverse proxy does at
least, with no parsing, headers, logging or metrics of its own.
"""

import sys

import aiohttp
from aiohttp import web


async def relay(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    headers = {"Content-Type": "application/json", "Authorization": request.headers.get("Authorization", "")}
    async with session.post(request.app["upstream"] + request.path_qs, data=await request.read(),
                            headers=headers) as up:
        if up.content_type != "text/event-stream":
            return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
        out = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        async for chunk in up.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def session(app: web.Application):  # type: ignore[no-untyped-def]
    app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100))
    yield
    await app["session"].close()


if __name__ == "__main__":
    app = web.Application()
    app["upstream"] = sys.argv[1].rstrip("/")
    app.cleanup_ctx.append(session)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/{path:.*}", relay)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None)
