"""The offload process (gateway/offload.py): `gateway serve` on Redis starts a sibling that serves
large bodies. Real processes: `gateway serve` as a subprocess, a redis-server of
this module's own, a fake upstream on port 0 in the test process, the official SDK as a client."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics, SiblingSamples
from gateway.testing import FakeUpstream
from tests.conftest import RedisProcess, free_port

KEY = "sk-offload-client-0001"
THRESHOLD = 64 * 1024


class Gateway:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def requests(self, conversation: str) -> list[dict[str, Any]]:
        return [ln for ln in self.lines() if ln.get("event") == "request" and ln.get("conversation") == conversation]

    async def offload_pid(self, after: int = 0, seconds: float = 60.0) -> int:
        """The pid of the offload process once it answers (its `after`+1-th start)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready = [ln["pid"] for ln in self.lines() if ln.get("event") == "offload.ready"]
            if len(ready) > after:
                return int(ready[after])
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            await asyncio.sleep(0.05)
        raise AssertionError("the offload process never answered:\n" + self.log.read_text()[-3000:])


def _spawn(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CONFIG"}
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                 "--port", str(port)], stdout=f, stderr=subprocess.STDOUT, env=env)


@contextlib.asynccontextmanager
async def gateway(tmp: Path, redis: RedisProcess, fake: FakeUpstream, **server: Any) -> AsyncIterator[Gateway]:
    cfg = {"store": {"url": redis.url},
           "upstreams": {"openai": {"base_url": fake.openai_base_url},
                         "anthropic": {"base_url": fake.anthropic_base_url}},
           "memory": {"message_threshold": 6, "keep_recent": 4, "fold_batch": 4, "cost_model": False},
           "server": {"offload_body_bytes": THRESHOLD, **server}}
    (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = tmp / "gw.log"
    proc = _spawn(tmp / "gw.yaml", port, log)
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log)
    try:
        await gw.offload_pid()
        yield gw
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _history(n: int, size: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: " + "lorem ipsum " * (size // 12)}
            for i in range(n)]


