"""A front process: HTTP in, parsed requests to the engine process, answers out. It holds no data.

`switchyard serve` runs one engine process (the full app: PostgreSQL pool, resident indexes, jobs, SSB and
spatial data) per device, listening on unix sockets only, and SWITCHYARD_FRONTS of these (default one per core)
on the port. A front parses and checks searches and JSON upserts itself (the costly part of a small request: JSON
floats, validation) and sends them to an engine over service/process/link.py; the engine answers from its one copy
of each index, micro-batching the searches of every front together. Everything else, and any hot request that
fails, is passed through unchanged to an engine's full app over HTTP on its unix socket, so every route, error,
header and status is the engine's own. A request refused before it is run (no key, a bad header, a body too slow or
too large) is answered by the front itself, with the problem the engine would give, and never reaches an engine.
With several engines each request goes to the one with the least in flight; /metrics gathers them all and /readyz
asks them all.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
from typing import Callable, Sequence, TypeVar
from urllib.parse import quote

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.admission.control import Shed, behind, loop_lag_of
from service.admission.pressure import LIGHT, WORK_SHARES, WRITE, class_shares
from service.errors import TYPE_PREFIX, problem_response
from service.http import access_log
from service.http.express import (
    CLIENT_HEADER,
    REFUSED_HEADER,
    SCREENED,
    Express,
    deadline_and_principal,
    problem_of,
    refused_header,
)
from service.http.limits import is_bulk
from service.http.work import work_of
from service.pipeline import is_search, problem_reply_of, reply_of
from service.process.link import EngineClient, EngineGone
from service.process.links import ProcessLinks
from service.process.messages import Call, Reply, SearchCall
from service.process.throttle import Throttle, send_ratio
from service.settings import Settings

HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
FRONT_SETS = {b"date", b"server"}  # the front's own server adds these to every answer
FRONT_HEADERS = {CLIENT_HEADER, REFUSED_HEADER}  # set by the front alone: a client's own are dropped
T = TypeVar("T")
IN_FLIGHT = operator.attrgetter("in_flight")  # of an EngineProxy or an EngineClient
OVERLOADED = f'"type":"{TYPE_PREFIX}{Shed.slug}"'.encode()  # in an engine's refusal of a call it had no room for
# The detail of a front's own refusal: one for all, so that the problem is encoded once (pipeline.problem_reply_of).
THROTTLED = ("the engine process has been refusing most requests of this work class as overloaded, and this front "
             "refused this one for it; it was not run")


class LeastBusy:
    """Picks the engine with the least in flight; ties go round robin, so that light traffic spreads too."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, engines: Sequence[T], in_flight: Callable[[T], int]) -> T:
        if len(engines) == 1:
            return engines[0]
        start = next(self._turn)
        order = [engines[(start + i) % len(engines)] for i in range(len(engines))]
        return min(order, key=in_flight)


class EngineProxy:
    """Passes a request through to the engine process's HTTP socket and streams its answer back. `refused`: the
    refusals this front made for that engine not yet told to it (InEngineProcess.unreported), which the next request
    passed through carries; `throttles`: the front's throttle of each work class for that engine, told whether the
    engine accepted each /v1 request passed through."""

    def __init__(self, socket_path: str, refused: dict[str, int], throttles: dict[str, Throttle]) -> None:
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://engine",
                                        timeout=None)
        self.in_flight = 0
        self.refused = refused
        self.throttles = throttles

    def headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k not in FRONT_HEADERS]
        if scope.get("client"):
            headers.append((CLIENT_HEADER, scope["client"][0].encode("latin-1")))
        if self.refused:
            headers.append((REFUSED_HEADER, refused_header(taken(self.refused))))
        return headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.in_flight += 1
        try:
            await self._pass(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _pass(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = self.headers(scope)
        has_body = any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])

        async def body():
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        url = ENGINE_URL.copy_with(raw_path=as_sent(scope))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body() if has_body else None)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            await _unavailable(scope, exc)(scope, receive, send)
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": _passed_headers(response)})
            # refused as overloaded? a 503's problem says, in its first bytes (None: not read yet)
            refused: bool | None = None if response.status_code == Shed.status else False
            async for chunk in response.aiter_raw():
                if refused is None:
                    refused = OVERLOADED in chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()
        if scope["path"].startswith("/v1/"):
            work, _ = work_of(scope["method"], scope["path"], is_bulk(scope["method"], scope["path"], scope["headers"]))
            self.throttles[work].answered(refused is not True)


ENGINE_URL = httpx.URL("http://engine")  # the engine process's HTTP socket (the client's unix-socket transport)


