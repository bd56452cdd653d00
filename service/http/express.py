"""The hot lane: the outermost layer of the app, serving the hottest routes with no Python they do not need.

POST /v1/collections/{name}/search (JSON, base64 or raw float32 bodies) and JSON upserts to
PUT /v1/collections/{name}/points cost a few hundred microseconds in the engine; FastAPI's per-request machinery
and the general middleware stack (error, telemetry and body-limit layers, metrics, size limit) cost about as much
again. This pure ASGI layer answers well-formed, authorised requests of a declared length within the body limit
directly, through the same functions the routes use (routes.vectors.run_search / run_upsert), and records the
same metrics. Anything else, and any request that fails, goes through the full app, so every error (401, 413,
422, 404, 503 ...) is produced by one code path, exactly as without the hot lane. Hot requests are access-logged
only when sampled (SWITCHYARD_ACCESS_LOG_SAMPLE). local_answer answers in this process; a front process's lane
(service/process/front.py) parses here and lets the engine process answer.
"""

from __future__ import annotations

import hmac
import random
import re
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.admission.control import (
    PRINCIPAL,
    TIMEOUT_HEADER,
    Admission,
    DeadlineExceeded,
    Shed,
    parse_timeout,
    principal_of,
)
from service.admission.deadlines import set_deadline
from service.errors import ProblemError
from service.http.access_log import log_request
from service.http.vector_requests import RAW_VECTORS, REQUEST_ERRORS
from service.metrics import Metrics, StatusSend
from service.settings import Settings

if TYPE_CHECKING:
    from service.runtime import Runtime  # not at run time: front processes import this module, not the engines

HOT = re.compile(r"^/v1/collections/([A-Za-z0-9][A-Za-z0-9_-]{0,62})/(search|points)$")
SEARCH_ROUTE = SimpleNamespace(path="/v1/collections/{name}/search")  # the metrics labels of the full routes
POINTS_ROUTE = SimpleNamespace(path="/v1/collections/{name}/points")
JSON = b"application/json"
HEADERS = [(b"content-type", JSON)]
RAW_VECTORS_BYTES = RAW_VECTORS.encode()
CLIENT_HEADER = b"x-switchyard-client"  # a front process's client address, to the engine process (quotas)
HOT_KINDS = {True: ("POST", "search"), False: ("PUT", "points")}  # a hot answer's kind for the in-flight limit
HEAVY_PREFIXES = ("/v1/olap/", "/v1/spatial/")  # SSB, SQL and geometry: at most half the in-flight limit


# A hot request's answer: (search?, collection, body, media type, query string, arrival time) -> the JSON answer,
# or None when the request fails (the full app then answers it).
Answer = Callable[[bool, str, bytes, str, str, float], Awaitable["bytes | None"]]
# A search answered at once, without awaiting anything: (collection, body, media type, query string, respond) ->
# whether it was; the JSON answer goes to `respond` as soon as it is made, before the bookkeeping (metrics), so the
# client is not kept waiting for it. False: nothing was sent, and the request takes the ASGI path.
AnswerNow = Callable[[str, bytes, str, str, Callable[[bytes], None]], bool]
NOW_MAX_BODY = 1 << 20  # bodies the protocol's synchronous lane may hold: a few single-vector searches' worth


class NowRequest(NamedTuple):
    """A search the synchronous lane may answer once its body is read."""
    collection: str
    media: str
    query: str


