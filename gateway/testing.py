"""Fake upstreams shipped with the package: one real aiohttp app speaking the OpenAI (Chat
Completions, Responses) and Anthropic (Messages) wire formats closely enough for the official SDKs.

Used by the tests, `gateway demo`, `gateway eval` and the overhead benchmark:

    async with FakeUpstream(reply="hi") as fake:
        settings = ...(openai base_url=fake.openai_base_url, anthropic base_url=fake.anthropic_base_url)
        ...
        fake.requests[-1].body   # what the upstream received

Behaviour is plain attributes, changeable between requests: `reply` or `responder(body) -> str`,
`tool_calls`, a scripted `error_status` (+ `error_headers`, `error_count`), `drop_after` (cut the
connection after K stream events), `latency` (before the answer) and `chunk_delay` (between events).
`python -m gateway.testing --port P --latency-ms 20` runs it standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import itertools
import random
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.config import Settings, parse_settings

Responder = Callable[[dict[str, Any]], "str | Awaitable[str]"]

_WORDS = re.compile(r"\S+\s*|\s+")
_ids = itertools.count(1)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(slots=True)
class Received:
    method: str
    path: str
    query: str
    headers: CIMultiDict[str]
    body: Any  # parsed JSON, or None
    raw: bytes


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _tokens(n_bytes: int) -> int:
    return max(1, n_bytes // 4)


def _pieces(text: str) -> list[str]:
    return _WORDS.findall(text) or ([text] if text else [])


@dataclass
class FakeUpstream:
    reply: str = "Hello from the fake upstream."
    responder: Responder | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    error_status: int | None = None
    error_headers: dict[str, str] = field(default_factory=dict)
    error_body: dict[str, Any] | None = None
    error_count: int | None = None  # fail this many requests, then answer; None: while error_status is set
    drop_after: int | None = None  # stream events sent before the connection is cut
    latency: float = 0.0
    latency_jitter: float = 0.0  # each answer waits latency ± up to this (uniform), like a real provider
    chunk_delay: float = 0.0
    extra_headers: dict[str, str] = field(default_factory=dict)  # added to every answer
    model_openai: str = "gpt-4o-mini"
    model_anthropic: str = "claude-sonnet-4-20250514"
    record: bool = True
    log: Path | None = None  # every request received, appended as one JSON line (method, path, body)
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[Received] = field(default_factory=list)
    disconnects: int = 0  # streams whose reader went away before the end
    # Report prompt-cache reads as a provider would: the longest prefix (system, then items) of this
    # request some earlier one had, when it is 1,024 tokens or more (never expires).
    prompt_cache: bool = False
    _prefixes: set[bytes] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.disconnected = asyncio.Event()
        self.app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_rejects_unreadable])
        r = self.app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/responses", self._responses)
        r.add_post("/v1/messages", self._messages)
        r.add_post("/v1/messages/count_tokens", self._count_tokens)
        r.add_get("/v1/models", self._models)
        r.add_route("*", "/v1/conversations/{id}", self._conversation)
        r.add_route("*", "/{tail:.*}", self._unknown)
        self._runner: web.AppRunner | None = None

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> FakeUpstream:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeUpstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.url

    def settings(self, **sections: Any) -> Settings:
        """Gateway settings with both upstreams pointing here; `sections` merge in (`auth={...}`)."""
        data: dict[str, Any] = {"upstreams": {"openai": {"base_url": self.openai_base_url},
                                              "anthropic": {"base_url": self.anthropic_base_url}}}
        return parse_settings(_merge(data, sections))

    # --- shared steps ------------------------------------------------------------------------------

    async def _receive(self, request: web.Request) -> tuple[dict[str, Any], int]:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        if self.record:
            self.requests.append(Received(request.method, request.path, request.query_string,
                                          CIMultiDict(request.headers), body, raw))
        if self.log is not None:
            line = {"method": request.method, "path": request.path, "body": body}
            with self.log.open("ab") as f:
                f.write(orjson.dumps(line) + b"\n")
        if self.latency:
            await asyncio.sleep(self.latency + random.uniform(-self.latency_jitter, self.latency_jitter))
        return (body if isinstance(body, dict) else {}), len(raw)

    def _scripted_error(self, anthropic: bool) -> web.Response | None:
        if self.error_status is None:
            return None
        if self.error_count is not None:
            if self.error_count <= 0:
                return None
            self.error_count -= 1
        status = self.error_status
        kind = {429: "rate_limit_error", 401: "authentication_error", 400: "invalid_request_error",
                529: "overloaded_error"}.get(status, "api_error")
        if self.error_body is not None:
            body = self.error_body
        elif anthropic:
            body = {"type": "error", "error": {"type": kind, "message": f"fake upstream error {status}"}}
        else:
            body = {"error": {"message": f"fake upstream error {status}", "type": kind, "param": None,
                              "code": kind}}
        headers = {**self._ids_header(anthropic), **self.error_headers}
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                            headers=headers)

    def _ids_header(self, anthropic: bool) -> dict[str, str]:
        n = next(_ids)
        if anthropic:
            return {"request-id": f"req_fake{n}", "anthropic-ratelimit-requests-limit": "1000",
                    "anthropic-ratelimit-requests-remaining": "999", **self.extra_headers}
        return {"x-request-id": f"req_fake{n}", "x-ratelimit-limit-requests": "1000",
                "x-ratelimit-remaining-requests": "999", "openai-processing-ms": "1", **self.extra_headers}

    async def _text(self, body: dict[str, Any]) -> str:
        if self.responder is None:
            return self.reply
        out = self.responder(body)
        return await out if inspect.isawaitable(out) else out

    def _cached(self, body: dict[str, Any], n_in: int) -> int:
        """Tokens of `body`'s prompt an earlier request already had (0 unless `prompt_cache`)."""
        if not self.prompt_cache:
            return 0
        seen = self._prefixes
        given = body.get("input")
        items = [body.get("system"), body.get("instructions"), *(body.get("messages") or []),
                 *(given if isinstance(given, list) else [])]
        digest = hashlib.blake2b(digest_size=16)
        size = hit = 0
        for item in items:
            part = orjson.dumps(item)
            digest.update(part)
            size += len(part)
            key = digest.copy().digest()
            if key in seen:
                hit = size
            seen.add(key)
        cached = min(_tokens(hit), _tokens(n_in))
        return cached if cached >= 1024 else 0

    def _calls(self) -> list[ToolCall]:
        return [ToolCall(c.name, c.arguments, c.id or f"call_fake{next(_ids)}") for c in self.tool_calls]

    async def _stream(self, request: web.Request, frames: Iterator[bytes], anthropic: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", **self._ids_header(anthropic)})
        await resp.prepare(request)
        try:
            for sent, frame in enumerate(frames):
                if self.drop_after is not None and sent >= self.drop_after:
                    # Cut the connection mid-body: the reader sees an incomplete chunked payload.
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                await resp.write(frame)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            self.disconnected.set()
            raise
        return resp

    # --- OpenAI Chat Completions -------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, n_in = await self._receive(request)
        if (err := self._scripted_error(False)) is not None:
            return err
        text, calls = await self._text(body), self._calls()
        model = body.get("model") or self.model_openai
        usage = {"prompt_tokens": _tokens(n_in), "completion_tokens": _tokens(len(text)),
                 "total_tokens": _tokens(n_in) + _tokens(len(text)),
                 "prompt_tokens_details": {"cached_tokens": self._cached(body, n_in)},
                 "completion_tokens_details": {"reasoning_tokens": 0}}
        tool_calls: list[dict[str, Any]] = [{"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": orjson.dumps(c.arguments).decode()}} for c in calls]
        finish = "tool_calls" if calls else "stop"
        base: dict[str, Any] = {"id": f"chatcmpl-fake{next(_ids)}", "created": int(time.time()), "model": model,
                "system_fingerprint": "fp_fake"}
        if body.get("stream") is not True:
            message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else ""),
                                       "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return web.json_response({**base, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]},
                headers=self._ids_header(False), dumps=lambda o: orjson.dumps(o).decode())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            obj = {**base, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        def frames() -> Iterator[bytes]:
            yield chunk({"role": "assistant", "content": "", "refusal": None})
            for piece in _pieces(text):
                yield chunk({"content": piece})
            for i, tc in enumerate(tool_calls):
                args = tc["function"]["arguments"]
                yield chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                             "function": {"name": tc["function"]["name"], "arguments": ""}}]})
                for j in range(0, len(args), 8):
                    yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j:j + 8]}}]})
            yield chunk({}, finish)
            if include_usage:
                yield _sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return await self._stream(request, frames(), anthropic=False)

    # --- OpenAI Responses --------------------------------------------------------------------------

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body, n_in = await self._receive(request)
        if (err := self._scripted_error(False)) is not None:
            return err
        text, calls = await self._text(body), self._calls()
        rid, mid = f"resp_fake{next(_ids)}", f"msg_fake{next(_ids)}"
        output: list[dict[str, Any]] = []
        if text or not calls:
            output.append({"type": "message", "id": mid, "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        for c in calls:
            output.append({"type": "function_call", "id": f"fc_{c.id}", "call_id": c.id, "name": c.name,
                           "arguments": orjson.dumps(c.arguments).decode(), "status": "completed"})
        usage = {"input_tokens": _tokens(n_in), "input_tokens_details": {"cached_tokens": self._cached(body, n_in)},
                 "output_tokens": _tokens(len(text)), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": _tokens(n_in) + _tokens(len(text))}

        def response(status: str, out: list[dict[str, Any]], use: dict[str, Any] | None) -> dict[str, Any]:
            return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
                    "model": body.get("model") or self.model_openai, "output": out, "usage": use,
                    "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
                    "metadata": {}, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                    "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}}, "truncation": "disabled"}

        if body.get("stream") is not True:
            return web.json_response(response("completed", output, usage), headers=self._ids_header(False),
                                     dumps=lambda o: orjson.dumps(o).decode())
        seq = itertools.count()

        def ev(kind: str, **data: Any) -> bytes:
            return _sse({"type": kind, "sequence_number": next(seq), **data}, event=kind)

        def frames() -> Iterator[bytes]:
            yield ev("response.created", response=response("in_progress", [], None))
            yield ev("response.in_progress", response=response("in_progress", [], None))
            for index, item in enumerate(output):
                if item["type"] == "message":
                    yield ev("response.output_item.added", output_index=index,
                             item={**item, "status": "in_progress", "content": []})
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield ev("response.content_part.added", item_id=mid, output_index=index, content_index=0,
                             part=part)
                    for piece in _pieces(text):
                        yield ev("response.output_text.delta", item_id=mid, output_index=index, content_index=0,
                                 delta=piece, logprobs=[])
                    yield ev("response.output_text.done", item_id=mid, output_index=index, content_index=0,
                             text=text, logprobs=[])
                    yield ev("response.content_part.done", item_id=mid, output_index=index, content_index=0,
                             part={**part, "text": text})
                else:
                    yield ev("response.output_item.added", output_index=index,
                             item={**item, "status": "in_progress", "arguments": ""})
                    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"])
                    yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"])
                yield ev("response.output_item.done", output_index=index, item=item)
            yield ev("response.completed", response=response("completed", output, usage))

        return await self._stream(request, frames(), anthropic=False)

    # --- Anthropic Messages ------------------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body, n_in = await self._receive(request)
        if (err := self._scripted_error(True)) is not None:
            return err
        text, calls = await self._text(body), self._calls()
        content: list[dict[str, Any]] = []
        if text or not calls:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name,
                     "input": c.arguments} for c in calls]
        read = self._cached(body, n_in)
        usage = {"input_tokens": _tokens(n_in) - read, "output_tokens": _tokens(len(text)),
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": read}
        message = {"id": f"msg_fake{next(_ids)}", "type": "message", "role": "assistant",
                   "model": body.get("model") or self.model_anthropic, "content": content,
                   "stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None, "usage": usage}
        if body.get("stream") is not True:
            return web.json_response(message, headers=self._ids_header(True), dumps=lambda o: orjson.dumps(o).decode())

        def ev(kind: str, **data: Any) -> bytes:
            return _sse({"type": kind, **data}, event=kind)

        def frames() -> Iterator[bytes]:
            yield ev("message_start", message={**message, "content": [], "stop_reason": None,
                                               "usage": {**usage, "output_tokens": 1}})
            for index, block in enumerate(content):
                if block["type"] == "text":
                    yield ev("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    if index == 0:
                        yield ev("ping")
                    for piece in _pieces(text):
                        yield ev("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
                else:
                    yield ev("content_block_start", index=index,
                             content_block={**block, "input": {}})
                    if index == 0:
                        yield ev("ping")
                    args = orjson.dumps(block["input"]).decode()
                    for j in range(0, len(args), 8):
                        yield ev("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": args[j:j + 8]})
                yield ev("content_block_stop", index=index)
            yield ev("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": None},
                     usage={"output_tokens": usage["output_tokens"]})
            yield ev("message_stop")

        return await self._stream(request, frames(), anthropic=True)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        _body, n_in = await self._receive(request)
        if (err := self._scripted_error(True)) is not None:
            return err
        return web.json_response({"input_tokens": _tokens(n_in)}, headers=self._ids_header(True))

    async def _models(self, request: web.Request) -> web.Response:
        await self._receive(request)
        if "anthropic-version" in request.headers:
            model = {"type": "model", "id": self.model_anthropic, "display_name": "Fake Claude",
                     "created_at": "2025-05-14T00:00:00Z"}
            return web.json_response({"data": [model], "has_more": False, "first_id": model["id"],
                                      "last_id": model["id"]}, headers=self._ids_header(True))
        return web.json_response({"object": "list", "data": [
            {"id": self.model_openai, "object": "model", "created": 1700000000, "owned_by": "fake"}]},
            headers=self._ids_header(False))

    async def _conversation(self, request: web.Request) -> web.Response:
        """OpenAI's own Conversations API (a gateway must pass it through, not answer it)."""
        await self._receive(request)
        conv = request.match_info["id"]
        if request.method == "DELETE":
            return web.json_response({"id": conv, "object": "conversation.deleted", "deleted": True})
        return web.json_response({"id": conv, "object": "conversation", "created_at": 1700000000,
                                  "metadata": {"from": "fake upstream"}})

    async def _unknown(self, request: web.Request) -> web.Response:
        await self._receive(request)
        message = f"fake upstream has no route {request.method} {request.path}"
        if "anthropic-version" in request.headers:
            return web.json_response({"type": "error", "error": {"type": "not_found_error", "message": message}},
                                     status=404)
        return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                            "param": None, "code": "unknown_url"}}, status=404)


