"""The gateway's core, free of HTTP: prompts, request limits, the round loop per request, text deltas.

Each request's round loop runs in its own task, fed to the request through a queue. A client that goes away
cancels that task (or it simply finishes), and run_rounds' `finally` then ends both sessions. The loop runs in
a task of its own because the HTTP side is cancelled by anyio, whose cancellation repeats at every await:
inside the request's task the session cleanup itself would be cancelled and the servers would keep the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from protos.types import SamplingParams
from gateway.admission import RunningLimit
from gateway.config import GatewayConfig
from gateway.detokenize import IncrementalDetokenizer, StopStrings
from gateway.health import BackendMonitor, Backends, DrafterBackend
from gateway.metrics import Metrics
from gateway.openai_api import APIError
from gateway.rounds import Round, Speculation, run_rounds

log = logging.getLogger("ddtree.gateway")
T = TypeVar("T")


@dataclass(frozen=True)
class ModelInfo:
    """The served model as requests see it, derived from the verifier's info."""

    name: str
    vocab_size: int
    max_context: int  # prompt + completion tokens one request may use
    max_budget: int  # tree nodes per round one request may ask for
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    spec: Speculation
    eos_ids: tuple[int, ...]
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None  # set on the last delta only
    completion_tokens: int = 0  # on the last delta: tokens generated


class GatewayService:
    def __init__(self, config: GatewayConfig, backends: Backends, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.backends = backends
        self.tokenizer = tokenizer
        self.metrics = Metrics()
        self.monitor = BackendMonitor(backends, config.health_interval, self.metrics)
        self._slots = RunningLimit(config.max_running)
        # templating and tokenizing a long prompt take long enough to stall every stream if run on the event loop;
        # one thread, because a fast tokenizer must not be used from two at once
        self._text_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._loops: set[asyncio.Task] = set()  # round loops in flight, so shutdown can end their sessions

    async def start(self) -> None:
        await self.monitor.start()

    async def stop(self) -> None:
        """Stops the health checks, cancels every round loop and waits for the loops to end their sessions."""
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(self.monitor.stop(), *self._loops, return_exceptions=True)
        self._text_thread.shutdown(wait=False)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer's thread: chat templates and tokenization (chat_prompt, text_prompt)."""
        return await asyncio.get_running_loop().run_in_executor(self._text_thread, fn, *args)

    @property
    def model(self) -> ModelInfo | None:
        """The served model; None while the gateway is loading (the verifier has not answered yet)."""
        info = self.monitor.verifier_info
        if info is None:
            return None
        # EOS as vLLM takes it: the model's eos ids plus the tokenizer's (a chat model's end-of-turn token).
        eos = set(info.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        # A session holds the sequence plus one tree (and its root) while that tree is verified.
        max_context = min(info.max_context_length, info.max_session_tokens - info.max_tree_size - 1)
        return ModelInfo(self.config.served_model_name or info.model_name, info.vocab_size, max_context,
                         min(self.config.max_budget, info.max_tree_size), tuple(sorted(eos)))

    def require_model(self, name: str) -> ModelInfo:
        model = self.model
        if model is None or not self.monitor.verifier_up:
            raise APIError(503, "the model is not ready; retry later", type="server_error", code="service_unavailable")
        if name != model.name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return model

    # ---- requests -------------------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - templates raise on conversations they do not support
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        # The template already wrote any BOS/special tokens, so none are added again.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def text_prompt(self, prompt: str | list[int], model: ModelInfo) -> list[int]:
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt)["input_ids"]
            if not prompt:
                raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
                           param="prompt")
        return list(prompt)

    def make_request(self, model: ModelInfo, prompt: list[int], max_tokens: int | None, default_max_tokens: int | None,
                     params: SamplingParams, mode: str | None, budget: int | None,
                     stop: tuple[str, ...]) -> GenerationRequest:
        """Applies the limits. max_tokens None: `default_max_tokens`, or all the context left (clamped to fit)."""
        room = model.max_context - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            wanted = max_tokens or 1
            raise APIError(400, f"This model's maximum context length is {model.max_context} tokens. However, you "
                           f"requested {len(prompt) + wanted} tokens ({len(prompt)} in the prompt, {wanted} in the "
                           "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens or room, room)
        budget = budget or min(self.config.budget, model.max_budget)
        if budget > model.max_budget:
            raise APIError(400, f"speculation.budget must be <= {model.max_budget}", param="speculation")
        mode = mode or self.config.spec_mode
        spec = Speculation("ar" if mode == "off" else mode, budget)  # type: ignore[arg-type]
        return GenerationRequest(prompt, max_tokens, params, spec, model.eos_ids, stop)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Text deltas; the last one has the finish reason. Waits for a slot (at most max_running decode at once)."""
        arrival = time.perf_counter()
        self._slots.set_limit(self._running_limit())
        self.metrics.waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            self.metrics.waiting.dec()
        self.metrics.running.inc()
        finish = "abort"  # unless the loop ends or fails: the client went away
        slot: list[asyncio.Task] = []  # the round loop, once started: it frees the slot when done
        try:
            # Closed explicitly, so a request that is given up ends its round loop now, not when collected.
            async with contextlib.aclosing(self._decode(req, arrival, slot)) as deltas:
                async for delta in deltas:
                    finish = delta.finish_reason or finish
                    yield delta
        except Exception:
            finish = "error"
            raise
        finally:
            if slot:
                # Only once the loop has ended the request's sessions: the last answer reaches the client first,
                # and the next request must not find the model services' session slots still held (with as many
                # running requests as the verifier has slots, its StartSession would fail).
                slot[0].add_done_callback(lambda _: self._slots.release())
            else:
                self._slots.release()
            self.metrics.running.dec()
            self.metrics.requests.labels(finish).inc()
            self.metrics.e2e.observe(time.perf_counter() - arrival)

    def _running_limit(self) -> int:
        """max_running, lowered to the sessions the model services hold at once (as their Info reports them):
        a request past those would fail its StartSession rather than wait."""
        limits = [self.config.max_running]
        for info in (self.monitor.verifier_info, self.monitor.drafter_info):
            if info is not None and info.max_sessions > 0:
                limits.append(info.max_sessions)
        limit = min(limits)
        if limit != self._slots.limit and limit < self.config.max_running:
            log.info("running at most %d requests at once: a model service holds %d sessions at most "
                     "(--max-running %d)", limit, limit, self.config.max_running)
        return limit

    async def _decode(
        self, req: GenerationRequest, arrival: float, started: list[asyncio.Task]
    ) -> AsyncIterator[Delta]:
        """The request's deltas from its round loop, a task of its own, which is appended to `started`."""
        queue: asyncio.Queue[Round | Exception] = asyncio.Queue()
        loop = asyncio.create_task(self._run_loop(req, queue))
        started.append(loop)
        self._loops.add(loop)
        loop.add_done_callback(self._loops.discard)
        detok, stops = IncrementalDetokenizer(self.tokenizer), StopStrings(req.stop)
        generated, last, loop_done = 0, arrival, False
        self.metrics.prompt_tokens.inc(len(req.prompt))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    loop_done = True
                    log.error("round loop failed", exc_info=item)
                    raise APIError(500, f"generation failed: {item}", type="server_error") from item
                now = time.perf_counter()
                self._observe_latency(item, now - last)
                last = now
                loop_done = item.finish_reason is not None
                text = ""
                for token in item.tokens:
                    generated += 1
                    self.metrics.generation_tokens.inc()
                    piece, matched = stops.feed(detok.add(token))
                    text += piece
                    if matched:
                        yield Delta(text, "stop", generated)
                        return
                if loop_done:
                    tail, matched = stops.feed(detok.flush())
                    yield Delta(text + tail + ("" if matched else stops.flush()),
                                "stop" if matched else item.finish_reason, generated)
                    return
                if text:
                    yield Delta(text)
        finally:
            if not loop_done:  # a finished loop is ending its sessions now: cancelling would cut that short
                loop.cancel()

    def _observe_latency(self, rnd: Round, interval: float) -> None:
        if rnd.index == 0:
            self.metrics.ttft.observe(interval)
        else:  # a round commits several tokens at once; each is credited an equal share of the wait
            for _ in rnd.tokens:
                self.metrics.itl.observe(interval / len(rnd.tokens))
        self.metrics.observe_round(rnd)

    def _drafter_for(self, req: GenerationRequest) -> DrafterBackend | None:
        """The drafter, unless the request decodes AR: by choice, because the drafter is known to be down (the
        request would otherwise pay a failed call first), or because the request exceeds the drafter's limits."""
        info = self.monitor.drafter_info
        if req.spec.mode == "ar" or not self.monitor.drafter_up or info is None:
            return None
        fits = len(req.prompt) + req.max_tokens <= info.max_session_tokens
        return self.backends.drafter if fits and req.spec.tree_shape(info.block_size)[0] <= info.max_budget else None

    async def _run_loop(self, req: GenerationRequest, queue: asyncio.Queue) -> None:
        drafter = self._drafter_for(req)
        spec = req.spec if drafter is not None else Speculation("ar", req.spec.budget)
        try:
            async for rnd in run_rounds(self.backends.verifier, drafter, req.prompt, req.params, spec, req.max_tokens,
                                        list(req.eos_ids), self.monitor.drafter_failed, self.config.prefill_chunk):
                queue.put_nowait(rnd)
        except Exception as exc:  # noqa: BLE001 - handed to the request, which answers it
            self.monitor.recheck()
            queue.put_nowait(exc)
