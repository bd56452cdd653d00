"""Request body size limit, enforced before anything parses the body."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastapi import HTTPException

from .errors import problem_response


class BodySizeLimitMiddleware:
    """413 for a declared Content-Length over the limit without reading a byte; for chunked bodies the
    stream is counted as it arrives and cut off at the limit."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _problem(self, scope: Scope, declared: int | None = None):
        said = f"{declared} bytes" if declared is not None else "the body"
        return problem_response(
            413, "payload-too-large", "Payload too large",
            f"{said} exceeds the limit of {self.max_body_bytes} bytes (SWITCHYARD_MAX_BODY_BYTES); "
            "send large loads in parts or as an Arrow IPC stream job",
            instance=scope.get("path"), limit_bytes=self.max_body_bytes,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_body_bytes:
                    await self._problem(scope, declared)(scope, receive, send)
                    return
                break

        received = 0
        limit = self.max_body_bytes

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException, because FastAPI re-raises those from body parsing (others become 400).
                    raise HTTPException(413, f"the body exceeds the limit of {limit} bytes (SWITCHYARD_MAX_BODY_BYTES)")
            return message

        await self.app(scope, counting_receive, send)
