"""End to end: `ddtree draft`, `ddtree verify` and `ddtree gateway` as real processes on loopback (and `ddtree serve`
starting all three), on the tiny chat target. Greedy output through the services must equal the in-process loop;
a killed drafter must not change it; a client that goes away must leave no session behind on either server."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from ddtree.bench_gateway import served_model
from runtime.prefix_blocks import BLOCK_TOKENS
from tests.conftest import BLOCK, make_drafter, png_size
from tests.gateway_support import chat_ids, events, local_backends, make_chat_target, metric, reference
from tests.services import (DRAFTER_SERVICE, VERIFIER_SERVICE, Service, free_ports,
                            interrupt, launch, wait_gateway_ready, wait_serving)

STORY = [{"role": "user", "content": "tell me a story"}]  # its greedy reply runs 600 tokens without EOS
LONG = 600
MODEL = "tiny"
# the gateway plans prompts in chunks of this many tokens a step (every prompt here is longer): against the
# in-process loop's one-step prefill (`expected`), through the verifier's Step with prompt chunks (`more`) and the
# drafter's Append of each chunk's features
STEP_TOKENS = 7
DDTREE = [sys.executable, "-m", "ddtree.cli"]


@dataclass
class Services:
    drafter: Service
    verifier: Service
    gateway: subprocess.Popen
    url: str  # the gateway's
    logs: Path

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.iterdir()))

    def active_sessions(self) -> tuple[float | None, float | None]:
        return (self.drafter.metric("ddtree_draft_active_sessions"),
                self.verifier.metric("ddtree_verify_active_sessions"))


def start(name: str, cmd: list[str], logs: Path) -> subprocess.Popen:
    """A process that is not a gRPC service (the gateway, `serve`), in a session of its own like a daemon."""
    with open(logs / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return make_chat_target(tmp_path_factory.mktemp("e2e_target")), make_drafter(tmp_path_factory.mktemp("e2e_drafter"))


@pytest.fixture(scope="module")
def tokenizer(models):
    return AutoTokenizer.from_pretrained(models[0], local_files_only=True)


@pytest.fixture(scope="module")
def expected(models, tokenizer):
    """What the in-process round loop generates, per conversation, computed once."""
    backends = local_backends(*models)
    cache: dict[tuple[str, int], tuple[str, list[int], str]] = {}

    def get(messages, max_tokens: int) -> tuple[str, list[int], str]:
        key = (messages[0]["content"], max_tokens)
        if key not in cache:
            cache[key] = asyncio.run(reference(backends, tokenizer, chat_ids(tokenizer, messages), max_tokens))
        return cache[key]

    return get


@pytest.fixture(scope="module")
def services(models, tmp_path_factory) -> Iterator[Services]:
    target, drafter = models
    logs = tmp_path_factory.mktemp("e2e_logs")
    draft, draft_metrics, verify, verify_metrics, http = free_ports(5)
    # every process polls its sockets for a while after I/O (runtime/event_loop.py), as on a GPU host by default
    dtype = ["--dtype", "float32", "--busy-poll-us", "3000"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as `ddtree serve` sets it: see there
        svc = Services(
            drafter=launch(DRAFTER_SERVICE, ["ddtree.cli", "draft", "--target", str(target), "--drafter", str(drafter),
                                             "--max-batch", "4", *dtype], (draft, draft_metrics), logs),
            # every step drafts its full trees: these tests read what speculation does, which the verifier's choice of
            # each step's speculation (by this machine's timings) may skip
            verifier=launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(target), "--model-name", MODEL,
                                               "--drafter", f"127.0.0.1:{draft}", "--no-fit-trees", *dtype],
                            (verify, verify_metrics), logs),
            gateway=start("gateway", [*DDTREE, "gateway", "--target", str(target), "--host", "127.0.0.1",
                                      "--port", str(http), "--verifier", f"127.0.0.1:{verify}",
                                      "--drafter", f"127.0.0.1:{draft}", "--health-interval", "0.5",
                                      "--busy-poll-us", "3000",
                                      "--max-step-tokens", str(STEP_TOKENS)], logs),
            url=f"http://127.0.0.1:{http}", logs=logs,
        )
    try:
        wait_serving(svc.drafter, svc.verifier)  # fails fast, with its log, if one of them dies
        wait_gateway_ready(svc.url, svc.gateway, svc.output)
        yield svc
    finally:
        codes = [interrupt(svc.gateway), svc.verifier.stop()]
        svc.drafter.stop()  # the last test kills it
    assert codes == [0, 0], f"the gateway or the verifier did not shut down cleanly\n{svc.output()}"


def stream_text(lines: Iterable[str]) -> tuple[str, str | None]:
    """An SSE chat stream's lines -> (content, finish reason)."""
    text, finish = "", None
    for chunk in events("".join(f"{line}\n" for line in lines)):
        if chunk != "[DONE]" and chunk["choices"]:
            text += chunk["choices"][0]["delta"].get("content") or ""
            finish = chunk["choices"][0]["finish_reason"] or finish
    return text, finish


