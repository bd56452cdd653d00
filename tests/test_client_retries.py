"""switchyard_client's retry policy against a scripted HTTP server that counts what it is sent (issue 36): a 503 or
429 with Retry-After is sent again after that wait, for idempotent calls only and within the budget; a 422 is
raised at once, typed, with its field; a timeout is sent as the request's deadline."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from switchyard_client import AsyncClient, Client, InvalidRequest, Overloaded, QuotaExceeded, RetryPolicy, Unavailable

PROBLEM = "urn:switchyard:problem:"
SEARCH_ANSWER = {"ids": [3, 1], "distances": [0.5, 1.5], "engine": "faiss", "took_ms": 0.1, "fallback": None,
                 "consistency": "bounded", "watermark": 7}


class Script:
    """The answers to give, in order (the last repeats), and what was asked."""

    def __init__(self, *answers: tuple[int, dict, dict]) -> None:
        self.answers = list(answers)
        self.seen: list[tuple[str, str, float]] = []


def problem(status: int, kind: str, retry_after: str | None = None, **extra) -> tuple[int, dict, dict]:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return status, {"type": PROBLEM + kind, "title": kind, "status": status, "detail": kind, **extra}, headers


@pytest.fixture
def scripted():
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            script.seen.append((self.command, self.path, time.monotonic()))
            status, body, headers = script.answers[min(len(script.seen), len(script.answers)) - 1]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/problem+json" if status >= 400 else "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield script, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("transport", ["http", "pycurl"])
def test_a_503_with_retry_after_is_sent_again_after_that_wait(scripted, transport):
    if transport == "pycurl":
        pytest.importorskip("pycurl")
    script, url = scripted
    script.answers = [problem(503, "overloaded", "0.3"), problem(429, "quota-exceeded", "0.2"),
                      (200, SEARCH_ANSWER, {})]
    with Client(url, transport=transport) as sy:
        hits = sy.search("c", np.ones(4), k=2)
    assert hits.ids.tolist() == [3, 1] and hits.distances.dtype == np.float32
    assert len(script.seen) == 3
    first, second, third = (t for _, _, t in script.seen)
    assert second - first >= 0.3 and third - second >= 0.2


def test_a_422_is_raised_at_once_with_its_field(scripted):
    script, url = scripted
    script.answers = [problem(422, "validation-error", field="k", errors=[{"field": "k", "reason": "too small"}])]
    with Client(url, transport="http") as sy, pytest.raises(InvalidRequest) as bad:
        sy.search("c", np.ones(4), k=0)
    assert bad.value.field == "k" and bad.value.errors[0]["reason"] == "too small"
    assert len(script.seen) == 1


def test_what_is_not_idempotent_is_never_sent_twice(scripted):
    script, url = scripted
    script.answers = [problem(503, "overloaded", "0")]
    with Client(url, transport="http") as sy, pytest.raises(Overloaded) as refused:
        sy.create_collection("c", dim=4)
    assert refused.value.retry_after == 0.0 and len(script.seen) == 1
    script.seen.clear()
    with Client(url, transport="http") as sy, pytest.raises(Overloaded):
        sy.build("c")
    assert len(script.seen) == 1


def test_retries_stop_at_the_policy_bounds(scripted):
    script, url = scripted
    script.answers = [problem(503, "unavailable", "0.05")]
    with Client(url, transport="http", retry=RetryPolicy(max_retries=2)) as sy, pytest.raises(Unavailable):
        sy.get_collection("c")
    assert len(script.seen) == 3  # the call and two retries
    script.seen.clear()
    script.answers = [problem(429, "quota-exceeded", "5")]  # one wait alone would pass the budget
    with Client(url, transport="http", retry=RetryPolicy(budget_s=1.0)) as sy, pytest.raises(QuotaExceeded):
        sy.get_collection("c")
    assert len(script.seen) == 1


def test_the_async_client_retries_the_same_way(scripted):
    import asyncio

    script, url = scripted
    script.answers = [problem(503, "overloaded", "0.1"), (200, SEARCH_ANSWER, {})]

    async def search():
        async with AsyncClient(url) as sy:
            return await sy.search("c", np.ones(4), k=2)

    assert asyncio.run(search()).ids.tolist() == [3, 1]
    assert len(script.seen) == 2


def test_a_timeout_is_sent_as_the_request_deadline(scripted):
    script, url = scripted
    script.answers = [(200, SEARCH_ANSWER, {})]
    seen_headers: list[str] = []
    with Client(url, transport="http") as sy:
        import http.client

        original = http.client.HTTPConnection.request

        def spy(self, method, path, body=None, headers=None, **kwargs):
            seen_headers.append((headers or {}).get("X-Request-Timeout"))
            return original(self, method, path, body, headers or {}, **kwargs)

        http.client.HTTPConnection.request = spy
        try:
            sy.search("c", np.ones(4), k=2)
            sy.with_options(timeout=2.5).search("c", np.ones(4), k=2)
        finally:
            http.client.HTTPConnection.request = original
    assert seen_headers == [None, "2.5"]