async def _stored_user_turns(http: aiohttp.ClientSession, url: str, conv: str) -> list[str] | None:
    async with http.get(f"{url}/gateway/conversations/{conv}/messages?limit=1000",
                        headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status == 404:
            return None  # (not recorded yet: that happens after the answer)
        assert r.status == 200, await r.text()
        page = await r.json()
    return [d["message"]["content"] for d in page["data"] if d["role"] == "user"]


async def _stored_is(http: aiohttp.ClientSession, url: str, conv: str, want: list[str]) -> bool:
    return await _stored_user_turns(http, url, conv) == want


async def _eventually(check: Any, seconds: float = 20.0) -> Any:
    """`check()` (awaited if it must be) once it is truthy, or its last value after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


def _socket_of(pid: int) -> str:
    """The Unix socket an offload process serves (its --offload-socket)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--offload-socket") + 1].decode()


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its parent was killed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


async def test_a_large_body_is_served_by_the_offload_process_and_remembered(tmp_path: Path,
                                                                            redis_process: RedisProcess) -> None:
    """A body over offload_body_bytes, sent with the official SDK, streamed and not: the offload
    process answers it (its log line says so), the answer arrives whole, and the turn is stored;
    a small request on the same gateway is served by the gateway's own process."""
    async with FakeUpstream(reply="Noted, all of it.") as fake, gateway(tmp_path, redis_process, fake) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        history = _history(11, 12_000)  # ~130 KB of JSON
        big = await client.chat.completions.create(model="gpt-4o", messages=history,  # type: ignore[arg-type]
                                                   extra_headers={"X-Conversation-Id": "big"})
        assert big.choices[0].message.content == "Noted, all of it."
        history += [{"role": "assistant", "content": "Noted, all of it."}, {"role": "user", "content": "and now?"}]
        stream = await client.chat.completions.create(model="gpt-4o", messages=history,  # type: ignore[arg-type]
                                                      stream=True, extra_headers={"X-Conversation-Id": "big"})
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "Noted, all of it."
        small = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Conversation-Id": "small"})
        assert small.http_response.status_code == 200
        await client.close()

        async with aiohttp.ClientSession() as http:
            want = [m["content"] for m in history if m["role"] == "user"]
            assert await _eventually(lambda: _stored_is(http, gw.url, "big", want))
        logged = await _eventually(lambda: (len(gw.requests("big")) == 2 and gw.requests("small")))
        assert logged
        assert [ln.get("process_role") for ln in gw.requests("big")] == ["offload", "offload"]
        assert [ln.get("process_role") for ln in gw.requests("small")] == [None]


async def test_a_chunked_body_is_measured_as_it_arrives(tmp_path: Path, redis_process: RedisProcess) -> None:
    """A body without Content-Length goes to the offload process once it passes the threshold; a short
    one is served here, its first chunks (read to measure it) forwarded first and in order."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw, \
            aiohttp.ClientSession() as http:
        for conv, n, size, step in (("chunked-big", 11, 12_000, 10_000), ("chunked-small", 5, 300, 97)):
            sent = _history(n, size)
            raw = json.dumps({"model": "gpt-4o", "messages": sent}).encode()

            async def body(raw: bytes = raw, step: int = step) -> AsyncIterator[bytes]:
                for i in range(0, len(raw), step):
                    yield raw[i:i + step]
                    await asyncio.sleep(0)

            async with http.post(gw.url + "/v1/chat/completions", data=body(),
                                 headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": conv,
                                          "Content-Type": "application/json"}) as r:
                assert r.status == 200, await r.text()
            assert fake.requests[-1].body["messages"] == sent
        assert await _eventually(lambda: (gw.requests("chunked-big") and gw.requests("chunked-small")))
        assert gw.requests("chunked-big")[0].get("process_role") == "offload"
        assert gw.requests("chunked-small")[0].get("process_role") is None


async def test_compressed_bodies_go_on_decoded(tmp_path: Path, redis_process: RedisProcess) -> None:
    """A gzip request body (aiohttp decodes it as it reads) reaches the upstream decoded and without
    its Content-Encoding, relayed (over the threshold once decoded, though smaller compressed) or not."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw, \
            aiohttp.ClientSession() as http:
        for conv, n in (("gz-big", 11), ("gz-small", 3)):
            sent = _history(n, 12_000)  # repetitive: 130 KB compresses to ~2 KB
            raw = gzip.compress(json.dumps({"model": "gpt-4o", "messages": sent}).encode())
            async with http.post(gw.url + "/v1/chat/completions", data=raw,
                                 headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": conv,
                                          "Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
                assert r.status == 200, await r.text()
            assert fake.requests[-1].body["messages"] == sent
            assert "content-encoding" not in {k.lower() for k in fake.requests[-1].headers}
        assert await _eventually(lambda: (gw.requests("gz-big") and gw.requests("gz-small")))
        assert gw.requests("gz-big")[0].get("process_role") == "offload"
        assert gw.requests("gz-small")[0].get("process_role") is None


async def test_an_offload_process_killed_mid_upload_loses_nothing(tmp_path: Path, redis_process: RedisProcess) -> None:
    """SIGKILL to the offload process while a large body is still arriving: the gateway serves the
    request itself, from the part already relayed and the rest, and stores the turn."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw, \
            aiohttp.ClientSession() as http:
        pid = await gw.offload_pid()
        sent = _history(31, 12_000)
        want = [m["content"] for m in sent if m["role"] == "user"]
        raw = json.dumps({"model": "gpt-4o", "messages": sent}).encode()

        async def body() -> AsyncIterator[bytes]:
            for i in range(0, len(raw), 16_384):
                if i >= len(raw) // 2 and not _exited(pid):
                    os.kill(pid, signal.SIGKILL)
                    await _eventually(lambda: _exited(pid))
                yield raw[i:i + 16_384]
                await asyncio.sleep(0.005)

        for length in (True, False):  # declared, then chunked
            headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": f"mid-{length}",
                       "Content-Type": "application/json"}
            if length:
                headers["Content-Length"] = str(len(raw))
            async with http.post(gw.url + "/v1/chat/completions", data=body(), headers=headers) as r:
                assert r.status == 200, await r.text()
            assert fake.requests[-1].body["messages"] == sent
            assert await _eventually(lambda c=f"mid-{length}": _stored_is(http, gw.url, c, want))
            pid = await gw.offload_pid(after=1 if length else 2)
        assert [ln["event"] for ln in gw.lines() if ln.get("event") == "offload.failed"]


async def test_metrics_count_what_the_offload_process_served(tmp_path: Path, redis_process: RedisProcess) -> None:
    """/metrics adds the offload process's samples to the gateway's own: one large and one small
    request count two, before and after the offload process is replaced, and the exposition stays
    valid (one family per name)."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw, \
            aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "m"}
        for n in (11, 1):
            body = {"model": "gpt-4o", "messages": _history(n, 12_000 if n > 1 else 10)}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200

        async def total_is(want: float) -> bool:
            async with http.get(gw.url + "/metrics") as r:
                families = list(text_string_to_metric_families(await r.text()))
            names = [f.name for f in families]
            assert len(names) == len(set(names)), names
            return want == sum(s.value for f in families if f.name == "gateway_requests" for s in f.samples
                               if s.name == "gateway_requests_total" and s.labels["route"] == "/v1/chat/completions")

        assert await _eventually(lambda: total_is(2.0))
        # A restart of the offload process does not take back what it had counted.
        os.kill(await gw.offload_pid(), signal.SIGKILL)
        assert await total_is(2.0)
        await gw.offload_pid(after=1)
        assert await total_is(2.0)


async def test_conversations_the_offload_process_serves_are_folded_by_the_gateway(tmp_path: Path,
                                                                                   redis_process: RedisProcess) -> None:
    """The offload process queues folds; the gateway's own workers run them (one set of workers)."""
    async with FakeUpstream(reply="Noted.") as fake, gateway(tmp_path, redis_process, fake) as gw, \
            aiohttp.ClientSession() as http:
        messages = _history(9, 12_000)
        for i in range(3):
            messages.append({"role": "user", "content": f"Turn {i}: we decided to use port {8000 + i}."})
            async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": messages},
                                 headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "f"}) as r:
                assert r.status == 200
            messages.append({"role": "assistant", "content": "Noted."})
        folds = await _eventually(lambda: [ln for ln in gw.lines()
                                           if ln.get("event") == "fold.ok" and ln.get("conversation") == "f"])
        assert folds and {ln.get("process_role") for ln in folds} == {None}
        assert {ln.get("process_role") for ln in gw.requests("f")} == {"offload"}
        started = [ln for ln in gw.lines() if ln.get("event") == "fold.workers_started"]
        assert [ln.get("process_role") for ln in started] == [None]


