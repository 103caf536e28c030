"""response_format through `ddtree serve` on the demo pair, with the official `openai` client: a json_schema reply
parses and keeps to its schema; a schema the grammar engine refuses (as response_format, or as a tool's parameters)
and a json_schema without its schema are 400s naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from runtime.models import resolve_pair
from tests.services import free_ports, interrupt, wait_gateway_ready

MODEL = "demo"
SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["blue", "green", "grey"]}, "clear": {"type": "boolean"}},
          "required": ["sky", "clear"]}
QUESTION = [{"role": "user", "content": "Answer in JSON: what colour is the sky, and is it clear?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    target, drafter = resolve_pair(None, None)
    (port,) = free_ports(1)
    log_path = tmp_path_factory.mktemp("grammar_api") / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "serve", str(target), "--drafter", str(drafter), "--device", "cpu",
             "--dtype", "float32", "--port", str(port), "--health-interval", "0.5", "--served-model-name", MODEL],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_gateway_ready(url, process, lambda: log_path.read_text(errors="replace"))
        yield openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=120)
    finally:
        interrupt(process)


@pytest.mark.parametrize("mode", ["ddtree", "off"])
def test_json_schema_reply_parses(client: openai.OpenAI, mode: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=64, extra_body={"speculation": {"mode": mode}},
        response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    answer = json.loads(choice.message.content)
    assert set(answer) == {"sky", "clear"} and answer["sky"] in SCHEMA["properties"]["sky"]["enum"]
    assert isinstance(answer["clear"], bool)


def test_bad_response_formats_and_tools_are_400s(client: openai.OpenAI) -> None:
    cases = (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "colour"}}}},
         'Unsupported type "colour"'),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "colour"}}}]},
         'tools.0.function.parameters: invalid parameters schema: Unsupported type "colour"'),
    )
    for fields, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **fields)
        assert info.value.status_code == 400
