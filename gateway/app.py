"""The HTTP adapter: OpenAI-compatible routes over GatewayService. Built by `create_app`; all state is the app's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Send
from transformers import PreTrainedTokenizerBase

from runtime.models import load_tokenizer
from gateway.body_limit import BodyLimit
from gateway.config import GatewayConfig
from gateway.health import Backends
from gateway.openai_api import (APIError, ChatCompletionRequest, CompletionRequest, OpenAIRequest, ResponseFormat,
                                validation_error)
from gateway.service import Delta, GatewayService, GenerationRequest, ModelInfo

DISCONNECT_POLL_S = 0.5  # how soon a non-streaming request notices its client is gone


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
    app.state.service = service

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

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
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = await service.off_loop(service.chat_prompt, messages)
        gen = _generation(service, req, model, prompt, default_max_tokens=None)
        fmt = ResponseFormat(True, model.name, req.include_usage())
        return await _respond(service, gen, fmt, bool(req.stream), http)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request) -> Response:
        model = service.require_model(req.model)
        prompt = await service.off_loop(service.text_prompt, req.prompt, model)
        gen = _generation(service, req, model, prompt, default_max_tokens=16)  # OpenAI's default for completions
        fmt = ResponseFormat(False, model.name, req.include_usage())
        return await _respond(service, gen, fmt, bool(req.stream), http)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = service.model
        if model is None:
            raise APIError(503, "the model is not ready; retry later", type="server_error", code="service_unavailable")
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "ddtree",
                                            "max_model_len": model.max_context}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.monitor.status()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _generation(service: GatewayService, req: OpenAIRequest, model: ModelInfo, prompt: list[int],
                default_max_tokens: int | None) -> GenerationRequest:
    spec = req.speculation
    return service.make_request(
        model, prompt, req.requested_max_tokens(), default_max_tokens,
        req.sampling_params(), spec.mode if spec else None, spec.budget if spec else None, req.stop_strings(),
    )


async def _respond(
    service: GatewayService, gen: GenerationRequest, fmt: ResponseFormat, stream: bool, http: Request
) -> Response:
    if stream:
        return EventStreamResponse(_events(service, gen, fmt))
    # A non-streaming client that hangs up would otherwise keep both model services busy to the last token.
    collect = asyncio.create_task(_collect(service, gen))
    while not (await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S))[0]:
        if await http.is_disconnected():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)  # its round loop ends both sessions
            return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
    text, delta = collect.result()
    return JSONResponse(fmt.response(text, delta.finish_reason, len(gen.prompt), delta.completion_tokens))


async def _collect(service: GatewayService, gen: GenerationRequest) -> tuple[str, Delta]:
    text = ""
    async with aclosing(service.generate(gen)) as deltas:
        async for delta in deltas:
            text += delta.text
    return text, delta


async def _events(service: GatewayService, gen: GenerationRequest, fmt: ResponseFormat) -> AsyncIterator[str]:
    """SSE as OpenAI sends it: a role chunk (chat), content chunks, a chunk with the finish reason and an empty
    delta, the usage chunk (choices: []) when asked for, then [DONE]. A failure after the stream has started can
    only be reported in the stream, as an error event."""
    if fmt.chat:
        yield _sse(fmt.chunk("", first=True))
    try:
        async with aclosing(service.generate(gen)) as deltas:
            async for delta in deltas:
                if delta.text:
                    yield _sse(fmt.chunk(delta.text))
                if delta.finish_reason:
                    yield _sse(fmt.chunk(None, delta.finish_reason))
                    if fmt.include_usage:
                        yield _sse(fmt.usage_chunk(len(gen.prompt), delta.completion_tokens))
    except APIError as exc:
        yield _sse(exc.body())
    yield "data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator. When the client disconnects, Starlette stops
    iterating but leaves the generator suspended; closing it is what stops the request's round loop now."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
