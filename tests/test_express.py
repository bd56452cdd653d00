"""Express (service/http/express.py): which searches it claims for an inline answer, from headers alone, and what it
refuses before anything else."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from service.admission.control import Admission
from service.http.app import create_app
from service.http.express import Claim, Express
from service.settings import Settings

SEARCH = b"/v1/collections/c1/search?k=3"


def headers(length: int, media: bytes = b"application/json", **more: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-length", str(length).encode()), (b"content-type", media),
            *((name.replace("_", "-").encode(), value) for name, value in more.items())]


def express(**settings: object) -> Express:
    return Express(app=None, settings=Settings(**settings), runner=None, inline=True)  # type: ignore[arg-type]


def test_a_plain_search_within_the_limits_is_claimed_with_its_options():
    claim = express().claim(b"POST", SEARCH, headers(100, b"application/octet-stream"))
    assert claim == Claim("c1", "application/octet-stream", "k=3")


def test_what_must_be_refused_or_bounded_is_never_claimed():
    small = express(max_body_bytes=2000)
    assert small.claim(b"POST", SEARCH, headers(2000)) is not None
    assert small.claim(b"POST", SEARCH, headers(2001)) is None  # over the body limit: the app answers 413
    keyed = express(api_key="k")
    assert keyed.claim(b"POST", SEARCH, headers(10)) is None  # no key: the app answers 401
    assert keyed.claim(b"POST", SEARCH, headers(10, authorization=b"Bearer x")) is None
    assert keyed.claim(b"POST", SEARCH, headers(10, authorization=b"Bearer k")) is not None
    plain = express()
    assert plain.claim(b"POST", SEARCH, headers(10, x_request_timeout=b"0.5")) is None  # a deadline to keep
    assert plain.claim(b"POST", SEARCH, headers(10, x_request_timeout=b"nan")) is None  # the app answers 400
    assert plain.claim(b"POST", SEARCH, headers(10, x_request_timeout=b"1")) is not None  # none an answer can miss
    assert plain.claim(b"POST", SEARCH, headers(10, transfer_encoding=b"chunked")) is None
    assert plain.claim(b"POST", SEARCH, headers(10, b"text/plain")) is None
    assert plain.claim(b"PUT", b"/v1/collections/c1/points", headers(10)) is None  # upserts are never inline
    assert plain.claim(b"POST", b"/v1/collections/c1/recall", headers(10)) is None
    assert express(quota_requests_per_s=5).claim(b"POST", SEARCH, headers(10)) is None  # a quota to charge
    assert express(request_timeout_s=0.5).claim(b"POST", SEARCH, headers(10)) is None
    assert express(request_timeout_s=5).claim(b"POST", SEARCH, headers(10)) is not None


def test_a_request_without_the_key_is_refused_before_it_takes_a_slot_or_sends_its_body(tmp_path):
    """Authorize, then admit: N half-sent bodies without the key must not hold the in-flight slots of everyone."""
    app = create_app(Settings(api_key="k", data_dir=tmp_path))
    classes = app.express.admission.classes
    sent: list[dict] = []

    async def receive() -> dict:
        raise AssertionError("express read the body of a request it must refuse")

    async def send(message: dict) -> None:
        sent.append(message)

    for path in ("/v1/collections", "/v1/collections/c1/search", "/v1/olap/sql"):
        sent.clear()
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "headers": [(b"content-length", b"1000"), (b"content-type", b"application/json")],
                 "client": ("192.0.2.1", 4000), "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}
        asyncio.run(app(scope, receive, send))
        assert sent[0]["status"] == 401, (path, sent)
        assert (b"www-authenticate", b'Bearer realm="switchyard"') in sent[0]["headers"]
        assert classes is not None and not any(work.inflight for work in classes.values())


def test_a_search_the_inline_lane_declines_is_parsed_once(monkeypatch):
    """A search parsed for an inline answer and declined there (its cost not learnt yet, say) reaches the app's path
    with its parsed call: a large filter's parse is paid once, not once per lane."""
    from service.http import express as express_module
    from service.http.express import PARSED_CALL
    from service.process.messages import Reply

    ran: list[object] = []

    class Declining:
        def run_inline(self, call, respond) -> bool:
            return False

        async def run(self, call, spent_s, scope) -> Reply:
            ran.append(call)
            return Reply(0, 200, b"{}")

    ex = Express(app=None, settings=Settings(), runner=Declining(), inline=True)  # type: ignore[arg-type]
    body = b'{"vector": [1.0, 2.0], "k": 3, "filter": {"tag": {"$in": ["a", "b"]}}}'
    answered, call, _ = ex.answer_inline(Claim("c1", "application/json", ""), body, [].append, [].append)
    assert not answered and call is not None and call.k == 3 and call.filter == {"tag": {"$in": ["a", "b"]}}

    def parse_again(*args: object) -> None:
        raise AssertionError("the app's path parsed the body again")

    monkeypatch.setattr(express_module, "parse_call", parse_again)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/collections/c1/search", "query_string": b"",
             "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")],
             PARSED_CALL: call}
    asyncio.run(ex(scope, receive, send))
    assert ran == [call] and sent[0]["status"] == 200


