"""Dialects: picking one from a request, and rebuilding replies from streams cut anywhere."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dialects import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, SSEParser, dialect_for_path
from gateway.model import Usage


def sse(obj: dict, event: str | None = None) -> bytes:
    return (f"event: {event}\n".encode() if event else b"") + b"data: " + orjson.dumps(obj) + b"\n\n"


CHAT_STREAM = b"".join([
    sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    sse({"choices": [{"index": 0, "delta": {"content": "Héllo "}}]}),
    sse({"choices": [{"index": 0, "delta": {"content": "wörld"}}]}),
    sse({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]}),
    sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}}]}),
    sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]}),
    sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}),
    b"data: [DONE]\n\n",
])

ANTHROPIC_STREAM = b"".join([
    sse({"type": "message_start", "message": {"usage": {"input_tokens": 3, "cache_read_input_tokens": 10,
                                                         "cache_creation_input_tokens": 2, "output_tokens": 1}}},
        "message_start"),
    sse({"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}}, "content_block_start"),
    sse({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hmm"}},
        "content_block_delta"),
    sse({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig=="}},
        "content_block_delta"),
    sse({"type": "ping"}, "ping"),
    sse({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        "content_block_start"),
    sse({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi "}},
        "content_block_delta"),
    sse({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "there"}},
        "content_block_delta"),
    sse({"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}}, "content_block_start"),
    sse({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"x": ['}},
        "content_block_delta"),
    sse({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "1]}"}},
        "content_block_delta"),
    sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
        "message_delta"),
    sse({"type": "message_stop"}, "message_stop"),
])

RESPONSES_STREAM = b"".join([
    sse({"type": "response.created", "response": {"output": []}}, "response.created"),
    sse({"type": "response.output_text.delta", "delta": "Hi"}, "response.output_text.delta"),
    sse({"type": "response.completed", "response": {
        "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
                   {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "g", "arguments": "{}",
                    "status": "completed"}],
        "usage": {"input_tokens": 8, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 1}}}},
        "response.completed"),
])

CHAT_RESULT = ([{"role": "assistant", "content": "Héllo wörld", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}],
    Usage(input_tokens=11, output_tokens=5, cache_read_tokens=4))
ANTHROPIC_RESULT = ([{"role": "assistant", "content": [
    {"type": "thinking", "thinking": "hmm", "signature": "sig=="},
    {"type": "text", "text": "Hi there"},
    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": [1]}}]}],
    Usage(input_tokens=15, output_tokens=9, cache_read_tokens=10, cache_write_tokens=2))
RESPONSES_RESULT = ([
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
    {"type": "function_call", "call_id": "call_9", "name": "g", "arguments": "{}"}],
    Usage(input_tokens=8, output_tokens=2, cache_read_tokens=1))

CASES = [(OPENAI_CHAT, CHAT_STREAM, CHAT_RESULT), (ANTHROPIC, ANTHROPIC_STREAM, ANTHROPIC_RESULT),
         (OPENAI_RESPONSES, RESPONSES_STREAM, RESPONSES_RESULT)]


def feed_in_pieces(dialect, data: bytes, cuts: list[int]):
    acc = dialect.accumulator()
    prev = 0
    for cut in sorted(set(cuts)):
        acc.feed(data[prev:cut])
        prev = cut
    acc.feed(data[prev:])
    return acc.result()


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(range(3)), cuts=st.lists(st.integers(0, 2500), max_size=30))
def test_accumulators_survive_any_split(case: int, cuts: list[int]) -> None:
    """Each dialect rebuilds the same reply and usage however the network cuts the stream."""
    dialect, data, expected = CASES[case]
    assert feed_in_pieces(dialect, data, [c % (len(data) + 1) for c in cuts]) == expected


def test_accumulator_handles_crlf_frames() -> None:
    """Frames separated by CRLF (allowed by the SSE spec) are parsed like LF ones."""
    assert feed_in_pieces(OPENAI_CHAT, CHAT_STREAM.replace(b"\n", b"\r\n"), [7, 100, 101]) == CHAT_RESULT


def test_parse_response_non_streamed() -> None:
    """Non-streamed JSON answers are rebuilt into the same request-shaped items as streams."""
    chat = {"choices": [{"message": {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1}}
    assert OPENAI_CHAT.parse_response(chat) == ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
        Usage(input_tokens=2, output_tokens=1))
    text_only = {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}
    assert OPENAI_CHAT.parse_response(text_only)[0] == [{"role": "assistant", "content": "ok"}]
    message = {"content": [{"type": "text", "text": "a", "citations": None}], "usage": {"input_tokens": 1}}
    assert ANTHROPIC.parse_response(message) == ([{"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
                                                 Usage(input_tokens=1))


def test_error_shapes() -> None:
    """Error bodies and stream error frames follow each provider's format."""
    assert orjson.loads(OPENAI_CHAT.error_body(400, "invalid_request_error", "bad"))["error"]["message"] == "bad"
    assert orjson.loads(ANTHROPIC.error_body(400, "invalid_request_error", "bad")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert ANTHROPIC.stream_error_frame("x").startswith(b"event: error\ndata: {")
    assert OPENAI_RESPONSES.stream_error_frame("x").startswith(b'data: {"error":')


def test_dialect_for_path() -> None:
    """Known paths decide the dialect; other paths follow anthropic-version."""
    assert dialect_for_path("/v1/chat/completions", {}) is OPENAI_CHAT
    assert dialect_for_path("/v1/responses", {}) is OPENAI_RESPONSES
    assert dialect_for_path("/v1/messages/count_tokens", {}) is ANTHROPIC
    assert dialect_for_path("/v1/models", {"anthropic-version": "2023-06-01"}) is ANTHROPIC
    assert dialect_for_path("/v1/models", {}) is OPENAI_CHAT
    assert OPENAI_CHAT.is_stream({"stream": True}) and not OPENAI_CHAT.is_stream({"stream": "yes"})


def test_sse_parser_keeps_event_names_and_multiline_data() -> None:
    """The SSE splitter returns event names and joins multi-line data."""
    p = SSEParser()
    assert p.feed(b"event: a\ndata: 1\ndata: 2\n\nda") == [("a", b"1\n2")]
    assert p.feed(b"ta: 3\n\n") == [(None, b"3")]