async def test_a_killed_offload_process_is_replaced_and_no_request_fails(tmp_path: Path,
                                                                         redis_process: RedisProcess) -> None:
    """SIGKILL to the offload process: large requests are served by the gateway meanwhile (200, stored),
    and a new offload process takes over."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw, \
            aiohttp.ClientSession() as http:
        first = await gw.offload_pid()
        os.kill(first, signal.SIGKILL)
        history = _history(11, 12_000)
        headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "k"}
        for _ in range(3):
            async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": history},
                                 headers=headers) as r:
                assert r.status == 200, await r.text()
            history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {len(history)}"}]
        second = await gw.offload_pid(after=1)
        assert second != first
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": history},
                             headers=headers) as r:
            assert r.status == 200
        want = [m["content"] for m in history if m["role"] == "user"]
        assert await _eventually(lambda: _stored_is(http, gw.url, "k", want))
        assert any(ln.get("event") == "offload.exited" for ln in gw.lines())


async def test_a_request_the_provider_got_is_not_sent_again_when_the_offload_process_dies(
        tmp_path: Path, redis_process: RedisProcess) -> None:
    """The offload process dies after it sent the request upstream and before the answer came back:
    the client gets a 502 in its API's format that its SDK does not retry, and the provider saw the
    request once (serving it again here would bill it twice). The next request is served as usual."""
    victim: list[int] = []

    async def dies_first(body: dict[str, Any]) -> str:
        if victim:
            pid = victim.pop()
            os.kill(pid, signal.SIGKILL)
            await _eventually(lambda: _exited(pid))
        return "ok"

    async with FakeUpstream(responder=dies_first) as fake, gateway(tmp_path, redis_process, fake) as gw:
        victim.append(await gw.offload_pid())
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY)  # (the SDK's own retries on)
        history = _history(11, 12_000)
        try:
            await client.chat.completions.create(model="gpt-4o", messages=history,  # type: ignore[arg-type]
                                                 extra_headers={"X-Conversation-Id": "once"})
            raise AssertionError("answered, so the request was sent upstream a second time")
        except openai.APIStatusError as exc:
            assert exc.status_code == 502
            assert exc.response.headers["x-should-retry"] == "false"
            assert isinstance(exc.body, dict) and "not sent again" in exc.body["message"]
        assert len(fake.requests) == 1
        assert "x-gateway-offload-call" not in {k.lower() for k in fake.requests[0].headers}
        again = await client.chat.completions.create(model="gpt-4o", messages=history,  # type: ignore[arg-type]
                                                     extra_headers={"X-Conversation-Id": "once"})
        assert again.choices[0].message.content == "ok"
        assert len(fake.requests) == 2
        await client.close()
        marks = os.path.dirname(_socket_of(await gw.offload_pid(after=1)))
        assert not [f for f in os.listdir(marks) if f.startswith("pending-")]  # each is read once, then gone


async def test_the_offload_process_calls_the_provider_only_with_the_relays_mark(
        tmp_path: Path, redis_process: RedisProcess) -> None:
    """A request reaching the offload process without a mark the relay left (a forged header, or one
    whose mark is gone) is answered 503 and never sent upstream: the relay may serve it itself."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw:
        sock = _socket_of(await gw.offload_pid())
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(sock)) as direct:
            for mark in (None, "0" * 32, "../../etc"):
                headers = {"Authorization": f"Bearer {KEY}"} | ({"X-Gateway-Offload-Call": mark} if mark else {})
                async with direct.post("http://gateway/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 503, await r.text()
                    assert "not sent to the provider" in (await r.json())["error"]["message"]
        assert fake.requests == []
        # A client's own header is not the relay's: small and large requests are served as usual.
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0,
                                    default_headers={"X-Gateway-Offload-Call": "0" * 32})
        for history in ([{"role": "user", "content": "hi"}], _history(11, 12_000)):
            done = await client.chat.completions.create(model="gpt-4o", messages=history)  # type: ignore[arg-type]
            assert done.choices[0].message.content == "ok"
        await client.close()
        assert len(fake.requests) == 2


