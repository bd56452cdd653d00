"""Connections against a real `switchyard serve` (issue 35, item 5): the cap on open connections
(SWITCHYARD_MAX_CONNECTIONS) closes idle ones first, so an honest client is answered while idle connections pile up,
and answers a clean 503 problem when every connection is busy; the keep-alive timeout (SWITCHYARD_KEEP_ALIVE_S) and
the read deadline (SWITCHYARD_READ_TIMEOUT_S) hold in every layout. The scaled-down form of
loadtests/idle_connections.py (cap 50, 100 idle connections)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Iterator

import httpx
import orjson
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from helpers import closed_by_server, raw_socket, read_response
from loadtests.processes import local_service
from service.http import connections
from service.process.launcher import CAPPED_PROTOCOL

CAP = 50
# Layouts, and whether one process faces the clients (the kernel spreads connections among several unevenly, so
# only there does a given number of connections reach the cap for sure).
LAYOUTS = {
    "one process": ({}, True),
    "uvicorn's protocol": ({"SWITCHYARD_EXPRESS_PROTOCOL": "false"}, True),
    "a front": ({"SWITCHYARD_FRONTS": "1"}, True),
    "engines": ({"SWITCHYARD_ENGINES": "2", "SWITCHYARD_FRONTS": "1"}, True),
    "workers": ({"SWITCHYARD_WORKERS": "2"}, False),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("connections")
    layout, one_facing = LAYOUTS[request.param]
    env = {"SWITCHYARD_MAX_CONNECTIONS": str(CAP), "SWITCHYARD_KEEP_ALIVE_S": "1", "SWITCHYARD_READ_TIMEOUT_S": "3",
           **layout}
    with local_service(1, folder / "data", folder / "serve.log", env=env) as url:
        yield url, folder / "serve.log", one_facing


@pytest.fixture
def capped(served):
    url, log, one_facing = served
    if not one_facing:
        pytest.skip("several processes face the clients: how many connections each gets is the kernel's choice")
    return url, log


def dropped(sock: socket.socket) -> bool:
    """Whether the server has closed the connection without a word (the cap closing an idle one), now."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:  # nothing to read: open
        return False
    except ConnectionResetError:
        return True


def honest(url: str, n: int) -> list[int]:
    """n requests, each on a new connection: their statuses. A 503 must be a clean problem; an empty reply or a
    reset fails the test."""
    statuses = []
    for _ in range(n):
        with httpx.Client(base_url=url, timeout=10) as client:
            r = client.get("/v1/collections")
        if r.status_code == 503:
            assert r.headers["content-type"] == "application/problem+json" and "retry-after" in r.headers, r.text
        statuses.append(r.status_code)
    return statuses


def test_idle_connections_past_the_cap_are_closed_for_an_honest_client(capped):
    url, _ = capped
    with ExitStack() as stack:
        idle = [stack.enter_context(raw_socket(url)) for _ in range(3 * CAP)]
        time.sleep(0.3)
        assert honest(url, 20) == [200] * 20
        # The idle connections over the cap were closed to make room, the oldest first (before the read deadline,
        # 3 s, which answers 408 first), and one more for the first honest connection.
        gone = [dropped(sock) for sock in idle]
        assert sum(gone) >= 2 * CAP + 1, sum(gone)
        assert all(gone[:2 * CAP]), "not the oldest idle connections were closed first"
    assert honest(url, 5) == [200] * 5