class SlowInline:
    """A runner whose inline answers take `seconds` each (an engine on a busy core)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run_inline(self, call: object, respond: Callable[[bytes], None]) -> bool:
        time.sleep(self.seconds)
        respond(b"{}")
        return True


def test_with_the_loop_gate_inline_answers_neither_move_the_limit_nor_pass_a_loop_running_behind(tmp_path):
    """With the event loop's lag gate on, an inline answer's latency is no slowdown, and no unqueued latency for the
    searches that go the app's way (a thread, a batch) to be measured against (counted, it held the light limit at
    its floor); while the loop runs behind, the share the gate refuses is refused here too."""
    settings = Settings(data_dir=tmp_path, max_inflight=4, loop_lag_target_ms=1.0)
    admission = Admission(settings)
    light = admission.classes["light"]
    app = Express(app=None, settings=settings, runner=SlowInline(0.002), admission=admission,  # type: ignore[arg-type]
                  inline=True)
    claim = Claim("c1", "application/json", "")
    answers, refusals = [], []
    for _ in range(40):
        light._interval_end = 0.0  # every answer may end an interval
        assert app.answer_inline(claim, b'{"vector": [1.0], "k": 1}', answers.append, refusals.append)[0]
    assert len(answers) == 40 and not refusals
    assert light.inflight == 0 and light.limit == 4 and not light.kinds
    admission.loop_lag.share = 0.5
    for _ in range(4):
        assert app.answer_inline(claim, b'{"vector": [1.0], "k": 1}', answers.append, refusals.append)[0]
    assert len(answers) == 42 and [r.status for r in refusals] == [503, 503]
    assert b'"reason":"loop_lag"' in refusals[0].body.replace(b" ", b"") and light.inflight == 0
    # Without the gate, the light limit is their only bound: their latency moves it.
    settings = Settings(data_dir=tmp_path, max_inflight=4, loop_lag_target_ms=0)
    admission = Admission(settings)
    app = Express(app=None, settings=settings, runner=SlowInline(0.0), admission=admission,  # type: ignore[arg-type]
                  inline=True)
    assert app.answer_inline(claim, b'{"vector": [1.0], "k": 1}', answers.append, refusals.append)[0]
    assert list(admission.classes["light"].kinds) == [("POST", "/v1/collections/*/search")]


def test_a_request_the_server_cancels_at_shutdown_is_a_503_problem_not_a_plain_500():
    """uvicorn cancels the requests still running once --timeout-graceful-shutdown has passed, and answers a plain-
    text 500 for any that has not started its answer; one that has keeps what it sent."""
    import orjson

    started: list[asyncio.Event] = []

    async def running(scope, receive, send) -> None:
        if scope["path"] == "/v1/answering":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        started[-1].set()
        await asyncio.sleep(3600)

    async def request(path: str) -> tuple[list[dict], BaseException | None]:
        ex = Express(app=running, settings=Settings(), runner=None)  # type: ignore[arg-type]
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]}
        started.append(asyncio.Event())
        task = asyncio.create_task(ex(scope, receive, send))
        await started[-1].wait()
        task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        try:
            await task
        except BaseException as exc:  # noqa: BLE001 - what uvicorn would see
            return sent, exc
        return sent, None

    sent, raised = asyncio.run(request("/v1/olap/sql"))
    assert raised is None and sent[0]["status"] == 503
    head = dict(sent[0]["headers"])
    assert head[b"content-type"] == b"application/problem+json" and head[b"retry-after"] == b"1"
    assert head[b"connection"] == b"close"
    problem = orjson.loads(sent[1]["body"])
    assert problem["type"] == "urn:switchyard:problem:unavailable" and "stopped" in problem["detail"]
    sent, raised = asyncio.run(request("/v1/answering"))
    assert isinstance(raised, asyncio.CancelledError) and [m["status"] for m in sent] == [200]