async def test_a_stopped_offload_process_is_replaced_and_what_waited_on_it_is_answered(
        tmp_path: Path, redis_process: RedisProcess) -> None:
    """SIGSTOP to the offload process (alive, answering nothing): the health check kills it after three
    unanswered asks, another takes over, and a large request sent to the stopped one meanwhile is
    answered by the gateway's own process and stored."""
    async with FakeUpstream(reply="ok") as fake, \
            gateway(tmp_path, redis_process, fake, offload_health_seconds=1) as gw, aiohttp.ClientSession() as http:
        stopped = await gw.offload_pid()
        os.kill(stopped, signal.SIGSTOP)
        history = _history(11, 12_000)
        headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "stopped"}
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": history},
                             headers=headers) as r:
            assert r.status == 200, await r.text()
        assert fake.requests[-1].body["messages"] == history
        assert await _eventually(lambda: _exited(stopped))
        assert await gw.offload_pid(after=1) != stopped
        assert any(ln.get("event") == "offload.unresponsive" for ln in gw.lines())
        want = [m["content"] for m in history if m["role"] == "user"]
        assert await _eventually(lambda: _stored_is(http, gw.url, "stopped", want))
        logged = await _eventually(lambda: gw.requests("stopped"))
        assert [ln.get("process_role") for ln in logged] == [None]


