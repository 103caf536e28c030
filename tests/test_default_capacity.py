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

pytestmark = pytest.mark.services
CLIENTS = 48


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServeStack]:
    with serve_stack(tmp_path_factory.mktemp("defaults")) as running:
        yield running


def test_48_concurrent_requests_run_at_once_at_the_defaults(stack: ServeStack) -> None:
    async def scenario() -> tuple[list[str], float, float]:
        client = openai.AsyncOpenAI(api_key="unused", base_url=f"{stack.url}/v1", max_retries=0, timeout=600)
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