class HotLane:
    """Picks out hot requests for `answer`; the app it wraps answers everything else, and any hot request that
    fails (replayed to it)."""

    def __init__(self, app: ASGIApp, settings: Settings, answer: Answer, admission: Admission | None = None,
                 answer_now: AnswerNow | None = None) -> None:
        self.app = app
        self.answer = answer
        self.now = answer_now  # None: no synchronous lane (a front process, or the lane turned off)
        self.admission = admission  # None in a front process: the engine process admits
        # a front process names the principal; the engine counts
        self.quota = bool(settings.admission.quota_requests_per_s)
        self.default_timeout = settings.admission.request_timeout_s
        self.pressure = admission.pressure if admission is not None else None  # the in-flight limit, if any
        self.max_body = settings.server.max_body_bytes
        self.sample = settings.server.access_log_sample
        self.key = settings.server.api_key.get_secret_value().encode() if settings.server.api_key is not None else None

    def __getattr__(self, name: str) -> object:
        if name == "app":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self.app, name)  # app.state, app.openapi(), dependency_overrides ...: the FastAPI app's

    def take_now(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> NowRequest | None:
        """What answer_now needs of a request it may answer, from its request line and headers (before its body
        is read), or None: the request goes through __call__ as any other, which answers it or its error.
        Requests with a deadline, a quota to charge, a forwarded client or a body of undeclared length always go
        that way."""
        if self.now is None or method != b"POST" or self.quota or self.default_timeout is not None:
            return None
        path, _, query = url.partition(b"?")
        match = HOT.match(path.decode("latin-1"))
        if match is None or match.group(2) != "search":
            return None
        length, media, authorization, timeout, forwarded, chunked = read_headers(headers)
        if (timeout is not None or forwarded is not None or chunked or not 0 < length <= NOW_MAX_BODY
                or not self._accepts(length, media, authorization, True)):
            return None
        return NowRequest(match.group(1), media.decode(), query.decode("latin-1"))

    def answer_now(self, request: NowRequest, raw: bytes, respond: Callable[[bytes], None]) -> bool:
        """The search take_now accepted, answered at once from the HTTP protocol itself (http/express_protocol.py),
        before any ASGI machinery, with the same in-flight accounting and metrics as __call__: whether its answer
        went to `respond`."""
        pressure = self.pressure
        if pressure is not None and not pressure.admit(True):
            return False
        start, answered = time.perf_counter(), False
        assert self.now is not None  # take_now accepted the request
        try:
            answered = self.now(request.collection, raw, request.media, request.query, respond)
        finally:
            if pressure is not None:
                pressure.leave(True, HOT_KINDS[True] if answered else None, time.perf_counter() - start)
        if answered and self.sample and random.random() < self.sample:
            log_request({"client": None, "method": "POST", "path": f"/v1/collections/{request.collection}/search",
                         "query_string": request.query.encode("latin-1")}, 200, time.perf_counter() - start,
                        sampled=True)
        return answered

    def _accepts(self, length: int, media: bytes, authorization: bytes | None, search: bool) -> bool:
        """Whether this request is ours: authorised, declared length within the limit, a body we parse."""
        if self.key is not None:
            scheme, _, token = (authorization or b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key)):
                return False
        if not 0 <= length <= self.max_body:
            return False
        return media == JSON or (search and media == RAW_VECTORS_BYTES)

    def _admit(self, scope: Scope, timeout: bytes | None, authorization: bytes | None, forwarded: bytes | None) -> None:
        """Set the request's deadline and principal for everything it runs; count it against its quota."""
        seconds = parse_timeout(timeout) if timeout is not None else self.default_timeout
        if seconds is not None:
            set_deadline(time.monotonic() + seconds)
        if self.quota and scope["path"].startswith("/v1/"):
            client = scope.get("client")
            if client is None and forwarded:  # from a front process, over the engine's unix socket
                client = (forwarded.decode("latin-1"), 0)
            who = principal_of(authorization, client)
            PRINCIPAL.set(who)
            if self.admission is not None:
                self.admission.check_request(who)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hot = HOT.match(scope["path"])
        pressure = self.pressure
        if pressure is None or not scope["path"].startswith("/v1/"):  # probes and metrics: never refused
            await self._serve(scope, receive, send, hot)
            return
        light = not scope["path"].startswith(HEAVY_PREFIXES)
        if not await pressure.enter(light):
            assert self.admission is not None  # the pressure is the admission's
            self.admission.shed("requests", "inflight")
            await self._answer_failure(scope, receive, send, Shed(
                f"the service is serving {pressure.inflight} requests, its limit under the present load "
                "(SWITCHYARD_MAX_INFLIGHT, SWITCHYARD_INFLIGHT_LATENCY_TOLERANCE), and no slot came free in time; "
                "this one was not run", 1.0, reason="inflight"))
            return
        start, watched = time.perf_counter(), StatusSend(send, 0)
        try:
            await self._serve(scope, receive, watched, hot)
        finally:  # successes' latency, by kind of request, moves the limit
            kind = None
            if 200 <= watched.status < 300:
                kind = hot.group(2) if hot is not None else getattr(scope.get("route"), "path", None)
            pressure.leave(light, kind and (scope["method"], kind), time.perf_counter() - start)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, match: re.Match | None) -> None:
        """`match`: HOT's match of the path."""
        length, media, authorization, timeout, forwarded, _ = read_headers(scope["headers"])
        if timeout is not None or self.default_timeout is not None or self.quota:
            try:
                self._admit(scope, timeout, authorization, forwarded)
            except ProblemError as exc:  # a bad X-Request-Timeout, or over quota: answered as the app would
                await self._answer_failure(scope, receive, send, exc)
                return
        search = match is not None and match.group(2) == "search"
        if (match is None or scope["method"] != ("POST" if search else "PUT")
                or not self._accepts(length, media, authorization, search)):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
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
            answer = await self.answer(search, match.group(1), raw, media.decode(),
                                       scope["query_string"].decode("latin-1"), start)
        except Exception as exc:  # noqa: BLE001 - past the point where a replay is safe: the app's handler answers
            await self._answer_failure(scope, receive, send, exc)
            return
        if answer is None:
            await self.app(scope, _replay(raw), send)  # the full app formats the error (and counts it)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*HEADERS, (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})
        if self.sample and random.random() < self.sample:
            log_request(scope, 200, time.perf_counter() - start, sampled=True)

    async def _answer_failure(self, scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
        """Answer as the full app's exception handlers do (problem+json; 503 for a database that is gone; 500 with
        an error id for the unexpected), without running the request again: a write may have reached PostgreSQL
        before it failed."""
        handlers = getattr(self.app, "exception_handlers", {})
        handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)
        if handler is None:
            raise exc
        response = await handler(Request({**scope, "app": self.app}), exc)
        await response(scope, receive, send)