async def test_the_offload_process_leaves_with_the_gateway(tmp_path: Path, redis_process: RedisProcess) -> None:
    """SIGTERM: both exit 0; SIGKILL to the gateway: the offload process exits on its own."""
    async with FakeUpstream() as fake:
        async with gateway(tmp_path, redis_process, fake) as gw:
            pid = await gw.offload_pid()
            gw.proc.send_signal(signal.SIGTERM)
            assert gw.proc.wait(timeout=40) == 0
            assert await _eventually(lambda: (_exited(pid)))
        (tmp_path / "gw.log").unlink()
        async with gateway(tmp_path, redis_process, fake) as gw:
            pid = await gw.offload_pid()
            gw.proc.kill()
            gw.proc.wait()
            assert await _eventually(lambda: (_exited(pid)), seconds=40)


def test_merged_metrics_add_every_sample_once() -> None:
    """The merge behind /metrics: counters with the same labels add, other label sets are kept,
    histogram buckets, sums and counts add, and each family is written once."""
    ours, theirs = Metrics(), Metrics()
    ours.requests.labels("/v1/messages", "full", "200", "anthropic", "claude").inc(2)
    theirs.requests.labels("/v1/messages", "full", "200", "anthropic", "claude").inc(3)
    theirs.requests.labels("/v1/messages", "full", "400", "anthropic", 'a "quoted" \\ model').inc()
    ours.overhead.observe(0.0002)
    theirs.overhead.observe(0.2)
    theirs.unrecorded_pending.set(4)
    sibling = SiblingSamples()
    sibling.update(1, theirs.render()[0].decode())
    text, _ = ours.render(sibling)
    families = list(text_string_to_metric_families(text.decode()))
    assert len({f.name for f in families}) == len(families)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    base = (("context", "full"), ("model", "claude"), ("provider", "anthropic"), ("route", "/v1/messages"))
    assert samples[("gateway_requests_total", (*base, ("status", "200")))] == 5
    odd = (("context", "full"), ("model", 'a "quoted" \\ model'), ("provider", "anthropic"),
           ("route", "/v1/messages"), ("status", "400"))
    assert samples[("gateway_requests_total", odd)] == 1
    assert samples[("gateway_overhead_seconds_count", ())] == 2
    assert samples[("gateway_overhead_seconds_bucket", (("le", "0.00025"),))] == 1
    assert samples[("gateway_overhead_seconds_bucket", (("le", "+Inf"),))] == 2
    assert samples[("gateway_unrecorded_pending", ())] == 4
    # Restarted (another pid), counting from 0 again: what it had counted stays; gauges are its latest.
    again = Metrics()
    again.requests.labels("/v1/messages", "full", "200", "anthropic", "claude").inc()
    sibling.update(2, again.render()[0].decode())
    sibling.update(2, "not an exposition {")  # a garbled one changes nothing
    text, _ = ours.render(sibling)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert samples[("gateway_requests_total", (*base, ("status", "200")))] == 6
    assert samples[("gateway_unrecorded_pending", ())] == 0


