"""Client: the blocking client. One pool of keep-alive connections; safe to share between threads."""

from __future__ import annotations

import time

from ._driver import blocking, headers_for, wait_limit
from ._ops import Operations
from ._transport import Transport, transport_for
from ._wire import Plan, Request, Response, RetryPolicy, Sessions, Sleep, T


class Client:
    """Switchyard over HTTP/1.1 with keep-alive.

    `url`: http://host:port, or unix:/path/to.sock. `api_key`: sent as a bearer token. `timeout`: seconds each
    call may take, also sent to the service as its deadline (X-Request-Timeout); None waits up to 300 s and sends
    no deadline. `transport`: "auto" (libcurl when pycurl is installed, else http.client), "http" or "pycurl".
    Writes are remembered per collection, so that later searches see them (read-your-writes; see search()).
    """

    def __init__(self, url: str = "http://localhost:8000", *, api_key: str | None = None,
                 timeout: float | None = None, retry: RetryPolicy | None = None, transport: str = "auto",
                 max_idle_connections: int = 32) -> None:
        self.url = url
        self.api_key = api_key
        self._transport: Transport = transport_for(url, transport, max_idle_connections)
        self._ops = Operations(Sessions(), timeout, retry)

    @property
    def transport(self) -> str:
        """The transport in use: "pycurl" (libcurl) or "http" (http.client); what "auto" chose."""
        return self._transport.name

    def with_options(self, *, timeout: float | None = None, retry: RetryPolicy | None = None) -> "Client":
        """A client sharing this one's connections and read-your-writes memory, with another timeout or retry
        policy: `client.with_options(timeout=0.5).search(...)`."""
        other = object.__new__(Client)
        other.__dict__.update(self.__dict__)
        other._ops = Operations(self._ops.sessions, timeout, retry or self._ops.retry)
        return other

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: Request) -> Response:
        return self._transport.send(request.method, request.path, request.body, headers_for(request, self.api_key),
                                    wait_limit(request), request.idempotent)

    def _run(self, plan: Plan[T]) -> T:
        answer: Response | None = None
        try:
            while True:
                step = plan.send(answer)
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    answer = None
                else:
                    answer = self._send(step)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except BaseException as error:
            plan.close()
            raise error

    health = blocking(Operations.health)
    engines = blocking(Operations.engines)
    create_collection = blocking(Operations.create_collection)
    get_collection = blocking(Operations.get_collection)
    list_collections = blocking(Operations.list_collections)
    delete_collection = blocking(Operations.delete_collection)
    upsert = blocking(Operations.upsert)
    delete = blocking(Operations.delete)
    search = blocking(Operations.search)
    load = blocking(Operations.load)
    build = blocking(Operations.build)
    recall = blocking(Operations.recall)
    job = blocking(Operations.job)
    cancel_job = blocking(Operations.cancel_job)
    wait_job = blocking(Operations.wait_job)
    create_points = blocking(Operations.create_points)
    create_polygons = blocking(Operations.create_polygons)
    upload_geoparquet = blocking(Operations.upload_geoparquet)
    list_layers = blocking(Operations.list_layers)
    delete_layer = blocking(Operations.delete_layer)
    point_in_polygon_counts = blocking(Operations.point_in_polygon_counts)
    point_in_polygon = blocking(Operations.point_in_polygon)
    within_distance = blocking(Operations.within_distance)
    ssb_generate = blocking(Operations.ssb_generate)
    ssb_query = blocking(Operations.ssb_query)
    sql = blocking(Operations.sql)
