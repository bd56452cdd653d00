"""Request body limits: its size, enforced before anything parses the body, and the time it may take to arrive.

Size: SWITCHYARD_MAX_BODY_BYTES, or SWITCHYARD_MAX_BULK_BYTES for the bulk-load route (BodySizeLimitMiddleware).
Time (`read_body`, `timed_receive`, used by express for every request): the body must arrive within
SWITCHYARD_READ_TIMEOUT_S of the request's headers, plus one second per BODY_MIN_RATE bytes received, so a client
sending slowly (a byte every few seconds) is cut off with a 408 and its connection closed, while a large body sent at
a sane rate is never cut off.
"""

from __future__ import annotations

import asyncio
import re

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, ProblemError, problem_response
from service.http.media import media_type

# The routes that take bulk loads, with the media type that makes a body one: only these get the bulk limit.
# Going by route, not by the Content-Type alone: an Arrow content type on any other route once lifted its limit.
BULK_ROUTES = (
    ("PUT", re.compile(r"^/v1/collections/[^/]+/points$"), b"application/vnd.apache.arrow.stream"),
)
BODY_MIN_RATE = 1 << 20  # bytes per second: each MiB received extends the body's deadline by a second


class RequestTimeout(ProblemError):
    """The request's body did not arrive in time: answered 408, and the connection closed (the rest of the body may
    still be on its way)."""

    status, slug, title = 408, "request-timeout", "Request timeout"

    def __init__(self, timeout_s: float, received: int) -> None:
        super().__init__(
            f"the request body did not arrive within {timeout_s:g} s of its headers (SWITCHYARD_READ_TIMEOUT_S, plus "
            f"a second per {BODY_MIN_RATE} bytes); {received} bytes arrived", field="body",
            headers={"Connection": "close"})


def is_bulk(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request is a bulk load, which gets the bulk limit (media type: service/http/media.py)."""
    if method != "PUT" or not path.endswith("/points"):  # no header scan for every other request
        return False
    media = media_type(headers)
    return any(method == m and pattern.match(path) and media == bulk_media for m, pattern, bulk_media in BULK_ROUTES)


class BodyGone(Exception):
    """The client went away before its body arrived."""


async def read_body(receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, read under its arrival deadline: RequestTimeout past it, PayloadTooLarge past `limit` bytes
    (bodies of undeclared length), BodyGone when the client disconnects."""
    timed = timed_receive(receive, timeout_s)
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await timed()
        if message["type"] != "http.request":
            raise BodyGone()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise PayloadTooLarge(f"the body exceeds the limit of {limit} bytes (SWITCHYARD_MAX_BODY_BYTES)",
                                  limit_bytes=limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then what the client sends next (its disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def timed_receive(receive: Receive, timeout_s: float) -> Receive:
    """`receive` under the body's arrival deadline (read_body's, and a bulk load's streamed to the app):
    RequestTimeout (answered 408) once the deadline passes."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    received = 0

    async def timed() -> Message:
        nonlocal received
        try:
            async with asyncio.timeout_at(start + timeout_s + received / BODY_MIN_RATE):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout(timeout_s, received) from None
        received += len(message.get("body", b""))
        return message

    return timed


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
        # Bulk loads (Arrow IPC streams to a collection's points) have their own, larger limit.
        try:
            bulk = is_bulk(scope["method"], scope["path"], scope.get("headers", []))
        except ProblemError as exc:  # a repeated Content-Type (express refuses it before this)
            await problem_response(exc.status, exc.slug, exc.title, exc.detail, instance=scope.get("path"),
                                   field=exc.field)(scope, receive, send)
            return
        limit = self.max_bulk_bytes if bulk else self.max_body_bytes
        headers = dict(scope.get("headers", ()))
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
