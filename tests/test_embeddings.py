"""Hybrid retrieval (memory.retrieval.embeddings): a question worded unlike the message that answers
it still gets that message as an excerpt; messages are embedded in the background, never by a
request; the switch off never loads the model."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gateway import embed
from gateway.app import HOOK
from gateway.config import ConfigError, parse_settings
from tests.memory_helpers import memory_gateway, openai_turn

# The answer, and a question sharing none of its content words (even after stemming).
ANSWER = "Last night I made pasta with basil and cherry tomatoes that grew on my balcony."
QUESTION = "What dinner did I cook using homegrown ingredients?"
FILLER = [
    "Can you explain how a Kubernetes deployment rolls out a new container image?",
    "What is the difference between TCP and UDP for a multiplayer game server?",
    "Recommend a schedule for training to run a half marathon in spring.",
    "How should I structure unit tests for a Python command line parser?",
    "Which budget spreadsheet columns help track monthly utility bills?",
    "Explain the rules of chess castling and when it is not allowed.",
    "What are good habits for reviewing pull requests in a small team?",
    "How do noise cancelling headphones reduce low frequency sound?",
]
# Excerpts get room for about two short messages; small thresholds make every request a rewrite.
MEMORY: dict[str, Any] = {"retrieval_budget_tokens": 90, "retrieval_max_share": 1.0}


async def _converse(g: Any, conv: str) -> list[dict[str, Any]]:
    """The answer early on, then the filler: the answer leaves the recent window. Folds finish
    between turns, as between a user's messages, so the later turns are rewrites that search (and
    so index) the conversation, however slow the machine."""
    client = g.openai()
    history: list[dict[str, Any]] = []
    for text in [ANSWER, *FILLER]:
        history.append({"role": "user", "content": text})
        _, reply = await openai_turn(g, client, conv, history)
        history.append({"role": "assistant", "content": reply})
        await g.settle()
    return history


async def _ask(g: Any, conv: str, history: list[dict[str, Any]], question: str = QUESTION) -> str:
    """The question (once the folds are done: the request is a rewrite); what the gateway forwarded
    upstream, as text."""
    await g.settle()
    await openai_turn(g, g.openai(), conv, [*history, {"role": "user", "content": question}])
    body = g.last("/chat/completions").body
    return "\n".join(str(m.get("content")) for m in body["messages"])


def _tenant(g: Any) -> Any:
    return next(iter(g.app[HOOK].caches.recall._entries))  # the one conversation's key


@pytest.mark.parametrize("embeddings", [True, False])
async def test_paraphrased_question_finds_its_answer_only_with_embeddings(embeddings: bool) -> None:
    async with memory_gateway("memory://", memory={**MEMORY, "retrieval": {"embeddings": embeddings}}) as g:
        history = await _converse(g, "garden")
        recall = g.app[HOOK].caches.recall
        if embeddings:
            await recall.embedder.drain()  # as between a user's turns: stored messages have vectors
            assert recall.embedded(_tenant(g)) > 0
        forwarded = await _ask(g, "garden", history)
        assert "Relevant earlier excerpts" in forwarded or not embeddings
        # Without embeddings nothing the question says matches the answer's words.
        assert (ANSWER in forwarded) is embeddings


async def test_messages_are_embedded_in_the_background_not_by_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = embed._encode

    def gated(texts: list[str]) -> Any:
        # Background batches wait for the test; a request's own question is embedded at once.
        if threading.current_thread().name.startswith("embed-batch"):
            gate.wait(30)
        return real(texts)

    monkeypatch.setattr(embed, "_encode", gated)
    async with memory_gateway("memory://", memory={**MEMORY, "retrieval": {"embeddings": True}}) as g:
        try:
            history = await _converse(g, "garden")  # every request answered while no batch could run
            recall = g.app[HOOK].caches.recall
            key = _tenant(g)
            assert recall.embedded(key) == 0
            assert ANSWER not in await _ask(g, "garden", history)  # lexical only meanwhile
        finally:
            gate.set()
        await recall.embedder.drain()
        assert recall.embedded(key) >= 2 * len(FILLER)
        assert ANSWER in await _ask(g, "garden", [*history, {"role": "user", "content": QUESTION},
                                                  {"role": "assistant", "content": "Noted."}])


async def test_switch_off_never_loads_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[object] = []

    class Refused(embed.Encoder):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(self)
            raise AssertionError("the model was loaded with memory.retrieval.embeddings off")

    monkeypatch.setattr(embed, "Encoder", Refused)
    monkeypatch.setattr(embed, "_encoder", None)
    async with memory_gateway("memory://", memory=MEMORY) as g:
        history = await _converse(g, "garden")
        assert g.app[HOOK].caches.recall.embedder is None
        forwarded = await _ask(g, "garden", history, "Which chess rules did we discuss about castling?")
        assert FILLER[5] in forwarded  # retrieval itself works, lexically
    assert made == [] and not embed.loaded()


def test_switch_on_without_the_extra_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embed, "available", lambda: False)
    with pytest.raises(ConfigError) as err:
        parse_settings({"memory": {"retrieval": {"embeddings": True}}})
    assert "memory.retrieval.embeddings" in str(err.value) and "pip install" in str(err.value)
