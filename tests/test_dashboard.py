"""GET /dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): what a new user
sees after `gateway demo`, and a state edit made in the page reaching the next forwarded request."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from memory_helpers import OTHER_KEY, Chat, memory_gateway, reply_text, user_text
from playwright.async_api import Browser, Page, async_playwright

from gateway import demo
from gateway.app import drain_background

CHROMIUM = os.environ.get("GATEWAY_TEST_CHROMIUM", "/usr/bin/chromium")
# FACTS.md: what Debian's chromium needs to run headless here, as root, touching nothing outside
# (`headless=True` adds --headless; Playwright gives each launch a fresh profile directory of its own).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"  # gitignored
ADMIN = "admin-token-for-the-page-0001"
DECISION = "Billing records live in PostgreSQL, never in Redis"


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not os.path.exists(CHROMIUM):  # noqa: ASYNC240 (one stat, before the browser starts)
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does this)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
async def toured() -> AsyncIterator[demo.Demo]:
    """`gateway demo`'s gateway after 36 turns of its project conversation (rewritten and folded)."""
    async with demo.running() as d, aiohttp.ClientSession() as http:
        await demo.tour(d, 36, http, quiet=True)
        yield d


def _watch(page: Page, base: str) -> tuple[list[str], list[str]]:
    """Requests to anywhere but the gateway, and console errors, as the page runs."""
    foreign: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(base) else foreign.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return foreign, errors


async def _shot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    await page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


async def test_dashboard_shows_savings_and_a_state_edit_reaches_the_next_request(
        browser: Browser, toured: demo.Demo) -> None:
    """After the demo, the page (with the demo key typed in) draws original vs forwarded, lists the
    conversation with its summary coverage, opens its summary and state, and a decision typed into the
    state is in the project state block of the next request the upstream receives."""
    d = toured
    page = await browser.new_page(viewport={"width": 1360, "height": 900})
    foreign, errors = _watch(page, d.base)
    await page.goto(d.base + "/dashboard")
    await page.fill("#key", demo.DEMO_KEY)
    await page.click("#login button[type=submit]")

    row = page.locator(f'#conversations tbody tr[data-id="{demo.CONVERSATION}"]')
    await row.wait_for()
    chart = page.locator("#chart")
    assert int(await chart.get_attribute("data-points") or 0) == 37  # from zero, then one per request
    forwarded_path = await page.locator("#chart path.forwarded").get_attribute("d") or ""
    original_path = await page.locator("#chart path.original").get_attribute("d") or ""
    assert forwarded_path.count("L") == 36 and original_path != forwarded_path
    # The top of the forwarded line ends lower than the original's: the savings are visible.
    assert float(forwarded_path.rsplit(",", 1)[1]) > float(original_path.rsplit(",", 1)[1])
    cards = await page.locator("#cards").inner_text()
    assert "tokens saved" in cards and "36" in cards
    cells = await row.locator("td").all_inner_texts()
    assert cells[1] == "72"  # messages: 36 turns, each a question and its answer
    assert cells[2].startswith(tuple(f"{n} of 72" for n in range(1, 72)))  # folded: the summary covers some
    assert "rewritten" in cells[6]
    await _shot(page, "dashboard-overview.png")

    await row.click()
    await page.locator("#conversation").wait_for(state="visible")
    assert "Dana" in await page.input_value("#summary")  # the rolling summary, editable
    assert "PostgreSQL 16" in await page.input_value("#state-decisions")
    assert await page.locator("#window li").count() >= 10
    decisions = await page.input_value("#state-decisions")
    await page.fill("#state-decisions", decisions + "\n" + DECISION)
    await page.click("#save-state")
    await page.locator("#status", has_text="State saved").wait_for()  # the CSP forbids evaluated strings
    # Its last request was rewritten, so the next one carries the edit (one sent whole would not).
    assert "the next request of this conversation carries it" in await page.locator("#status").inner_text()
    await _shot(page, "dashboard-conversation.png")
    assert foreign == [] and errors == []

    client = openai.AsyncOpenAI(base_url=d.base + "/v1", api_key=demo.DEMO_KEY, max_retries=0)
    history: list[Any] = [*d.history, {"role": "user", "content": "Where do billing records go?"}]
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=history, extra_headers={"X-Conversation-Id": demo.CONVERSATION})
    await client.close()
    await drain_background(d.app)
    assert raw.headers["x-gateway-context"] == "rewritten"
    forwarded = d.fake.requests[-1].body
    injected = "\n".join(m["content"] for m in forwarded["messages"] if m["role"] == "system")
    state_block = injected.split("## Project state", 1)[1]
    assert DECISION in state_block and "PostgreSQL 16" in state_block


async def test_admin_token_sees_every_tenant_folds_and_forgets_from_the_page(browser: Browser, redis_url: str) -> None:
    """Logged in with the admin token the page lists every tenant's conversations; on one of them
    "Fold now" queues a fold and a confirmed "Forget…" deletes it from the store and the table."""
    async with memory_gateway(redis_url, auth={"admin_token": ADMIN}) as g:
        g.fake.responder = reply_text
        alice, bob_chat = Chat(g, "openai", "alice-plan"), Chat(g, "anthropic", "bob-notes", key=OTHER_KEY)
        for chat, turns in ((alice, 8), (bob_chat, 3)):
            msgs: list[dict[str, Any]] = []
            for i in range(turns):
                msgs.append({"role": "user", "content": user_text(i)})
                _, text = await chat.send(msgs)
                msgs.append({"role": "assistant", "content": text})
            await g.settle()
        page = await browser.new_page(viewport={"width": 1360, "height": 900})
        foreign, errors = _watch(page, g.url)
        await page.goto(g.url + "/dashboard")
        await page.fill("#key", ADMIN)
        await page.click("#login button[type=submit]")
        bob = page.locator('#conversations tbody tr[data-id="bob-notes"]')
        await bob.wait_for()
        assert await page.locator('#conversations tbody tr[data-id="alice-plan"]').count() == 1
        assert "all tenants" in await page.locator("#cards").inner_text()
        assert await page.locator("#tenant").is_visible()  # the admin may narrow to one tenant
        await bob.click()
        await page.locator("#conversation").wait_for(state="visible")
        await page.click("#fold")
        await page.locator("#conv-status", has_text="Fold").wait_for()
        assert "failed" not in await page.locator("#conv-status").inner_text()
        page.once("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
        await page.click("#forget")
        await page.locator("#status", has_text="bob-notes forgotten").wait_for()
        await bob.wait_for(state="detached")
        await page.locator('#conversations tbody tr[data-id="alice-plan"]').wait_for()  # still every tenant
        assert "all tenants" in await page.locator("#cards").inner_text()
        await _shot(page, "dashboard-admin.png")
        assert foreign == [] and errors == []
    async with memory_gateway(redis_url) as again:  # same Redis: the forget reached the store
        status, _ = await again.api("GET", "bob-notes", key=OTHER_KEY)
        assert status == 404
        assert (await again.api("GET", "alice-plan"))[0] == 200
