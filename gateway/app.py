"""The HTTP adapter: OpenAI-compatible routes over GatewayService. Built by `create_app`; all state is the app's."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from runtime.grammar import parse_grammar, tool_calls_grammar
from runtime.models import load_tokenizer
from gateway.auth import ApiKeyGuard
from gateway.body_limit import BodyLimit
from gateway.chat import ChatTemplateArgs, template_messages
from gateway.client_limit import ClientLimit, client_of
from gateway.choices import choice_deltas, choice_params
from gateway.config import GatewayConfig
from gateway.health import Backends
from gateway.openai_api import APIError, ChatCompletionRequest, CompletionRequest, OpenAIRequest, validation_error
from gateway.openai_responses import ResponseFormat, TokenLogprob
from gateway.generation import Delta, GenerationRequest, ModelInfo, make_request
from gateway.service import GatewayService
from gateway.tool_calls import ToolCallParser, finish_reason, parse_reply
from gateway.vllm_api import DetokenizeRequest, TokenizeRequest

DISCONNECT_POLL_S = 0.5  # how soon a non-streaming request notices its client is gone
DISTRIBUTION = "ddtree-serving"  # the package whose version GET /version reports


def create_app(config: GatewayConfig, backends: Backends, tokenizer: PreTrainedTokenizerBase | None = None) -> FastAPI:
    """The gateway app. Its lifespan starts the backend health monitor and, on shutdown, ends every request's
    sessions; the backends themselves belong to the caller, who closes them."""
    service = GatewayService(config, backends, tokenizer or load_tokenizer(config.target))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="DDTree gateway", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=config.max_request_bytes)
    if config.max_client_requests:  # outside the body limit: a client past its limit is refused before its upload
        app.add_middleware(ClientLimit, limit=config.max_client_requests,
                           shed=service.metrics.shed.labels("client_limit").inc)
    if config.api_key is not None:  # added last, so outermost: a refused request is not even size-checked
        app.add_middleware(ApiKeyGuard, key=config.api_key, open_paths=config.open_path_set)
    app.state.service = service

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own shape; OpenAI clients expect 400 and {"error": {...}}.
        return await api_error(_request, validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return await api_error(_request, APIError(exc.status_code, str(exc.detail), code=code))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request) -> Response:
        model = service.require_model(req.model)
        args = ChatTemplateArgs(req.add_generation_prompt is not False, bool(req.continue_final_message),
                                req.chat_template_kwargs or {}, req.template_tools())
        prompt = await service.off_loop(service.chat_prompt, template_messages(req.messages), args)
        await _check_grammar(service, req)
        await _check_tools(service, req)
        gens = _generations(service, req, model, prompt, client_of(http.scope), default_max_tokens=None)
        fmt = ResponseFormat(True, model.name, req.include_usage())
        tool_calls = req.max_tool_calls() if req.tool_parsing() else 0
        return await _respond(service, gens, fmt, bool(req.stream), http, tool_calls)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request) -> Response:
        model = service.require_model(req.model)
        prompt = await service.off_loop(service.text_prompt, req.prompt, model)
        await _check_grammar(service, req)
        gens = _generations(service, req, model, prompt, client_of(http.scope),
                            default_max_tokens=16)  # OpenAI's default for completions
        fmt = ResponseFormat(False, model.name, req.include_usage())
        return await _respond(service, gens, fmt, bool(req.stream), http)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = service.model
        if model is None:
            raise APIError(503, "the model is not ready; retry later", type="server_error", code="service_unavailable")
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "ddtree",
                                            "max_model_len": model.max_context}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the prompt's token ids, or the conversation's as /v1/chat/completions would render it."""
        model = service.require_model(req.model)
        if req.messages is not None:
            args = ChatTemplateArgs(req.add_generation_prompt is not False, bool(req.continue_final_message),
                                    req.chat_template_kwargs or {})
            tokens = await service.off_loop(service.chat_prompt, template_messages(req.messages), args,
                                            req.special_tokens())
        else:
            tokens = await service.off_loop(service.text_prompt, req.prompt, model, req.special_tokens())
        strs = service.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return {"count": len(tokens), "max_model_len": model.max_context, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        model = service.require_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < model.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})", param="tokens")
        return {"prompt": await service.off_loop(service.tokenizer.decode, req.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version(DISTRIBUTION)}

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.monitor.status()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _check_grammar(service: GatewayService, req: OpenAIRequest) -> None:
    """A response_format the grammar engine refuses (a bad schema) is a 400 naming the problem, before any
    session starts; parsed on the tokenizer's thread, as a large schema takes a while."""
    if req.response_format is None or req.response_format.type == "text":
        return
    try:
        await service.off_loop(parse_grammar, req.response_format.grammar())
    except ValueError as exc:
        raise APIError(400, f"response_format: {exc}", param="response_format") from None


async def _check_tools(service: GatewayService, req: ChatCompletionRequest) -> None:
    """A tool whose parameters schema the grammar engine refuses is a 400 naming it, whatever tool_choice says."""
    for i, tool in enumerate(req.tools or ()):
        function = tool.function
        try:
            await service.off_loop(parse_grammar, tool_calls_grammar([(function.name, function.parameters_schema())],
                                                                     parallel=False))
        except ValueError as exc:
            raise APIError(400, f"tools.{i}.function.parameters: {exc}", param="tools") from None


def _generations(service: GatewayService, req: OpenAIRequest, model: ModelInfo, prompt: list[int], client: str,
                 default_max_tokens: int | None) -> list[GenerationRequest]:
    """One generation per choice (n), each with its own seed when the request has one (choices.choice_params)."""
    n = req.choices()
    if n > service.config.max_n:
        raise APIError(400, f"n must be <= {service.config.max_n}, got {n}", param="n")
    spec = req.speculation
    return [make_request(
        service.config, model, prompt, req.requested_max_tokens(), default_max_tokens,
        params, spec.mode if spec else None, spec.budget if spec else None, req.stop_strings(),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False, client=client,
    ) for params in choice_params(req.sampling_params(), n)]


async def _respond(
    service: GatewayService, gens: list[GenerationRequest], fmt: ResponseFormat, stream: bool, http: Request,
    tool_calls: int | None = 0,
) -> Response:
    """tool_calls: how many tool calls each choice's text is parsed for (None: any number; 0: not parsed)."""
    service.admit(gens)  # a shed request gets its 429/503 before a stream's first byte
    if stream:
        return EventStreamResponse(_events(service, gens, fmt, tool_calls), lambda: service.dismiss(gens))
    try:
        # A non-streaming client that hangs up would otherwise keep both model services busy to the last token.
        collect = asyncio.create_task(_collect(service, gens))
        while not (await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S))[0]:
            if await http.is_disconnected():
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)  # its round loops end their sessions
                return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
    finally:
        service.dismiss(gens)
    texts, lasts, logprobs = collect.result()
    choices = []
    for i, (text, last, lps) in enumerate(zip(texts, lasts, logprobs)):
        content, calls = parse_reply(text, tool_calls) if tool_calls != 0 else (text, [])
        choices.append(fmt.choice(content, finish_reason(last.finish_reason, bool(calls)), i, lps,
                                  [c.message() for c in calls]))
    return JSONResponse(fmt.response(choices, len(gens[0].prompt), sum(d.completion_tokens for d in lasts)))


