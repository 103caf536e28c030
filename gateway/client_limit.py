"""Who a request comes from, and --max-client-requests: the requests one client may have in flight at once.

A client is its peer's address. Not its API key: the gateway takes one key (--api-key), which every client then
presents alike, so the key tells none apart. Clients behind one proxy or NAT count as one.

ClientLimit counts a request from its arrival to its answer's last byte (or its client going away), so the count
covers its upload, its tokenizing, its wait for a place and its decoding, with no gap between admission's check and
the wait in which a burst could slip past the limit.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission import RETRY_AFTER_S
from gateway.openai_api import APIError


def client_of(scope: Scope) -> str:
    """The client an HTTP request comes from: its peer's address ("" where the server does not know it)."""
    peer = scope.get("client")
    return peer[0] if peer else ""


class ClientLimit:
    """ASGI middleware: a client may have at most `limit` POST requests (the ones that tokenize or decode) in
    flight; one more gets a 429 in OpenAI's shape with Retry-After, before its body is read, and other clients'
    requests go on as before. `shed` counts each refusal."""

    def __init__(self, app: ASGIApp, limit: int, shed: Callable[[], None]) -> None:
        self.app, self.limit, self.shed = app, limit, shed
        self._in_flight: dict[str, int] = {}  # by client; a client with none in flight has no entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        client = client_of(scope)
        held = self._in_flight.get(client, 0)
        if held >= self.limit:
            self.shed()
            error = APIError(429, f"this client already has {held} requests in flight, the most one client may have "
                                  "at once; retry later", type="requests", code="rate_limit_exceeded",
                             retry_after=RETRY_AFTER_S)
            await JSONResponse(error.body(), status_code=429, headers=error.headers())(scope, receive, send)
            return
        self._in_flight[client] = held + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self._in_flight.pop(client) - 1
            if left:
                self._in_flight[client] = left
