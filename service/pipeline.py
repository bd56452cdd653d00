"""The request pipeline of searches and JSON upserts: parse -> authorize -> admit -> run -> observe -> answer.

Each step is written once, and every lane goes through the same functions:
- parse: `parse_call` (http/vector_requests.parse_search / parse_upsert), a body to a typed call;
- authorize: http/auth.check_bearer;
- admit: Admission.begin (deadline, quota) and Admission.enter / enter_now (the in-flight limit);
- run and observe: `Pipeline.serve` (awaited) and `Pipeline.serve_inline` (at once, no await), in the process
  that holds the engines;
- answer: the lane's own way out, from the `Reply` the run gives.
The lanes differ only in how bytes arrive and leave and where the run happens: http/express.py (an ASGI request
of this process), http/express_protocol.py (a search answered from the HTTP parser's callbacks), and
process/front.py + process/engine_host.py (parsed in a front process, run in an engine process).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from service.errors import PROBLEM_MEDIA_TYPE, ProblemError, problem_json
from service.http.vector_requests import RAW_VECTORS, REQUEST_ERRORS, parse_search, parse_upsert
from service.metrics import Metrics
from service.process.messages import Call, Reply, SearchCall, UnparsedCall, UpsertCall

if TYPE_CHECKING:
    from service.runtime import Runtime  # not at run time: front processes import this module, not the engines

JSON_HEADERS = [("content-type", "application/json")]
HOT = re.compile(r"^/v1/collections/([A-Za-z0-9][A-Za-z0-9_-]{0,62})/(search|points)$")  # the paths of hot calls
ROUTES = {True: ("POST", "/v1/collections/{name}/search"), False: ("PUT", "/v1/collections/{name}/points")}
# A hot call's kind under the in-flight limit (Admission.enter), as http/work.kind_of names it.
HOT_KINDS = {True: ("POST", "/v1/collections/*/search"), False: ("PUT", "/v1/collections/*/points")}
Handlers = Mapping[Any, Callable[..., Any]]  # the app's exception handlers, by exception class
# JSON bodies larger than this are parsed by the run, on a thread: parsing one on the event loop held it 130 ms
# for 20 MB of payloads (this size parses in about 3 ms, twice a lone search's p99; the hop costs 0.1 ms).
LARGE_BODY_BYTES = 256 * 1024


def parse_call(search: bool, collection: str, raw: bytes, media: str, query: str) -> Call:
    """The parse step: a hot request's body as its typed call; what does not parse becomes an UnparsedCall, which
    the run parses again to answer with the exact problem (so errors have one way out: Pipeline.serve). A large
    JSON body is left unparsed here too: the run parses it off the event loop (parse_unparsed)."""
    if len(raw) > LARGE_BODY_BYTES and media != RAW_VECTORS:
        return UnparsedCall(search, collection, raw, media, query)
    try:
        return parse_search(collection, raw, media, query) if search else parse_upsert(collection, raw)
    except REQUEST_ERRORS:
        return UnparsedCall(search, collection, raw, media, query)


def parse_now(call: UnparsedCall, max_keys: int | None = None) -> SearchCall | UpsertCall:
    """An UnparsedCall's typed call, or the request's own error (`max_keys`: see parse_upsert)."""
    if call.search:
        return parse_search(call.collection, call.body, call.media, call.query)
    return parse_upsert(call.collection, call.body, max_keys)


async def parse_unparsed(call: UnparsedCall, max_keys: int | None = None) -> SearchCall | UpsertCall:
    """parse_now, on a thread for a large body. What that buys is measured in docs/design/serving.md: pydantic
    and orjson hold the GIL for a whole parse, so float lists (one C call) still stall the loop about as long,
    but payloads (Python between the pieces: each payload's own JSON text) stop stalling it."""
    if len(call.body) > LARGE_BODY_BYTES:
        return await asyncio.to_thread(parse_now, call, max_keys)
    return parse_now(call, max_keys)


def is_search(call: Call) -> bool:
    return isinstance(call, SearchCall) or (isinstance(call, UnparsedCall) and call.search)


def observe(metrics: Metrics, search: bool, status: int, seconds: float) -> None:
    """The observe step: a hot call counted under its full route's labels, as the app counts every other."""
    method, template = ROUTES[search]
    metrics.observe_request(template, method, status, seconds)


class Pipeline:
    """Run and observe for the process that holds the engines; its app's exception handlers write the problems."""

    def __init__(self, runtime: Runtime, handlers: Handlers, app: Any) -> None:
        from service.http.routes.vectors import answer_search, answer_upsert, search_inline

        self.runtime = runtime
        self.handlers = handlers
        self.app = app
        self._search, self._upsert, self._inline = answer_search, answer_upsert, search_inline

    async def serve(self, call: Call, spent_s: float = 0.0, scope: Scope | None = None) -> Reply:
        """Run a call and count it (with `spent_s`, the time a front spent on it)."""
        started = time.perf_counter()
        reply = await self.run(call, scope)
        observe(self.runtime.metrics, is_search(call), reply.status, spent_s + time.perf_counter() - started)
        return reply

    async def run(self, call: Call, scope: Scope | None = None) -> Reply:
        """The run step: a call's JSON answer, or its problem. `scope`: the HTTP request it came in, when there is
        one (the problem's `instance` and logs). Uncounted: FastAPI's routes, whose requests the app counts."""
        search = is_search(call)
        try:
            if isinstance(call, UnparsedCall):  # a large body, or one that raises the request's own error
                call = await parse_unparsed(call, self.runtime.settings.vectors.max_payload_keys)
            if isinstance(call, SearchCall):
                body = await self._search(self.runtime, call)
            else:
                assert isinstance(call, UpsertCall)  # a pipeline runs only the hot calls
                body = await self._upsert(self.runtime, call)
            return Reply(0, 200, body, JSON_HEADERS)
        except Exception as exc:  # noqa: BLE001 - every failure is answered by the app's own handler
            return await problem_reply(self.handlers, self.app, exc, scope or call_scope(call, search))

    def serve_inline(self, call: SearchCall, respond: Callable[[bytes], None]) -> bool:
        """Run a search at once if the resident engine can without waiting, its answer to `respond` as soon as it
        is made, and count it: whether it was (False: nothing was sent; serve() answers it)."""
        started = time.perf_counter()
        if not self._inline(self.runtime, call, respond):
            return False
        observe(self.runtime.metrics, True, 200, time.perf_counter() - started)  # the answer's send included
        self.runtime.metrics.answered_in_protocol()
        return True

    async def refuse(self, exc: Exception, scope: Scope) -> Reply:
        """A request a step before the run refused (401, 429, 503 ...): the answer the app's exception handler gives
        `exc`, counted when it was a hot call."""
        started = time.perf_counter()
        reply = await problem_reply(self.handlers, self.app, exc, scope)
        match = HOT.match(scope["path"])
        if match is not None and scope["method"] == ROUTES[match.group(2) == "search"][0]:
            observe(self.runtime.metrics, match.group(2) == "search", reply.status, time.perf_counter() - started)
        return reply


async def problem_reply(handlers: Handlers, app: Any, exc: Exception, scope: Scope) -> Reply:
    handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)
    if isinstance(exc, ProblemError) and handler is handlers.get(ProblemError):  # what that handler gives, without
        return problem_reply_of(exc, scope["path"])  # a Request: refusals under overload must cost little
    if handler is None:
        raise exc
    return reply_of(await handler(Request({**scope, "app": app}), exc))


def problem_reply_of(exc: ProblemError, path: str | None) -> Reply:
    """What the app's ProblemError handler answers (errors.problem_of), made without a Response: the refusals a
    process under overload sends by the thousand, each distinct one encoded once (a fresh Reply each time: the
    engine process sets its id)."""
    try:
        key: tuple | None = (type(exc), exc.detail, exc.field, path, tuple(exc.headers.items()),
                             tuple(exc.extra.items()))
        made = _problems.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable extra (a list of errors): encoded each time
        key, made = None, None
    if made is None:
        made = (problem_json(exc.status, exc.slug, exc.title, exc.detail, instance=path, field=exc.field, **exc.extra),
                [*((k.lower(), v) for k, v in exc.headers.items()), ("content-type", PROBLEM_MEDIA_TYPE)])
        if key is not None and len(made[0]) <= PROBLEM_KEPT_BYTES:
            if len(_problems) >= PROBLEMS_KEPT:
                _problems.clear()
            _problems[key] = made
    return Reply(0, exc.status, *made)


PROBLEMS_KEPT = 256  # distinct problems encoded once (refusals differ by path and by the count in their detail) ...
PROBLEM_KEPT_BYTES = 2048  # ... of at most this size
_problems: dict[tuple, tuple[bytes, list[tuple[str, str]]]] = {}


def reply_of(response: Response) -> Reply:
    """A (whole, not streamed) response as a Reply."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers if k != b"content-length"]
    return Reply(0, response.status_code, bytes(response.body), headers)


def call_scope(call: Call, search: bool) -> Scope:
    """The HTTP request a call stands for, as far as an exception handler reads it (method, path)."""
    method, template = ROUTES[search]
    return {"type": "http", "method": method, "path": template.replace("{name}", call.collection),
            "root_path": "", "query_string": b"", "headers": []}