@pytest.mark.parametrize("mode", ["ddtree", "chain", "off"])
def test_streamed_chat_equals_in_process_loop(services, expected, tokenizer, mode) -> None:
    text, _, finish = expected(STORY, 120)
    request = {"model": MODEL, "messages": STORY, "max_tokens": 120, "temperature": 0, "stream": True,
               "speculation": {"mode": mode}}
    drafts = [metric(httpx.get(f"{services.url}/metrics").text, "ddtree_spec_drafts_total")]
    prefills = [services.verifier.metric("ddtree_verify_prefill_batch_size_sum") or 0.0]
    appends = [services.drafter.metric("ddtree_draft_requests_total", rpc="Append", code="OK") or 0.0]
    hits = [services.drafter.metric("ddtree_draft_prefix_cache_hit_tokens_total") or 0.0]
    with httpx.stream("POST", f"{services.url}/v1/chat/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        assert stream_text(r.iter_lines()) == (text, finish)
    drafts.append(metric(httpx.get(f"{services.url}/metrics").text, "ddtree_spec_drafts_total"))
    prefills.append(services.verifier.metric("ddtree_verify_prefill_batch_size_sum"))
    appends.append(services.drafter.metric("ddtree_draft_requests_total", rpc="Append", code="OK") or 0.0)
    hits.append(services.drafter.metric("ddtree_draft_prefix_cache_hit_tokens_total") or 0.0)
    assert (drafts[1] > drafts[0]) == (mode != "off")  # speculation ran through the drafter service, or not
    chunks = -(-len(chat_ids(tokenizer, STORY)) // STEP_TOKENS)
    assert chunks >= 3 and prefills[1] - prefills[0] == chunks  # a prefill in chunks, one a step
    # the drafter's prefix cache restored the context of the prompt's first `reused` positions (the same story sent
    # by an earlier test or mode): the verifier appends the features of the chunks reaching past them to the drafter
    reused = hits[1] - hits[0]
    assert reused % BLOCK_TOKENS == 0 and (reused == 0 or mode != "off")
    featured = sum(begin + STEP_TOKENS > reused for begin in range(0, chunks * STEP_TOKENS, STEP_TOKENS))
    assert appends[1] - appends[0] == (featured if mode != "off" else 0)


def test_openai_client(services, expected) -> None:
    text, tokens, finish = expected(STORY, 60)
    client = openai.OpenAI(base_url=f"{services.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=60, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"speculation": {"mode": "ddtree", "budget": 16}})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    whole = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=60, temperature=0)
    assert whole.choices[0].message.content == text and whole.usage.completion_tokens == len(tokens)
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=STORY)
    with pytest.raises(openai.BadRequestError, match="n must be <= 8"):
        client.chat.completions.create(model=MODEL, messages=STORY, n=9)


def test_logprobs_and_logit_bias_through_the_openai_client(services, expected, tokenizer) -> None:
    """The verifier service's logprobs reach the client in OpenAI's shapes: chat's tokens are the greedy output's,
    each its place's most likely; streamed chunks carry their own tokens' logprobs; completions' legacy form has
    consistent offsets and top entries. A logit_bias of 100 forces its token; bad values are 400s."""
    text, tokens, _ = expected(STORY, 30)
    client = openai.OpenAI(base_url=f"{services.url}/v1", api_key="unused", max_retries=0)
    request = dict(model=MODEL, messages=STORY, max_tokens=30, temperature=0, logprobs=True, top_logprobs=3,
                   extra_body={"speculation": {"mode": "ddtree", "budget": 16}})
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == text
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in tokens]
    for c in content:
        assert c.bytes == list(c.token.encode()) and c.logprob <= 0 and len(c.top_logprobs) == 3
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)  # greedy: the argmax
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    streamed = [entry for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    # the same tokens; their log-probabilities to float rounding (a step's forward differs in shape between the two: a
    # sequence takes AR steps while its prompt's features are on their way to the drafter)
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)

    completion = client.completions.create(model=MODEL, prompt="once upon", max_tokens=12, temperature=0, logprobs=2)
    legacy = completion.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == completion.usage.completion_tokens == 12
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(12)]
    for token, logprob, top in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs):
        assert top[token] == logprob and len(top) <= 3  # the two most likely, and the chosen token
    chunks = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=12, temperature=0,
                                            logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in parts for t in lp.tokens] == legacy.tokens
    assert [o for lp in parts for o in lp.text_offset] == legacy.text_offset

    a = tokenizer.convert_tokens_to_ids("a")
    forced = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=0,
                                            logit_bias={str(a): 100})
    assert forced.choices[0].message.content == "a" * 8
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2}, {"logit_bias": {"4800": 1}},
                {"logit_bias": {"x": 1}}, {"presence_penalty": 3}, {"min_tokens": 9, "max_tokens": 8}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=STORY, extra_body=bad)


