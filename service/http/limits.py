"""Request body size limit, enforced before anything parses the body."""

from __future__ import annotations

import re

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import problem_response

# The routes that take bulk loads, with the media type that makes a body one: only these get the bulk limit.
# Going by route, not by the Content-Type alone: an Arrow content type on any other route once lifted its limit.
BULK_ROUTES = (
    ("PUT", re.compile(r"^/v1/collections/[^/]+/points$"), b"application/vnd.apache.arrow.stream"),
)


def is_bulk(method: str, path: str, content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return any(method == m and pattern.match(path) and media == bulk_media for m, pattern, bulk_media in BULK_ROUTES)


class BodySizeLimitMiddleware:
    """413 for a declared Content-Length over the limit without reading a byte; for chunked bodies the
    stream is counted as it arrives and cut off at the limit."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_bulk_bytes: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_bulk_bytes = max_bulk_bytes or max_body_bytes

    def _problem(self, scope: Scope, limit: int, declared: int):
        setting = ("SWITCHYARD_MAX_BULK_BYTES" if limit == self.max_bulk_bytes != self.max_body_bytes
                   else "SWITCHYARD_MAX_BODY_BYTES")
        return problem_response(
            413, "payload-too-large", "Payload too large",
            f"{declared} bytes exceeds the limit of {limit} bytes ({setting}); "
            "send large loads in parts or as an Arrow IPC stream (application/vnd.apache.arrow.stream)",
            instance=scope.get("path"), limit_bytes=limit,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        # Bulk loads (Arrow IPC streams to a collection's points) have their own, larger limit.
        bulk = is_bulk(scope["method"], scope["path"], headers.get(b"content-type", b""))
        limit = self.max_bulk_bytes if bulk else self.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"-1"))
        except ValueError:
            declared = -1
        if declared > limit:
            await self._problem(scope, limit, declared)(scope, receive, send)
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException, because FastAPI re-raises those from body parsing (others become 400).
                    setting = "SWITCHYARD_MAX_BULK_BYTES" if bulk else "SWITCHYARD_MAX_BODY_BYTES"
                    raise HTTPException(413, f"the body exceeds the limit of {limit} bytes ({setting})")
            return message

        await self.app(scope, counting_receive, send)
