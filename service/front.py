"""A front process: HTTP in, parsed requests to the engine process, answers out. It holds no data.

`switchyard serve` runs one engine process (the full app: PostgreSQL pool, resident indexes, jobs, SSB and
spatial data) listening on unix sockets only, and SWITCHYARD_FRONTS of these (default one per core) on the port.
A front parses and checks searches and JSON upserts itself (the costly part of a small request: JSON floats,
validation) and sends them to the engine over service/engine_link.py; the engine answers from its one copy of
each index, micro-batching the searches of every front together. Everything else, and any hot request that
fails, is passed through unchanged to the engine's full app over HTTP on its unix socket, so every route, error,
header and status is the engine's own.
"""

from __future__ import annotations

import time

import httpx
from starlette.types import Receive, Scope, Send

from . import access_log
from .engine_link import EngineClient, EngineGone
from .errors import problem_response
from .admission import PRINCIPAL
from .deadlines import deadline as current_deadline
from .fastlane import CLIENT_HEADER, REQUEST_ERRORS, HotLane
from .vector_requests import parse_search, parse_upsert
from .settings import Settings

HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
FRONT_SETS = {b"date", b"server"}  # the front's own server adds these to every answer


class EngineProxy:
    """Passes a request through to the engine process's HTTP socket and streams its answer back."""

    def __init__(self, socket_path: str) -> None:
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://engine",
                                        timeout=None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != CLIENT_HEADER]
        if scope.get("client"):
            headers.append((CLIENT_HEADER, scope["client"][0].encode("latin-1")))
        has_body = any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])

        async def body():
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        url = httpx.URL(path=scope["path"], query=scope["query_string"])
        request = self.client.build_request(scope["method"], url, headers=headers, content=body() if has_body else None)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            unavailable = problem_response(503, "engine-unavailable", "Engine unavailable", (
                f"the engine process did not answer ({type(exc).__name__}); it may be starting or restarting"),
                instance=scope["path"], headers={"Retry-After": "1"})
            await unavailable(scope, receive, send)
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.lower(), v) for k, v in response.headers.raw
                                    if k.lower() not in HOP_BY_HOP and k.lower() not in FRONT_SETS]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


class Front(HotLane):
    """The hot lane of a front process: parse here, answer in the engine process."""

    def __init__(self, settings: Settings) -> None:
        if settings.engine_http is None or settings.engine_socket is None:
            raise RuntimeError("a front process needs SWITCHYARD_ENGINE_HTTP and SWITCHYARD_ENGINE_SOCKET")
        super().__init__(EngineProxy(str(settings.engine_http)), settings, self._answer)
        self.engine = EngineClient(settings.engine_socket)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.sample:
                    access_log.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.close()
                await self.app.client.aclose()
                access_log.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _answer(self, search: bool, name: str, raw: bytes, media: str, query_string: str,
                      start: float) -> bytes | None:
        try:
            parsed = parse_search(raw, media, query_string) if search else parse_upsert(raw)
        except REQUEST_ERRORS:
            return None  # the engine's full app answers the replay with the exact problem
        try:
            # The engine counts the request in its metrics, adding the time spent here.
            return await self.engine.call("search" if search else "upsert", name, parsed, time.perf_counter() - start,
                                          current_deadline(), PRINCIPAL.get())
        except EngineGone:
            return None  # the replay answers 503 if the engine is still away


def create_front() -> Front:
    """Uvicorn's factory for a front process (`uvicorn service.front:create_front --factory`)."""
    return Front(Settings())