def as_sent(scope: Scope) -> bytes:
    """The request's target as the client sent it, for the engine to parse as a lone process would: its raw path
    (percent-escapes kept), with dot segments escaped so that httpx passes them on instead of resolving them.
    Rebuilt from the decoded path, `c%00` and `//v1/...` were a 500 here, and `/v1/jobs/%2e%2e/%2e%2e/healthz`
    reached /healthz."""
    raw = scope.get("raw_path") or quote(scope["path"]).encode()
    segments = [b"%2E" * len(part) if part in (b".", b"..") else part for part in raw.split(b"/")]
    query = scope["query_string"]
    return b"/".join(segments) + (b"?" + query if query else b"")


def taken(counts: dict[str, int]) -> dict[str, int]:
    """What `counts` holds, which it then no longer does (it is shared: kept by InEngineProcess, told by either
    way to the engine)."""
    told = dict(counts)
    counts.clear()
    return told


def _unavailable(scope: Scope, exc: Exception) -> Response:
    # 503 `unavailable`: the engine process is down or restarting, which a retry outlasts. Not 409
    # `engine-unavailable`, which says that the engine a request names cannot serve it (docs/api.md#errors).
    return problem_response(503, "unavailable", "Service unavailable", (
        f"the engine process did not answer ({type(exc).__name__}); it may be starting or restarting"),
        instance=scope["path"], headers={"Retry-After": "1"})


def _passed_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in response.headers.raw
            if k.lower() not in HOP_BY_HOP and k.lower() not in FRONT_SETS]


