"""vLLM's request fields, endpoints and access control on the gateway, through the official `openai` client against
`ddtree draft`, `ddtree verify` and `ddtree gateway` as real processes on loopback.

The gateway runs with --api-key (from its env var), --max-n 4 and --chat-template (a template that is not the
tokenizer's, reads chat_template_kwargs' enable_thinking and renders tool calls). The target's
generation_config.json names an EOS token that its greedy reply holds, and its tokenizer counts "," as a special
token, so EOS, ignore_eos and skip_special_tokens all show in the text. Expected outputs are the target's own greedy
tokens from the in-process round loop, run without any stop token."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from protos.types import SamplingParams
from ddtree.cli import build_parser
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.detokenize import StopStrings
from gateway.health import Backends
from gateway.rounds import Speculation, run_rounds
from tests.conftest import make_drafter
from tests.gateway_support import events, local_backends, make_chat_target
from tests.services import DRAFTER_SERVICE, VERIFIER_SERVICE, free_ports, interrupt, launch, wait_gateway_ready, wait_serving

MODEL = "tiny"
KEY = "sk-test-key"
MAX_N = 4
LONG = 40  # max_tokens of the requests that run to the limit
TEMPLATE = (
    "{%- for m in messages %}"
    "{{- m.role }}{% if m.name %}{{ ' named ' + m.name }}{% endif %}"
    "{%- if m.tool_call_id %}{{ ' for ' + m.tool_call_id }}{% endif %}"
    "{%- if m.reasoning_content %}{{ ' thinking ' + m.reasoning_content }}{% endif %}{{ ' - ' + m.content + '\\n' }}"
    "{%- for c in m.tool_calls or [] %}{{ 'call ' + c.function.name + ' ' + c.function.arguments.city + '\\n' }}"
    "{%- endfor %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'assistant -' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ ' no thinking.' }}{% endif %}{{ '\\n' }}"
    "{%- endif %}"
)
COMMA = ","  # a special token of this module's tokenizer
CANDIDATES = ["hello there", "what is one plus one?", "tell me a story", "say hi", "abc"]


@dataclass
class Setup:
    url: str
    target: Path
    backends: Backends  # in-process engines of the same pair
    tokenizer: object
    messages: list[dict]  # the conversation the tests ask about
    greedy: list[int]  # its greedy reply, LONG tokens, no stop token applied
    eos: int  # generation_config.json's eos_token_id: first in `greedy` at `eos_at`
    eos_at: int

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def http(self, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if body is None:
            return httpx.get(f"{self.url}{path}", headers=headers, timeout=60)
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60)

    def text(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)


def prompt_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
                                         **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy(backends, prompt: list[int], max_tokens: int) -> list[int]:
    async def run() -> list[int]:
        rounds = [r async for r in run_rounds(backends.verifier, None, prompt, SamplingParams(), Speculation("ar"),
                                              max_tokens, [])]
        return [t for r in rounds for t in r.tokens]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("fields")
    target, drafter = make_chat_target(root / "target"), make_drafter(root / "drafter")
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|mask|>", COMMA]})
    tokenizer.save_pretrained(target)
    comma = tokenizer.convert_tokens_to_ids(COMMA)
    backends = local_backends(target, drafter)
    # the first conversation whose greedy reply holds the special token and a plain character to make the EOS
    for content in CANDIDATES:
        messages = [{"role": "user", "content": content}]
        tokens = greedy(backends, prompt_ids(tokenizer, messages), LONG)
        plain = [i for i, t in enumerate(tokens) if 6 <= i < 30 and tokens.index(t) == i and 4 <= t <= 32]
        if comma in tokens and plain:
            break
    else:
        raise AssertionError("no candidate conversation fits")
    eos_at = plain[0]
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[eos_at]]}))
    template = root / "template.jinja"
    template.write_text(TEMPLATE)

    logs = root / "logs"
    logs.mkdir()
    draft, draft_metrics, verify, verify_metrics, port = free_ports(5)
    dtype = ["--dtype", "float32"]
    services = [launch(DRAFTER_SERVICE, ["ddtree.cli", "draft", "--target", str(target), "--drafter", str(drafter),
                                         *dtype], (draft, draft_metrics), logs),
                launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(target), "--model-name", MODEL,
                                          "--drafter", f"127.0.0.1:{draft}", *dtype], (verify, verify_metrics), logs)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DDTREE_GATEWAY_API_KEY", KEY)
        with open(logs / "gateway.log", "w") as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "ddtree.cli", "gateway", "--target", str(target), "--host", "127.0.0.1",
                 "--port", str(port), "--verifier", f"127.0.0.1:{verify}", "--drafter", f"127.0.0.1:{draft}",
                 "--health-interval", "0.5", "--max-n", str(MAX_N), "--chat-template", str(template)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(*services)
        wait_gateway_ready(url, gateway, lambda: (logs / "gateway.log").read_text())
        yield Setup(url, target, backends, tokenizer, messages, tokens, tokens[eos_at], eos_at)
    finally:
        interrupt(gateway)
        for service in services:
            service.stop()


def chat(setup: Setup, **kwargs):
    return setup.client().chat.completions.create(model=MODEL, messages=setup.messages, **{"temperature": 0, **kwargs})


def test_unknown_fields_get_400_naming_them(setup) -> None:
    client = setup.client()
    for body, param in [({"frobnicate": 1}, "frobnicate"), ({"stream_options": {"x": 1}, "stream": True},
                                                            "stream_options.x")]:
        with pytest.raises(openai.BadRequestError) as info:
            chat(setup, max_tokens=4, extra_body=body)
        error = info.value.response.json()["error"]
        assert error == {"message": f"Unrecognized request argument supplied: {param}",
                         "type": "invalid_request_error", "param": param, "code": None}
    with pytest.raises(openai.BadRequestError, match="messages.0.colour"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a", "colour": "red"}])
    for refused in ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]},
                    {"response_format": {"type": "json_schema"}}, {"tool_choice": "required"}, {"store": True}):
        with pytest.raises(openai.BadRequestError) as info:
            chat(setup, max_tokens=4, extra_body=refused)
        assert info.value.response.json()["error"]["param"] == next(iter(refused))
    # fields that describe the caller are accepted and change nothing
    plain = chat(setup, max_tokens=8)
    tagged = chat(setup, max_tokens=8, user="someone", metadata={"team": "x"}, store=False, service_tier="auto")
    assert tagged.choices[0].message.content == plain.choices[0].message.content


def test_generation_config_eos_stops_and_ignore_eos_runs_on(setup) -> None:
    stopped = chat(setup, max_tokens=LONG)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == setup.text(setup.greedy[:setup.eos_at])  # EOS's text left out
    assert stopped.usage.completion_tokens == setup.eos_at + 1
    ignored = chat(setup, max_tokens=LONG, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.choices[0].message.content == setup.text(setup.greedy)
    kept = chat(setup, max_tokens=LONG, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == setup.text(setup.greedy[:setup.eos_at + 1])


def test_stop_token_ids(setup) -> None:
    at = next(i for i, t in enumerate(setup.greedy) if i >= 2 and setup.greedy.index(t) == i and 4 <= t <= 32)
    assert at < setup.eos_at
    token = setup.greedy[at]
    reply = chat(setup, max_tokens=LONG, extra_body={"stop_token_ids": [token]})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == at + 1
    assert reply.choices[0].message.content == setup.text(setup.greedy[:at])
    streamed = chat(setup, max_tokens=LONG, stream=True, extra_body={"stop_token_ids": [token],
                                                                      "include_stop_str_in_output": True})
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == setup.text(setup.greedy[:at + 1])
    assert chunks[-1].choices[0].finish_reason == "stop"
    # past EOS, with the EOS ignored
    late = setup.greedy[setup.eos_at + 1:].index(next(t for t in setup.greedy[setup.eos_at + 1:]
                                                    if t not in setup.greedy[:setup.eos_at + 1])) + setup.eos_at + 1
    reply = chat(setup, max_tokens=LONG, extra_body={"stop_token_ids": [setup.greedy[late]], "ignore_eos": True})
    assert reply.choices[0].message.content == setup.text(setup.greedy[:late])
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        chat(setup, max_tokens=4, extra_body={"stop_token_ids": [10**6]})


def test_stop_string_kept_with_include_stop_str_in_output(setup) -> None:
    text = setup.text(setup.greedy)
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    reply = chat(setup, max_tokens=LONG, stop=[stop], extra_body={"include_stop_str_in_output": True,
                                                                 "ignore_eos": True})
    assert reply.choices[0].message.content == text[:text.find(stop) + len(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_skip_special_tokens(setup) -> None:
    body = {"ignore_eos": True}
    skipped = chat(setup, max_tokens=LONG, extra_body=body).choices[0].message.content
    kept = chat(setup, max_tokens=LONG, extra_body={**body, "skip_special_tokens": False}).choices[0].message.content
    assert skipped == setup.text(setup.greedy) and COMMA not in skipped
    assert kept == setup.text(setup.greedy, skip_special_tokens=False) and COMMA in kept


def test_n_choices(setup) -> None:
    greedy = chat(setup, max_tokens=12, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {setup.text(setup.greedy[:12])}
    assert greedy.usage.completion_tokens == 3 * 12
    sampled = chat(setup, max_tokens=12, n=2, seed=5, temperature=1.0)
    alone = [chat(setup, max_tokens=12, seed=5 + i, temperature=1.0).choices[0].message.content for i in range(2)]
    assert [c.message.content for c in sampled.choices] == alone and alone[0] != alone[1]
    stream = chat(setup, max_tokens=12, n=2, seed=5, temperature=1.0, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts == alone
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens  # both choices' tokens
    with pytest.raises(openai.BadRequestError) as info:
        chat(setup, max_tokens=4, n=MAX_N + 1)
    assert info.value.response.json()["error"]["param"] == "n"


def test_api_key(setup) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        setup.client(key="wrong").chat.completions.create(model=MODEL, messages=setup.messages, max_tokens=2)
    assert info.value.response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        setup.client(key="wrong").models.list()
    assert [m.id for m in setup.client().models.list()] == [MODEL]
    for path in ("/version", "/tokenize"):
        r = setup.http(path, {"prompt": "a"} if path == "/tokenize" else None, key=None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # open by default: a load balancer's probe and Prometheus carry no key
    assert setup.http("/health", key=None).status_code == 200
    assert "ddtree_requests_total" in setup.http("/metrics", key=None).text


def test_tokenize_detokenize_version(setup) -> None:
    tok = setup.tokenizer
    r = setup.http("/tokenize", {"model": MODEL, "prompt": "once upon a time"}).json()
    assert r["tokens"] == tok("once upon a time")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0 and r["token_strs"] is None
    r = setup.http("/tokenize", {"messages": setup.messages, "return_token_strs": True}).json()
    assert r["tokens"] == prompt_ids(tok, setup.messages)  # --chat-template's rendering
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert setup.http("/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json() == {
        "prompt": tok.decode(r["tokens"])}
    assert setup.http("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert setup.http("/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    assert setup.http("/tokenize", {"prompt": "a", "messages": setup.messages}).status_code == 400
    assert setup.http("/version").json() == {"version": importlib.metadata.version("ddtree-serving")}


def test_chat_template_controls(setup) -> None:
    def rendered(body: dict) -> str:
        r = setup.http("/tokenize", body)
        assert r.status_code == 200, r.text
        return setup.tokenizer.decode(r.json()["tokens"])

    assert rendered({"messages": setup.messages}).endswith("assistant -\n")
    off = {"enable_thinking": False}
    assert rendered({"messages": setup.messages, "chat_template_kwargs": off}).endswith("assistant - no thinking.\n")
    reply = chat(setup, max_tokens=2, extra_body={"chat_template_kwargs": off})
    assert reply.usage.prompt_tokens == len(prompt_ids(setup.tokenizer, setup.messages, enable_thinking=False))
    started = [*setup.messages, {"role": "assistant", "content": "once upon"}]
    assert rendered({"messages": started, "add_generation_prompt": False, "continue_final_message": True}).endswith(
        "assistant - once upon")
    with pytest.raises(openai.BadRequestError, match="Cannot set both `continue_final_message` and "
                                                     "`add_generation_prompt` to True."):
        setup.client().chat.completions.create(model=MODEL, messages=started, extra_body={
            "continue_final_message": True})
    with pytest.raises(openai.BadRequestError) as info:
        chat(setup, extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.response.json()["error"]["param"] == "chat_template_kwargs"


def test_tool_messages_reach_the_template(setup) -> None:
    conversation = [
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
    ]
    text = setup.tokenizer.decode(setup.http("/tokenize", {"messages": conversation}).json()["tokens"])
    assert "assistant - \ncall weather paris\ntool for call1 - sunny\nassistant -\n" in text
    reply = setup.client().chat.completions.create(model=MODEL, messages=conversation, max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == len(prompt_ids(setup.tokenizer, [
        conversation[0], {**conversation[1], "content": "", "tool_calls": [{**conversation[1]["tool_calls"][0],
                                                                            "function": {"name": "weather",
                                                                                         "arguments": {"city": "paris"}}}]},
        conversation[2]]))
    bad = [conversation[0], {**conversation[1], "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "w", "arguments": "{oops"}}]}]
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        setup.client().chat.completions.create(model=MODEL, messages=bad, max_tokens=3)


def test_a_reply_echoed_back_reaches_the_template(setup) -> None:
    # clients send a reply's message back as the SDK holds it (refusal, audio... all null), with vLLM's reasoning
    # fields and names; the template gets name and reasoning_content as data
    client = setup.client()
    reply = client.chat.completions.create(model=MODEL, messages=setup.messages, max_tokens=3, temperature=0)
    said = reply.choices[0].message.content
    echoed = {**reply.choices[0].message.model_dump(), "reasoning_content": "hm"}
    conversation = [{**setup.messages[0], "name": "ann"}, echoed, {"role": "user", "content": "and?"}]
    text = setup.tokenizer.decode(setup.http("/tokenize", {"messages": conversation}).json()["tokens"])
    assert f"user named ann - {setup.messages[0]['content']}\nassistant thinking hm - " in text
    follow = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=3, temperature=0)
    assert follow.usage.prompt_tokens == len(prompt_ids(setup.tokenizer, [
        conversation[0], {"role": "assistant", "content": said, "reasoning_content": "hm"}, conversation[2]]))
    newer = [conversation[0], {"role": "assistant", "content": said, "reasoning": "hm", "refusal": None},
             conversation[2]]
    assert setup.http("/tokenize", {"messages": newer}).json()["tokens"] == prompt_ids(
        setup.tokenizer, [conversation[0], {"role": "assistant", "content": said, "reasoning_content": "hm"},
                          conversation[2]])
    for bad, param in [({"mood": "odd"}, "messages.1.mood"), ({"audio": {"id": "a"}}, "messages.1.audio"),
                       ({"reasoning": "hm", "reasoning_content": "ho"}, "messages.1")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[conversation[0], {**echoed, **bad}], max_tokens=3)
        assert param in info.value.response.json()["error"]["message"]


def test_streamed_events_carry_choice_indexes(setup) -> None:
    r = httpx.post(f"{setup.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
        "model": MODEL, "messages": setup.messages, "max_tokens": 5, "temperature": 0, "n": 2, "stream": True})
    chunks = events(r.text)[:-1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    for i in range(2):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in mine) == setup.text(setup.greedy[:5])
        assert mine[-1]["choices"][0]["finish_reason"] == "length"


def test_open_paths_and_key_settings(setup) -> None:
    """--open-paths '': every route needs the key, /health too; the settings are checked at startup."""

    async def health(config: GatewayConfig, headers: dict[str, str]) -> httpx.Response:
        app = create_app(config, setup.backends)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            return await client.get("/health", headers=headers)

    closed = GatewayConfig(target=str(setup.target), api_key=KEY, open_paths="")
    assert asyncio.run(health(closed, {})).status_code == 401
    assert asyncio.run(health(closed, {"Authorization": "Bearer wrong"})).json()["error"]["code"] == "invalid_api_key"
    assert asyncio.run(health(closed, {"Authorization": f"Bearer {KEY}"})).status_code == 503  # loading: no checks
    assert asyncio.run(health(GatewayConfig(target=str(setup.target)), {})).status_code == 503  # no key: open
    for bad, message in (({"api_key": ""}, "api_key"), ({"open_paths": "health"}, "open_paths"),
                         ({"chat_template": "/no/such/file"}, "chat template"), ({"max_n": 0}, "max_n")):
        with pytest.raises(ValueError, match=message):
            GatewayConfig(target=str(setup.target), **bad)


def test_serve_hands_the_key_over_by_env_not_argv() -> None:
    from ddtree.serve import commands

    gateway = commands(build_parser().parse_args(["serve", "--drafter", "none", "--api-key", KEY]))["gateway"]
    assert KEY not in gateway  # other users can read a process's arguments


def test_stop_strings_kept_when_included() -> None:
    stops = StopStrings(("abc", "xy"), include=True)
    assert stops.feed("hello ab") == ("hello ", False)
    assert stops.feed("c tail") == ("abc", True)
    stops = StopStrings(("xyz", "y"), include=True)
    assert stops.feed("ayxyz") == ("ay", True)  # the earliest match wins
