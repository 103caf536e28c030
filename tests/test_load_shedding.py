"""The gateway's waiting queue has a bound: past it new requests get 429 with Retry-After in OpenAI's shape, up
front (a stream too, before its first byte), and the requests already admitted are unharmed. In-process: the real
app over the in-process engines, through the official `openai` client on httpx's ASGI transport."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.health import Backends
from protos.types import StepResult
from tests.conftest import make_drafter
from tests.gateway_support import ServiceVerifier, local_backends, make_chat_target, metric

pytestmark = pytest.mark.anyio
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class GatedVerifier(ServiceVerifier):
    """The in-process verifier whose decode steps wait until `gate` opens: a request holds its slot meanwhile."""

    gate: asyncio.Event

    async def decode(self, session_id: str, steps: int = 1, untap: bool = False) -> StepResult:
        await self.gate.wait()
        return await super().decode(session_id, steps)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("shed_target"))


@pytest.fixture(scope="module")
def backends(target: Path, tmp_path_factory) -> Backends:
    local = local_backends(target, make_drafter(tmp_path_factory.mktemp("shed_drafter")))
    return Backends(GatedVerifier(local.verifier.engine), local.drafter)


def _gauge(service, name: str) -> float:
    return metric(service.metrics.render().decode(), name)


async def _until(condition) -> None:
    # Polled every millisecond, not every turn of the loop: a request's way in includes work on the gateway's text
    # thread (the chat template, the tokenizer), which a loop spinning on sleep(0) starves of the GIL on a busy
    # machine. The bound only ends a test that would otherwise hang.
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


async def test_a_full_waiting_queue_sheds_new_requests_with_429_and_retry_after(target, backends) -> None:
    backends.verifier.gate = asyncio.Event()
    app = create_app(GatewayConfig(target=str(target), max_running=1, max_waiting=1, spec_mode="off"), backends)
    async with app.router.lifespan_context(app):
        service = app.state.service
        await service.monitor.check()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway/v1")
        client = openai.AsyncOpenAI(api_key="unused", base_url="http://gateway/v1", http_client=http, max_retries=0)
        request = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0}
        running = asyncio.create_task(client.chat.completions.create(**request))
        await _until(lambda: _gauge(service, "ddtree_requests_running") == 1)
        waiting = asyncio.create_task(client.chat.completions.create(**request))
        await _until(lambda: _gauge(service, "ddtree_requests_waiting") == 1)
        shed = []
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(**request, stream=stream)
            shed.append(refused.value)
        backends.verifier.gate.set()
        answers = await asyncio.gather(running, waiting)
        metrics = (await http.get("http://gateway/metrics")).text
        await http.aclose()
    for error in shed:
        assert error.status_code == 429 and error.response.headers["Retry-After"] == "1"
        body = error.response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["code"] == "rate_limit_exceeded"
        assert "1 requests running, 1 waiting" in body["message"]
    assert [a.choices[0].finish_reason for a in answers] == ["length", "length"]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert metric(metrics, "ddtree_requests_shed_total", reason="queue_full") == 2


def test_max_waiting_defaults_to_four_times_max_running_and_is_checked(target, backends) -> None:
    app = create_app(GatewayConfig(target=str(target), max_running=3), backends)
    assert app.state.service.max_waiting == 12
    with pytest.raises(ValueError, match="max_waiting"):
        GatewayConfig(target=str(target), max_waiting=-1)


def test_max_client_requests_is_off_by_default_and_checked(target) -> None:
    assert GatewayConfig(target=str(target)).max_client_requests == 0
    with pytest.raises(ValueError, match="max_client_requests"):
        GatewayConfig(target=str(target), max_client_requests=-1)
