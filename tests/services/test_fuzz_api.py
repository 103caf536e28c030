"""Property-based fuzzing of the HTTP API: request bodies for /v1/chat/completions and /v1/completions that mix
valid fields with out-of-range numbers, wrong types, unknown keys, huge and negative integers, NaN-like strings,
nested garbage and unicode (lone surrogates too, through JSON escapes), sent to the real app over the in-process
engines. Whatever comes, the answer is never a 5xx, and a 4xx (or a stream's error event) is in OpenAI's error shape.

Hypothesis runs derandomized (the same cases on every run) and bounded, so CI sees one fixed, fast set of cases.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.conftest import make_drafter
from tests.gateway_support import events, local_backends, make_chat_target

EXAMPLES = 400  # per endpoint: a few seconds each on 2 cores
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values of every kind JSON can carry, and the ones parsers trip on.
HUGE = st.sampled_from([2**31, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63), -1, 0, -(10**30)])
NAN_LIKE = st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "inf", "1e999", "-0", "0x10", "", " ", "null"])
UNICODE = st.text(st.characters(codec=None, categories=["L", "M", "N", "P", "S", "Z", "C"]), max_size=12)
SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)  # lone halves: \udXXX once escaped
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), HUGE,
                    st.floats(allow_nan=False, allow_infinity=False), NAN_LIKE, UNICODE, SURROGATES)
GARBAGE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(UNICODE, inner, max_size=4)),
                       max_leaves=12)


SMALL_TOKENS = st.integers(1, 4)  # valid lengths stay short: the cases are about the answer's form, not generation
TEXT = st.one_of(st.text(max_size=16), SURROGATES, st.just(""))
# Each field's valid values (some still refused, as a stop token id outside the vocabulary is).
COMMON = {
    "max_tokens": SMALL_TOKENS,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 2),
    "logit_bias": st.dictionaries(st.integers(-3, 60).map(str), st.floats(-100, 100), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(-2, 60), max_size=3),
    "ignore_eos": st.booleans(),
    "speculation": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["ddtree", "chain", "off"]),
                                                       "budget": st.integers(1, 70)}),
    "user": TEXT,
    "metadata": st.dictionaries(st.text(max_size=4), TEXT, max_size=2),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
     "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))},
    optional={"name": TEXT, "tool_call_id": TEXT})
CHAT = ({"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
        {**COMMON, "max_completion_tokens": SMALL_TOKENS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
         "chat_template_kwargs": st.dictionaries(TEXT, SCALARS, max_size=2)})
COMPLETION = ({"prompt": st.one_of(TEXT, st.lists(st.integers(-5, 60), min_size=1, max_size=6))},
              {**COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans()})


def _bodies(fields: tuple[dict[str, st.SearchStrategy], dict[str, st.SearchStrategy]]) -> st.SearchStrategy[bytes]:
    """Request bodies, as JSON with every non-ASCII character escaped (a lone surrogate travels as its \\udXXX
    escape, as a client may send it): valid ones; valid ones with one field (or an unknown key) turned to garbage;
    ones whose every field may be garbage; and now and then no JSON object at all."""
    required, optional = fields
    names = sorted({*required, *optional, "model"})
    valid = st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": SMALL_TOKENS, **required},
                                  optional={k: v for k, v in optional.items() if k != "max_tokens"})
    one_bad = st.builds(lambda body, key, value: {**body, key: value}, valid,
                        st.one_of(st.sampled_from(names), st.text(min_size=1, max_size=8)), GARBAGE)
    anything = st.fixed_dictionaries(
        {}, optional={name: st.one_of(strategy, GARBAGE) for name, strategy in
                      {"model": st.sampled_from(["tiny", "other-model"]), **required, **optional}.items()})
    as_json = st.one_of(valid, one_bad, one_bad, anything).map(lambda body: json.dumps(body, ensure_ascii=True).encode())
    not_objects = st.one_of(GARBAGE.map(lambda value: json.dumps(value, ensure_ascii=True).encode()),
                            st.binary(max_size=40), st.just(b'{"model": "tiny", "prompt": "a", '))
    return st.one_of(as_json, as_json, as_json, as_json, not_objects)


def _assert_error_shape(payload: Any, context: str) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, context
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}, context
    assert isinstance(error["message"], str) and error["message"], context
    assert isinstance(error["type"], str), context


def _check_answer(response: httpx.Response, body: bytes) -> None:
    context = f"{response.status_code} for {body[:300]!r}: {response.text[:300]}"
    assert response.status_code < 500, context
    if response.status_code >= 400:
        _assert_error_shape(response.json(), context)
        return
    assert response.status_code == 200, context
    if response.headers["content-type"].startswith("text/event-stream"):
        chunks = events(response.text)
        assert chunks[-1] == "[DONE]", context
        for chunk in chunks[:-1]:
            if "error" in chunk:
                _assert_error_shape(chunk, context)
    else:
        assert response.json()["choices"], context


class InProcessGateway:
    """The app over the in-process engines on an event loop of its own, so hypothesis' synchronous cases can post."""

    def __init__(self, target: Path, drafter: Path) -> None:
        self.loop = asyncio.new_event_loop()
        app = create_app(GatewayConfig(target=str(target), max_n=2), local_backends(target, drafter))
        self._lifespan = app.router.lifespan_context(app)
        self.loop.run_until_complete(self._lifespan.__aenter__())
        self.loop.run_until_complete(app.state.service.monitor.check())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        self.statuses: Counter[int] = Counter()

    def post(self, path: str, body: bytes) -> httpx.Response:
        response = self.loop.run_until_complete(
            self.client.post(path, content=body, headers={"content-type": "application/json"}))
        self.statuses[response.status_code] += 1
        return response

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[InProcessGateway]:
    running = InProcessGateway(make_chat_target(tmp_path_factory.mktemp("chat_target")),
                               make_drafter(tmp_path_factory.mktemp("drafter")))
    yield running
    print(f"\nHTTP API fuzzing: {running.statuses.total()} requests, by status {dict(sorted(running.statuses.items()))}")
    running.close()


@FUZZ
@given(body=_bodies(CHAT))
def test_chat_completions_never_fail_on_any_body(gateway: InProcessGateway, body: bytes) -> None:
    _check_answer(gateway.post("/v1/chat/completions", body), body)


@FUZZ
@given(body=_bodies(COMPLETION))
def test_completions_never_fail_on_any_body(gateway: InProcessGateway, body: bytes) -> None:
    _check_answer(gateway.post("/v1/completions", body), body)


def test_the_gateway_still_serves_after_the_fuzzing(gateway: InProcessGateway) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
    response = gateway.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
