"""BodyLimit: the HTTP app's bound on a request body, checked before anything parses it. A body past the limit gets
a 413 in OpenAI's error shape. The declared length is checked up front; a body without one (chunked) is read up to
the limit, then handed to the app whole."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.openai_api import APIError


class BodyLimit:
    """ASGI middleware: at most `limit` bytes of request body reach `app`."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(send)
            else:  # the server holds the body to its declared length
                await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect a streaming response waits for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        error = APIError(413, f"the request body is larger than this server's limit of {self.limit} bytes",
                         code="request_too_large")
        payload = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
