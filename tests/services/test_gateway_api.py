"""The gateway's HTTP API in-process: the real app (create_app) over the in-process engines, driven through httpx's
ASGI transport. Greedy outputs are checked against the round loop run directly on the same engines."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from protos.types import SamplingParams
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.generation import make_request
from gateway.detokenize import IncrementalDetokenizer, StopStrings
from gateway.health import Backends
from gateway.metrics import PHASES, Metrics
from gateway.rounds import Round, Speculation
from tests.conftest import make_drafter
from verify_server.verify import VerifyEngine
from tests.gateway_support import (MAX_CONTEXT, ServiceVerifier, chat_ids, events, local_backends, make_chat_target,
                                   metric, reference)

pytestmark = pytest.mark.anyio
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("chat_target"))


@pytest.fixture(scope="module")
def tokenizer(target: Path):
    return AutoTokenizer.from_pretrained(target, local_files_only=True)


@pytest.fixture(scope="module")
def module_backends(target: Path, tmp_path_factory) -> Backends:
    return local_backends(target, make_drafter(tmp_path_factory.mktemp("drafter")))


@pytest.fixture
def backends(module_backends: Backends) -> Backends:
    module_backends.verifier.healthy = module_backends.drafter.healthy = True
    module_backends.drafter.broken = False
    return module_backends


@asynccontextmanager
async def gateway(target: Path, backends: Backends, **config) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(GatewayConfig(target=str(target), **config), backends)
    async with app.router.lifespan_context(app):
        await app.state.service.monitor.check()  # do not wait for the monitor's first round
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            client.service = app.state.service
            yield client


@pytest.mark.parametrize("mode", ["ddtree", "chain", "off"])
async def test_chat_greedy_equals_in_process_loop(target, backends, tokenizer, mode) -> None:
    text, tokens, finish = await reference(backends, tokenizer, chat_ids(tokenizer, HELLO), 40)
    async with gateway(target, backends) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": HELLO, "max_tokens": 40, "temperature": 0, "speculation": {"mode": mode}})
        drafts = metric((await client.get("/metrics")).text, "ddtree_spec_drafts_total")
    assert r.status_code == 200, r.text
    assert (drafts > 0) == (mode != "off")
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == finish
    assert body["usage"] == {"prompt_tokens": len(chat_ids(tokenizer, HELLO)), "completion_tokens": len(tokens),
                             "total_tokens": len(chat_ids(tokenizer, HELLO)) + len(tokens)}


async def test_seeded_sampling_is_the_in_process_loop_with_the_same_parameters(target, backends, tokenizer) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    text, _, _ = await reference(backends, tokenizer, chat_ids(tokenizer, HELLO), 30, Speculation("ddtree", 8), params)
    request = {"model": "tiny", "messages": HELLO, "max_tokens": 30, "temperature": 0.9, "top_k": 20, "top_p": 0.95,
               "seed": 7, "speculation": {"mode": "ddtree", "budget": 8}}
    async with gateway(target, backends) as client:
        replies = [await client.post("/v1/chat/completions", json=request) for _ in range(2)]
        other_seed = await client.post("/v1/chat/completions", json={**request, "seed": 8})
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == [text, text]
    assert other_seed.json()["choices"][0]["message"]["content"] != text


async def test_a_seed_fixes_the_text_in_every_mode_alone_and_among_others(target, backends, tokenizer) -> None:
    """A seeded sampled request's text is its prompt's and seed's alone: the same in AR, chain and ddtree of any
    budget run directly on the engines, and through the gateway among 12 concurrent requests of every mode, greedy
    and sampled with other seeds, each of which also gets its own text alone."""
    prompt = chat_ids(tokenizer, HELLO)
    specs = [Speculation("ar"), Speculation("chain"), Speculation("ddtree", 3), Speculation("ddtree", 16)]
    kinds = [SamplingParams(temperature=0.9, seed=21), SamplingParams(temperature=0.8, top_p=0.9, seed=5)]
    for params in kinds:
        texts = [(await reference(backends, tokenizer, prompt, 40, spec, params))[1] for spec in specs]
        assert len(texts[0]) >= 10 and all(text == texts[0] for text in texts), texts
    alone = [(await reference(backends, tokenizer, prompt, 40, Speculation("ar"), SamplingParams(temperature=0.9,
                                                                                                  seed=seed)))[0]
             for seed in range(3)]
    assert len(set(alone)) > 1  # the seed shapes the text
    modes = ["off", "chain", "ddtree"]
    bodies = [{"model": "tiny", "messages": HELLO, "max_tokens": 40, "speculation": {"mode": modes[i % 3], "budget": 4 + i},
               **({"temperature": 0.9, "seed": i % 3} if i % 4 else {"temperature": 0})} for i in range(12)]
    greedy = (await reference(backends, tokenizer, prompt, 40))[0]
    async with gateway(target, backends) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for body in bodies))
    got = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert got == [alone[body["seed"]] if "seed" in body else greedy for body in bodies]


async def test_chat_stream_chunks_and_usage(target, backends, tokenizer) -> None:
    text, tokens, finish = await reference(backends, tokenizer, chat_ids(tokenizer, HELLO), 30)
    async with gateway(target, backends) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": HELLO, "max_completion_tokens": 30, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    first, *content, final, usage = chunks[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == first["id"] for c in chunks[:-1])
    assert all(c["usage"] is None and c["choices"][0]["finish_reason"] is None for c in [first, *content])
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == text
    assert final["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": finish, "delta": {}}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)


async def test_stream_without_usage_has_no_usage_fields(target, backends) -> None:
    async with gateway(target, backends) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": HELLO, "max_tokens": 5, "temperature": 0, "stream": True})
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks[:-1])


async def test_completions_stream_and_not(target, backends, tokenizer) -> None:
    prompt = "once upon a time"
    text, tokens, finish = await reference(backends, tokenizer, tokenizer(prompt)["input_ids"], 25)
    async with gateway(target, backends) as client:
        whole = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 25,
                                                           "temperature": 0})
        streamed = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 25,
                                                              "temperature": 0, "stream": True})
        default = await client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                                             "temperature": 0})
    assert whole.json()["choices"][0]["text"] == text and whole.json()["object"] == "text_completion"
    assert whole.json()["choices"][0]["finish_reason"] == finish
    chunks = events(streamed.text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == text
    assert chunks[-2]["choices"][0]["finish_reason"] == finish
    assert default.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens for completions


async def test_stop_strings_across_token_boundaries(target, backends, tokenizer) -> None:
    text, _, _ = await reference(backends, tokenizer, chat_ids(tokenizer, HELLO), 40)
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]  # two characters are two tokens with this tokenizer
    expected = text[: text.find(stop)]
    request = {"model": "tiny", "messages": HELLO, "max_tokens": 40, "temperature": 0, "stop": ["zzzz", stop]}
    async with gateway(target, backends) as client:
        whole = await client.post("/v1/chat/completions", json=request)
        streamed = await client.post("/v1/chat/completions", json={**request, "stream": True})
        unmatched = await client.post("/v1/chat/completions", json={**request, "stop": "qqqq"})
    assert whole.json()["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": expected}}
    chunks = events(streamed.text)[1:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert unmatched.json()["choices"][0]["message"]["content"] == text


def test_incremental_detokenizer_never_splits_characters(tokenizer) -> None:
    text = "h\u00e9llo \u20ac!"  # é is two byte tokens, € three
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text and "" in pieces  # held back while a character was incomplete


def test_stop_strings_hold_back_only_possible_prefixes() -> None:
    stops = StopStrings(("abc", "xy"))
    assert stops.feed("hello a") == ("hello ", False)
    assert stops.feed("b") == ("", False)
    assert stops.feed("d x") == ("abd ", False)
    assert stops.feed("y tail") == ("", True)
    stops = StopStrings(("end",))
    assert stops.feed("the en") == ("the ", False)
    assert stops.flush() == "en"


async def test_models_and_unknown_model(target, backends) -> None:
    async with gateway(target, backends, served_model_name="served") as client:
        models = (await client.get("/v1/models")).json()
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO})
    assert [m["id"] for m in models["data"]] == ["served"] and models["object"] == "list"
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', None),
    ("not an object", "/v1/chat/completions", [1, 2], None),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     "messages"),
    ("messages as string", "/v1/chat/completions", {"model": "tiny", "messages": "hello"}, "messages"),
    ("max_tokens as string", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": -3},
     "max_tokens"),
    ("temperature as string", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": "hot"},
     "temperature"),
    ("negative temperature", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -1}, "temperature"),
    ("temperature past a double", "/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": 1e309}',
     "temperature"),
    ("top_k past int32", "/v1/completions", {"model": "tiny", "prompt": "a", "top_k": 2**31}, "top_k"),
    ("lone surrogate", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("lone surrogate in a stop string", "/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": ["\\udfff"]}',
     "stop"),
    ("top_p zero", "/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, "top_p"),
    ("stop as number", "/v1/completions", {"model": "tiny", "prompt": "a", "stop": 5}, "stop"),
    ("empty stop", "/v1/completions", {"model": "tiny", "prompt": "a", "stop": [""]}, "stop"),
    ("n past --max-n", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "n": 9}, "n"),
    ("n zero", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "n": 0}, "n"),
    ("unknown field", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "frobnicate": 1}, "frobnicate"),
    ("top_logprobs past 20", "/v1/chat/completions",
     {"model": "tiny", "messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": "tiny", "messages": HELLO, "top_logprobs": 2}, None),
    ("completions logprobs past 20", "/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 21}, "logprobs"),
    ("logit_bias id outside vocab", "/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"48": 1}},
     "logit_bias"),
    ("logit_bias key not an id", "/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"a": 1}},
     "logit_bias"),
    ("logit_bias past 100", "/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"5": 101}},
     "logit_bias"),
    ("presence_penalty past 2", "/v1/completions", {"model": "tiny", "prompt": "a", "presence_penalty": 2.5},
     "presence_penalty"),
    ("repetition_penalty zero", "/v1/completions", {"model": "tiny", "prompt": "a", "repetition_penalty": 0},
     "repetition_penalty"),
    ("min_tokens past max_tokens", "/v1/completions",
     {"model": "tiny", "prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("negative seed", "/v1/completions", {"model": "tiny", "prompt": "a", "seed": -1}, "seed"),
    ("image content", "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("stream_options without stream", "/v1/completions",
     {"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}}, None),
    ("bad speculation mode", "/v1/completions", {"model": "tiny", "prompt": "a", "speculation": {"mode": "fast"}},
     "speculation"),
    ("budget over the limit", "/v1/completions", {"model": "tiny", "prompt": "a", "speculation": {"budget": 65}},
     "speculation"),
    ("token id outside vocab", "/v1/completions", {"model": "tiny", "prompt": [3, 48]}, "prompt"),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("empty token prompt", "/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("prompt fills the context", "/v1/completions", {"model": "tiny", "prompt": [5] * MAX_CONTEXT}, "max_tokens"),
    ("prompt + max_tokens over the context", "/v1/completions",
     {"model": "tiny", "prompt": [5] * 1000, "max_tokens": 25}, "max_tokens"),
]


async def test_bad_requests_get_400_in_openai_shape_and_do_not_disturb_others(target, backends, tokenizer) -> None:
    text, _, _ = await reference(backends, tokenizer, chat_ids(tokenizer, HELLO), 20)
    good = {"model": "tiny", "messages": HELLO, "max_tokens": 20, "temperature": 0}
    async with gateway(target, backends) as client:
        for name, path, body, param in BAD_REQUESTS:
            kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = await client.post(path, **kwargs)
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], name
            assert error["type"] == "invalid_request_error" and error["param"] == param, (name, error)
        # a request in flight while bad ones arrive is untouched by them
        in_flight = asyncio.create_task(client.post("/v1/chat/completions", json=good))
        bad = [client.post("/v1/completions", json=body) for _, path, body, _ in BAD_REQUESTS if isinstance(body, dict)]
        await asyncio.gather(*bad)
        r = await in_flight
        assert r.json()["choices"][0]["message"]["content"] == text
        assert "context_length_exceeded" in (await client.post("/v1/completions", json=BAD_REQUESTS[-1][2])).text


async def test_concurrent_requests_keep_their_own_sessions(target, backends, tokenizer) -> None:
    conversations = [HELLO, [{"role": "user", "content": "what is one plus one?"}]]
    expected = [(await reference(backends, tokenizer, chat_ids(tokenizer, m), 30))[0] for m in conversations]
    async with gateway(target, backends) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": m, "max_tokens": 30, "temperature": 0, "stream": i == 0})
            for i, m in enumerate(conversations)))
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in events(replies[0].text)[:-1])
    assert [streamed, replies[1].json()["choices"][0]["message"]["content"]] == expected


class SlowlyEnding(ServiceVerifier):
    """A verifier whose sessions end a while after they are asked to, as a remote EndSession does."""

    async def end_session(self, session_id: str) -> None:
        await asyncio.sleep(0.05)
        await super().end_session(session_id)


async def test_a_finished_request_frees_its_slot_only_with_its_sessions(target, backends, tokenizer) -> None:
    """As many running requests as the verifier has session slots: a queued request starts only once the request
    before it has ended its sessions, so it never finds the verifier full (before: HTTP 500, RESOURCE_EXHAUSTED)."""
    verifier = SlowlyEnding(VerifyEngine.from_pretrained(target, max_sessions=2))
    want = (await reference(Backends(verifier, backends.drafter), tokenizer, chat_ids(tokenizer, HELLO), 8))[0]
    async with gateway(target, Backends(verifier, backends.drafter), max_running=2) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": HELLO, "max_tokens": 8, "temperature": 0, "stream": i % 2 == 0,
            "speculation": {"mode": "off"}}) for i in range(6)))
    assert [r.status_code for r in replies] == [200] * 6
    assert [r.json()["choices"][0]["message"]["content"] for r in replies[1::2]] == [want] * 3


async def test_requests_past_the_verifiers_sessions_wait(target, backends, tokenizer) -> None:
    """A verifier that holds 2 sessions (its Info says so) behind a gateway allowed 16 running requests: the
    gateway runs 2 at once and queues the rest, where their StartSession would have failed (HTTP 500)."""
    verifier = SlowlyEnding(VerifyEngine.from_pretrained(target, max_sessions=2))
    want = (await reference(Backends(verifier, backends.drafter), tokenizer, chat_ids(tokenizer, HELLO), 8))[0]
    async with gateway(target, Backends(verifier, backends.drafter), max_running=16) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": HELLO, "max_tokens": 8, "temperature": 0,
            "speculation": {"mode": "off"}}) for _ in range(5)))
        assert client.service._slots.limit == 2
    assert [r.status_code for r in replies] == [200] * 5
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == [want] * 5


async def test_health_states(target, backends) -> None:
    async with gateway(target, backends) as client:
        service = client.service
        assert (await client.get("/health")).json()["status"] == "ok"
        backends.drafter.healthy = False
        await service.monitor.check()
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "degraded" and r.json()["drafter"] == "down"
        backends.verifier.healthy = False
        await service.monitor.check()
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    backends.verifier.healthy = False
    app = create_app(GatewayConfig(target=str(target)), backends)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        await app.state.service.monitor.check()
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert (await client.get("/v1/models")).status_code == 503


async def test_drafter_failure_falls_back_and_unhealthy_drafter_is_skipped(target, backends, tokenizer) -> None:
    text, _, _ = await reference(backends, tokenizer, chat_ids(tokenizer, HELLO), 30)
    request = {"model": "tiny", "messages": HELLO, "max_tokens": 30, "temperature": 0}
    async with gateway(target, backends) as client:
        backends.drafter.broken = True  # fails at its first draft call while still reported healthy
        failed_over = await client.post("/v1/chat/completions", json=request)
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "ddtree_fallbacks_total") == 1
        assert metric(metrics, "ddtree_spec_drafts_total") == 0

        backends.drafter.healthy = False  # known down: new requests do not even try it
        await client.service.monitor.check()
        skipped = await client.post("/v1/chat/completions", json=request)
        assert metric((await client.get("/metrics")).text, "ddtree_fallbacks_total") == 1

        backends.drafter.healthy, backends.drafter.broken = True, False
        await client.service.monitor.check()
        resumed = await client.post("/v1/chat/completions", json=request)
        metrics = (await client.get("/metrics")).text
    assert [r.json()["choices"][0]["message"]["content"] for r in (failed_over, skipped, resumed)] == [text] * 3
    assert metric(metrics, "ddtree_spec_drafts_total") > 0 and metric(metrics, "ddtree_fallbacks_total") == 1


async def test_speculation_metrics_add_up(target, backends) -> None:
    async with gateway(target, backends) as client:
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 40,
                                                            "temperature": 0, "speculation": {"budget": 8}})
        text = (await client.get("/metrics")).text
    drafts = metric(text, "ddtree_spec_drafts_total")
    accepted = metric(text, "ddtree_spec_accepted_tokens_total")
    assert drafts > 0
    assert metric(text, "ddtree_spec_draft_tokens_total") == 8 * drafts
    assert metric(text, "ddtree_spec_tree_size_count") == drafts
    assert metric(text, "ddtree_spec_acceptance_length_sum") == accepted + drafts  # 1 bonus per drafted round
    by_depth = [metric(text, "ddtree_spec_accepted_tokens_per_depth_total", depth=str(d))
                for d in range(1, 9) if f'depth="{d}"' in text]
    assert sum(by_depth) == accepted and by_depth == sorted(by_depth, reverse=True)
    generated, finish = r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]
    assert metric(text, "ddtree_requests_total", finish_reason=finish) == 1
    assert metric(text, "ddtree_generation_tokens_total") == generated
    assert metric(text, "ddtree_requests_running") == 0 and metric(text, "ddtree_requests_waiting") == 0
    assert metric(text, "ddtree_time_to_first_token_seconds_count") == 1
    assert metric(text, "ddtree_inter_token_latency_seconds_count") == generated - 1  # all but the prefill's
    assert metric(text, "ddtree_backend_up", service="drafter") == 1


def test_round_phases_split_each_round_without_remainder() -> None:
    """draft, tree, verify and walk: the services' device time; server: their totals beyond it; transport: the
    rest. A round from backends that report no totals (in-process) has no server part."""
    metrics = Metrics()
    metrics.observe_round(Round(1, [1, 2, 3], 8, None, {
        "draft_s": 0.002, "tree_s": 0.001, "draft_server_s": 0.004, "verify_s": 0.005, "walk_s": 0.001,
        "verify_server_s": 0.0075, "round_s": 0.02,
    }))
    metrics.observe_round(Round(2, [4], 0, None, {"verify_s": 0.001, "round_s": 0.003}))
    text = metrics.render().decode()
    phases = {p: metric(text, "ddtree_round_phase_seconds_sum", phase=p) for p in PHASES}
    assert phases == pytest.approx({"draft": 0.002, "tree": 0.001, "verify": 0.006, "walk": 0.001, "server": 0.0025,
                                    "transport": 0.0105})
    assert sum(phases.values()) == pytest.approx(0.023)  # the two rounds' time, all of it
    counts = {p: metric(text, "ddtree_round_phase_seconds_count", phase=p) for p in PHASES}
    # draft and tree: drafted rounds
    assert counts == {"draft": 1, "tree": 1, "verify": 2, "walk": 2, "server": 2, "transport": 2}


async def test_closing_a_stream_ends_both_sessions(target, backends, tokenizer) -> None:
    async with gateway(target, backends) as client:
        service = client.service
        req = make_request(service.config, service.model, chat_ids(tokenizer, HELLO), 200, None, SamplingParams(),
                           None, None, ())
        deltas = service.generate(req)
        await anext(deltas)
        assert backends.verifier.engine.sessions and backends.drafter.engine.sessions
        await deltas.aclose()  # what the HTTP layer does when the client goes away
        for _ in range(1000):  # the cancelled round loop ends its sessions on its next scheduling
            if not backends.verifier.engine.sessions and not backends.drafter.engine.sessions:
                break
            await asyncio.sleep(0.01)
        assert not backends.verifier.engine.sessions and not backends.drafter.engine.sessions
        metrics = (await client.get("/metrics")).text
    assert metric(metrics, "ddtree_requests_total", finish_reason="abort") == 1
    assert metric(metrics, "ddtree_requests_running") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
async def test_metrics_pass_promtool(target, backends) -> None:
    async with gateway(target, backends) as client:
        await client.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 10})
        text = (await client.get("/metrics")).text
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stdout + check.stderr


def test_config_flags_default_from_env(monkeypatch, target) -> None:
    monkeypatch.setenv("DDTREE_GATEWAY_BUDGET", "12")
    monkeypatch.setenv("DDTREE_GATEWAY_SPEC_MODE", "chain")
    parser = argparse.ArgumentParser()
    GatewayConfig.add_arguments(parser)
    config = GatewayConfig.from_args(parser.parse_args(["--target", str(target), "--spec-mode", "off", "--drafter",
                                                        "none"]))
    assert (config.budget, config.spec_mode, config.drafter_address) == (12, "off", None)  # flags beat env
    with pytest.raises(ValueError, match="budget"):
        GatewayConfig(target=str(target), budget=0)


async def test_a_body_past_the_limit_gets_413_before_any_parsing(target, backends, tokenizer) -> None:
    """Declared or chunked, a body past --max-request-bytes is refused in OpenAI's shape; one at the limit is served."""
    good = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0}
    raw = json.dumps(good).encode()
    async with gateway(target, backends, max_request_bytes=len(raw)) as client:
        assert (await client.post("/v1/chat/completions", content=raw,
                                  headers={"content-type": "application/json"})).status_code == 200
        big = json.dumps({**good, "messages": [{"role": "user", "content": "x" * 2 * len(raw)}]}).encode()

        async def chunked():  # no content-length: the limit is counted as the body arrives
            for i in range(0, len(big), 64):
                yield big[i:i + 64]

        for body in (big, chunked()):
            r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"
        r = await client.post("/v1/chat/completions", json=good)  # the gateway serves on
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