def test_when_no_connection_is_idle_a_new_one_gets_a_clean_503_and_the_service_recovers(capped):
    url, log = capped
    with ExitStack() as stack:
        busy = []
        for _ in range(CAP + 10):  # headers begun, never finished: busy, until the read deadline
            sock = stack.enter_context(raw_socket(url))
            sock.sendall(b"GET /v1/collections HTTP/1.1\r\nHost: t\r\n")
            busy.append(sock)
        time.sleep(0.3)
        with raw_socket(url) as sock:
            sock.sendall(b"GET /v1/collections HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, body = read_response(sock)
            assert status == 503, body
            assert headers["content-type"] == "application/problem+json" and headers["retry-after"] == "1"
            assert headers["connection"] == "close"
            assert orjson.loads(body)["type"] == "urn:switchyard:problem:too-many-connections"
            assert closed_by_server(sock, 5)
    assert honest(url, 5) == [200] * 5
    assert "none idle, at the cap of 50" in log.read_text()


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(served):
    url = served[0]
    with raw_socket(url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock)[0] == 200
        started = time.monotonic()
        assert closed_by_server(sock, 5)
        assert time.monotonic() - started < 2.5  # SWITCHYARD_KEEP_ALIVE_S=1, not uvicorn's default 5 s, nor the
        # read deadline (3 s)


@pytest.mark.parametrize("route", ["app", "search", "bulk"])
def test_a_trickling_body_is_cut_off_in_every_layout(served, route):
    """A body sent a byte a second: 408 within the read deadline, for a route of the app (FastAPI), a search
    (express, or the front's parse) and a bulk load (streamed to its spool file)."""
    url = served[0]
    with httpx.Client(base_url=url, timeout=30) as client:
        client.post("/v1/collections", json={"name": "trickle", "dim": 2})
    method, path, media = {"app": ("POST", "/v1/collections", "application/json"),
                           "search": ("POST", "/v1/collections/trickle/search", "application/json"),
                           "bulk": ("PUT", "/v1/collections/trickle/points", "application/vnd.apache.arrow.stream")}[
        route]
    with raw_socket(url) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: {media}\r\nContent-Length: 100\r\n\r\n"
                     .encode())
        started = time.monotonic()
        status = None
        for _ in range(10):  # a byte a second until the server answers
            sock.settimeout(1)
            try:
                status = read_response(sock)[0]
                break
            except TimeoutError:
                sock.sendall(b"{")
        assert status == 408
        assert time.monotonic() - started < 7
        assert closed_by_server(sock, 5)


def test_the_cap_is_below_the_fd_limit():
    assert connections.default_cap(20_000) == 18_000
    assert connections.default_cap(1024) == 768
    assert connections.connection_cap(None, 20_000) == 18_000
    assert connections.connection_cap(50, 20_000) == 50
    assert connections.connection_cap(19_990, 20_000) == 18_000  # too close to the limit: lowered
    assert connections.raise_fd_limit() >= 1024


def test_the_protocol_relies_on_uvicorn_state_that_exists():
    """What CappedProtocol reads or sets of HttpToolsProtocol's state, on the installed uvicorn."""
    names = set(HttpToolsProtocol.__init__.__code__.co_names) | set(dir(HttpToolsProtocol))
    missing = [name for name in connections.UVICORN_STATE if name not in names]
    assert not missing, f"uvicorn's HttpToolsProtocol no longer has {missing}"


@contextmanager
def capped_server(cap: int) -> Iterator[str]:
    """A plain ASGI app (200 "ok") served in a thread by the capped protocol with the given cap; its URL."""

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=CAPPED_PROTOCOL, lifespan="off",
                                           limit_concurrency=cap, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_past_the_ceiling_a_new_connection_is_closed_at_once():
    """Refused connections hold descriptors too: past the cap plus half the reserve they are closed unanswered, so
    the process keeps descriptors of its own."""
    cap = 16
    ceiling = connections.Connections(cap).ceiling
    with capped_server(cap) as url:
        with ExitStack() as stack:
            for _ in range(ceiling - 1):
                sock = stack.enter_context(raw_socket(url))
                sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n")  # busy: nothing to close for room
            time.sleep(0.3)
            last = stack.enter_context(raw_socket(url))  # the last under the ceiling: a clean 503 ...
            over = stack.enter_context(raw_socket(url))  # ... and one more, closed unanswered
            time.sleep(0.3)
            assert dropped(over)
            last.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(last)[0] == 503
        time.sleep(0.3)
        with httpx.Client(base_url=url, timeout=5) as client:  # all closed: answered again
            assert client.get("/").status_code == 200
