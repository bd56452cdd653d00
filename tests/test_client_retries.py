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
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/problem+json" if status >= 400 else "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # clients in many threads connect at once

    server = Server(("127.0.0.1", 0), Handler)
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


@pytest.fixture
def dropping():
    """A server that answers its first request on a connection with 200, then reads the next request on that
    connection and closes it unanswered (a process that died under the call); it counts what it was sent."""
    import socket

    seen: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def connection(conn: socket.socket) -> None:
        with conn:
            buffer, answered = b"", 0
            while not stop.is_set():
                head, sep, rest = buffer.partition(b"\r\n\r\n")
                if not sep:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                    continue
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(rest) < length:
                    rest += conn.recv(65536)
                buffer = rest[length:]
                seen.append(head.split(b" ")[0].decode() + " " + head.split(b" ")[1].decode())
                if answered:
                    return  # closed unanswered
                body = json.dumps({"ok": True}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
                answered += 1

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=connection, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield seen, f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()


@pytest.mark.parametrize("transport", ["http", "pycurl"])
def test_a_call_unsafe_to_resend_is_sent_once_when_its_kept_alive_connection_dies(dropping, transport):
    """libcurl sends a request again by itself when a reused connection closes before any answer: a collection
    created (or a build started) twice. Such calls go on a new connection; an idempotent read may be resent."""
    from switchyard_client import TransportError

    if transport == "pycurl":
        pytest.importorskip("pycurl")
    seen, url = dropping
    for call in (lambda sy: sy.create_collection("c", dim=4), lambda sy: sy.build("c", wait=False),
                 lambda sy: sy.ssb_generate(0.01, wait=False)):
        with Client(url, transport=transport, retry=RetryPolicy(max_retries=0)) as sy:
            sy.engines()  # answered: the connection is kept alive
            seen.clear()
            try:
                call(sy)
            except TransportError:
                pass  # a connection that died unanswered (the fresh one: this server answers it)
        assert len(seen) == 1, seen


@pytest.mark.parametrize("transport", ["http", "pycurl"])
def test_connections_are_bounded_by_calls_in_flight_not_by_threads_that_called(scripted, transport):
    """One client shared by many short-lived threads: a handle (and socket) kept per thread that ever called ran
    the process out of file descriptors."""
    import os

    if transport == "pycurl":
        pytest.importorskip("pycurl")
    script, url = scripted
    script.answers = [(200, SEARCH_ANSWER, {})]
    with Client(url, transport=transport, max_idle_connections=4) as sy:
        before = len(os.listdir("/proc/self/fd"))
        failed: list[Exception] = []

        def search() -> None:
            try:
                sy.search("c", np.ones(4), k=2)
            except Exception as exc:  # noqa: BLE001 - asserted below
                failed.append(exc)

        for _ in range(5):
            threads = [threading.Thread(target=search) for _ in range(40)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        grown = len(os.listdir("/proc/self/fd")) - before
    assert not failed and len(script.seen) == 200, failed[:3]
    # The 4 idle connections kept, each a socket at both ends (this server runs in the test's process) and for
    # libcurl a wake-up socket pair per handle: under 24, where a handle per thread that called made about 800.
    assert grown < 24, grown


@pytest.mark.parametrize("transport", ["http", "pycurl", "async"])
def test_a_passed_deadline_is_typed_and_never_retried(scripted, transport):
    """The service's 504 (or 503 deadline-exceeded) is DeadlineExceeded, raised at once: another try would have a
    deadline of its own and the call would last several timeouts. No answer at all within the timeout is TimedOut,
    a TransportError, on every transport."""
    import asyncio

    from switchyard_client import DeadlineExceeded, TimedOut, TransportError

    if transport == "pycurl":
        pytest.importorskip("pycurl")

    def search(timeout: float):
        if transport == "async":
            async def run():
                async with AsyncClient(url, timeout=timeout) as sy:
                    return await sy.search("c", np.ones(4), k=2)
            return asyncio.run(run())
        with Client(url, transport=transport, timeout=timeout) as sy:
            return sy.search("c", np.ones(4), k=2)

    script, url = scripted
    for answer in (problem(504, "deadline-exceeded"), problem(503, "deadline-exceeded", "1")):
        script.seen.clear()
        script.answers = [answer, (200, SEARCH_ANSWER, {})]
        with pytest.raises(DeadlineExceeded):
            search(5.0)
        assert len(script.seen) == 1
    script.answers = SlowAnswers([(200, SEARCH_ANSWER, {})], delay_s=2.0)
    with pytest.raises(TimedOut) as late:
        search(0.3)
    assert isinstance(late.value, TransportError) and "0.33" in str(late.value)  # the timeout and its grace


class SlowAnswers(list):
    """Script answers that each take `delay_s` to come."""

    def __init__(self, answers, delay_s: float) -> None:
        super().__init__(answers)
        self.delay_s = delay_s

    def __getitem__(self, index):
        time.sleep(self.delay_s)
        return super().__getitem__(index)


def test_a_success_that_is_not_json_is_a_transport_error(scripted):
    """A proxy's page answered 200 was orjson's JSONDecodeError, which neither SwitchyardError nor TransportError
    catches."""
    from switchyard_client import TransportError

    script, url = scripted
    script.answers = [(200, b"<html>maintenance</html>", {})]
    with Client(url, transport="http") as sy, pytest.raises(TransportError, match="not JSON.*maintenance"):
        sy.list_collections()
