"""--api-key: every HTTP request but those to the open paths must carry `Authorization: Bearer <key>`, else a 401 in
OpenAI's error shape. A pure ASGI middleware, so a refused request is answered before its body is read."""

from __future__ import annotations

import hashlib
import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.openai_api import APIError


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is None:
            await self.app(scope, receive, send)
            return
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if not values:
            return APIError(401, "You didn't provide an API key. Send it in an Authorization header using Bearer "
                            "auth (i.e. Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        scheme, _, token = values[0].partition(b" ")
        # Digests of equal length compare in constant time: neither the key's bytes nor its length leak.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest):
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None