class EngineProxies:
    """Passes each request through to the engine process with the least in flight. GET /metrics gathers every
    engine's metrics into one exposition, each sample labelled engine_process="i"; GET /readyz is ready only when
    every engine is (else it is the first unready engine's answer)."""

    def __init__(self, proxies: list[EngineProxy]) -> None:
        self.proxies = proxies
        self.pick = LeastBusy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in ("/metrics", "/readyz"):
            await self._gather(scope, receive, send)
            return
        await self.pick(self.proxies, IN_FLIGHT)(scope, receive, send)

    async def _gather(self, scope: Scope, receive: Receive, send: Send) -> None:
        url = httpx.URL(path=scope["path"], query=scope["query_string"])
        try:
            answers = await asyncio.gather(*(p.client.get(url, headers=p.headers(scope)) for p in self.proxies))
        except httpx.TransportError as exc:
            await _unavailable(scope, exc)(scope, receive, send)
            return
        failed = [a for a in answers if a.status_code != 200]
        answer = failed[0] if failed else answers[0]
        body = answer.content
        if scope["path"] == "/metrics" and not failed:
            body = merge_metrics([a.text for a in answers]).encode()
        headers = [(k, v) for k, v in _passed_headers(answer) if k != b"content-length"]
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def merge_metrics(texts: list[str]) -> str:
    """Each engine's Prometheus text as one exposition: every sample labelled with its engine_process, and the
    samples of a family kept together under one HELP and TYPE (the format allows each family once)."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for engine, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                head = heads.setdefault(family, [])
                if engine == 0 or not any(h.startswith(line[:7]) for h in head):
                    head.append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(_labelled(line, f'engine_process="{engine}"'))
    families = dict.fromkeys([*heads, *samples])
    return "".join(line + "\n" for family in families for line in (*heads.get(family, ()), *samples.get(family, ())))


def _labelled(sample: str, label: str) -> str:
    """A sample line (`name{a="b"} 1` or `name 1`) with one more label, first."""
    brace, space = sample.find("{"), sample.find(" ")
    if 0 <= brace < space:
        return f"{sample[:brace + 1]}{label},{sample[brace + 1:]}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


class InEngineProcess:
    """Hot calls run in an engine process, sent over its link (service/process/link.py) to the engine with the
    least in flight, which admits, runs and counts them (with the time spent here). While that engine refuses
    requests of a work class as overloaded (calls sent here, or requests passed through: EngineProxy), the front
    refuses a share of them itself (service/process/throttle.py)."""

    def __init__(self, engines: list[EngineClient], floors: dict[str, int]) -> None:
        self.engines = engines
        self.pick = LeastBusy()
        # floors: the fewest slots each work class has in an engine (its admission's floor), which sets how much
        # more than the engine accepts the throttle sends on
        self.throttles = {engine: {work: Throttle(send_ratio(floors[work])) for work in WORK_SHARES}
                          for engine in engines}
        # requests refused here, by reason, not yet told to the engine
        self.unreported: dict[EngineClient, dict[str, int]] = {engine: {} for engine in engines}

    def refused(self, work: str, path: str) -> Reply | None:
        """The front's own refusal of a request of this work class arriving now, for the engine with the least in
        flight (its throttle), or None: the request goes on."""
        engine = self.pick(self.engines, IN_FLIGHT)
        if not self.throttles[engine][work].refuse():
            return None
        return self.refuse(engine, Shed(THROTTLED, 1.0, reason="throttled", work_class=work), path)

    def refusing(self) -> bool:
        """Whether any throttle refuses a share now."""
        return any(throttle.refusing() for throttles in self.throttles.values() for throttle in throttles.values())

    def refuse(self, engine: EngineClient, shed: Shed, path: str) -> Reply:
        """A refusal made here, counted for `engine` (told with the next request sent to it: a call, or a request
        passed through)."""
        told = self.unreported[engine]
        told[shed.extra["reason"]] = told.get(shed.extra["reason"], 0) + 1
        return problem_reply_of(shed, path)

    async def run(self, call: Call, spent_s: float, scope: Scope) -> Reply:
        work = LIGHT if is_search(call) else WRITE  # as the engine admits it (engine_host.py)
        # A call the protocol screened (Front.refusal) was drawn for already, from its headers.
        if not scope.get(SCREENED) and (refusal := self.refused(work, scope["path"])) is not None:
            return refusal
        deadline, principal = deadline_and_principal()
        engine = self.pick(self.engines, IN_FLIGHT)
        try:
            reply = await engine.call(call, deadline, principal, spent_s, taken(self.unreported[engine]))
        except EngineGone as exc:
            return reply_of(_unavailable(scope, exc))
        self.throttles[engine][work].answered(not (reply.status == Shed.status and OVERLOADED in reply.body))
        if not reply.body:  # the engine's handler itself failed (a bug): a 500 problem with an error id, logged here
            return problem_of(RuntimeError(f"the engine process's handler failed: {reply.value}"), scope)
        return reply

    def run_inline(self, call: SearchCall, respond: Callable[[bytes], None]) -> bool:
        return False  # a front answers nothing itself


class Front(Express):
    """Express in a front process: parse here, run in the engine process; everything else passes through."""

    def __init__(self, settings: Settings, links: ProcessLinks) -> None:
        if not links.engines:
            raise RuntimeError("a front process is started by `switchyard serve`, which hands it the engines' sockets")
        self.engines = [EngineClient(engine.calls) for engine in links.engines]
        self.calls = InEngineProcess(self.engines, class_shares(settings.admission.min_inflight))
        proxies = [EngineProxy(str(sockets.http), self.calls.unreported[engine], self.calls.throttles[engine])
                   for sockets, engine in zip(links.engines, self.engines)]
        self.proxies = proxies
        self.loop_lag = loop_lag_of(settings.admission)  # the engine admits; a front bounds only its own backlog
        super().__init__(proxies[0] if len(proxies) == 1 else EngineProxies(proxies), settings, self.calls)

    def refusal(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[Reply | None, bool]:
        """A front's own refusals, made from a request's headers (answered by the protocol once its small body is
        read), as the engine makes its own (Express.refusal): one of the share of /v1 requests refused while this
        front's event loop runs behind (its backlog, bounded as the engine bounds its own: loop_lag.py), or one its
        work class's throttle refuses for the engine (for a hot call, InEngineProcess.run would refuse it once its
        body is parsed, at about eight times the CPU; other requests would be passed through over HTTP first). None:
        the request goes on, drawn for (run does not draw again). A request with a missing key or a bad header is
        left to __call__, which answers it as before."""
        self.loop_lag.arrive()
        lagging = bool(self.loop_lag.share)
        if not lagging and not self.calls.refusing():
            return None, False  # the common case, made cheap: no header is read
        if self.refusable(url, headers) is None:
            return None, False
        path = url.partition(b"?")[0].decode("latin-1")
        if lagging and self.loop_lag.refuse_next():
            engine = self.calls.pick(self.engines, IN_FLIGHT)
            return self.calls.refuse(engine, behind(self.loop_lag, "this front process's"), path), True
        verb = method.decode("latin-1")  # the work class the engine admits it in (a hot call's too: run)
        return self.calls.refused(work_of(verb, path, is_bulk(verb, path, headers))[0], path), True

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
                if self.loop_lag.target_s:
                    self.loop_lag.start(asyncio.get_running_loop())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for engine, proxy in zip(self.engines, self.proxies):
                    await engine.close()
                    await proxy.client.aclose()
                access_log.stop()
                self.loop_lag.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_front() -> Front:
    """Uvicorn's factory for a front process (`uvicorn service.process.front:create_front --factory`)."""
    return Front(Settings(), ProcessLinks.handed_down())
