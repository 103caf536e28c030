"""Many users through `ddtree serve` on the bundled demo pair (CPU, fp32), with the step scheduler on (the default):
64 concurrent streaming requests all complete, each with the text the same request gets alone, and 16 streams at
once are verified in batches of (almost) all of them, one Step call per step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway_support import metric
from tests.services import ServeStack, serve_stack

PROMPTS = [f"Write a short note about {topic}." for topic in (
    "rivers", "stones", "light", "paper", "gardens", "windows", "silver", "music", "numbers", "mornings", "engines",
    "circles", "markets", "winter", "bridges", "letters")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServeStack]:
    with serve_stack(tmp_path_factory.mktemp("steps"), "--max-batch", "16",
                     "--max-running", "16", "--health-interval", "0.5") as running:
        yield running


def _client(stack: ServeStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="unused", base_url=f"{stack.url}/v1", max_retries=0, timeout=600)


async def _streamed(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, **extra: object) -> str:
    stream = await client.chat.completions.create(
        model=(await client.models.list()).data[0].id, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, **extra)
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


def test_64_concurrent_streams_complete_each_as_alone(stack: ServeStack) -> None:
    """Equal although busy steps verify their trees cut (load-adaptive trees): a cut tree is still a tree the
    verifier walks exactly."""
    async def scenario() -> tuple[list[str], list[str], str]:
        client = _client(stack)
        alone = [await _streamed(client, prompt, 24) for prompt in PROMPTS]
        together = await asyncio.gather(*(_streamed(client, PROMPTS[i % len(PROMPTS)], 24) for i in range(64)))
        async with httpx.AsyncClient() as http:
            verifier = (await http.get(f"{stack.verifier_metrics}/metrics")).text  # the verifier fits the trees
        return alone, together, verifier

    alone, together, verifier = asyncio.run(scenario())
    assert all(alone), "every request produced text"
    assert together == [alone[i % len(PROMPTS)] for i in range(64)]
    steps = metric(verifier, "ddtree_step_tree_nodes_count")
    cut = metric(verifier, "ddtree_step_tree_nodes_bucket", le="16.0")
    print(f"steps {steps:.0f}, cut to <= 16 nodes {cut:.0f}, mean size "
          f"{metric(verifier, 'ddtree_step_tree_nodes_sum') / steps:.1f}")
    assert cut > 0, f"no step of {steps:.0f} cut its trees below the budget"


def test_seeded_sampling_gives_the_same_text_under_load(stack: ServeStack) -> None:
    """A sampled request with a seed gets the text it gets alone while 8 greedy streams share its steps (its numbers
    are its positions', whatever size the fit cuts its trees to, and in fp32 a batched forward is the lone one's)."""
    async def scenario() -> tuple[list[str], list[str]]:
        client = _client(stack)
        model = (await client.models.list()).data[0].id

        async def sampled(i: int) -> str:
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=24, temperature=0.9,
                seed=1000 + i, stream=True)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in reply if chunk.choices])

        alone = [await sampled(i) for i in range(8)]
        mixed = await asyncio.gather(*(sampled(i) for i in range(8)),
                                     *(_streamed(client, PROMPTS[8 + i], 24) for i in range(8)))
        return alone, list(mixed[:8])

    alone, together = asyncio.run(scenario())
    assert all(alone) and len(set(alone)) > 1, "sampled texts, not all the same"
    assert together == alone


def test_ar_streams_each_equal_alone(stack: ServeStack) -> None:
    """Speculation off: greedy and seeded sampled streams, some stopped early by a stop string, are each the text
    they are alone."""
    off = {"speculation": {"mode": "off"}}

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        extra = {"temperature": 0.9, "seed": 2000 + i} if i % 4 == 3 else {"temperature": 0}
        stop = {"stop": [" the"]} if i % 5 == 4 else {}
        reply = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id, messages=[{"role": "user", "content": PROMPTS[i % 16]}],
            max_tokens=20 + i % 7, stream=True, extra_body=off, **extra, **stop)
        return "".join([chunk.choices[0].delta.content or "" async for chunk in reply if chunk.choices])

    async def scenario() -> tuple[list[str], list[str]]:
        client = _client(stack)
        alone = [await one(client, i) for i in range(32)]
        return alone, list(await asyncio.gather(*(one(client, i) for i in range(32))))

    alone, together = asyncio.run(scenario())
    assert all(alone), "every request produced text"
    assert together == alone


def test_a_steady_load_is_verified_in_steps_of_every_client(stack: ServeStack) -> None:
    """16 streams at once (fixed lengths: ignore_eos): from the moment all 16 stream until the first ends, the
    verifier's mean batch, from its own histogram, counts (nearly) every one of them."""

    async def read(http: httpx.AsyncClient) -> tuple[float, float, float]:
        verifier = (await http.get(f"{stack.verifier_metrics}/metrics")).text
        gateway = (await http.get(f"{stack.url}/metrics")).text
        # a histogram's samples appear with its first observation: none yet counts as 0
        def count(text: str, name: str, **labels: str) -> float:
            try:
                return metric(text, name, **labels)
            except KeyError:
                return 0.0

        return (count(verifier, "ddtree_verify_batch_size_count"), count(verifier, "ddtree_verify_batch_size_sum"),
                count(gateway, "ddtree_step_batch_size_count", rpc="Step"))

    async def stream(client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event) -> str:
        chunks = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id, messages=[{"role": "user", "content": prompt}],
            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
                text += chunk.choices[0].delta.content
        return text

    async def scenario() -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        client = _client(stack)
        started = [asyncio.Event() for _ in range(16)]
        streams = [asyncio.ensure_future(stream(client, PROMPTS[i], started[i])) for i in range(16)]
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(*(event.wait() for event in started))
            before = await read(http)
            await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED)
            after = await read(http)
        assert all(await asyncio.gather(*streams))
        return before, after

    before, after = asyncio.run(scenario())
    forwards, rounds, steps = (b - a for a, b in zip(before, after))
    assert forwards >= 5 and steps >= 5, f"a window of {forwards:.0f} forwards and {steps:.0f} steps"
    assert rounds / forwards >= 12, f"mean verify batch {rounds / forwards:.2f} over {forwards:.0f} forwards"