@web.middleware
async def _rejects_unreadable(request: web.Request, handler: Any) -> web.StreamResponse:
    """A body the fake cannot read is the caller's 400, in the provider's shape, as a real provider answers."""
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except web.HTTPException:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        message = f"the fake provider cannot read this body: {type(exc).__name__}"
        if request.path.startswith("/v1/messages"):
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                  "message": message}}, status=400)
        return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                            "param": None, "code": None}}, status=400)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@asynccontextmanager
async def serve_app(app: web.Application, host: str = "127.0.0.1",
                    ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """Run `app` on a free port (a client that hangs up cancels its handler, as under `gateway serve`);
    yields its base URL (http:// even with `ssl_context`: the caller knows it serves TLS)."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, 0, ssl_context=ssl_context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway.testing", description="run a fake upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9999)
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before each answer")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="each delay varies by up to this much either way")
    p.add_argument("--reply", default="Hello from the fake upstream.", help="what every answer says")
    p.add_argument("--log", type=Path, default=None, metavar="FILE",
                   help="append every request received (what the gateway forwarded) to FILE, one JSON line each: "
                        "method, path, body")
    args = p.parse_args(argv)

    async def run() -> None:
        fake = FakeUpstream(reply=args.reply, latency=args.latency_ms / 1000, latency_jitter=args.jitter_ms / 1000,
                            record=False, log=args.log,
                            host=args.host, port=args.port)
        async with fake:
            print(f"fake upstream on {fake.url}", flush=True)
            await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
