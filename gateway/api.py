"""The gateway's own API under `/gateway/`: what it remembers of each conversation, the edits that
win over extraction, and the savings totals.

Every route is scoped like the memory path: a conversation is reachable only with the credential
(or gateway key) that created it. `auth.admin_token` (as Bearer) may act for any tenant, named in
`X-Gateway-Tenant` or `?tenant=`; listing and stats without one cover every tenant. A conversation
the store does not hold is a 404 on every verb. Errors are rendered by the app's edge middleware in
the caller's dialect.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from gateway import paths, state
from gateway.activity import Activity
from gateway.auth import Authenticator, AuthError, presented_credential
from gateway.keys import ConvRef
from gateway.model import Summary
from gateway.proxy import GatewayError, read_body
from gateway.retrieval import RetrievalIndex
from gateway.store import UNAVAILABLE, Store, StoreBusy, StoreUnavailable

ADMIN_TENANT_HEADER = "X-Gateway-Tenant"
MAX_PAGE = 1000
MAX_SUMMARY_EDIT_CHARS = 20_000
SEARCH_MAX_MESSAGES = 5000  # newest messages a search reads: bounds its time and memory
SEARCH_MAX_QUERY = 1000  # characters


def _json(data: Any, status: int = 200) -> web.Response:
    # orjson: stored messages and ledgers can be large, and the stdlib encoder is several times slower.
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _summary_json(summary: Summary, edited: bool) -> dict[str, Any]:
    return {"text": summary.text, "covers": summary.covers, "version": summary.version,
            "tokens": summary.tokens, "edited": edited}


def _int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    try:
        value = int(request.query.get(name, str(default)))
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise GatewayError(400, "invalid_request_error", f"{name} must be an integer within {lo}..{hi}")
    return value


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None  # None: the admin token, all tenants
    admin: bool


class ConversationAPI:
    def __init__(self, app: web.Application, settings: Any, store_key: Any, hook_key: Any, count: Any, *,
                 activity_key: Any, metrics_key: Any) -> None:
        # The app's keys, not its module: app.py builds this API, so it cannot be imported here.
        self.app = app
        self._activity_key = activity_key
        self._metrics_key = metrics_key
        self.settings = settings
        self.auth = Authenticator(settings)
        self._store_key = store_key
        self._hook_key = hook_key
        self._count = count

    @property
    def store(self) -> Store:
        store = self.app[self._store_key]
        if store is None:
            raise GatewayError(404, "not_found_error", "the conversation API needs the memory layer (memory.enabled)")
        return store  # type: ignore[no-any-return]

    @property
    def activity(self) -> Activity:
        self.store  # noqa: B018 (the activity lives in the store: with memory off, the same 404)
        return self.app[self._activity_key]  # type: ignore[no-any-return]

    async def _fresh(self) -> None:
        """Write this process's pending notes first: what it just answered shows at once."""
        if self.app[self._store_key] is not None:
            await self._guard(self.activity.flush())

    def caller(self, request: web.Request) -> Caller:
        """The caller's tenant; the admin token acts for the tenant it names, or for all."""
        admin = self.settings.auth.admin_token
        presented = presented_credential(request.headers) or request.headers.get("X-Gateway-Key")
        if admin and presented and hmac.compare_digest(presented.encode(), admin.encode()):
            return Caller(request.headers.get(ADMIN_TENANT_HEADER) or request.query.get("tenant") or None, True)
        try:
            ident = self.auth.identify(request.headers)
        except AuthError as exc:
            raise GatewayError(401, "authentication_error", str(exc)) from exc
        if ident.anonymous:
            raise GatewayError(401, "authentication_error", "no credential: conversations belong to a credential")
        return Caller(ident.tenant, False)

    def _ref(self, request: web.Request) -> ConvRef:
        conv = request.match_info["conversation"]
        project = next((paths.conversation_id(request.headers[h]) for h in self.settings.conversation.project_headers
                        if request.headers.get(h)), None)  # (as the memory path reads it: bytes not UTF-8 as %XX)
        who = self.caller(request)
        if who.tenant is None:
            raise GatewayError(400, "invalid_request_error",
                               f"an admin request names the tenant in {ADMIN_TENANT_HEADER} or ?tenant=")
        return ConvRef(who.tenant, conv, project)

    async def _json(self, request: web.Request) -> Any:
        try:
            server = self.settings.server
            return orjson.loads(await read_body(request, server.body_timeout_seconds, server.max_body_bytes))
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, "invalid_request_error", f"body is not valid JSON: {exc}") from exc

    async def _guard(self, coro: Any) -> Any:
        try:
            return await coro
        except StoreBusy as exc:
            raise GatewayError(503, "api_error", "the conversation store is busy: every connection of this process's "
                               "pool stayed in use for store.pool_wait_seconds; retry shortly",
                               {"Retry-After": "1"}) from exc
        except StoreUnavailable as exc:
            raise GatewayError(503, "api_error", "the conversation store is unreachable") from exc
        except UNAVAILABLE as exc:  # activity.py's reads use the connection directly
            raise GatewayError(503, "api_error", "the conversation store is unreachable") from exc

    async def _existing(self, request: web.Request) -> tuple[ConvRef, Any]:
        """The conversation the path names, loaded; 404 when the store holds nothing of it."""
        ref = self._ref(request)
        if ref.project is None:
            # A call without X-Project-Id (the dashboard's) means the project the conversation's
            # requests name: its state is the project's, and an edit must reach what they read.
            await self._fresh()
            last = (await self._guard(self.activity.last(ref.tenant, [ref.conversation])))[0]
            if last and last.get("project"):
                ref = ConvRef(ref.tenant, ref.conversation, last["project"])
        view = await self._guard(self.store.load(ref, head=0))
        if view.length == 0 and view.summary is None and view.dialect is None:
            raise GatewayError(404, "not_found_error", f"no conversation {ref.conversation!r} for this credential")
        return ref, view

    async def _changed(self, ref: ConvRef) -> None:
        """An edit or delete: the memory hook here, and every other replica, stop planning from what
        they knew of the conversation (gateway/views.py)."""
        hook = self.app[self._hook_key]
        if hook is not None and hasattr(hook, "changed"):
            hook.changed(ref)
        await self._guard(self.store.announce(ref, "edited"))

    def _summarizer_usd(self, stats: dict[str, int]) -> float:
        model = self.settings.price(self.settings.memory.summarizer.model)
        return (stats.get("summarizer_tokens_in", 0) * model.input_usd_per_mtok
                + stats.get("summarizer_tokens_out", 0) * model.output_usd_per_mtok) / 1_000_000

    async def _tenants(self, who: Caller) -> list[str]:
        return [who.tenant] if who.tenant is not None else await self._guard(self.activity.tenants())

    # -- routes -------------------------------------------------------------------------------

    async def list(self, request: web.Request) -> web.Response:
        who = self.caller(request)
        await self._fresh()
        offset = _int(request, "offset", 0, 0, 10**9)
        limit = _int(request, "limit", 50, 1, MAX_PAGE)
        activity = self.activity
        rows: list[tuple[float, str, str]] = []  # (last used, tenant, conversation)
        total = 0
        for tenant in await self._tenants(who):
            n, page = await self._guard(activity.conversations(tenant, 0 if who.tenant is None else offset,
                                                                offset + limit if who.tenant is None else limit))
            total += n
            rows += [(at, tenant, conv) for conv, at in page]
        if who.tenant is None:  # merged across tenants, newest first
            rows = sorted(rows, reverse=True)[offset:offset + limit]
        data = await asyncio.gather(*(self._row(tenant, conv, at) for at, tenant, conv in rows))
        return _json({"object": "list", "total": total, "offset": offset, "limit": limit, "data": list(data)})

    async def _row(self, tenant: str, conv: str, at: float) -> dict[str, Any]:
        ref = ConvRef(tenant, conv)
        seen = await self._guard(self.store.overview(ref))
        last = (await self._guard(self.activity.last(tenant, [conv])))[0]
        stats = seen.stats
        return {
            "id": conv, "tenant": tenant, "last_used": at, "messages": seen.length,
            "summary": {"covers": seen.covers, "version": seen.version, "edited": seen.edited,
                        "folded_at": seen.folded_at},
            "tokens_original": stats.get("tokens_original", 0), "tokens_forwarded": stats.get("tokens_forwarded", 0),
            "requests": stats.get("requests", 0),
            "summarizer_tokens": stats.get("summarizer_tokens_in", 0) + stats.get("summarizer_tokens_out", 0),
            "summarizer_usd": self._summarizer_usd(stats),
            "last": None if last is None else {k: v for k, v in last.items() if k != "excerpts"},
        }

    async def get(self, request: web.Request) -> web.Response:
        ref, view = await self._existing(request)
        await self._fresh()
        mem = self.settings.memory
        summary, _, edited = await self._guard(self.store.get_summary(ref))
        folded = (await self._guard(self.store.overview(ref))).folded_at
        last = (await self._guard(self.activity.last(ref.tenant, [ref.conversation])))[0]
        covers = summary.covers if summary else 0
        ledger = state.load(view.state)
        return _json({
            "id": ref.conversation,
            "tenant": ref.tenant,
            "project": ref.project,
            "dialect": view.dialect,
            "messages": view.length,
            "tokens": view.tokens_total,
            "summary": None if summary is None else _summary_json(summary, edited),
            "last_fold": folded,
            "state": ledger.model_dump(mode="json"),
            "state_rendered": state.render(ledger, mem.state_budget_tokens, self._count),
            "window": {"start": covers, "end": view.length, "keep_recent": mem.keep_recent},
            "fold_pending": view.fold_pending,
            "stats": view.stats,
            "summarizer_usd": self._summarizer_usd(view.stats),
            "last": last,
        })

    async def messages(self, request: web.Request) -> web.Response:
        ref, view = await self._existing(request)
        offset = _int(request, "offset", 0, 0, 10**9)
        limit = _int(request, "limit", 100, 1, MAX_PAGE)
        turns = await self._guard(self.store.messages(ref, offset, min(offset + limit, view.length)))
        return _json({
            "object": "list", "total": view.length, "offset": offset, "limit": limit,
            "data": [{"index": offset + i, "role": t.role, "message": t.raw, "tokens": t.tokens, "time": t.time}
                     for i, t in enumerate(turns)],
        })

    async def branches(self, request: web.Request) -> web.Response:
        """The branches an edit (or a request with another history) left: kept, never deleted."""
        ref, _ = await self._existing(request)
        found = await self._guard(self.store.branches(ref))
        return _json({"object": "list", "data": [_branch_json(b) for b in found]})

    async def branch_messages(self, request: web.Request) -> web.Response:
        ref, _ = await self._existing(request)
        number = request.match_info["branch"]
        found = await self._guard(self.store.branches(ref))
        # isdigit() also takes "²" and other digits int() refuses; ten digits are more branches than exist.
        if not (number.isascii() and number.isdigit() and len(number) < 10) or not 1 <= int(number) <= len(found):
            raise GatewayError(404, "not_found_error", f"no branch {number!r} in conversation {ref.conversation!r}")
        branch = found[int(number) - 1]
        offset = _int(request, "offset", 0, 0, 10**9)
        limit = _int(request, "limit", 100, 1, MAX_PAGE)
        turns = await self._guard(self.store.branch_messages(branch, ref, offset, offset + limit))
        at = int(branch["at"])
        return _json({
            "object": "list", "branch": _branch_json(branch), "total": int(branch["count"]), "offset": offset,
            "limit": limit,
            "data": [{"index": at + offset + i, "role": t.role, "message": t.raw, "tokens": t.tokens, "time": t.time}
                     for i, t in enumerate(turns)],
        })

    async def search(self, request: web.Request) -> web.Response:
        ref, view = await self._existing(request)
        query = request.query.get("q", "").strip()
        if not query or len(query) > SEARCH_MAX_QUERY:
            raise GatewayError(400, "invalid_request_error", f"q must be 1..{SEARCH_MAX_QUERY} characters")
        limit = _int(request, "limit", 10, 1, 100)
        start = max(0, view.length - SEARCH_MAX_MESSAGES)
        turns = await self._guard(self.store.messages(ref, start, view.length))

        def rank() -> list[tuple[int, float]]:
            # Positions from 0 (it appends only): turns[i] is message start + i. In a thread: every
            # message is indexed whole, the middle of a pasted file too.
            index = RetrievalIndex(index_end=None)
            for i, t in enumerate(turns):
                index.add(i, t.role, t.text, t.time, t.tokens)
            found = index.search(query, budget_tokens=sum(t.tokens for t in turns) + 1)
            return [(start + e.index, e.score) for e in sorted(found, key=lambda e: -e.score)[:limit]]

        hits = await asyncio.to_thread(rank)  # CPU work over up to SEARCH_MAX_MESSAGES: off the event loop
        return _json({"object": "list", "query": query, "data": [
            {"index": i, "score": round(score, 4), "role": turns[i - start].role, "message": turns[i - start].raw}
            for i, score in hits]})

    async def put_state(self, request: web.Request) -> web.Response:
        ref, _ = await self._existing(request)
        edits = await self._json(request)
        if not isinstance(edits, dict) or not edits:
            raise GatewayError(400, "invalid_request_error",
                               f"body must be an object of kinds ({', '.join(state.KINDS)}) to a text or a list")
        unknown = [k for k in edits if k not in state.KINDS]
        bad = [k for k, v in edits.items() if not (isinstance(v, str) or
                                                   (isinstance(v, list) and all(isinstance(x, str) for x in v)))]
        if unknown or bad:
            problems = ([f"unknown kinds {unknown}"] if unknown else []) + (
                [f"values that are not a text or a list of texts: {bad}"] if bad else [])
            raise GatewayError(400, "invalid_request_error",
                               f"{'; '.join(problems)} (kinds: {', '.join(state.KINDS)})")
        texts = [t for v in edits.values() for t in ([v] if isinstance(v, str) else v)]
        if len(texts) > state.MAX_EDIT_ITEMS or any(len(t) > state.MAX_EDIT_CHARS for t in texts):
            raise GatewayError(400, "invalid_request_error",
                               f"a state edit sets at most {state.MAX_EDIT_ITEMS} items of at most "
                               f"{state.MAX_EDIT_CHARS} characters each (got {len(texts)} items, the longest "
                               f"{max(map(len, texts), default=0)} characters)")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")
        for _ in range(10):  # compare-and-set against folds updating the same ledger
            data, version = await self._guard(self.store.get_state(ref))
            # Up to MAX_EDIT_ITEMS comparisons against each active item (~15 ms): off the event loop.
            ledger = await asyncio.to_thread(_edited, data, edits, now)
            if await self._guard(self.store.put_state(ref, ledger.model_dump(mode="json"), expect_version=version)):
                await self._changed(ref)
                return _json({"state": ledger.model_dump(mode="json")})
            await asyncio.sleep(0.01)
        raise GatewayError(409, "conflict_error", "the state kept changing; try again")

    async def put_summary(self, request: web.Request) -> web.Response:
        ref, _ = await self._existing(request)
        body = await self._json(request)
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise GatewayError(400, "invalid_request_error", 'body must be {"text": "<summary>"}')
        if len(text) > MAX_SUMMARY_EDIT_CHARS:
            # It goes into every rewritten request, and counting it runs on the event loop.
            raise GatewayError(400, "invalid_request_error",
                               f"a summary edit holds at most {MAX_SUMMARY_EDIT_CHARS} characters (got {len(text)})")
        summary = await self._guard(self.store.put_summary(ref, text, self._count(text)))
        await self._changed(ref)
        return _json({"summary": _summary_json(summary, True)})

    async def fold(self, request: web.Request) -> web.Response:
        ref, _ = await self._existing(request)
        queued = await self._guard(self.store.enqueue_fold(ref, urgent=True))
        return _json({"queued": queued}, status=202)

    async def delete(self, request: web.Request) -> web.Response:
        ref, _ = await self._existing(request)
        await self._guard(self.store.delete(ref))
        if ref.project:
            await self._guard(self._unmark(ref))
        await self._guard(self.activity.forget(ref.tenant, ref.conversation))
        hook = self.app[self._hook_key]
        if hook is not None and hasattr(hook, "forget"):
            hook.forget(ref)
        await self._changed(ref)
        return _json({"id": ref.conversation, "deleted": True})

    async def _unmark(self, ref: ConvRef) -> None:
        """Forget how far the project's shared state read a deleted conversation, by CAS."""
        for _ in range(3):  # other conversations of the project may write the ledger meanwhile
            data, version = await self.store.get_state(ref)
            ledger = state.load(data)
            updated = state.unmarked(ledger, ref.conversation)
            if updated is ledger or await self.store.put_state(ref, updated.dump(), expect_version=version):
                return

    async def stats(self, request: web.Request) -> web.Response:
        who = self.caller(request)
        hours = _int(request, "hours", 24, 1, 24 * 7)
        await self._fresh()
        tenants = await self._tenants(who)
        totals = await self._guard(self.activity.totals(tenants))
        series = await self._guard(self.activity.series(tenants, hours=hours))
        usd = {name: totals.pop(f"{name}_uusd") / 1_000_000 for name in ("cost_original", "cost_forwarded")}
        folds = {labels["result"]: int(value)
                 for labels, value in _samples(self.app[self._metrics_key], "gateway_folds_total")}
        return _json({
            "tenant": who.tenant, "admin": who.admin, **totals, **usd,
            "cost_saved": usd["cost_original"] - usd["cost_forwarded"],
            "folds": folds, "at": time.time(),
            "series": [{"t": p["t"], "requests": p["requests"], "tokens_original": p["tokens_original"],
                        "tokens_forwarded": p["tokens_forwarded"],
                        "cost_original": p["cost_original_uusd"] / 1_000_000,
                        "cost_forwarded": p["cost_forwarded_uusd"] / 1_000_000} for p in series],
        })


