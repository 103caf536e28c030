"""The gateway's core, free of HTTP: prompts, request limits, the step engine for every request, text deltas.

Each admitted request submits a sequence to the one step engine (gateway/engine.py) and reads its rounds. A client
that goes away cancels its sequence; the engine ends its sessions in tasks of its own, which the HTTP side's
cancellation (anyio's repeats at every await) cannot cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
from transformers import PreTrainedTokenizerBase

from gateway.admission import RETRY_AFTER_S, RunningLimit
from gateway.chat import ChatTemplateArgs, render, warn_unrendered_tools
from gateway.config import GatewayConfig
from gateway.detokenize import TextStream
from gateway.engine import Engine
from gateway.generation import Delta, GenerationRequest, ModelInfo
from protos.types import MemoryShort
from runtime.client import BackendError
from gateway.health import BackendMonitor, Backends, DrafterBackend
from gateway.metrics import Metrics
from gateway.openai_api import APIError
from gateway.openai_responses import TokenLogprob
from gateway.sequence import Round, Sequence, Speculation

log = logging.getLogger("ddtree.gateway")
T = TypeVar("T")
# the verifier's answers when it is gone, holds no free session, or has no KV memory for a request that cannot
# resume (gateway/resume.py): the request is answered 503, not 500
UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)


class GatewayService:
    def __init__(self, config: GatewayConfig, backends: Backends, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.backends = backends
        self.tokenizer = tokenizer
        # --chat-template's text, which replaces the tokenizer's template
        self.chat_template = Path(config.chat_template).read_text() if config.chat_template else None
        warn_unrendered_tools(tokenizer, self.chat_template)
        self.metrics = Metrics()
        self.monitor = BackendMonitor(backends, config.health_interval, self.metrics)
        self._slots = RunningLimit(config.max_running)
        self.engine = Engine(backends.verifier, backends.drafter, config.max_step_tokens, self.monitor.drafter_failed,
                             self._observe_step, self.metrics.resumed.inc)
        self._closing: APIError | None = None  # set once shutdown has begun: what new requests are answered
        self._drain: asyncio.Task | None = None
        self._decoding: set[Sequence] = set()  # the running requests' sequences, for the end of a drain
        # templating and tokenizing a long prompt take long enough to stall every stream if run on the event loop;
        # one thread, because a fast tokenizer must not be used from two at once
        self._text_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def start(self) -> None:
        await self.monitor.start()
        self.engine.start()

    def drain(self, grace: float) -> None:
        """Shutdown has begun: new requests get 503, and those still waiting or running after `grace` seconds end
        with a 503 (a stream: an error event, then [DONE]), never a cut connection. Idempotent."""
        if self._closing is not None:
            return
        self._closing = APIError(503, "the server is shutting down; retry the request", type="server_error",
                                 code="service_unavailable", retry_after=RETRY_AFTER_S)
        self._drain = asyncio.create_task(self._end_in_flight(grace))

    async def _end_in_flight(self, grace: float) -> None:
        await asyncio.sleep(grace)
        ended = self._slots.waiting + len(self._decoding)
        if ended:
            log.warning("shutdown grace of %.1f s over: ending %d requests with 503", grace, ended)
            self.metrics.shed.labels("shutdown").inc(ended)
        self._slots.fail_waiters(self._closing)
        for seq in list(self._decoding):
            self.engine.cancel(seq, self._closing)  # their sessions end as a gone client's do

    async def stop(self) -> None:
        """Stops the health checks and the engine, whose sequences end their sessions."""
        if self._drain is not None:
            self._drain.cancel()
        await asyncio.gather(self.monitor.stop(), self.engine.stop(), return_exceptions=True)
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

    def require_model(self, name: str | None) -> ModelInfo:
        """The served model, once ready; `name`, where a request names one, must be its name."""
        model = self.model
        if model is None or not self.monitor.verifier_up:
            self.metrics.shed.labels("unavailable").inc()
            raise APIError(503, "the model is not ready; retry later", type="server_error", code="service_unavailable",
                           retry_after=self.retry_after_unavailable)
        if name is not None and name != model.name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return model

    # ---- requests -------------------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict[str, Any]], args: ChatTemplateArgs,
                    add_special_tokens: bool = False) -> list[int]:
        return render(self.tokenizer, self.chat_template, messages, args, add_special_tokens)

    def text_prompt(self, prompt: str | list[int], model: ModelInfo, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if not prompt:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
                           param="prompt")
        return list(prompt)

    @property
    def retry_after_unavailable(self) -> int:
        """Retry-After of a 503 while the verifier is down: about when the gateway next looks for it."""
        return max(1, math.ceil(self.config.health_interval))

    @property
    def max_waiting(self) -> int:
        return self.config.max_waiting if self.config.max_waiting is not None else 4 * self.config.max_running

    def admit(self, gens: list[GenerationRequest]) -> None:
        """Sheds a new request (its choices, `gens`) up front, before any response starts: 503 once shutdown has
        begun, 429 when those that would have to wait would take the waiting queue past max_waiting. Else each
        choice's place is reserved now, as the request's own generate takes it over only awaits later and the
        requests arriving meanwhile must count it; the caller calls `dismiss` once the request is over."""
        if self._closing is not None:
            self.metrics.shed.labels("shutdown").inc()
            raise self._closing
        self._slots.set_limit(self._running_limit())
        running, waiting = self._slots.load()
        if waiting + max(0, len(gens) - max(0, self._slots.limit - running)) > self.max_waiting:
            self.metrics.shed.labels("queue_full").inc()
            raise APIError(429, f"the server is at capacity ({running} requests running, {waiting} waiting); "
                           "retry later", type="requests", code="rate_limit_exceeded", retry_after=RETRY_AFTER_S)
        for gen in gens:
            self._slots.reserve(_ticket(gen))

    def dismiss(self, gens: list[GenerationRequest]) -> None:
        """An admitted request is over (answered, failed or gone): the places of its choices that never reached
        generate go back. Their generate, should it still begin, waits for a place as an unreserved request."""
        for gen in gens:
            self._slots.unreserve(_ticket(gen))

    def _timed_out(self) -> APIError:
        """A request past --request-timeout: 504, as a gateway answers when the servers behind it are not done in
        time. Not 503 with Retry-After: the same request would run past the same limit again."""
        return APIError(504, f"the request took longer than the server's limit of {self.config.request_timeout:g} s "
                             "(--request-timeout)", type="server_error", code="timeout")

    def _failure(self, exc: Exception) -> APIError:
        """A sequence's failure as the request's answer: 503 (with Retry-After) when the verifier is gone or out
        of sessions, else 500. Either names the call that failed."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, MemoryShort) or isinstance(exc, BackendError) and exc.code in UNAVAILABLE_CODES:
            log.warning("request failed: %s", exc)
            self.metrics.shed.labels("unavailable").inc()
            return APIError(503, f"the model is unavailable, retry later: {exc}", type="server_error",
                            code="service_unavailable", retry_after=self.retry_after_unavailable)
        log.error("generation failed", exc_info=exc)
        return APIError(500, f"generation failed: {exc}", type="server_error")

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Text deltas; the last one has the finish reason. Waits for a slot (at most max_running decode at once)."""
        arrival = time.perf_counter()
        timeout = self.config.request_timeout
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None  # on the event loop's clock
        self._slots.set_limit(self._running_limit())
        self.metrics.waiting.inc()
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire(req.client, _ticket(req))  # in turns with other clients' requests
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            self.metrics.waiting.dec()
        self.metrics.running.inc()
        finish = "abort"  # unless the sequence ends or fails: the client went away
        ended: list[asyncio.Future] = []  # the sequence's sessions' end, once submitted: it frees the slot
        try:
            # Closed explicitly, so a request that is given up ends its sequence now, not when collected.
            async with contextlib.aclosing(self._decode(req, arrival, deadline, ended)) as deltas:
                async for delta in deltas:
                    finish = delta.finish_reason or finish
                    yield delta
        except Exception:
            finish = "error"
            raise
        finally:
            if ended:
                # Only once the engine has ended the request's sessions: the last answer reaches the client first,
                # and the next request must not find the model services' session slots still held (with as many
                # running requests as the verifier has slots, its session's start would fail).
                ended[0].add_done_callback(lambda _: self._ended())
            else:
                self._ended()
            self.metrics.running.dec()
            self.metrics.requests.labels(finish).inc()
            self.metrics.e2e.observe(time.perf_counter() - arrival)

    def _ended(self) -> None:
        """A request's slot is free, for the requests that wait for one."""
        self._slots.release()

    def _running_limit(self) -> int:
        """max_running, lowered to the sessions the verifier holds at once (as its Info reports them): a request
        past those would fail its StartSession rather than wait. Not the drafter's: a request that finds its
        sessions all held decodes AR (Engine._start_drafter)."""
        info = self.monitor.verifier_info
        limit = self.config.max_running
        if info is not None and info.max_sessions > 0:
            limit = min(limit, info.max_sessions)
        if limit != self._slots.limit and limit < self.config.max_running:
            log.info("running at most %d requests at once: the verifier holds %d sessions at most "
                     "(--max-running %d)", limit, limit, self.config.max_running)
        return limit

    async def _decode(
        self, req: GenerationRequest, arrival: float, deadline: float | None, ended: list[asyncio.Future]
    ) -> AsyncIterator[Delta]:
        """The request's deltas from its sequence's rounds; the sequence's `ended` is appended to `ended`. Past the
        `deadline` (event-loop time) the request ends as a drain ends it."""
        spec = req.spec if self._drafter_for(req) is not None else Speculation("ar", req.spec.budget)
        seq = Sequence.of(req.prompt, req.params, spec, req.max_tokens, req.stop_ids)
        begun = time.perf_counter()
        self.metrics.queue_time.observe(begun - arrival)
        self.engine.submit(seq)
        self._decoding.add(seq)
        ended.append(seq.ended)
        expiry = None if deadline is None else asyncio.get_running_loop().call_at(
            deadline, lambda: self.engine.cancel(seq, self._timed_out()))
        text_stream = TextStream(self.tokenizer, req.text)
        generated, last, done = 0, arrival, False
        self.metrics.prompt_tokens.inc(len(req.prompt))
        try:
            while True:
                item = await seq.rounds.get()
                if isinstance(item, BaseException):
                    self.monitor.recheck()
                    raise self._failure(item) from item
                now = time.perf_counter()
                if item.index == 0:
                    self.metrics.prefill_time.observe(now - begun)
                self._observe_latency(item, now - last)
                last = now
                done = item.finish_reason is not None
                text = ""
                logprobs = self._token_logprobs(item)
                for i, token in enumerate(item.tokens):
                    generated += 1
                    self.metrics.generation_tokens.inc()
                    # a round cut at a stop token ends with it
                    stop_token = item.finish_reason == "stop" and i == len(item.tokens) - 1
                    piece, matched = text_stream.add(token, stop_token)
                    text += piece
                    if matched:
                        yield Delta(text, "stop", generated, None if logprobs is None else logprobs[: i + 1])
                        return
                if done:
                    tail, matched = text_stream.finish()
                    yield Delta(text + tail, "stop" if matched else item.finish_reason, generated, logprobs)
                    return
                if text or logprobs:
                    yield Delta(text, logprobs=logprobs)
        finally:
            if expiry is not None:
                expiry.cancel()
            self._decoding.discard(seq)
            self.engine.cancel(seq)  # (a finished sequence is done already)

    def _token_logprobs(self, rnd: Round) -> list[TokenLogprob] | None:
        """The round's tokens' logprobs as text; None where the request did not ask for them. A logprob too small
        for a float is sent as -9999.0, as vLLM sends it (JSON has no -inf)."""
        if rnd.logprobs is None:
            return None

        def text(token: int) -> str:
            return self.tokenizer.decode([token])

        lp = rnd.logprobs
        return [TokenLogprob(text(t), max(v, -9999.0), tuple((text(a), max(b, -9999.0)) for a, b in zip(ids, values)))
                for t, v, ids, values in zip(rnd.tokens, lp.logprobs, lp.top_ids, lp.top_logprobs)]

    def _observe_step(self, rpc: str, calls: int) -> None:
        """A step's call (Step) of `calls` sequences."""
        self.metrics.step_calls.labels(rpc).observe(calls)

    def _observe_latency(self, rnd: Round, interval: float) -> None:
        if rnd.index == 0:
            self.metrics.ttft.observe(interval)
        else:  # a round commits several tokens at once; each is credited an equal share of the wait
            for _ in rnd.tokens:
                self.metrics.itl.observe(interval / len(rnd.tokens))
        self.metrics.observe_round(rnd)

    def _drafter_for(self, req: GenerationRequest) -> DrafterBackend | None:
        """The drafter, unless the request decodes AR: by choice, because the drafter is known to be down (the
        request would otherwise pay a failed call first), or because the request exceeds the drafter's limits.
        Its text is the same either way, a seeded sampled one's too: a seed's number at each position is the
        position's alone."""
        info = self.monitor.drafter_info
        if req.spec.mode == "ar" or not self.monitor.drafter_up or info is None:
            return None
        fits = len(req.prompt) + req.max_tokens <= info.max_session_tokens
        return self.backends.drafter if fits and req.spec.tree_shape(info.block_size)[0] <= info.max_budget else None


def _ticket(gen: GenerationRequest) -> int:
    """An admitted choice's reservation (RunningLimit.reserve). By identity, unique while the choice lives: a
    request's choices may be equal, and a generation is not hashable."""
    return id(gen)