async def _raw_post(port: int, head: bytes, parts: list[tuple[float, bytes]], hang_up: bool) -> bytes:
    """A POST written by hand: each part after its delay; then the answer, or a hang-up mid-body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    for delay, part in parts:
        await asyncio.sleep(delay)
        writer.write(part)
        await writer.drain()
    if hang_up:
        await asyncio.sleep(0.3)
        writer.close()
        return b""
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


async def _prompt_400(port: int, head: bytes, parts: list[tuple[float, bytes]]) -> None:
    t0 = time.monotonic()
    answer = await _raw_post(port, head, parts, hang_up=False)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert time.monotonic() - t0 < 10
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "invalid_request_error" and "could not be read" in error["message"]


async def test_a_body_that_cannot_be_read_is_a_400_or_a_499_and_leaves_no_mark(tmp_path: Path,
                                                                               redis_process: RedisProcess) -> None:
    """Corrupt gzip in a request body, at once or after 100 KB of good data (relayed by then), or a
    broken chunk-size line after 100 KB: a prompt 400 in the caller's format, not a 500 nor a wait for
    the offload process's body timeout. A client that hangs up mid-body (declared length or chunked):
    a 499 in the log, no unhandled error. Neither leaves a relay's call mark behind, nor reaches the
    provider."""
    async with FakeUpstream(reply="ok") as fake, gateway(tmp_path, redis_process, fake) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        marks = os.path.dirname(_socket_of(await gw.offload_pid()))
        raw = json.dumps({"model": "gpt-4o", "messages": [
            {"role": "user", "content": "hi " + "".join(f"{i:07d}" for i in range(60_000))}]}).encode()
        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        good = z.compress(raw[:100_000]) + z.flush(zlib.Z_SYNC_FLUSH)
        bad = b"\xff" * 64 + b"garbage" * 1000
        for parts in ([(0, b"\x1f\x8b\x08\x00" + b"garbage-not-deflate" * 10)], [(0, good), (0.5, bad)]):
            size = sum(len(p) for _, p in parts)
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nX-Conversation-Id: bad-gz\r\n"
                    + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % size)
            await _prompt_400(port, head, parts)
        # A chunk-size line that is not hex, after 100 KB of good chunks (relayed by then).
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nContent-Type: application/json\r\nX-Conversation-Id: bad-chunk\r\n"
                + b"Transfer-Encoding: chunked\r\n\r\n")
        await _prompt_400(port, head, [(0, b"%x\r\n%s\r\n" % (100_000, raw[:100_000])), (0.5, b"zz-not-a-size\r\n")])
        for chunked in (False, True):
            body = json.dumps({"model": "gpt-4o", "messages": _history(11, 12_000)}).encode()
            framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nContent-Type: application/json\r\nX-Conversation-Id: left\r\n" + framing + b"\r\n\r\n")
            part = body[:len(body) // 2]
            await _raw_post(port, head, [(0, b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)], hang_up=True)
        def relayed(status: int) -> list[dict[str, Any]]:  # (the relay's own lines: no conversation read yet)
            return [ln for ln in gw.lines() if ln.get("event") == "request" and ln.get("route") == "offload"
                    and ln.get("process_role") is None and ln["status"] == status]

        # The offload process had the hung-up requests: it logs and counts them, the relay does not again.
        assert await _eventually(lambda: len(gw.requests("left")) == 2)
        assert all(ln["status"] == 499 for ln in gw.requests("left")) and relayed(499) == []
        assert len(relayed(400)) == 3
        assert not [ln for ln in gw.lines() if ln.get("event") == "unhandled_error"]
        assert [n for n in os.listdir(marks) if n.startswith("pending-")] == []
        assert fake.requests == []


async def test_a_compressed_answer_keeps_its_content_encoding_when_relayed(tmp_path: Path,
                                                                          redis_process: RedisProcess) -> None:
    """A provider that compresses its answer although asked not to (in an encoding the gateway does not
    decode): the bytes go to the client as they came, and so must their Content-Encoding, whether the
    request was relayed or not."""
    async with FakeUpstream(reply="ok", extra_headers={"Content-Encoding": "br"}) as fake, \
            gateway(tmp_path, redis_process, fake) as gw, aiohttp.ClientSession(auto_decompress=False) as http:
        seen = []
        for n in (11, 1):  # over the threshold (relayed), then under it
            async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-4o",
                                                                        "messages": _history(n, 12_000)},
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                seen.append((r.headers.get("Content-Encoding"), await r.read()))
        assert [encoding for encoding, _ in seen] == ["br", "br"]
        assert [json.loads(body)["choices"][0]["message"]["content"] for _, body in seen] == ["ok", "ok"]
        assert len(fake.requests) == 2
