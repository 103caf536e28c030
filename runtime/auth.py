"""The shared secret between the gateway and the model services (`--auth-token`), for deployments where the model
services listen beyond loopback. The gateway sends it with every gRPC call (metadata `authorization: Bearer TOKEN`)
and in every round lane's hello (runtime/lane.py); a service that has one answers any call without it
UNAUTHENTICATED. Health checks (grpc.health.v1) stay open, so orchestrators probe without the secret.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
MAX_TOKEN_CHARS = 128  # it travels in the lane's hello, which a server reads only up to MAX_HELLO_BYTES
_OPEN_PREFIX = f"/{health.SERVICE_NAME}/"


def check_token(token: str | None) -> None:
    """A token must be printable ASCII without spaces (an HTTP/2 header value and one word of the lane's hello)."""
    if token is None:
        return
    if not 0 < len(token) <= MAX_TOKEN_CHARS or not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"auth_token must be 1 to {MAX_TOKEN_CHARS} printable ASCII characters without spaces")


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata a client sends with each call (None: no token, nothing to send)."""
    return None if token is None else ((METADATA_KEY, f"Bearer {token}"),)


def matches(presented: str, token: str) -> bool:
    return hmac.compare_digest(presented.encode(), token.encode())  # constant time: no guessing byte by byte


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets through the calls that present the token, and every health check; answers the others
    UNAUTHENTICATED before their method runs."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX):
            return handler
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if matches(presented, self._expected):
            return handler
        log.warning("refused %s: %s", details.method, "wrong token" if presented else "no token")
        return _refusal(handler)


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service needs the shared auth token (--auth-token)")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as `handler` that only refuses."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(_refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
