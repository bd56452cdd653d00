"""AsyncClient: the asyncio client (httpx underneath). One pool of keep-alive connections per client."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, BinaryIO

import httpx

from ._driver import awaitable, headers_for, wait_limit
from ._ops import Operations
from ._transport import Endpoint
from ._wire import Plan, Request, Response, RetryPolicy, Sessions, Sleep, T
from .errors import TimedOut, TransportError


async def file_chunks(file: BinaryIO, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A file body from its start, a block at a time, read off the event loop (Content-Length is already set)."""
    file.seek(0)
    while block := await asyncio.to_thread(file.read, size):
        yield block


class AsyncClient:
    """Client's calls as coroutines, with the same arguments, results, errors, retries and read-your-writes."""

    def __init__(self, url: str = "http://localhost:8000", *, api_key: str | None = None,
                 timeout: float | None = None, retry: RetryPolicy | None = None,
                 max_connections: int = 100) -> None:
        endpoint = Endpoint(url)
        self.url = url
        self.api_key = api_key
        transport = httpx.AsyncHTTPTransport(uds=endpoint.socket_path, limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=1.0))
        self._http = httpx.AsyncClient(base_url=f"http://{endpoint.host}:{endpoint.port}", transport=transport)
        self._ops = Operations(Sessions(), timeout, retry)

    def with_options(self, *, timeout: float | None = None, retry: RetryPolicy | None = None) -> "AsyncClient":
        """A client sharing this one's connections and read-your-writes memory, with another timeout or retry
        policy."""
        other = object.__new__(AsyncClient)
        other.__dict__.update(self.__dict__)
        other._ops = Operations(self._ops.sessions, timeout, retry or self._ops.retry)
        return other

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, request: Request) -> Response:
        body: bytes | AsyncIterator[bytes] | None = (
            request.body if request.body is None or isinstance(request.body, bytes) else file_chunks(request.body))
        try:
            answer = await self._http.request(request.method, request.path, content=body,
                                              headers=headers_for(request, self.api_key),
                                              timeout=wait_limit(request))
        except httpx.TimeoutException as exc:
            raise TimedOut(f"{request.method} {request.path}: no answer within {wait_limit(request):g} s "
                           f"({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{request.method} {request.path}: {type(exc).__name__}: {exc}") from exc
        return Response(answer.status_code, answer.headers, answer.content)

    async def _run(self, plan: Plan[T]) -> T:
        answer: Response | None = None
        try:
            while True:
                step = plan.send(answer)
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    answer = None
                else:
                    answer = await self._send(step)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except BaseException as error:
            plan.close()
            raise error

    health = awaitable(Operations.health)
    engines = awaitable(Operations.engines)
    create_collection = awaitable(Operations.create_collection)
    get_collection = awaitable(Operations.get_collection)
    list_collections = awaitable(Operations.list_collections)
    delete_collection = awaitable(Operations.delete_collection)
    upsert = awaitable(Operations.upsert)
    delete = awaitable(Operations.delete)
    search = awaitable(Operations.search)
    load = awaitable(Operations.load)
    build = awaitable(Operations.build)
    recall = awaitable(Operations.recall)
    job = awaitable(Operations.job)
    cancel_job = awaitable(Operations.cancel_job)
    wait_job = awaitable(Operations.wait_job)
    create_points = awaitable(Operations.create_points)
    create_polygons = awaitable(Operations.create_polygons)
    upload_geoparquet = awaitable(Operations.upload_geoparquet)
    list_layers = awaitable(Operations.list_layers)
    delete_layer = awaitable(Operations.delete_layer)
    point_in_polygon_counts = awaitable(Operations.point_in_polygon_counts)
    point_in_polygon = awaitable(Operations.point_in_polygon)
    within_distance = awaitable(Operations.within_distance)
    ssb_generate = awaitable(Operations.ssb_generate)
    ssb_query = awaitable(Operations.ssb_query)
    sql = awaitable(Operations.sql)