def test_concurrent_chats_share_the_verifiers_forwards(services, expected) -> None:
    """Chats at once, in every speculation mode: each answer is what it is alone, the verifier ran some of their
    rounds (trees and AR steps together) in shared forwards, and the drafter some of their blocks."""
    chats = [([{"role": "user", "content": f"tell me story number {i}"}], mode)
             for i, mode in enumerate(("ddtree", "ddtree", "chain", "off", "ddtree", "chain"))]
    for messages, _ in chats:
        expected(messages, 60)  # computed before the clock of the requests starts

    async def ask(http: httpx.AsyncClient, messages: list, mode: str) -> str:
        request = {"model": MODEL, "messages": messages, "max_tokens": 60, "temperature": 0,
                   "speculation": {"mode": mode}}
        reply = await http.post(f"{services.url}/v1/chat/completions", json=request, timeout=120)
        return reply.json()["choices"][0]["message"]["content"]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(ask(http, messages, mode) for messages, mode in chats))

    shared = [(service, f"ddtree_{name}_batch_size") for service, name in ((services.verifier, "verify"),
                                                                             (services.drafter, "draft"))]
    before = [[service.metric(f"{sizes}_{part}") or 0.0 for part in ("sum", "count")] for service, sizes in shared]
    assert asyncio.run(all_at_once()) == [expected(messages, 60)[0] for messages, _ in chats]
    for (service, sizes), (calls, forwards) in zip(shared, before):
        after = [service.metric(f"{sizes}_{part}") for part in ("sum", "count")]
        assert after[0] - calls > after[1] - forwards, sizes  # more calls than forwards: some shared one


