"""Structured output and tool calls through `ddtree serve` (the demo pair, CPU, fp32) once its load-adaptive tree
fit has warmed up: a grammar that leaves one token drafts trees without nodes, and the fit must take such steps,
alone or beside free trees. Mixed json_schema, json_object, tool and free requests, many at once: every one
answered, every schema's answer valid."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.gateway_support import metric
from tests.services import ServeStack, serve_stack

TEMPLATE = Path(__file__).resolve().parents[1] / "qwen3_tools.jinja"
SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["blue", "green", "grey"]}, "clear": {"type": "boolean"}},
          "required": ["sky", "clear"], "additionalProperties": False}
# one value whatever the model: every token of its answer is forced, so its trees have no nodes
FORCED = {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
    "additionalProperties": False}}}]
REQUESTS = 96  # of each of the mixed kinds below, in turn
CONCURRENCY = 16


def _client(stack: ServeStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="unused", base_url=f"{stack.url}/v1", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServeStack]:
    # every request asks for speculation, so the structured ones' trees meet the fit's cut
    with serve_stack(tmp_path_factory.mktemp("structured-load"), "--max-batch", "16",
                     "--max-running", str(CONCURRENCY), "--chat-template", str(TEMPLATE)) as running:
        yield running


def _request(kind: int) -> dict:
    """The i-th request of the mixed load: json_schema, a forced json_schema, json_object, a required tool call, a
    named one, and free text, in turn."""
    base: dict = {"messages": [{"role": "user", "content": f"Request {kind}: the weather, in JSON."}],
                  "max_tokens": 40, "temperature": 0}
    choice = kind % 6
    if choice == 0:
        base["response_format"] = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}
    elif choice == 1:
        base["response_format"] = {"type": "json_schema", "json_schema": {"name": "forced", "schema": FORCED}}
    elif choice == 2:
        base["response_format"] = {"type": "json_object"}
    elif choice == 3:  # (one call: the demo model, left free, makes as many parallel calls as the grammar allows)
        base |= {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 160}
    elif choice == 4:
        base |= {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}},
                 "max_tokens": 160}
    return base


def test_structured_and_tool_requests_after_the_fit_has_warmed_up(stack: ServeStack) -> None:
    async def scenario() -> tuple[list, str]:
        async with _client(stack) as client:
            model = (await client.models.list()).data[0].id
            # free streams at once until the fit cuts trees: it has its rounds and its cost curve
            await asyncio.gather(*(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Write a note about river {i}."}], max_tokens=24,
                temperature=0) for i in range(48)))
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(kind: int) -> object:
                async with gate:
                    try:
                        return kind, await client.chat.completions.create(model=model, **_request(kind))
                    except openai.APIError as exc:
                        return kind, exc

            answers = await asyncio.gather(*(one(kind) for kind in range(REQUESTS)))
            async with httpx.AsyncClient() as http:  # the fit is the verifier's
                return answers, (await http.get(f"{stack.verifier_metrics}/metrics")).text

    answers, verifier = asyncio.run(scenario())
    assert metric(verifier, "ddtree_step_tree_nodes_bucket", le="16.0") > 0, "the fit never cut a step's trees"
    failed = [(kind, exc) for kind, exc in answers if isinstance(exc, Exception)]
    assert not failed, failed[:3]
    complete = {choice: 0 for choice in range(6)}  # answers that ended of themselves, by kind
    for kind, answer in answers:
        message, finish = answer.choices[0].message, answer.choices[0].finish_reason
        complete[kind % 6] += finish in ("stop", "tool_calls")
        if kind % 6 == 1:
            assert json.loads(message.content) == {"ok": True} and finish == "stop"
        elif kind % 6 == 0 and finish == "stop":
            jsonschema.validate(json.loads(message.content), SCHEMA)
        elif kind % 6 in (3, 4) and finish == "tool_calls":
            assert message.content is None
            for call in message.tool_calls:
                assert call.function.name == "weather"
                jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    print("answers that ended of themselves, by kind:", complete)
    # schemas and calls checked, not just sent
    assert complete[0] and complete[1] and complete[3] and complete[4], complete
    assert "tree fit could not" not in stack.log()
