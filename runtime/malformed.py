"""Requests whose bytes are no valid message are INVALID_ARGUMENT, as on the round lane (runtime/lane.py).

Why: gRPC's asyncio server parses a request with the method's deserializer before the servicer runs, and a parse
failure there ends the call UNKNOWN (logged as an unexpected error), which reads as the service's fault. This
interceptor takes the parsing away from gRPC and does it inside the call instead (for a streamed request, as the
servicer reads each message), so a malformed request is the client's error, with the parser's reason.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Parse = Callable[[bytes], Any]


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Parses each call's requests inside the call, answering INVALID_ARGUMENT to bytes that are no valid request.
    The handler gRPC is given has no deserializer, so the messages arrive as bytes and are parsed here. gRPC tells
    a streamed answer's two forms apart by the function (an async generator, or a coroutine that writes through the
    context) and so does this; a coroutine that reads a streamed request through the context keeps gRPC's parsing,
    since its reads cannot be intercepted (none is served here: none are generators)."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, serialize = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_parsing(handler.unary_unary, parse),
                                                       response_serializer=serialize)
        if handler.unary_stream is not None:
            behaviour = handler.unary_stream
            wrapped = (_parsing_to_stream(behaviour, parse) if inspect.isasyncgenfunction(behaviour)
                       else _parsing(behaviour, parse))  # health's Watch writes through the context
            return grpc.unary_stream_rpc_method_handler(wrapped, response_serializer=serialize)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(_parsing_stream(handler.stream_stream, parse),
                                                         response_serializer=serialize)
        return handler


async def _parsed(payload: bytes, parse: Parse, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(payload)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")


async def _each_parsed(payloads: AsyncIterator[bytes], parse: Parse, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[Any]:
    """The stream's requests, parsed as the servicer reads them: a malformed one aborts the call there, after the
    answers to the requests before it."""
    async for payload in payloads:
        yield await _parsed(payload, parse, context)


def _parsing(behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], parse: Parse
             ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def call(payload: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await _parsed(payload, parse, context), context)

    return call


def _parsing_to_stream(behaviour: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], parse: Parse
                       ) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def call(payload: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for answer in behaviour(await _parsed(payload, parse, context), context):
            yield answer

    return call


def _parsing_stream(behaviour: Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]],
                    parse: Parse) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def call(payloads: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for answer in behaviour(_each_parsed(payloads, parse, context), context):
            yield answer

    return call

