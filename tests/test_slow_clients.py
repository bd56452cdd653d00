"""Slow and keyless clients against a real service on a real socket (uvicorn with the express protocol, in a thread):
each costs a socket and nothing more. Headers and bodies must arrive within SWITCHYARD_READ_TIMEOUT_S (408, closed),
bodies are read before the request takes an in-flight slot, and an unexpected failure is a problem, not plain text
on a dropped connection."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import orjson
import pytest
import uvicorn

from helpers import closed_by_server, raw_socket, read_response
from service.http.app import create_app
from service.process.launcher import EXPRESS_PROTOCOL

KEY = "slow-client-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextmanager
def serving(settings) -> Iterator[tuple[str, object]]:
    """The app served by uvicorn with the express protocol on a free port; its URL and the app."""
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=EXPRESS_PROTOCOL, log_level="warning",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(60)


def request(method: str, path: str, body: bytes = b"", length: int | None = None, media: str = "application/json",
            key: bool = True) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Type: {media}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def test_slow_bodies_hold_no_in_flight_slot(make_settings):
    """Bodies that arrive slowly (with the key or without) must not make an honest client's requests 503: the body
    is read before the request takes a slot."""
    settings = make_settings(api_key=KEY, max_inflight=2, min_inflight=2, read_timeout_s=30)
    with serving(settings) as (url, _):
        slow = []
        try:
            for key in (True, False) * 4:  # 8 sockets, each sending 1 byte of a declared 1,000
                sock = raw_socket(url)
                sock.sendall(request("POST", "/v1/collections", b"{", length=1000, key=key))
                slow.append(sock)
            time.sleep(0.5)
            with httpx.Client(base_url=url, headers=AUTH, timeout=30) as honest:
                for _ in range(5):
                    r = honest.get("/v1/collections")
                    assert r.status_code == 200, r.text
                    r = honest.post("/v1/collections/none/search", json={"vector": [0.0, 1.0]})
                    assert r.status_code == 404, r.text
        finally:
            for sock in slow:
                sock.close()


@pytest.mark.parametrize("lane", ["app", "inline", "bulk"])
def test_a_body_that_does_not_arrive_in_time_is_cut_off_with_408(make_settings, lane):
    """The body deadline on every lane: a route with a body model (the app), a search held by the protocol for an
    inline answer, a bulk load streamed to its spool file."""
    with serving(make_settings(api_key=KEY, read_timeout_s=1)) as (url, _):
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
            assert client.post("/v1/collections", json={"name": f"slow-{lane}", "dim": 2}).status_code == 201
        message = {
            "app": request("POST", "/v1/collections", b'{"na', length=1000),
            "inline": request("POST", f"/v1/collections/slow-{lane}/search", b'{"vec', length=100),
            "bulk": request("PUT", f"/v1/collections/slow-{lane}/points", b"\xff\xff", length=100_000,
                            media="application/vnd.apache.arrow.stream"),
        }[lane]
        sock = raw_socket(url)
        try:
            started = time.monotonic()
            sock.sendall(message)
            status, headers, body = read_response(sock)
            assert status == 408, body
            assert headers["content-type"] == "application/problem+json"
            problem = orjson.loads(body)
            assert problem["type"] == "urn:switchyard:problem:request-timeout" and problem["field"] == "body"
            assert 0.9 < time.monotonic() - started < 6
            assert closed_by_server(sock)  # the rest of the body may still come: the connection is not reused
        finally:
            sock.close()
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:  # and the service answers as before
            assert client.get(f"/v1/collections/slow-{lane}").json()["count"] == 0


def test_headers_that_do_not_arrive_in_time_are_cut_off(make_settings):
    with serving(make_settings(read_timeout_s=1)) as (url, _):
        silent, partial = raw_socket(url), raw_socket(url)
        try:
            partial.sendall(b"POST /v1/collections HTTP/1.1\r\nHost: t\r\n")
            started = time.monotonic()
            status, headers, body = read_response(partial)
            assert status == 408 and headers["content-type"] == "application/problem+json", body
            assert closed_by_server(partial) and closed_by_server(silent)  # one that never sent a byte is closed too
            assert time.monotonic() - started < 6
        finally:
            silent.close()
            partial.close()


def test_a_later_requests_headers_are_timed_from_its_own_first_byte(make_settings):
    """On a kept-alive connection the deadline of a request's headers runs from its first byte, not from the
    connection's opening or an earlier request: the timer is armed lazily, only while headers are awaited."""
    with serving(make_settings(read_timeout_s=1)) as (url, _):
        with raw_socket(url) as sock:
            sock.sendall(request("GET", "/v1/collections"))
            assert read_response(sock)[0] == 200
            time.sleep(0.7)
            sock.sendall(b"GET /v1/collections HTTP/1.1\r\nHost: t\r\n")  # most of the headers, 0.7 s in
            started = time.monotonic()
            time.sleep(0.6)  # past the connection's first second, within this request's
            sock.sendall(f"Authorization: Bearer {KEY}\r\n\r\n".encode())
            assert read_response(sock)[0] == 200
            sock.sendall(b"GET /v1/collections HTTP/1.1\r\n")  # and one that never completes
            status, _, body = read_response(sock)
            assert status == 408 and 0.9 < time.monotonic() - started - 0.6 < 5, body


def test_an_unexpected_failure_is_a_problem_and_keeps_the_connection(make_settings, monkeypatch):
    """A route or a hot call that raises something no handler expects: 500 problem with an error id, on a
    connection that stays open for the next request."""
    with serving(make_settings()) as (url, app):
        vectors = app.state.switchyard.vectors

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(vectors.store, "list", broken)  # a FastAPI route's call
        monkeypatch.setattr("service.http.express.parse_call", lambda *args: 1 / 0)  # the hot lane's parse step
        sock = raw_socket(url)
        try:
            for message in (b"GET /v1/collections HTTP/1.1\r\nHost: t\r\n\r\n",
                            request("PUT", "/v1/collections/c/points", b'{"ids": [1], "vectors": [[1.0]]}'),
                            b"GET /v1/collections HTTP/1.1\r\nHost: t\r\n\r\n"):
                sock.sendall(message)
                status, headers, body = read_response(sock)
                assert status == 500 and headers["content-type"] == "application/problem+json", body
                problem = orjson.loads(body)
                assert problem["type"] == "urn:switchyard:problem:internal-error" and problem["error_id"]
                assert "a bug" not in problem["detail"]
        finally:
            sock.close()
