"""The verifier's KV memory as an operator limits it (`ddtree serve --kv-cache-gib`), on the tiny chat pair: sessions
hold memory for what they have committed and grow as they go; when the running requests' growth passes the limit, a
request whose step cannot get memory is resumed once another request ends (the client sees a pause, not an error),
and every greedy stream is the text it has alone."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from ddtree.cli import build_parser
from ddtree.serve import commands, free_ports
from verify_server.config import VerifyServerConfig
from tests.conftest import TARGET_LAYERS, make_drafter
from tests.gateway_support import make_chat_target, metric
from tests.services import interrupt, wait_gateway_ready
from tests.services.test_serve_stacks import MODEL, STORY, Stack, _start

ROW_BYTES = 2 * TARGET_LAYERS * 2 * 16 * 4  # a slot's K/V: K and V, layers, kv heads, head_dim (the conftest's), fp32
SPARE = 512  # rows past each cache slot for the largest padded step (step_inputs.MAX_GRAPH_NODES)
REQUESTS = 4
ANSWER = 400  # tokens: past the first cache's 256 slots
# room for every request's first cache and one grown one: the second to grow runs short
LIMIT_BYTES = REQUESTS * (256 + SPARE) * ROW_BYTES + (512 + SPARE) * ROW_BYTES + ROW_BYTES


@dataclass
class Limited(Stack):
    verify_metrics: int = 0  # the verifier's metrics port


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[Limited]:
    target = make_chat_target(tmp_path_factory.mktemp("kv_target"))
    drafter = make_drafter(tmp_path_factory.mktemp("kv_drafter"))
    (metrics_port,) = free_ports(1)
    stack = _start(target, drafter, tmp_path_factory.mktemp("kv_logs"), "kv", "--max-sessions", str(REQUESTS),
                   "--max-running", str(REQUESTS), "--kv-cache-gib", repr(LIMIT_BYTES / 2**30),
                   "--verify-metrics-port", str(metrics_port))
    stack = Limited(stack.process, stack.url, stack.log_path, metrics_port)
    try:
        wait_gateway_ready(stack.url, stack.process, stack.log)
        yield stack
    finally:
        assert interrupt(stack.process) == 0, stack.log()[-5000:]


def _verifier(stack: Limited) -> str:
    return httpx.get(f"http://127.0.0.1:{stack.verify_metrics}/metrics", timeout=10).text


def _story(stack: Stack, max_tokens: int) -> tuple[str, str]:
    reply = stack.client().chat.completions.create(model=MODEL, messages=STORY, max_tokens=max_tokens, temperature=0,
                                                   stream=False)
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def _streamed_story(stack: Stack, max_tokens: int, mode: str) -> str:
    chunks = stack.client().chat.completions.create(model=MODEL, messages=STORY, max_tokens=max_tokens, temperature=0,
                                                    stream=True, extra_body={"speculation": {"mode": mode}})
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


@pytest.mark.parametrize("mode", ["ddtree", "off"])  # rounds of trees; AR steps, submitted a step ahead
def test_requests_past_the_kv_limit_are_resumed_with_their_text(limited: Limited, mode: str) -> None:
    alone, finish = _story(limited, ANSWER)
    assert finish == "length"
    resumed_before = metric(httpx.get(f"{limited.url}/metrics", timeout=10).text, "ddtree_requests_resumed_total")
    hits_before = metric(_verifier(limited), "ddtree_verify_prefix_cache_hit_tokens_total")
    # the same request four times over: they step together, and their caches run past their first slots together
    with ThreadPoolExecutor(REQUESTS) as pool:
        texts = list(pool.map(lambda _: _streamed_story(limited, ANSWER, mode), range(REQUESTS)))
    assert texts == [alone] * REQUESTS
    resumed = metric(httpx.get(f"{limited.url}/metrics", timeout=10).text, "ddtree_requests_resumed_total")
    assert resumed > resumed_before
    verifier = _verifier(limited)
    # a request runs short past its first 256 slots, and a restart that gets memory finds those in the prefix cache,
    # all but the last partial block: it recomputes little (a restart short again at its prefill looks nothing up)
    hits = metric(verifier, "ddtree_verify_prefix_cache_hit_tokens_total") - hits_before
    assert hits >= 256 - 16
    assert 0 < metric(verifier, "ddtree_verify_kv_cache_pool_bytes") <= LIMIT_BYTES
    assert metric(verifier, "ddtree_verify_kv_cache_limit_bytes") == pytest.approx(LIMIT_BYTES, abs=1)




def test_the_limit_goes_from_serve_to_the_verifier_and_bad_values_are_refused(tmp_path) -> None:
    def verify_command(*flags: str) -> list[str]:
        return commands(build_parser().parse_args(["serve", "--drafter", "none", *flags]))["verify"]

    command = verify_command("--kv-cache-gib", "2.5")
    assert command[command.index("--kv-cache-gib") + 1] == "2.5"
    assert "--kv-cache-gib" not in verify_command()
    with pytest.raises(SystemExit, match="--kv-cache-gib"):
        verify_command("--kv-cache-gib", "0")
    sharded = verify_command("--kv-cache-gib", "1", "--tp", "2")  # on each rank alike (test_tensor_parallel.py)
    assert sharded[sharded.index("--kv-cache-gib") + 1] == "1.0"
    with pytest.raises(ValueError, match="must be > 0"):
        VerifyServerConfig(target=str(tmp_path), kv_cache_gib=-1.0)
    assert VerifyServerConfig(target=str(tmp_path), kv_cache_gib=0.5).kv_cache_bytes == 2**29
    assert VerifyServerConfig(target=str(tmp_path), kv_cache_gib=0.5, tp=2).kv_cache_bytes == 2**29
    assert VerifyServerConfig(target=str(tmp_path)).kv_cache_bytes is None