async def _collect(
    service: GatewayService, gens: list[GenerationRequest]
) -> tuple[list[str], list[Delta], list[list[TokenLogprob] | None]]:
    """Every choice's text, last delta and tokens' logprobs (None: not asked for), by choice index."""
    texts, lasts = [""] * len(gens), [Delta("")] * len(gens)
    logprobs: list[list[TokenLogprob] | None] = [None] * len(gens)
    async with aclosing(choice_deltas(service, gens)) as deltas:
        async for index, delta in deltas:
            texts[index] += delta.text
            lasts[index] = delta
            if delta.logprobs is not None:
                logprobs[index] = (logprobs[index] or []) + delta.logprobs
    return texts, lasts, logprobs


async def _events(service: GatewayService, gens: list[GenerationRequest], fmt: ResponseFormat,
                  tool_calls: int | None = 0) -> AsyncIterator[str]:
    """SSE as OpenAI sends it: per choice a role chunk (chat), content chunks (and, where tool calls are parsed,
    a chunk per call delta: a call's first, then pieces of its arguments) and a chunk with the finish reason and
    an empty delta, the choices' chunks interleaved as they come; the usage chunk (choices: [], every choice's
    tokens) when asked for, then [DONE]. A failure after the stream has started can only be reported in the
    stream, as an error event."""
    if fmt.chat:
        for index in range(len(gens)):
            yield _sse(fmt.chunk("", first=True, index=index))
    parsers = [ToolCallParser(tool_calls) for _ in gens] if tool_calls != 0 else []
    completion_tokens = 0
    try:
        async with aclosing(choice_deltas(service, gens)) as deltas:
            async for index, delta in deltas:
                text, calls = delta.text, []
                if parsers:
                    parsed = parsers[index].read(delta.text, last=delta.finish_reason is not None)
                    text, calls = parsed.text, parsed.calls
                if text or delta.logprobs:
                    yield _sse(fmt.chunk(text, index=index, logprobs=delta.logprobs))
                for call in calls:  # a chunk per call delta, as OpenAI streams them
                    yield _sse(fmt.chunk(None, index=index, tool_calls=[call.delta()]))
                if delta.finish_reason:
                    called = bool(parsers and parsers[index].calls)
                    yield _sse(fmt.chunk(None, finish_reason(delta.finish_reason, called), index=index))
                    completion_tokens += delta.completion_tokens
        if fmt.include_usage:
            yield _sse(fmt.usage_chunk(len(gens[0].prompt), completion_tokens))
    except APIError as exc:
        yield _sse(exc.body())
    yield "data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator. When the client disconnects, Starlette stops
    iterating but leaves the generator suspended; closing it is what stops the request's round loop now.
    `ended` runs once the response is over however it ends, even where the generator never began (a client gone
    before the response started)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], ended: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ended()

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
