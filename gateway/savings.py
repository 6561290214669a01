"""`gateway stats [--url URL] [--key KEY]`: the savings table of a running gateway, for a terminal.

Reads `/gateway/stats` and the first page of `/gateway/conversations` with the key given (the one an
application sends through the gateway, or the admin token for every tenant).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import aiohttp

DEFAULT_URL = "http://127.0.0.1:8080"
KEY_ENV = ("GATEWAY_KEY", "OPENAI_API_KEY")
ROWS = 10


class Refused(Exception):
    """The gateway could not be reached or refused the request (one line for the terminal)."""


async def fetch(url: str, key: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=15)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
            out = []
            for path in ("/gateway/stats", f"/gateway/conversations?limit={ROWS}"):
                async with http.get(url.rstrip("/") + path) as r:
                    body = await r.json(content_type=None)
                    if r.status != 200:
                        error = body.get("error") if isinstance(body, dict) else None
                        message = error.get("message") if isinstance(error, dict) else None
                        hint = ("; pass the key your application uses (--key, or $GATEWAY_KEY / $OPENAI_API_KEY), "
                                "or the admin token" if r.status == 401 else "")
                        raise Refused(f"{url} answered {r.status}: {message or body}{hint}")
                    out.append(body)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise Refused(f"cannot reach {url} ({type(exc).__name__}: {exc}); is `gateway serve` running?") from exc
    return out[0], out[1]


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "–"


def render(url: str, stats: dict[str, Any], listing: dict[str, Any]) -> str:
    scope = "all tenants" if stats.get("admin") and not stats.get("tenant") else f"tenant {stats.get('tenant')}"
    o, f = stats["tokens_original"], stats["tokens_forwarded"]
    co, cf = stats["cost_original"], stats["cost_forwarded"]
    folds = ", ".join(f"{n} {result}" for result, n in sorted(stats.get("folds", {}).items())) or "none"
    lines = [
        f"Memory Gateway at {url} ({scope})",
        "",
        f"{'':<18}{'original':>14}{'forwarded':>14}{'saved':>14}",
        f"{'requests':<18}{stats['requests']:>14,}",
        f"{'tokens':<18}{o:>14,}{f:>14,}{o - f:>14,}  {_pct(o - f, o)}",
        f"{'input cost (USD)':<18}{co:>14.4f}{cf:>14.4f}{co - cf:>14.4f}  {_pct(co - cf, co)}",
        f"folds (this process): {folds}",
        "",
    ]
    rows = listing.get("data", [])
    if not rows:
        lines.append("No conversations yet: requests name one with the X-Conversation-Id header.")
        return "\n".join(lines)
    lines.append(f"Conversations, most recent first ({len(rows)} of {listing.get('total', len(rows))}):")
    lines.append(f"{'conversation':<28}{'messages':>9}{'summary':>10}{'original':>11}{'forwarded':>11}"
                 f"{'saved':>7}  last decision")
    for c in rows:
        co_, cf_ = c["tokens_original"], c["tokens_forwarded"]
        last = c.get("last") or {}
        decision = last.get("context", "–") + (f" ({last['reason']})" if last.get("reason") else "")
        name = c["id"] if len(c["id"]) <= 27 else c["id"][:26] + "…"
        lines.append(f"{name:<28}{c['messages']:>9,}{c['summary']['covers']:>10,}{co_:>11,}{cf_:>11,}"
                     f"{_pct(co_ - cf_, co_):>7}  {decision}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    url = args.url or DEFAULT_URL
    key = args.key or next((os.environ[n] for n in KEY_ENV if os.environ.get(n)), None)
    try:
        stats, listing = asyncio.run(fetch(url, key))
    except Refused as exc:
        print(f"gateway stats: {exc}", file=sys.stderr)
        return 1
    print(render(url, stats, listing))
    return 0
