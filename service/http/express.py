"""Express: the outermost layer of the app, where every /v1 request is admitted and the hottest ones are answered.

Every /v1 request is authorized from its headers, then its body is read (under its arrival deadline and the body
limit: service/http/limits.py), and only then does it take a slot under the in-flight limit (Admission.enter): a
client without the key, or one sending its body slowly, holds a socket and nothing more. Searches (JSON, base64 or
raw float32 bodies) and JSON upserts then go down the request pipeline (service/pipeline.py) without FastAPI: its
per-request machinery and the general middleware stack cost about as much again as the engine's few hundred
microseconds. Express takes a request whose length is declared and within the body limit and whose body it parses;
anything else goes to the full app. Where the run happens is the `Runner` given: this process (`InThisProcess`), or
an engine process (process/front.py). A search the resident engine can answer at once is answered from the HTTP
parser's callbacks instead (`claim` and `answer_inline`, called by http/express_protocol.py). Whatever fails
unexpectedly on any lane is answered as a problem (500 with an error id), never as the server's plain text. Hot calls
that succeed are access-logged only when sampled (SWITCHYARD_ACCESS_LOG_SAMPLE), those that fail whenever the access
log is on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from typing import Awaitable, Callable, NamedTuple, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from service.admission.control import PRINCIPAL, TIMEOUT_HEADER, Admission, Queued, parse_timeout, principal_of
from service.admission.deadlines import deadline as current_deadline
from service.admission.deadlines import set_deadline
from service.admission.pressure import LIGHT
from service.errors import BadRequest, ProblemError, ServiceUnavailable, UnsupportedMediaType, internal_problem
from service.http.access_log import log_request
from service.http.auth import api_key, check_bearer
from service.http.limits import BodyGone, is_bulk, read_body, replay, timed_receive
from service.http.media import media_type
from service.http.vector_requests import RAW_VECTORS, REQUEST_ERRORS, parse_search
from service.http.work import work_of
from service.metrics import StatusSend
from service.pipeline import HOT, HOT_KINDS, Pipeline, parse_call, problem_reply_of, reply_of
from service.process.messages import Call, Reply, SearchCall
from service.settings import Settings

JSON = b"application/json"
RAW_VECTORS_BYTES = RAW_VECTORS.encode()
log = logging.getLogger("switchyard.express")
# A front process's client address, to its engine process (quotas): trusted only by an engine process behind fronts
# (whose HTTP socket only the fronts reach; a front drops the header from what its clients send).
CLIENT_HEADER = b"x-switchyard-client"
# A front process's own refusals since its last request to this engine (`throttled=3,loop_lag=1`), for the engine's
# metrics: carried by requests passed through over HTTP (hot calls carry them in their link frame), trusted as
# CLIENT_HEADER is.
REFUSED_HEADER = b"x-switchyard-refused"
FRONT_REASONS = frozenset({"throttled", "loop_lag"})  # the reasons a front refuses for: no other label is counted
INLINE_MAX_BODY = 1 << 20  # bodies the protocol may hold for an inline answer: a few single-vector searches' worth
# An inline answer takes microseconds (SWITCHYARD_INLINE_SEARCH_US): a deadline at least this far off cannot pass
# while it runs, so a request carrying one may still be answered inline (clients that always send their timeout).
INLINE_MIN_DEADLINE_S = 1.0
PARSED_CALL = "switchyard.parsed_call"  # the scope key of a search answer_inline parsed but left unanswered ...
QUEUED = "switchyard.queued"  # ... and of the place in the queue it took for it
SCREENED = "switchyard.screened"  # a request the protocol let through Express.refusal, drawn for there already (the
# loop's share; a front's throttle)


class Headers(NamedTuple):
    """What express reads of a request's headers."""
    length: int  # declared Content-Length; -1: none, or not a number
    media: bytes
    authorization: bytes | None
    timeout: bytes | None  # X-Request-Timeout
    forwarded: bytes | None  # a front process's client address
    chunked: bool
    refused: bytes | None  # a front process's own refusals (REFUSED_HEADER)