def test_streams_joining_speculating_ones_each_equal_alone(stack: ServeStack) -> None:
    """Two long greedy streams speculate alone; six more begin while they run, and the verifier chooses each step's
    speculation for the load (trees, cut trees or AR steps, counted in its histogram): every text is the one it gets
    alone."""
    long = {"ignore_eos": True}

    async def one(client: openai.AsyncOpenAI, i: int, first_token: asyncio.Event | None = None) -> str:
        reply = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id, messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=160 if i < 2 else 40, temperature=0, stream=True, extra_body=long if i < 2 else {})
        text = ""
        async for chunk in reply:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                if first_token is not None:
                    first_token.set()
        return text

    async def scenario() -> tuple[list[str], list[str], str, str]:
        client = _client(stack)
        alone = [await one(client, i) for i in range(8)]
        async with httpx.AsyncClient() as http:
            before = (await http.get(f"{stack.verifier_metrics}/metrics")).text
            started = [asyncio.Event(), asyncio.Event()]
            first = [asyncio.ensure_future(one(client, i, started[i])) for i in range(2)]
            await asyncio.gather(*(event.wait() for event in started))
            rest = await asyncio.gather(*(one(client, i) for i in range(2, 8)))
            together = [*await asyncio.gather(*first), *rest]
            after = (await http.get(f"{stack.verifier_metrics}/metrics")).text
        return alone, together, before, after

    alone, together, before, after = asyncio.run(scenario())
    assert all(alone)
    assert together == alone
    chosen = metric(after, "ddtree_step_tree_nodes_count") - metric(before, "ddtree_step_tree_nodes_count")
    assert chosen > 0, "the verifier chose no step's speculation"