def _samples(metrics: Any, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric of this process (folds are counted where the workers run)."""
    out = []
    for metric in metrics.registry.collect():
        out += [(s.labels, s.value) for s in metric.samples if s.name == name]
    return out


def _branch_json(branch: dict[str, Any]) -> dict[str, Any]:
    """An abandoned branch: `at` is the position of its first message in the history it left."""
    return {"id": branch["id"], "at": branch["at"], "messages": branch["count"], "tokens": branch.get("tokens", 0),
            "abandoned_at": branch["time"]}


def routes(api: ConversationAPI) -> list[tuple[str, str, Any]]:
    """(path, method, handler) of every route of the gateway's own API."""
    # Any id but a raw "/": "{", "}", "%" and non-UTF-8 bytes arrive percent-encoded and decoded.
    base = "/gateway/conversations/{conversation:[^/]+}"
    return [("/gateway/conversations", "GET", api.list), ("/gateway/stats", "GET", api.stats),
            (base, "GET", api.get), (base, "DELETE", api.delete), (base + "/messages", "GET", api.messages),
            (base + "/search", "GET", api.search), (base + "/branches", "GET", api.branches),
            (base + "/branches/{branch}/messages", "GET", api.branch_messages),
            (base + "/state", "PUT", api.put_state), (base + "/summary", "PUT", api.put_summary),
            (base + "/fold", "POST", api.fold)]


def _edited(data: Any, edits: dict[str, Any], now: str) -> state.Ledger:
    ledger = state.apply_edits(state.load(data), edits, time=now)
    edited = state.edited_items(ledger)
    if edited > state.MAX_EDITED:
        raise GatewayError(400, "invalid_request_error",
                           f"the state would hold {edited} items set by edits, more than "
                           f"{state.MAX_EDITED}: set fewer, or replace a kind's items with fewer")
    return ledger
