"""A fast lane for the hottest route, POST /v1/collections/{name}/search.

Single-vector searches cost a few hundred microseconds in the engine; FastAPI's per-request machinery
(routing through included routers, dependency solving, exception and telemetry middleware) costs about as much
again. This pure ASGI layer answers well-formed, authorised searches directly through the same function the
route uses (routes.vectors.run_search). Anything else, and any request that fails, goes through the full app,
so every error is produced by one code path, exactly as without the fast lane.
"""

from __future__ import annotations

import hmac
import re
from types import SimpleNamespace

from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from indexes.errors import VectorError

from .errors import ProblemError
from .routes.vectors import run_search

SEARCH = re.compile(r"^/v1/collections/([A-Za-z0-9][A-Za-z0-9_-]{0,62})/search$")
ROUTE = SimpleNamespace(path="/v1/collections/{name}/search")  # the metrics label of the full route


class SearchFastLane:
    def __init__(self, app: ASGIApp, runtime: object) -> None:
        self.app = app
        self.runtime = runtime

    def _authorised(self, scope: Scope) -> bool:
        key = self.runtime.settings.api_key
        if key is None:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.get_secret_value().encode())
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = SEARCH.match(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        # Only bodies of declared length (already checked against the size limit), from authorised clients.
        declared = any(name == b"content-length" for name, _ in scope.get("headers", ()))
        if match is None or not declared or not self._authorised(scope):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            answer = await run_search(self.runtime, match.group(1), raw)
        except (ProblemError, VectorError, RequestValidationError, ValueError):
            await self.app(scope, _replay(raw), send)  # the full app formats the error
            return
        scope["route"] = ROUTE
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive
