"""`ddtree serve` at its defaults (the demo pair, CPU): 48 concurrent streaming requests all run at once, none
waits for a place, and every one completes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway_support import metric
from tests.services import ServeStack, serve_stack

CLIENTS = 48


def _client(stack: ServeStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="unused", base_url=f"{stack.url}/v1", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServeStack]:
    with serve_stack(tmp_path_factory.mktemp("defaults")) as running:
        yield running


def test_48_concurrent_requests_run_at_once_at_the_defaults(stack: ServeStack) -> None:
    async def scenario() -> tuple[list[str], float, float]:
        async with _client(stack) as client:
            model = (await client.models.list()).data[0].id
            requests = [asyncio.create_task(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell a story about harbour {i}."}], max_tokens=64,
                temperature=0, extra_body={"ignore_eos": True})) for i in range(CLIENTS)]
            most_running = most_waiting = 0.0
            async with httpx.AsyncClient() as http:
                while not all(task.done() for task in requests):
                    gateway = (await http.get(f"{stack.url}/metrics")).text
                    most_running = max(most_running, metric(gateway, "ddtree_requests_running"))
                    most_waiting = max(most_waiting, metric(gateway, "ddtree_requests_waiting"))
                    await asyncio.sleep(0.02)
            answers = await asyncio.gather(*requests)
            return [answer.choices[0].finish_reason for answer in answers], most_running, most_waiting

    finishes, most_running, most_waiting = asyncio.run(scenario())
    assert finishes == ["length"] * CLIENTS
    assert most_running == CLIENTS and most_waiting == 0


def test_requests_past_the_drafters_sessions_decode_ar_and_the_drafter_stays_up(tmp_path, monkeypatch) -> None:
    """The running limit follows the verifier's sessions alone: with one drafter session slot (on a GPU its reserved
    memory may hold fewer than the verifier's), the requests that find it held decode AR with the same text, and the
    drafter is not taken for down: the next request speculates."""
    monkeypatch.setenv("DDTREE_DRAFT_MAX_SESSIONS", "1")
    with serve_stack(tmp_path) as stack:
        async def scenario() -> tuple[list[str], str, str]:
            async with _client(stack) as client:
                model = (await client.models.list()).data[0].id

                async def ask() -> str:
                    answer = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "Describe a lighthouse."}], max_tokens=48,
                        temperature=0)
                    return answer.choices[0].message.content

                alone = await ask()
                together = await asyncio.gather(*(ask() for _ in range(6)))
                async with httpx.AsyncClient() as http:
                    between = (await http.get(f"{stack.url}/metrics")).text
                    again = await ask()
                    after = (await http.get(f"{stack.url}/metrics")).text
                return [alone, *together, again], between, after

        texts, between, after = asyncio.run(scenario())
        log = stack.log()
    assert len(set(texts)) == 1 and texts[0]
    assert metric(between, "ddtree_fallbacks_total") >= 1 and "the drafter holds no more sessions" in log
    assert metric(after, "ddtree_backend_up", service="drafter") == 1
    assert "drafter is down" not in log
    rounds = "ddtree_spec_acceptance_length_count"
    assert metric(after, rounds) > metric(between, rounds)  # the last request speculated
