"""One client cannot starve or stall the others, through `ddtree serve` on the demo pair (real processes on loopback,
the official `openai` client). Clients are told apart by their address: each test's clients connect from their own
loopback address (127.0.0.2 and on; Linux routes all of 127/8 to the loopback interface).

- A client that floods requests gets 429 past --max-client-requests, and another client's single request is admitted
  at its first turn rather than behind the flood.
- A 10 MB chat body is read, parsed and tokenized without holding up another client's stream, and /health answers
  while it is uploaded.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from runtime.models import resolve_pair
from tests.gateway_support import metric
from tests.services import free_ports, interrupt, wait_gateway_ready

MODEL = "demo"
CLIENT_LIMIT = 4  # --max-client-requests
STORY = [{"role": "user", "content": "tell me a story"}]
BIG_BODY_BYTES = 10 * 2**20
# Decoded autoregressively (the slowest way) and past EOS, so each request takes long enough for the scenario to
# unfold behind it: the flood's first request decodes while every other request arrives and queues.
SLOW = {"temperature": 0, "extra_body": {"ignore_eos": True, "speculation": {"mode": "off"}}}
# The gaps of another client's stream (and of /health's answers) while a big body is handled are bounded, and
# generously: the requirement is that a big body does not hold other clients up, and before bodies were parsed and
# tokenized off the event loop one held every stream for 5-12 s. A healthy gap is well under a second even on CI's
# two slow cores, where tokenizing the body shares them with the decode.
MAX_GAP_S = 3.0
DEADLINE_S = 120.0  # for a state to be reached on a slow, busy machine: a deadline, not a measurement


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    target, drafter = resolve_pair(None, None)
    (port,) = free_ports(1)
    log_path = tmp_path_factory.mktemp("client_isolation") / "serve.log"
    with open(log_path, "w") as log:
        # one request decodes at a time, so the order of completions is the order of admission; the backends'
        # health checks keep their default time limit (5 s), which a busy two-core machine parsing the big body
        # meets, so that /health reports the backends up throughout (with 0.5 s a check can miss it: 503)
        process = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "serve", str(target), "--drafter", str(drafter), "--device", "cpu",
             "--dtype", "float32", "--port", str(port), "--served-model-name", MODEL,
             "--max-running", "1", "--max-waiting", "16", "--max-client-requests", str(CLIENT_LIMIT),
             "--max-request-bytes", str(2 * BIG_BODY_BYTES)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_gateway_ready(url, process, lambda: log_path.read_text(errors="replace"))
        yield url
    finally:
        interrupt(process)


def http_from(address: str, url: str) -> httpx.AsyncClient:
    """An HTTP client whose connections come from `address`: to the gateway, a client of its own."""
    return httpx.AsyncClient(base_url=url, transport=httpx.AsyncHTTPTransport(local_address=address), timeout=120)


def openai_from(address: str, url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0,
                              http_client=http_from(address, url))


async def gauges_reach(url: str, running: int, waiting: int) -> None:
    """Until the gateway has `running` requests decoding and `waiting` queued."""
    async with httpx.AsyncClient() as http:
        for _ in range(int(DEADLINE_S / 0.05)):
            text = (await http.get(f"{url}/metrics")).text
            if (metric(text, "ddtree_requests_running"), metric(text, "ddtree_requests_waiting")) == (running, waiting):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the gateway never had {running} requests running and {waiting} waiting")


def test_a_flooding_client_gets_429s_and_another_clients_request_is_admitted_at_its_turn(url: str) -> None:
    async def scenario() -> None:
        flooder, other = openai_from("127.0.0.2", url), openai_from("127.0.0.3", url)
        finished: list[str] = []  # whose requests have completed, in order

        async def ask(client: openai.AsyncOpenAI, name: str, max_tokens: int) -> None:
            await client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=max_tokens, **SLOW)
            finished.append(name)

        flood = [asyncio.create_task(ask(flooder, "flood", 300)) for _ in range(3 * CLIENT_LIMIT)]
        # the flood's first request decodes and the next ones wait; every one past the client's limit is refused
        await gauges_reach(url, 1, CLIENT_LIMIT - 1)
        while sum(t.done() for t in flood) < 2 * CLIENT_LIMIT:  # the refused are answered at once
            await asyncio.wait([t for t in flood if not t.done()], return_when=asyncio.FIRST_COMPLETED)
        refused = [t for t in flood if t.done()]
        assert len(refused) == 2 * CLIENT_LIMIT
        for task in refused:
            error = task.exception()
            assert isinstance(error, openai.RateLimitError), error
            assert error.response.headers["Retry-After"] == "1"
            body = error.response.json()["error"]
            assert set(body) == {"message", "type", "param", "code"} and body["code"] == "rate_limit_exceeded"

        single = asyncio.create_task(ask(other, "other", 8))
        # queued behind the flood's three waiters while its first request still decodes
        await gauges_reach(url, 1, CLIENT_LIMIT)
        await single
        # In arrival order the single request would come after all four of the flood's. In turns, the flood's first
        # (decoding when it came) and the flood's next waiter (its client's turn came first) are all that go ahead.
        assert finished == ["flood", "flood", "other"]

        for task in flood:
            task.cancel()  # the flood's last two: their sessions end as a gone client's do
        await asyncio.gather(*flood, return_exceptions=True)
        await gauges_reach(url, 0, 0)
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{url}/metrics")).text
        assert metric(text, "ddtree_requests_shed_total", reason="client_limit") == 2 * CLIENT_LIMIT
        assert metric(text, "ddtree_requests_shed_total", reason="queue_full") == 0
        for client in (flooder, other):
            await client.close()

    asyncio.run(scenario())


def test_a_10_mb_body_does_not_stall_another_clients_stream(url: str) -> None:
    async def scenario() -> None:
        reader, uploader, watcher = (openai_from("127.0.0.4", url), http_from("127.0.0.5", url),
                                     http_from("127.0.0.6", url))
        words = "the quick brown fox jumps over the lazy dog, and then it rests. "
        text = words * (BIG_BODY_BYTES // len(words))
        payload = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()
        assert len(payload) >= BIG_BODY_BYTES
        health_during_upload: list[int] = []

        async def upload() -> AsyncIterator[bytes]:
            """The body in 1 MiB pieces (no content-length: the gateway counts it as it arrives); half way, /health."""
            piece = 2**20
            for i in range(0, len(payload), piece):
                if i == len(payload) // 2 // piece * piece:
                    health_during_upload.append((await watcher.get("/health")).status_code)
                yield payload[i:i + piece]

        arrivals: list[float] = []  # when each of the stream's chunks arrived
        decoding, handled = asyncio.Event(), asyncio.Event()
        stream = await reader.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2000, stream=True, **SLOW)

        async def read() -> None:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter())
                    decoding.set()

        probes: list[tuple[float, int]] = []  # (when, status) of each /health answer while the big body is handled

        async def probe() -> None:
            # /health goes on answering for the whole of the big body's handling, however long the stream lasts
            while not handled.is_set():
                status = (await watcher.get("/health")).status_code
                probes.append((time.perf_counter(), status))
                await asyncio.sleep(0.1)

        reading = asyncio.create_task(read())
        await asyncio.wait_for(decoding.wait(), DEADLINE_S)
        started = time.perf_counter()
        probing = asyncio.create_task(probe())
        answer = await uploader.post("/v1/chat/completions", content=upload(),
                                     headers={"content-type": "application/json"})
        done = time.perf_counter()
        handled.set()
        still_streaming = not reading.done()
        reading.cancel()
        await asyncio.gather(reading, probing, return_exceptions=True)
        await stream.close()
        await reader.close()
        for client in (uploader, watcher):
            await client.aclose()

        # the body was read, parsed and tokenized (all of it: the prompt is far past the context), then refused
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "context_length_exceeded"
        assert health_during_upload == [200] and probes and all(status == 200 for _, status in probes)
        marks = [started, *(t for t, _ in probes), done]
        health_gap = max(b - a for a, b in zip(marks, marks[1:]))
        assert health_gap < MAX_GAP_S, f"/health went {health_gap:.1f} s unanswered while the big body was handled"
        # the stream's gaps while it lasted: from its last chunk before the big body to its last chunk, or to the
        # body's answer where it outlasted the handling
        during = [t for t in arrivals if t >= started]
        assert during, "no chunk of the stream arrived while the big body was handled"
        marks = [max(t for t in arrivals if t < started), *during, *([done] if still_streaming else [])]
        stream_gap = max(b - a for a, b in zip(marks, marks[1:]))
        assert stream_gap < MAX_GAP_S, f"the stream stalled for {stream_gap:.1f} s while the big body was handled"

    asyncio.run(scenario())