def read_headers(headers: list[tuple[bytes, bytes]]) -> Headers:
    """What express reads of the headers; BadRequest for a repeated Content-Type (service/http/media.py) or
    X-Request-Timeout, UnsupportedMediaType for a body with a Content-Encoding."""
    length, authorization, timeout, forwarded, chunked, refused = -1, None, None, None, False, None
    encodings: list[bytes] = []
    media = media_type(headers, JSON)
    for name, value in headers:
        if name == b"content-length":
            length = int(value) if value.isdigit() else -1
        elif name == b"authorization":
            authorization = value
        elif name == TIMEOUT_HEADER:
            if timeout is not None:  # as Content-Type: no two readers may take different copies
                raise BadRequest("X-Request-Timeout is given more than once; send it once", field="X-Request-Timeout")
            timeout = value
        elif name == CLIENT_HEADER:
            forwarded = value
        elif name == b"transfer-encoding":
            chunked = True
        elif name == REFUSED_HEADER:
            refused = value
        elif name == b"content-encoding":
            encodings.extend(coding.strip().lower() for coding in value.split(b","))
    if any(coding not in (b"", b"identity") for coding in encodings) and (length > 0 or chunked):
        raise UnsupportedMediaType(  # read as plain, a gzipped body was "invalid JSON" (RFC 9110 15.5.16)
            f"request bodies are read as sent: Content-Encoding {b', '.join(encodings).decode('latin-1')} is not "
            "supported; send the body uncompressed", field="Content-Encoding", headers={"Accept-Encoding": "identity"})
    return Headers(length, media, authorization, timeout, forwarded, chunked, refused)


def refused_header(counts: dict[str, int]) -> bytes:
    """A front's refusals by reason, as REFUSED_HEADER carries them."""
    return ",".join(f"{reason}={count}" for reason, count in counts.items()).encode("latin-1")


def refused_counts(value: bytes) -> dict[str, int]:
    """REFUSED_HEADER's counts, by reason; what is malformed, or names another reason, is left out."""
    counts = {}
    for item in value.decode("latin-1").split(","):
        reason, _, count = item.partition("=")
        if reason in FRONT_REASONS and count.isdigit():
            counts[reason] = int(count)
    return counts


class Claim(NamedTuple):
    """A search claimed from its headers for an inline answer, once its body is read."""
    collection: str
    media: str
    query: str


class Runner(Protocol):
    """Where a hot call runs."""

    async def run(self, call: Call, spent_s: float, scope: Scope) -> Reply: ...

    def run_inline(self, call: SearchCall, respond: Callable[[bytes], None]) -> bool: ...


class InThisProcess:
    """Calls run in this process, which holds the engines."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def run(self, call: Call, spent_s: float, scope: Scope) -> Reply:
        return await self.pipeline.serve(call, spent_s, scope)

    def run_inline(self, call: SearchCall, respond: Callable[[bytes], None]) -> bool:
        return self.pipeline.serve_inline(call, respond)


# The answer to a request express cannot serve itself (its admission or authorisation failed): the app's problem.
Refusal = Callable[[Exception, Scope], Awaitable[Reply]]


class Express:
    """`app`: the full app, for everything else. `refuse`: the app's answer to a failed step (None: a front process,
    which answers those with the step's own problem: `problem_of`)."""

    def __init__(self, app: ASGIApp, settings: Settings, runner: Runner, admission: Admission | None = None,
                 refuse: Refusal | None = None, inline: bool = False, trust_forwarded: bool = False) -> None:
        self.app = app
        self.runner = runner
        self.admission = admission  # None in a front process: the engine process admits
        self.refuse = refuse
        self.trust_forwarded = trust_forwarded  # an engine process behind fronts: CLIENT_HEADER names the client
        self.inline = inline  # whether searches may be answered from the protocol's callbacks
        self.quota = bool(settings.admission.quota_requests_per_s)  # a front names the principal, the engine counts
        self.default_timeout = settings.admission.request_timeout_s
        self.max_body = settings.server.max_body_bytes
        self.read_timeout_s = settings.server.read_timeout_s
        self.sample = settings.server.access_log_sample
        self.log_failures = settings.server.access_log  # successes are logged only when sampled
        self.key = api_key(settings)

    # -- the inline answer, from the HTTP protocol's callbacks (http/express_protocol.py) -------------------------
    def claim(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> Claim | None:
        """A search answer_inline may answer once its body is read, from its request line and headers, or None:
        the request goes through __call__ as any other. Requests with a deadline under INLINE_MIN_DEADLINE_S, a quota
        to charge, a forwarded client or a body of undeclared length always go that way, as do those that fail a step
        (to be answered)."""
        if not self.inline or method != b"POST" or self.quota or not far_off(self.default_timeout):
            return None
        path, _, query = url.partition(b"?")
        match = HOT.match(path.decode("latin-1"))
        if match is None or match.group(2) != "search":
            return None
        try:
            h = read_headers(headers)
        except ProblemError:
            return None
        if (not far_off(h.timeout) or h.forwarded is not None or h.chunked
                or not 0 < h.length <= min(INLINE_MAX_BODY, self.max_body)
                or not self._parses(h, True)):
            return None
        try:
            check_bearer(self.key, h.authorization)
        except ProblemError:
            return None
        return Claim(match.group(1), h.media.decode(), query.decode("latin-1"))

    def answer_inline(self, claim: Claim, raw: bytes, respond: Callable[[bytes], None],
                      refuse: Callable[[Reply], None]) -> tuple[bool, SearchCall | None, Queued | None]:
        """The claimed search answered at once, admitted and counted as __call__ would: whether its answer went to
        `respond` (False: nothing was sent, and the request goes through __call__); the call it was parsed to, if
        it was, and its place in the queue, if it took one: __call__ finds them in its scope (PARSED_CALL, QUEUED),
        does not parse the body again and waits in that place."""
        ticket, gated = None, False
        if self.admission is not None:
            gated = bool(self.admission.loop_lag.target_s)
            try:  # one of the share refused while the loop runs behind; else a slot, or a place in the queue (to
                self.admission.check_loop()  # wait in on the app's path), or a refusal here at once
                if (ticket := self.admission.enter_now(LIGHT)) is None:
                    return False, None, self.admission.queue_now(LIGHT, HOT_KINDS[True])
            except ProblemError as exc:
                refuse(problem_of(exc, {"method": "POST", "path": f"/v1/collections/{claim.collection}/search"}))
                return True, None, None
        answered, call = False, None
        try:
            call = parse_search(claim.collection, raw, claim.media, claim.query)
            answered = self.runner.run_inline(call, respond)
        except REQUEST_ERRORS:
            pass
        finally:
            if ticket is not None:
                # With the loop's lag gate on, that bounds inline answers, and their latency moves no limit: they
                # never waited, and searches on the app's way (a thread, a batch), measured against it, looked
                # slowed (the limit sat at its floor). Without it, the limit their latency moves is their only bound.
                ticket.leave(HOT_KINDS[True] if answered and not gated else None)
        if answered and self.sample and random.random() < self.sample:
            log_request({"client": None, "method": "POST", "path": f"/v1/collections/{claim.collection}/search",
                         "query_string": claim.query.encode("latin-1")}, 200, 0.0, sampled=True)
        return answered, call, None

    def refusal(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[Reply | None, bool]:
        """The 503 a /v1 request gets from its headers alone when its work class has no free slot and no room to
        wait, or it is one of the share refused while the event loop runs behind (Admission.check_room), for the
        protocol to answer without an ASGI cycle: the cheapest refusal, which a process refusing most of what it is
        sent must keep cheap. None: the request goes on to __call__, which also answers whatever fails an earlier
        step (the key, a bad header, a quota); and whether it was screened (counted in the loop's share)."""
        if self.admission is None or self.quota or not self.admission.crowded():
            return None, False
        if (h := self.refusable(url, headers)) is None:
            return None, False
        verb, path = method.decode("latin-1"), url.partition(b"?")[0].decode("latin-1")
        work, kind = work_of(verb, path, is_bulk(verb, path, headers))
        try:
            self.admission.check_room(work, kind)
        except ProblemError as exc:
            self._told(h)  # refused here: __call__, which would count them, does not run
            return problem_of(exc, {"method": verb, "path": path}), True
        return None, True

    def refusable(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> Headers | None:
        """The headers of a /v1 request the protocol may refuse from them: its key verified, its X-Request-Timeout
        well formed and its body small enough to hold (the protocol reads the body it refuses); None: the request
        goes on to __call__, which answers whatever fails those steps."""
        if not url.startswith(b"/v1/"):
            return None
        try:
            h = read_headers(headers)
            check_bearer(self.key, h.authorization)
            if h.timeout is not None:
                parse_timeout(h.timeout)
        except ProblemError:
            return None
        return None if h.chunked or h.length > INLINE_MAX_BODY else h

    # -- ASGI ------------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        queued: Queued | None = scope.get(QUEUED)  # type: ignore[assignment]
        watched = StatusSend(send, 0)
        try:
            await self._admitted(scope, receive, watched, queued)
        except asyncio.CancelledError:
            # Only the server cancels a request's task: uvicorn at shutdown, once --timeout-graceful-shutdown has
            # passed. Its own answer would be a plain-text 500 that no client can tell from a bug.
            if watched.status:
                raise
            log.warning("%s %s was still running when the server stopped: answered 503", scope["method"],
                        scope["path"])
            await _send_reply(send, problem_of(ServiceUnavailable(
                "the service stopped while this request ran; what it wrote may or may not have been committed: "
                "read before you write again", headers={"Retry-After": "1", "Connection": "close"}), scope))
        finally:
            if queued is not None:
                queued.abandon()  # a place in the queue the request did not wait in (it failed a step before)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, queued: Queued | None) -> None:
        """A /v1 request authorized, its body read, then a slot taken (in the place queued for it, if any) and the
        request served; anything else served as is."""
        match = HOT.match(scope["path"])
        v1 = scope["path"].startswith("/v1/")  # probes and metrics: never refused here (but a repeated Content-Type)
        try:
            h = read_headers(scope["headers"])
            self._told(h)
            bulk = is_bulk(scope["method"], scope["path"], scope["headers"])
            work, kind = work_of(scope["method"], scope["path"], bulk)
            if v1:  # authorize first: a client without the key sends no body and takes no slot
                check_bearer(self.key, h.authorization)
                if h.timeout is not None or self.default_timeout is not None or self.quota:
                    self._begin(scope, h)  # a bad X-Request-Timeout, or over quota, refuses it
                if self.admission is not None and queued is None:  # no slot, no room to wait, or the loop behind:
                    self.admission.check_room(work, kind, bool(scope.get(SCREENED)))  # refused before its body
        except ProblemError as exc:
            await self._refused(scope, receive, send, exc)
            return
        try:  # then the body, before any slot: a slow body holds a socket, not a slot
            raw, receive = await self._arrived(scope, receive, h, bulk)
        except BodyGone:
            return
        except ProblemError as exc:  # too slow or too large
            await self._refused(scope, receive, send, exc)
            return
        watched = StatusSend(send, 0)
        if self.admission is None or not v1:
            await self._guarded(scope, receive, watched, match, h, raw)
            return
        try:
            ticket = await (queued.wait(self.admission) if queued is not None else self.admission.enter(work, kind))
        except ProblemError as exc:
            await self._refused(scope, receive, send, exc)
            return
        try:
            await self._guarded(scope, receive, watched, match, h, raw)
        finally:  # successes' latency, by kind of request, moves the limit
            ticket.leave(kind if 200 <= watched.status < 300 else None)

    async def _arrived(self, scope: Scope, receive: Receive, h: Headers, bulk: bool) -> tuple[bytes | None, Receive]:
        """The body, read whole under its arrival deadline and the body limit (service/http/limits.py), and the
        receive the app reads it from. None where it is not read here: no body, a declared length over the limit
        (the app answers 413 without reading it), or a bulk load (streamed to the app, under the deadline)."""
        if h.length < 0 and not h.chunked:
            return None, receive
        if bulk:
            return None, timed_receive(receive, self.read_timeout_s)
        if h.length > self.max_body:
            return None, receive
        raw = await read_body(receive, self.max_body, self.read_timeout_s)
        return raw, replay(raw, receive)

    async def _guarded(self, scope: Scope, receive: Receive, send: StatusSend, match: re.Match | None, h: Headers,
                       raw: bytes | None) -> None:
        """_serve, with whatever it raises answered as a problem (500 with an error id at worst): uncaught, the
        server would answer plain text and drop the connection."""
        try:
            await self._serve(scope, receive, send, match, h, raw)
        except Exception as exc:  # noqa: BLE001 - every failure gets a problem
            if send.status:  # answered already (the app's error handler sends its 500, then re-raises): done
                return
            await _send_reply(send, await self._problem_of(exc, scope))

    async def _serve(self, scope: Scope, receive: Receive, send: Send, match: re.Match | None, h: Headers,
                     raw: bytes | None) -> None:
        search = match is not None and match.group(2) == "search"
        if (match is None or raw is None or scope["method"] != ("POST" if search else "PUT")
                or not self._parses(h, search)):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        call = scope.get(PARSED_CALL) or parse_call(search, match.group(1), raw, h.media.decode(),
                                                   scope["query_string"].decode("latin-1"))
        reply = await self.runner.run(call, time.perf_counter() - started, scope)
        await _send_reply(send, reply)
        if (self.log_failures and reply.status != 200) or (self.sample and random.random() < self.sample):
            log_request(scope, reply.status, time.perf_counter() - started, sampled=reply.status == 200)

    def _told(self, h: Headers) -> None:
        """Count the refusals a front made for this engine, which the request carries (REFUSED_HEADER)."""
        if h.refused and self.trust_forwarded and self.admission is not None:
            for reason, count in refused_counts(h.refused).items():
                self.admission.shed("requests", reason, count)

    def _parses(self, h: Headers, search: bool) -> bool:
        return h.media == JSON or (search and h.media == RAW_VECTORS_BYTES)

    def _begin(self, scope: Scope, h: Headers) -> None:
        """The admit step's per-request part: the deadline, and the principal charged under quotas."""
        seconds = parse_timeout(h.timeout) if h.timeout is not None else self.default_timeout
        deadline = time.monotonic() + seconds if seconds is not None else None
        principal = self._principal(scope, h) if self.quota and scope["path"].startswith("/v1/") else None
        if self.admission is not None:
            self.admission.begin(deadline, principal)
        else:  # a front: the engine process counts, with what the front sends along
            set_deadline(deadline)
            if principal is not None:
                PRINCIPAL.set(principal)

    def _principal(self, scope: Scope, h: Headers) -> str:
        """Whose quota the request draws on: the key it holds (verified before this step) or, with no key configured,
        its client's address; in an engine process behind fronts, the address its front forwards."""
        client = scope.get("client")
        if client is None and self.trust_forwarded and h.forwarded:
            client = (h.forwarded.decode("latin-1"), 0)
        return principal_of(self.key, client)

    async def _refused(self, scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
        """A request a step refused, answered as the app answers that error (the request is not run). A front
        answers it itself, with the same problem the engine's app would give: passed through, its body would be
        forwarded to the engine (a keyless or slow client would hold an engine connection)."""
        await _send_reply(send, await self._problem_of(exc, scope))

    async def _problem_of(self, exc: Exception, scope: Scope) -> Reply:
        """The answer to `exc`: the app's handler's (`refuse`), or, in a front process, which has none, its own."""
        if self.refuse is not None:
            try:
                return await self.refuse(exc, scope)
            except Exception:  # noqa: BLE001 - the handler failed too: the plain problem below
                pass
        return problem_of(exc, scope)


def problem_of(exc: Exception, scope: Scope) -> Reply:
    """`exc` as a problem without the app's handlers: a ProblemError's own; anything else 500 with an error id."""
    if isinstance(exc, ProblemError):
        return problem_reply_of(exc, scope["path"])
    return reply_of(internal_problem(scope.get("method"), scope.get("path"), exc))


def far_off(timeout: float | bytes | None) -> bool:
    """Whether a request's deadline (seconds, or its X-Request-Timeout header) leaves room for an inline answer:
    none at all, or one at least INLINE_MIN_DEADLINE_S away. A malformed header does not (the app answers it)."""
    if timeout is None:
        return True
    try:
        seconds = parse_timeout(timeout) if isinstance(timeout, bytes) else timeout
    except ProblemError:
        return False
    return seconds >= INLINE_MIN_DEADLINE_S


def deadline_and_principal() -> tuple[float | None, str]:
    """What a call carries to the process that runs it: the request's deadline and principal."""
    return current_deadline(), PRINCIPAL.get()


async def _send_reply(send: Send, reply: Reply) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers]
    await send({"type": "http.response.start", "status": reply.status,
                "headers": [*headers, (b"content-length", str(len(reply.body)).encode())]})
    await send({"type": "http.response.body", "body": reply.body})