def read_headers(headers: list[tuple[bytes, bytes]]
                 ) -> tuple[int, bytes, bytes | None, bytes | None, bytes | None, bool]:
    """What the lanes read of a request's headers: declared length (-1: none or not a number), media type,
    Authorization, X-Request-Timeout, a front process's forwarded client, whether the body is chunked."""
    length, media, authorization, timeout, forwarded, chunked = -1, JSON, None, None, None, False
    for name, value in headers:
        if name == b"content-length":
            length = int(value) if value.isdigit() else -1
        elif name == b"content-type":
            media = value.split(b";")[0].strip().lower()
        elif name == b"authorization":
            authorization = value
        elif name == TIMEOUT_HEADER:
            timeout = value
        elif name == CLIENT_HEADER:
            forwarded = value
        elif name == b"transfer-encoding":
            chunked = True
    return length, media, authorization, timeout, forwarded, chunked


def local_answer(runtime: Runtime) -> Answer:
    """Hot requests of a process that holds the engines: parsed and answered here."""
    from service.http.routes.vectors import (  # here: front processes import this module, not the engines
        run_search,
        run_upsert,
    )

    async def answer(search: bool, name: str, raw: bytes, media: str, query_string: str, start: float) -> bytes | None:
        try:
            if search:
                body = await run_search(runtime, name, raw, media, query_string)
            else:
                body = await run_upsert(runtime, name, raw)
        except (Shed, DeadlineExceeded):
            raise  # answered as they are: a replay would run the request again
        except REQUEST_ERRORS:
            return None
        observe_hot(runtime.metrics, search, time.perf_counter() - start)
        return body

    return answer


def local_answer_now(runtime: Runtime) -> AnswerNow:
    """Searches a process that holds the engines answers from its HTTP protocol, at once when it can."""
    from service.http.routes.vectors import search_now

    def answer(name: str, raw: bytes, media: str, query_string: str, respond: Callable[[bytes], None]) -> bool:
        start = time.perf_counter()
        if not search_now(runtime, name, raw, media, query_string, respond):
            return False
        observe_hot(runtime.metrics, True, time.perf_counter() - start)  # the answer's send included, as in the app
        runtime.metrics.synced()
        return True

    return answer


def observe_hot(metrics: Metrics, search: bool, seconds: float) -> None:
    """Count a hot request under its full route's labels."""
    template = (SEARCH_ROUTE if search else POINTS_ROUTE).path
    metrics.observe_request(template, "POST" if search else "PUT", 200, seconds)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive
