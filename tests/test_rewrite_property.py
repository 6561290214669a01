"""Property tests: whatever valid history and settings, the rewritten request is valid for its
provider, keeps the newest turn, and keeps the cacheable prefix byte-identical between turns."""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable
from typing import Any

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway import rewrite
from gateway.config import MemorySettings
from gateway.dialects import Dialect, content_hash, dialect_named
from gateway.model import Message, Plan, Summary
from gateway.rewrite import History, Inputs, align_boundary, clean_cuts, fill

Raw = dict[str, Any]
DIALECTS = ("openai_chat", "anthropic", "openai_responses")
WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta", "redis", "cache", "token", "window", "fold",
                         "summary", "tool"])
TEXT = st.lists(WORDS, min_size=1, max_size=12).map(" ".join)
ARGS = st.dictionaries(st.sampled_from(["a", "b", "path", "n", "q"]),
                       st.one_of(st.integers(-5, 5), TEXT, st.booleans()), max_size=3)

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def count(text: str) -> int:
    return len(text) // 4 + 1


# ---------------------------------------------------------------- valid histories per dialect


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


def _oa_user(draw: st.DrawFn) -> Raw:
    text = draw(TEXT)
    form = draw(st.integers(0, 2))
    if form == 0:
        return {"role": "user", "content": text}
    if form == 1:
        return {"role": "user", "content": [{"type": "text", "text": text}]}
    return {"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": "https://x/i.png"}}]}


def _oa_loop(draw: st.DrawFn, ids: _Ids) -> list[Raw]:
    calls = [{"id": ids("call_"), "type": "function",
              "function": {"name": draw(WORDS), "arguments": orjson.dumps(draw(ARGS)).decode()}}
             for _ in range(draw(st.integers(1, 3)))]
    out: list[Raw] = [{"role": "assistant", "content": None, "tool_calls": calls}]
    order = draw(st.permutations(calls))
    out += [{"role": "tool", "tool_call_id": c["id"], "content": draw(TEXT)} for c in order]
    return out


def _an_user(draw: st.DrawFn) -> Raw:
    text = draw(TEXT)
    if draw(st.booleans()):
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def _an_loop(draw: st.DrawFn, ids: _Ids) -> list[Raw]:
    uses = [{"type": "tool_use", "id": ids("toolu_"), "name": draw(WORDS), "input": draw(ARGS)}
            for _ in range(draw(st.integers(1, 3)))]
    lead = [{"type": "text", "text": draw(TEXT)}] if draw(st.booleans()) else []
    results: list[Any] = [{"type": "tool_result", "tool_use_id": u["id"], "content": draw(TEXT)}
                          for u in draw(st.permutations(uses))]
    if draw(st.integers(0, 4)) == 0:
        results.append({"type": "text", "text": draw(TEXT)})  # a remark after the results
    return [{"role": "assistant", "content": lead + uses}, {"role": "user", "content": results}]


def _rs_user(draw: st.DrawFn) -> Raw:
    text = draw(TEXT)
    if draw(st.booleans()):
        return {"role": "user", "content": text}
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _rs_loop(draw: st.DrawFn, ids: _Ids) -> list[Raw]:
    out: list[Raw] = []
    if draw(st.booleans()):
        out.append({"type": "reasoning", "id": ids("rs_"), "summary": []})
    calls = [{"type": "function_call", "id": ids("fc_"), "call_id": ids("call_"), "name": draw(WORDS),
              "arguments": orjson.dumps(draw(ARGS)).decode(), "status": "completed"}
             for _ in range(draw(st.integers(1, 3)))]
    out += calls
    out += [{"type": "function_call_output", "call_id": c["call_id"], "output": draw(TEXT)}
            for c in draw(st.permutations(calls))]
    return out


def _reply(dialect: str, draw: st.DrawFn, ids: _Ids) -> list[Raw]:
    text = draw(TEXT)
    if dialect == "openai_chat":
        return [{"role": "assistant", "content": text}]
    if dialect == "anthropic":
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]
    out: list[Raw] = []
    if draw(st.booleans()):
        out.append({"type": "reasoning", "id": ids("rs_"), "summary": [{"type": "summary_text", "text": "t"}]})
    out.append({"type": "message", "role": "assistant", "id": ids("msg_"), "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]})
    return out


_USER = {"openai_chat": _oa_user, "anthropic": _an_user, "openai_responses": _rs_user}
_LOOP = {"openai_chat": _oa_loop, "anthropic": _an_loop, "openai_responses": _rs_loop}


def _exchange(dialect: str, draw: st.DrawFn, ids: _Ids, *, last: bool) -> list[Raw]:
    """One user turn and what follows it; the last one stops where a client sends a request."""
    out = [_USER[dialect](draw)]
    for _ in range(draw(st.integers(0, 2))):
        out += _LOOP[dialect](draw, ids)
    if not last:
        out += _reply(dialect, draw, ids)
    return out


@st.composite
def conversations(draw: st.DrawFn, dialect: str) -> tuple[list[Raw], list[Raw]]:
    """(history of one request, the next request's history: one reply and one user turn more)."""
    ids = _Ids()
    raws: list[Raw] = []
    for _ in range(draw(st.integers(0, 10))):
        raws += _exchange(dialect, draw, ids, last=False)
    raws += _exchange(dialect, draw, ids, last=True)
    nxt = raws + _reply(dialect, draw, ids) + _exchange(dialect, draw, ids, last=True)
    return raws, nxt


def _body(dialect: str, history: list[Raw], breakpoints: int) -> dict[str, Any]:
    if dialect == "openai_chat":
        return {"model": "gpt-4o", "messages": [{"role": "system", "content": "be brief"}, *history]}
    if dialect == "openai_responses":
        return {"model": "gpt-4o", "instructions": "be brief", "input": history}
    history = copy.deepcopy(history)
    system: list[Raw] = [{"type": "text", "text": "be brief"}]
    tools: list[Raw] = [{"name": "t", "input_schema": {"type": "object"}}]
    # The client's own breakpoints: on the system, the tools and its newest messages.
    slots = [system[0], tools[0], *[m for m in reversed(history) if isinstance(m["content"], list)][:2]]
    for block in slots[:breakpoints]:
        target = block["content"][-1] if "role" in block else block
        target["cache_control"] = {"type": "ephemeral"}
    return {"model": "claude-sonnet-4", "max_tokens": 100, "system": system, "tools": tools,
            "messages": history}


def _turns(api: Dialect, raws: list[Raw]) -> list[Message]:
    return [Message(raw=r, role=api.role(r), text=api.text(r), tokens=count(api.text(r)) + 4,
                 hash=content_hash(api, r)) for r in raws]


# ---------------------------------------------------------------- provider validity


def _valid_openai(body: dict[str, Any]) -> None:
    pending: set[str] = set()
    for m in body["messages"]:
        if pending:
            assert m["role"] == "tool" and m["tool_call_id"] in pending, "tool_calls not answered right after"
            pending.discard(m["tool_call_id"])
            continue
        assert m["role"] != "tool", "tool message without its call"
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = {c["id"] for c in m["tool_calls"]}
    assert not pending


def _blocks(m: Raw) -> list[Any]:
    return m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]


def _valid_anthropic(body: dict[str, Any]) -> None:
    msgs = body["messages"]
    assert msgs and msgs[0]["role"] == "user"
    for a, b in itertools.pairwise(msgs):
        assert a["role"] != b["role"], "roles must alternate"
    for i, m in enumerate(msgs):
        blocks = _blocks(m)
        assert blocks, "empty content"
        results = [b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"]
        kinds = [b.get("type") == "tool_result" for b in blocks]
        assert kinds == sorted(kinds, reverse=True), "tool_result blocks first"
        if m["role"] == "user":
            prev = _blocks(msgs[i - 1]) if i else []
            uses = [b["id"] for b in prev if b.get("type") == "tool_use"]
            assert sorted(results) == sorted(uses), "tool_use/tool_result pairing across adjacent messages"
        elif i + 1 == len(msgs):
            assert not any(b.get("type") == "tool_use" for b in blocks)
    n = sum(1 for b in body.get("system") or [] if b.get("cache_control"))
    n += sum(1 for t in body.get("tools") or [] if t.get("cache_control"))
    n += sum(1 for m in msgs for b in _blocks(m) if b.get("cache_control"))
    assert n <= 4, "at most 4 cache_control breakpoints"


def _valid_responses(body: dict[str, Any], original: list[Raw]) -> None:
    items = body["input"]
    seen: set[str] = set()
    follower = {id(a): b for a, b in itertools.pairwise(original)}
    for i, it in enumerate(items):
        if it.get("type") == "function_call":
            seen.add(it["call_id"])
        elif it.get("type") == "function_call_output":
            assert it["call_id"] in seen, "function_call_output before its function_call"
        elif it.get("type") == "reasoning":
            assert i + 1 < len(items) and items[i + 1] is follower[id(it)], "reasoning lost its item"


VALIDATORS: dict[str, Callable[[dict[str, Any], list[Raw]], None]] = {
    "openai_chat": lambda body, raws: _valid_openai(body),
    "anthropic": lambda body, raws: _valid_anthropic(body),
    "openai_responses": _valid_responses,
}


def _stable_prefix(dialect: str, body: dict[str, Any], plan: Plan) -> bytes:
    """The bytes a provider prompt cache keys on before the messages: system, state, summary."""
    layers = 1 if plan.state_block or plan.summary_block else 0
    if dialect == "openai_chat":
        return orjson.dumps(body["messages"][: 1 + layers])
    if dialect == "anthropic":
        return orjson.dumps([body["system"], body["tools"]])
    return orjson.dumps([body["instructions"], body["input"][:layers]])


# ---------------------------------------------------------------- the properties


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dialect = draw(st.sampled_from(DIALECTS))
    raws, nxt = draw(conversations(dialect))
    api = dialect_named(dialect)
    cov = align_boundary(api, raws, 0, draw(st.integers(0, len(raws))))
    mem = MemorySettings.model_validate({
        "message_threshold": draw(st.integers(1, 40)), "token_threshold": draw(st.integers(1, 3000)),
        "keep_recent": draw(st.integers(1, 12)), "keep_initial": draw(st.integers(0, 5)),
        "retrieval_budget_tokens": draw(st.integers(0, 300)),
        # The layering rules: no prompt-cache cost choice, excerpts up to any share of the history.
        "cost_model": False, "retrieval_max_share": 1.0, "retrieval_target_share": 0.0,
        "retrieval_context_share": 1.0, "min_saving_share": draw(st.sampled_from([0.0, 0.2])),
    })
    return {
        "dialect": dialect, "raws": raws, "next": nxt, "cov": cov, "settings": mem,
        "summary": Summary(text=draw(TEXT), covers=cov, version=1, tokens=10) if cov else None,
        "state": draw(st.sampled_from(["", "- decision: use redis", "- goal: ship\n- owner: ann"])),
        "budget": draw(st.one_of(st.integers(10, 400), st.integers(400, 100_000))),
        "recalled": draw(st.lists(st.integers(0, len(raws) - 1), max_size=6)),
        "breakpoints": draw(st.integers(0, 4)),
        "cache_control": draw(st.booleans()),
    }


def _plan(case: dict[str, Any], raws: list[Raw]) -> tuple[Dialect, list[Message], Plan]:
    api = dialect_named(case["dialect"])
    turns = _turns(api, raws)
    cov = case["cov"]

    def recall(window_start: int, budget: int) -> list[tuple[int, Message]]:
        return [(p, turns[p]) for p in case["recalled"] if p < len(turns)]

    mem: MemorySettings = case["settings"]
    state_block = fill(mem.templates.state, state=case["state"]) if case["state"] else ""
    history = History(head=turns[: mem.keep_initial], tail=turns[cov:], tail_start=cov, total_messages=len(turns),
                      total_tokens=sum(t.tokens for t in turns), summary=case["summary"],
                      stored_head=turns[: mem.keep_initial])
    # As memory.py plans: the draft, then its excerpts when it wants them.
    draft = rewrite.plan(Inputs(dialect=api, history=history, system_tokens=3, state_block=state_block,
                                state_tokens=count(state_block), settings=mem, context_budget=case["budget"],
                                count=count))
    wants = draft.wants
    outcome = draft.finish(recall(wants.window_start, wants.budget) if wants is not None else ())
    return api, turns, outcome.plan


def _position(raws: list[Raw], raw: Raw) -> int:
    return next(i for i, r in enumerate(raws) if r is raw)


@PROPS
@given(cases())
def test_rendered_requests_are_valid_for_their_provider(case: dict[str, Any]) -> None:
    """Every rendered request keeps tool-call groups whole and the provider's ordering rules, and
    the client's body is never mutated."""
    dialect, raws = case["dialect"], case["raws"]
    api, _, plan = _plan(case, raws)
    body = _body(dialect, raws, case["breakpoints"])
    before = copy.deepcopy(body)
    out = api.render(body, plan, cache_control=case["cache_control"])
    event(f"{dialect} {plan.kind}{' urgent' if plan.urgent_fold else ''}"
          f"{' excerpts' if plan.excerpts_block else ''}{' head' if plan.head else ''}")
    assert body == before
    VALIDATORS[dialect](out, raws)
    if dialect == "anthropic":
        _valid_anthropic(_body(dialect, raws, case["breakpoints"]))  # the generator itself is valid


@PROPS
@given(cases())
def test_window_starts_at_a_turn_start_and_keeps_the_newest_turn(case: dict[str, Any]) -> None:
    """A rewritten window starts at a clean turn start and always ends with the whole newest turn;
    the head is an unbroken prefix; a plan over the budget is the newest turn alone."""
    raws = case["raws"]
    api, _, plan = _plan(case, raws)
    clean = clean_cuts(api, raws)
    newest = max(i for i in range(len(raws)) if clean[i] and api.is_turn_start(raws[i]))
    if plan.kind == "full":
        # The client's body goes as sent; the plan holds the part of it that is at hand.
        assert plan.tokens_forwarded == plan.tokens_original
        assert plan.window == raws[len(raws) - len(plan.window):]
        return
    start = _position(raws, plan.window[0])
    assert api.is_turn_start(raws[start]) and clean[start]
    assert plan.window == raws[start:] and start <= newest
    assert all(a is b for a, b in zip(plan.head, raws, strict=False))
    assert len(plan.head) <= case["settings"].keep_initial and clean[len(plan.head)]
    if plan.tokens_forwarded > case["budget"]:
        assert start == newest and not plan.head and not plan.summary_block and not plan.state_block
    else:
        # A whole-history client's body can always go as sent: a rewrite never costs more.
        assert plan.tokens_forwarded < plan.tokens_original
    if plan.urgent_fold or start > max(case["cov"], len(plan.head)):
        expected = start - max(case["cov"] if plan.summary_block else 0, len(plan.head))
        assert (plan.omitted_marker != "") == (expected > 0)
        if expected > 0:
            assert str(expected) in plan.omitted_marker


@PROPS
@given(cases())
def test_excerpts_never_repeat_forwarded_messages_and_fit_their_budget(case: dict[str, Any]) -> None:
    """Excerpts name only messages outside the head and the window, and stay within their budget."""
    raws = case["raws"]
    _, _, plan = _plan(case, raws)
    if not plan.excerpts_block:
        return
    start = _position(raws, plan.window[0])
    positions = [int(p) for p in re.findall(r"^\[message (\d+), ", plan.excerpts_block, re.M)]
    assert positions and positions == sorted(set(positions))
    assert all(len(plan.head) <= p < start for p in positions)
    assert count(plan.excerpts_block) <= case["settings"].retrieval_budget_tokens


@PROPS
@given(cases())
def test_stable_prefix_is_byte_identical_on_the_next_turn(case: dict[str, Any]) -> None:
    """With the same summary and state, the system + state + summary bytes do not change when the
    conversation grows by one turn: the provider's prompt cache stays warm."""
    dialect = case["dialect"]
    _, _, first = _plan(case, case["raws"])
    api, _, second = _plan(case, case["next"])
    if first.kind != "rewritten" or second.kind != "rewritten":
        return
    if (first.state_block, first.summary_block) != (second.state_block, second.summary_block):
        return  # the hard budget dropped a layer in one of them: a different prefix by design
    a = api.render(_body(dialect, case["raws"], 0), first, cache_control=case["cache_control"])
    b = api.render(_body(dialect, case["next"], 0), second, cache_control=case["cache_control"])
    event(f"compared {dialect} layers={bool(first.state_block or first.summary_block)}")
    assert _stable_prefix(dialect, a, first) == _stable_prefix(dialect, b, second)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, args=ARGS, call=st.sampled_from(["call_1", "toolu_9"]))
def test_rebuilt_reply_and_client_echo_hash_the_same(text: str, args: dict[str, Any], call: str) -> None:
    """The assistant message the gateway rebuilds from a response and the one each SDK sends back
    have the same canonical form, whatever optional fields and content shapes they use."""
    oa = dialect_named("openai_chat")
    dumped = orjson.dumps(args).decode()
    spaced = orjson.dumps(dict(reversed(list(args.items())))).decode().replace(",", ", ").replace(":", ": ")
    fn = {"name": "f", "arguments": dumped}
    variants: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"role": "assistant", "content": text, "refusal": None, "annotations": []},
         {"role": "assistant", "content": text}),
        ({"role": "assistant", "content": text}, {"role": "assistant", "content": [{"type": "text", "text": text}]}),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": call, "type": "function", "function": fn}]},
         {"role": "assistant", "tool_calls": [{"id": call, "type": "function",
                                               "function": {"name": "f", "arguments": spaced}}]}),
    ]
    for a, b in variants:
        assert oa.canonical(a) == oa.canonical(b)
        assert content_hash(oa, a) == content_hash(oa, b)
    an = dialect_named("anthropic")
    use = {"type": "tool_use", "id": call, "name": "f", "input": args}
    assert an.canonical({"role": "assistant", "content": text}) == an.canonical(
        {"role": "assistant", "content": [{"type": "text", "text": text, "citations": None}]})
    assert an.canonical({"role": "assistant", "content": [use]}) == an.canonical(
        {"role": "assistant", "content": [{**use, "input": dict(reversed(list(args.items()))),
                                           "cache_control": {"type": "ephemeral"}}]})
    rs = dialect_named("openai_responses")
    assert rs.canonical({"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                         "content": [{"type": "output_text", "text": text, "annotations": []}]}) == rs.canonical(
        {"role": "assistant", "content": text})
    assert rs.canonical({"type": "function_call", "id": "fc_1", "call_id": call, "name": "f",
                         "arguments": dumped, "status": "completed"}) == rs.canonical(
        {"type": "function_call", "call_id": call, "name": "f", "arguments": spaced})
