"""The conversation API: what the gateway remembers, and the edits that win over extraction.

Every route is scoped like the memory path: a conversation is reachable only with the credential
(or gateway key) that created it. `auth.admin_token` (as Bearer) may act for any tenant named in
`X-Gateway-Tenant`. Errors are rendered by the app's edge middleware in the caller's dialect.
"""

from __future__ import annotations

import asyncio
import hmac
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from gateway import state
from gateway.auth import Authenticator, AuthError, presented_credential
from gateway.keys import ConvRef
from gateway.model import Summary
from gateway.proxy import GatewayError
from gateway.store import Store, StoreUnavailable

ADMIN_TENANT_HEADER = "X-Gateway-Tenant"
MAX_PAGE = 1000


def _json(data: Any, status: int = 200) -> web.Response:
    # orjson: stored messages and ledgers can be large, and the stdlib encoder is several times slower.
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _summary_json(summary: Summary, edited: bool) -> dict[str, Any]:
    return {"text": summary.text, "covers": summary.covers, "version": summary.version,
            "tokens": summary.tokens, "edited": edited}


class ConversationAPI:
    def __init__(self, app: web.Application, settings: Any, store_key: Any, hook_key: Any, count: Any) -> None:
        self.app = app
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

    def _ref(self, request: web.Request) -> ConvRef:
        conv = request.match_info["conversation"]
        project = next((request.headers[h] for h in self.settings.conversation.project_headers
                        if request.headers.get(h)), None)
        admin = self.settings.auth.admin_token
        presented = presented_credential(request.headers)
        if admin and presented and hmac.compare_digest(presented, admin):
            tenant = request.headers.get(ADMIN_TENANT_HEADER)
            if not tenant:
                raise GatewayError(400, "invalid_request_error",
                                   f"an admin request names the tenant in {ADMIN_TENANT_HEADER}")
            return ConvRef(tenant, conv, project)
        try:
            ident = self.auth.identify(request.headers)
        except AuthError as exc:
            raise GatewayError(401, "authentication_error", str(exc)) from exc
        return ConvRef(ident.tenant, conv, project)

    async def _json(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, "invalid_request_error", f"body is not valid JSON: {exc}") from exc

    async def _guard(self, coro: Any) -> Any:
        try:
            return await coro
        except StoreUnavailable as exc:
            raise GatewayError(503, "api_error", "the conversation store is unreachable") from exc

    async def _changed(self, ref: ConvRef) -> None:
        """An edit or delete: the memory hook here, and every other replica, stop planning from what
        they knew of the conversation (gateway/views.py)."""
        hook = self.app[self._hook_key]
        if hook is not None and hasattr(hook, "changed"):
            hook.changed(ref)
        await self._guard(self.store.announce(ref, "edited"))

    # -- routes -------------------------------------------------------------------------------

    async def get(self, request: web.Request) -> web.Response:
        ref = self._ref(request)
        mem = self.settings.memory
        view = await self._guard(self.store.load(ref, head=0))
        summary, _, edited = await self._guard(self.store.get_summary(ref))
        if view.length == 0 and summary is None and view.state is None:
            raise GatewayError(404, "not_found_error", f"no conversation {ref.conversation!r} for this credential")
        covers = summary.covers if summary else 0
        ledger = state.load(view.state)
        return _json({
            "id": ref.conversation,
            "project": ref.project,
            "dialect": view.dialect,
            "messages": view.length,
            "tokens": view.tokens_total,
            "summary": None if summary is None else _summary_json(summary, edited),
            "state": ledger.model_dump(mode="json"),
            "state_rendered": state.render(ledger, mem.state_budget_tokens, self._count),
            "window": {"start": covers, "end": view.length, "keep_recent": mem.keep_recent},
            "fold_pending": view.fold_pending,
            "stats": view.stats,
        })

    async def messages(self, request: web.Request) -> web.Response:
        ref = self._ref(request)
        try:
            offset = int(request.query.get("offset", "0"))
            limit = int(request.query.get("limit", "100"))
        except ValueError as exc:
            raise GatewayError(400, "invalid_request_error", "offset and limit must be integers") from exc
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            raise GatewayError(400, "invalid_request_error", f"offset must be >= 0 and limit within 1..{MAX_PAGE}")
        view = await self._guard(self.store.load(ref, head=0))
        turns = await self._guard(self.store.messages(ref, offset, min(offset + limit, view.length)))
        return _json({
            "object": "list", "total": view.length, "offset": offset, "limit": limit,
            "data": [{"index": offset + i, "role": t.role, "message": t.raw, "tokens": t.tokens, "time": t.time}
                     for i, t in enumerate(turns)],
        })

    async def put_state(self, request: web.Request) -> web.Response:
        ref = self._ref(request)
        edits = await self._json(request)
        if not isinstance(edits, dict) or not edits:
            raise GatewayError(400, "invalid_request_error",
                               f"body must be an object of kinds ({', '.join(state.KINDS)}) to a text or a list")
        unknown = [k for k in edits if k not in state.KINDS]
        bad = [k for k, v in edits.items() if not (isinstance(v, str) or
                                                   (isinstance(v, list) and all(isinstance(x, str) for x in v)))]
        if unknown or bad:
            raise GatewayError(400, "invalid_request_error",
                               f"unknown kinds {unknown} / values not text or list of text {bad}; "
                               f"kinds: {', '.join(state.KINDS)}")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")
        for _ in range(10):  # compare-and-set against folds updating the same ledger
            data, version = await self._guard(self.store.get_state(ref))
            ledger = state.apply_edits(state.load(data), edits, time=now)
            if await self._guard(self.store.put_state(ref, ledger.model_dump(mode="json"), expect_version=version)):
                await self._changed(ref)
                return _json({"state": ledger.model_dump(mode="json")})
            await asyncio.sleep(0.01)
        raise GatewayError(409, "conflict_error", "the state kept changing; try again")

    async def put_summary(self, request: web.Request) -> web.Response:
        ref = self._ref(request)
        body = await self._json(request)
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise GatewayError(400, "invalid_request_error", 'body must be {"text": "<summary>"}')
        summary = await self._guard(self.store.put_summary(ref, text, self._count(text)))
        await self._changed(ref)
        return _json({"summary": _summary_json(summary, True)})

    async def fold(self, request: web.Request) -> web.Response:
        ref = self._ref(request)
        queued = await self._guard(self.store.enqueue_fold(ref, urgent=True))
        return _json({"queued": queued}, status=202)

    async def delete(self, request: web.Request) -> web.Response:
        ref = self._ref(request)
        await self._guard(self.store.delete(ref))
        hook = self.app[self._hook_key]
        if hook is not None and hasattr(hook, "forget"):
            hook.forget(ref)
        await self._changed(ref)
        return _json({"id": ref.conversation, "deleted": True})


def routes(api: ConversationAPI) -> list[tuple[str, str, Any]]:
    """(path, method, handler) of every conversation route."""
    base = "/v1/conversations/{conversation}"
    return [(base, "GET", api.get), (base, "DELETE", api.delete), (base + "/messages", "GET", api.messages),
            (base + "/state", "PUT", api.put_state), (base + "/summary", "PUT", api.put_summary),
            (base + "/fold", "POST", api.fold)]
