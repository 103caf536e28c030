"""Tool calling through `ddtree serve` on the demo pair, with the official `openai` client and Qwen3's tool format
(tests/qwen3_tools.jinja as --chat-template: the demo target's own template has no tools). A named function's call
parses and its arguments keep to the function's schema, whole and streamed (the arguments in pieces that join into
the whole reply's); the call and its result sent back in the conversation get a reply; a reply constrained to calls
("required", parallel or not, or a named function) is complete calls that end by themselves, and one cut short by
max_tokens has no content; bad tools and tool choices are 400s naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from runtime.grammar import MAX_PARALLEL_CALLS
from runtime.models import resolve_pair
from tests.services import free_ports, interrupt, wait_gateway_ready

MODEL = "demo"
TEMPLATE = Path(__file__).resolve().parents[1] / "qwen3_tools.jinja"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "description": "The time now"}}]
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
MAX_CALL_TOKENS = 160  # a call of `weather` is some 50 tokens of the demo tokenizer, with room for blanks
NAMED = {"type": "function", "function": {"name": "weather"}}
MAX_CALLS_TOKENS = MAX_PARALLEL_CALLS * 100  # room for the most calls a reply makes, blanks and all
SCHEMAS = {"weather": WEATHER, "clock": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    target, drafter = resolve_pair(None, None)
    (port,) = free_ports(1)
    log_path = tmp_path_factory.mktemp("tool_calls_api") / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "serve", str(target), "--drafter", str(drafter), "--device", "cpu",
             "--dtype", "float32", "--port", str(port), "--health-interval", "0.5", "--served-model-name", MODEL,
             "--chat-template", str(TEMPLATE)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_gateway_ready(url, process, lambda: log_path.read_text(errors="replace"))
        yield openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=120)
    finally:
        interrupt(process)


def test_a_named_function_is_called_and_its_result_answered(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=MAX_CALL_TOKENS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)

    # the same call streamed: its first delta with the id and name, then its arguments piece by piece as the
    # rounds commit them, which the client joins into the whole reply's arguments
    with client.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                        temperature=0, max_tokens=MAX_CALL_TOKENS) as stream:
        pieces = [e.arguments_delta for e in stream  # the first delta's arguments "" is a piece too: left out
                  if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    (streamed_call,) = streamed.message.tool_calls
    assert streamed_call.id.startswith("call_") and streamed_call.type == "function"
    assert (streamed_call.function.name, streamed_call.function.arguments) == ("weather", call.function.arguments)
    assert len(pieces) > 1 and "".join(pieces) == call.function.arguments, pieces

    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 3, "sky": "grey"})},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=16)
    final = answer.choices[0]
    assert final.message.role == "assistant" and final.finish_reason in ("stop", "length", "tool_calls")
    assert final.message.content is not None or final.message.tool_calls
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=MAX_CALL_TOKENS,
                                           extra_body={"speculation": {"mode": "off"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    schema = {"weather": WEATHER, "clock": {"type": "object"}}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_constrained_reply_is_complete_calls_that_end(client: openai.OpenAI, tool_choice: str | dict) -> None:
    # parallel calls are allowed: the grammar still ends, after MAX_PARALLEL_CALLS calls at most, and the demo
    # model, which would go on calling, must stop there
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                           temperature=0, max_tokens=MAX_CALLS_TOKENS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    calls = choice.message.tool_calls
    assert 1 <= len(calls) <= (MAX_PARALLEL_CALLS if tool_choice == "required" else 1)
    for call in calls:
        assert call.function.name in (SCHEMAS if tool_choice == "required" else ["weather"])
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    # cut short by max_tokens in the block's opening, its header and its arguments: "length", and no content, so
    # no piece of a block; a call whose header was complete is given with what was written of its arguments
    for max_tokens in (3, 12, 45):
        cut = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                             temperature=0, max_tokens=max_tokens).choices[0]
        assert cut.finish_reason == "length" and not cut.message.content, (max_tokens, cut.message)
        assert all(c.function.name in SCHEMAS for c in cut.message.tool_calls or ())


def test_bad_tools_and_tool_choices_are_400s(client: openai.OpenAI) -> None:
    cases = (
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "radio"}}},
         "tool_choice names 'radio', which is not among the tools", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                    "minProperties": "x"}}}]},
         "tools.0.function.parameters: invalid parameters schema", "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "'weather' is defined twice", "tools"),
        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
         "response_format cannot constrain", "response_format"),
    )
    for fields, message, param in cases:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **fields)
        assert info.value.response.json()["error"]["param"] == param