def test_bench_through_the_gateway(services, tmp_path) -> None:
    """`ddtree bench --gateway`: every mode through the running services, same greedy text as AR, τ from the
    gateway's counters."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (STORY, [{"role": "user", "content": "hi"}])))
    out = tmp_path / "bench.json"
    done = subprocess.run([*DDTREE, "bench", "--gateway", services.url, "--prompts", str(prompts), "--budgets", "4,16",
                           "--max-new-tokens", "24", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    # the chain's nodes a round, the drafter's block less its root, as the in-process bench reports them
    assert [(r["mode"], r["budget"]) for r in result["runs"]] == [("ar", 0), ("chain", BLOCK - 1), ("ddtree", 4),
                                                                  ("ddtree", 16)]
    assert all(r["matches_ar"] == 1.0 and r["tokens"] > 0 for r in result["runs"])
    assert result["runs"][0]["tau"] == 1.0 and all(r["tau"] >= 1.0 for r in result["runs"][1:])
    phases = result["runs"][3]["phases_ms"]
    assert set(phases) == {"draft", "tree", "verify", "walk", "server", "transport"}
    assert phases["draft"] > 0 and phases["tree"] > 0 and phases["walk"] > 0 and phases["server"] > 0
    share = 1 - (phases["draft"] + phases["verify"]) / sum(phases.values())
    assert result["runs"][3]["overhead_share"] == pytest.approx(share, abs=1e-3)  # all but the two forwards
    assert all(r["ttft_ms"] > 0 for r in result["runs"])
    assert all(r["request_ms"]["max"] >= r["request_ms"]["median"] > 0 for r in result["runs"])
    assert "ddtree16/chain" in result["ratios"]
    assert png_size(out.with_suffix(".png"))[0] > 0  # the figure beside the JSON


def test_bench_in_process(tmp_path) -> None:
    """`ddtree bench` in-process on the bundled demo pair (fp32, CPU): every mode, AR's greedy output in each, deep
    acceptance, per-phase times and the overhead share, JSON + ratios."""
    import json

    out = tmp_path / "bench.json"
    done = subprocess.run([*DDTREE, "bench", "--num-prompts", "2", "--budgets", "4,16", "--max-new-tokens", "24",
                           "--device", "cpu", "--dtype", "float32", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [(r["mode"], r["budget"]) for r in result["runs"]] == [("ar", 0), ("chain", 15), ("ddtree", 4), ("ddtree", 16)]
    assert all(r["matches_ar"] == 1.0 and r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in result["runs"])
    assert result["runs"][0]["tau"] == 1.0 and result["runs"][3]["tau"] > 2  # the demo drafter accepts deeply
    phases = result["runs"][3]["phases_ms"]
    assert set(phases) == {"draft", "tree", "verify", "walk", "other"} and phases["draft"] > 0 and phases["verify"] > 0
    assert 0 < result["runs"][3]["overhead_share"] < 1 and result["settings"]["fused_rows"] == 0  # no GPU here
    assert all(r["prefill_ms"] > 0 for r in result["runs"])
    # each mode's requests together take its seconds: two prompts, so the slowest is at least the median
    assert all(r["request_ms"]["max"] >= r["request_ms"]["median"] > 0 for r in result["runs"])
    assert all(abs(r["seconds"] * 1000 - 2 * r["request_ms"]["median"]) < 1 for r in result["runs"])
    assert result["settings"]["graphs_captured_while_timing"] == 0 and "ddtree16/ar" in result["ratios"]
    assert png_size(out.with_suffix(".png"))[0] > 0


def test_client_disconnect_frees_both_sessions(services) -> None:
    request = {"model": MODEL, "messages": STORY, "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{services.url}/v1/chat/completions", json=request, timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: a collected line iterator would close the connection early
        for line in lines:  # until the first content after the role chunk: generation is under way
            if '"content": "' in line and '"content": ""' not in line:
                break
        assert services.active_sessions() == (1, 1)
    # the connection is closed here, mid-stream; both servers must drop the session (their TTL is minutes away)
    for _ in range(300):
        if services.active_sessions() == (0, 0):
            break
        time.sleep(0.1)
    assert services.active_sessions() == (0, 0)
    assert metric(httpx.get(f"{services.url}/metrics").text, "ddtree_requests_total", finish_reason="abort") == 1


def test_non_streaming_client_disconnect_frees_both_sessions(services) -> None:
    request = {"model": MODEL, "messages": STORY, "max_tokens": LONG, "temperature": 0}
    aborted = metric(httpx.get(f"{services.url}/metrics").text, "ddtree_requests_total", finish_reason="abort") or 0
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 600 tokens are done
        httpx.post(f"{services.url}/v1/chat/completions", json=request, timeout=httpx.Timeout(60, read=1.0))
    for _ in range(300):
        if services.active_sessions() == (0, 0):
            break
        time.sleep(0.1)
    assert services.active_sessions() == (0, 0)
    assert metric(httpx.get(f"{services.url}/metrics").text, "ddtree_requests_total", finish_reason="abort") == aborted + 1


def test_killed_drafter_mid_stream_completes_autoregressively(services, expected) -> None:
    """The drafter stays dead: the last test on `services`."""
    text, _, finish = expected(STORY, LONG)
    assert finish == "length"  # the reply must outlast the kill
    request = {"model": MODEL, "messages": STORY, "max_tokens": LONG, "temperature": 0, "stream": True}
    before = metric(httpx.get(f"{services.url}/metrics").text, "ddtree_fallbacks_total")
    with httpx.stream("POST", f"{services.url}/v1/chat/completions", json=request, timeout=120) as r:
        lines = r.iter_lines()
        head = [next(lines) for _ in range(6)]  # the role chunk and a few content chunks: the rounds are drafted
        services.drafter.process.kill()
        services.drafter.process.wait()
        streamed, reason = stream_text(itertools.chain(head, lines))
    assert (streamed, reason) == (text, finish)
    gateway_metrics = httpx.get(f"{services.url}/metrics").text
    assert metric(gateway_metrics, "ddtree_fallbacks_total") == before + 1
    health = httpx.get(f"{services.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    # the benches wait for speculation: autoregressive decoding is not timed as a speculating stack's
    with pytest.raises(TimeoutError, match="degraded"):
        served_model(services.url, wait_s=1.0)


def test_serve_runs_three_services_and_stops_cleanly(models, tmp_path, expected) -> None:
    target, drafter = models
    port, *ports = free_ports(5)
    cmd = [*DDTREE, "serve", "--target", str(target), "--drafter", str(drafter), "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--draft-port", str(ports[0]), "--verify-port", str(ports[1]),
           "--draft-metrics-port", str(ports[2]), "--verify-metrics-port", str(ports[3]), "--health-interval", "0.5",
           "--served-model-name", MODEL]
    serve = start("serve", cmd, tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_gateway_ready(url, serve, lambda: (tmp_path / "serve.log").read_text())
        text, _, _ = expected(STORY, 30)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": STORY, "max_tokens": 30, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] == text
    finally:
        code = interrupt(serve)
    log = (tmp_path / "serve.log").read_text()
    assert code == 0, log
    for name in ("draft", "verify", "gateway"):
        assert f"[{name}] " in log and f"[{name}] Traceback" not in log
    # the gateway stops first (ending its sessions), then the model services, each gracefully
    finished = log.index("Finished server process")  # the gateway's (uvicorn's) last line
    assert finished < log.index("Drafter: shutting down") and finished < log.index("Verifier: shutting down")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
