"""Express's inline answers from the HTTP protocol (http/express_protocol.py), through a real `switchyard serve`.

Plain single-vector searches the resident CPU engine can answer at once are answered from the protocol itself;
everything else, errors included, must be answered exactly as before by the app. Checked against a numpy oracle,
over keep-alive connections, pipelined requests, HTTP/1.0 and `Expect: 100-continue`.
"""

from __future__ import annotations

import asyncio
import gzip
import inspect
import json
import logging
import re
import socket
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from helpers import assert_problem
from loadtests.processes import local_service
from service.http import express_protocol
from vector_data import b64, clustered, oracle

DIM = 16
KEY = "express-protocol-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RAW = {"Content-Type": "application/octet-stream"}
SEARCH_ROUTE = 'route="/v1/collections/{name}/search"'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("express-protocol")
    data = clustered(600, DIM, seed=31)
    # Whether a search is answered inline depends on its learnt engine time against these two: pinned high, so a
    # busy machine (a search preempted reads as many times its cost) cannot move the counts asserted below.
    env = {"SWITCHYARD_API_KEY": KEY, "SWITCHYARD_UDS": str(folder / "sy.sock"),
           "SWITCHYARD_INLINE_SEARCH_US": "100000", "SWITCHYARD_INLINE_TURN_US": "100000"}
    with local_service(1, folder / "data", folder / "serve.log", env=env) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            assert client.post("/v1/collections", json={"name": "s1", "dim": DIM}).status_code == 201
            r = client.put("/v1/collections/s1/points", json={
                "ids": list(range(600)), "vectors": data.tolist(),
                "payloads": [{"even": i % 2 == 0} for i in range(600)]})
            assert r.status_code == 200, r.text
            for q in clustered(5, DIM, seed=32):  # the engine's cost of a lone search is learnt on a thread first
                client.post("/v1/collections/s1/search?k=5", content=q.tobytes(), headers=RAW)
            yield client, data, folder / "sy.sock"


def test_the_installed_uvicorn_is_one_the_protocol_was_checked_on():
    """The protocol subclasses uvicorn's HttpToolsProtocol and reads its per-request state, which is not public API:
    pyproject.toml pins uvicorn to the versions these tests pass on, and this fails on any other."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    pin = next(Requirement(r) for r in requires("switchyard") or () if Requirement(r).name == "uvicorn")
    assert pin.specifier.contains(version("uvicorn")), (pin, version("uvicorn"))
    source = inspect.getsource(HttpToolsProtocol)
    for used in express_protocol.UVICORN_STATE:
        assert f"self.{used}" in source, f"uvicorn's HttpToolsProtocol no longer has {used!r}"
    for hook in ("on_message_begin", "on_headers_complete", "on_body", "on_message_complete", "data_received",
                 "shutdown", "timeout_keep_alive_handler"):
        assert callable(getattr(HttpToolsProtocol, hook, None)), hook


def metric(client: httpx.Client, name: str, *labels: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name) and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def synced(client: httpx.Client) -> float:
    return metric(client, "switchyard_express_protocol_searches_total")


def test_plain_searches_are_answered_by_the_protocol_as_the_oracle_answers(served):
    client, data, _ = served
    queries = clustered(20, DIM, seed=33)
    truth, distances = oracle(data, queries, 7, "l2")
    before, requests_before = synced(client), metric(client, "switchyard_http_requests_total", SEARCH_ROUTE,
                                                     'status="200"')
    for i, q in enumerate(queries):
        raw = client.post("/v1/collections/s1/search?k=7&engine=cpu", content=q.astype("<f4").tobytes(), headers=RAW)
        listed = client.post("/v1/collections/s1/search", json={"vector": q.tolist(), "k": 7})
        for r in (raw, listed):
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["ids"] == truth[i].tolist() and np.allclose(body["distances"], distances[i], atol=1e-4)
            assert body["engine"] == "faiss" and body["consistency"] == "bounded" and body["fallback"] is None
        # a batch of one, in each encoding, is answered as a batch
        for r in (client.post("/v1/collections/s1/search?k=7&batch=true", content=q.astype("<f4").tobytes(),
                              headers=RAW),
                  client.post("/v1/collections/s1/search", json={"vectors": [q.tolist()], "k": 7}),
                  client.post("/v1/collections/s1/search", json={"vectors_b64": b64(q[None]), "k": 7})):
            assert r.json()["ids"] == [truth[i].tolist()], r.text
    # nearly all of them by the protocol (a lone search may still go to the thread while its cost is relearnt)
    assert synced(client) - before >= 90
    assert metric(client, "switchyard_http_requests_total", SEARCH_ROUTE, 'status="200"') - requests_before == 100


def test_filtered_searches_are_answered_by_the_protocol_too_with_the_filter_in_the_query_string(served):
    client, data, _ = served
    odd = np.arange(1, 600, 2)
    queries = clustered(12, DIM, seed=34)
    rows, distances = oracle(data[odd], queries, 5, "l2")
    odd_filter = quote(json.dumps({"even": False}))
    for q in queries[:2]:  # each (k, params, filter) learns its cost on a thread first
        client.post(f"/v1/collections/s1/search?k=5&filter={odd_filter}", content=q.tobytes(), headers=RAW)
        client.post("/v1/collections/s1/search", json={"vector": q.tolist(), "k": 5, "filter": {"even": False}})
    before = synced(client)
    for i, q in enumerate(queries[2:], 2):
        raw = client.post(f"/v1/collections/s1/search?k=5&filter={odd_filter}", content=q.tobytes(), headers=RAW)
        listed = client.post("/v1/collections/s1/search", json={"vector": q.tolist(), "k": 5,
                                                                 "filter": {"even": False}})
        for r in (raw, listed):
            body = r.json()
            assert body["ids"] == odd[rows[i]].tolist() and np.allclose(body["distances"], distances[i], atol=1e-4)
            assert body["plan"]["matched_rows"] == 300 and body["plan"]["plan"] == "exact"
    assert synced(client) - before >= 18
    assert_problem(client.post("/v1/collections/s1/search?filter=%7Bnot%20json", content=queries[0].tobytes(),
                               headers=RAW), 422, "validation-error", "filter")
    assert_problem(client.post(f"/v1/collections/s1/search?filter={quote(json.dumps({'even': {'$foo': 1}}))}",
                               content=queries[0].tobytes(), headers=RAW), 422, "validation-error", "filter.even.$foo")


def test_what_the_lane_declines_is_answered_by_the_app_errors_included(served):
    client, data, _ = served
    q = data[3]
    before = synced(client)
    assert_problem(client.post("/v1/collections/s1/search", content=b"\x00" * 12, headers=RAW), 422,
                   "validation-error", "body")
    assert_problem(client.post("/v1/collections/s1/search", json={"vector": q.tolist(), "k": 0}), 422,
                   "validation-error", "k")
    assert_problem(client.post("/v1/collections/s1/search?ef=abc", content=q.tobytes(), headers=RAW), 422,
                   "validation-error", "ef")
    assert_problem(client.post("/v1/collections/nope/search", json={"vector": q.tolist()}), 404, "not-found")
    assert_problem(httpx.post(f"{client.base_url}/v1/collections/s1/search", content=q.tobytes(), headers=RAW), 401,
                   "unauthorized")
    assert_problem(client.post("/v1/collections/s1/search", json={"vector": q.tolist(), "engine": "gpu"}), 409,
                   "engine-unavailable", "engine")
    strong = client.post("/v1/collections/s1/search", json={"vector": q.tolist(), "k": 3, "consistency": "strong"})
    batch = client.post("/v1/collections/s1/search", json={"vectors": [q.tolist()] * 2, "k": 3})  # two: the app
    deadline = client.post("/v1/collections/s1/search?k=3", content=q.tobytes(),
                           headers={**RAW, "X-Request-Timeout": "0.5"})  # could pass: the app watches it
    assert strong.json()["ids"][0] == 3 and strong.json()["consistency"] == "strong"
    assert batch.json()["ids"] == [strong.json()["ids"]] * 2 and deadline.json()["ids"] == strong.json()["ids"]
    assert_problem(client.post("/v1/collections/s1/search", content=q.tobytes(),
                               headers={**RAW, "X-Request-Timeout": "soon"}), 400, "bad-request", "X-Request-Timeout")
    assert_problem(client.post(f"/v1/collections/s1/search?dim={DIM // 2}", content=q.tobytes(), headers=RAW), 422,
                   "validation-error", "dim")  # 2 rows of DIM / 2 are as many bytes as one of DIM
    assert_problem(client.post("/v1/collections/s1/search", content=gzip.compress(q.tobytes()),
                               headers={**RAW, "Content-Encoding": "gzip"}), 415, "unsupported-media-type",
                   "Content-Encoding")
    assert synced(client) == before  # none of these was the protocol's to answer


def test_a_deadline_an_inline_answer_cannot_miss_keeps_the_protocol_lane(served):
    """A client that sends its timeout with every call (switchyard_client does) is still answered by the protocol
    when the deadline is at least INLINE_MIN_DEADLINE_S away: an inline answer takes microseconds."""
    client, data, _ = served
    for q in data[:5]:  # each shape learns its cost first
        client.post("/v1/collections/s1/search?k=3", content=q.tobytes(), headers={**RAW, "X-Request-Timeout": "30"})
    before = synced(client)
    for i in range(20):
        r = client.post("/v1/collections/s1/search?k=3", content=data[i].tobytes(),
                        headers={**RAW, "X-Request-Timeout": "30"})
        assert r.json()["ids"][0] == i, r.text
    assert synced(client) - before >= 18


def test_the_unix_socket_serves_the_same_api(served):
    client, data, path = served
    before = synced(client)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://switchyard",
                      headers=AUTH) as local:
        answers = [local.post("/v1/collections/s1/search?k=3", content=data[i].tobytes(), headers=RAW).json()["ids"][0]
                   for i in range(5)]
        assert answers == list(range(5))
        assert local.get("/v1/collections/s1").json()["count"] == 600
        assert_problem(local.post("/v1/collections/s1/search", content=b"\x00", headers=RAW), 422, "validation-error")
    assert synced(client) - before >= 4


def test_a_unix_socket_needs_the_engine_process_to_serve_http():
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError, match="SWITCHYARD_FRONTS=0"):
        Settings(uds="/tmp/x.sock", fronts=2)
    assert Settings(uds="/tmp/x.sock").front_processes == 0


def exchange(port: int, payload: bytes, responses: int) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """Send raw bytes on one connection and read `responses` HTTP responses (status line, headers, body)."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        buffer = b""
        while len(out) < responses:
            while b"\r\n\r\n" not in buffer:
                chunk = s.recv(65536)
                assert chunk, f"connection closed after {len(out)} responses"
                buffer += chunk
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            status, *lines = head.split(b"\r\n")
            headers = {k.lower(): v for k, v in (line.split(b": ", 1) for line in lines)}
            length = int(headers.get(b"content-length", b"0"))
            while len(buffer) < length:
                buffer += s.recv(65536)
            body, buffer = buffer[:length], buffer[length:]
            out.append((status, headers, body))
        closed = False
        if out and out[-1][1].get(b"connection") == b"close":
            s.settimeout(5)
            closed = s.recv(1) == b""
        out.append((b"closed" if closed else b"open", {}, b""))
    return out


def request(path: str, body: bytes = b"", method: str = "POST", version: str = "1.1", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: test", f"Authorization: Bearer {KEY}"]
    if method == "POST":
        lines += ["Content-Type: application/octet-stream", f"Content-Length: {len(body)}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_pipelined_requests_are_answered_in_order_whichever_lane_serves_them(served):
    client, data, _ = served
    port = client.base_url.port
    q = data[10].astype("<f4").tobytes()
    strong = "/v1/collections/s1/search?k=2&consistency=strong"  # waits for a catch-up: the app answers it
    plain = "/v1/collections/s1/search?k=2"
    client.post(plain, content=q, headers=RAW)  # each (k, params) learns its lone cost on a thread first
    before = synced(client)
    # One write: the first search is answered by the protocol, the probe starts an ASGI cycle, and the search
    # behind it waits for that cycle (as uvicorn queues pipelined requests).
    answers = exchange(port, request(plain, q) + request("/healthz", method="GET") + request(plain, q), 3)
    assert synced(client) - before == 1
    # The app's answer to the first comes before the second's, which the protocol could have given at once.
    answers += exchange(port, request(strong, q) + request(plain, q), 2)
    assert synced(client) - before == 1
    assert [a[0].split(b" ")[1] for a in answers if a[0] not in (b"open", b"closed")] == [b"200"] * 5
    assert answers[3][0] == answers[6][0] == b"open"  # keep-alive
    bodies = [httpx.Response(200, content=a[2]).json() for a in (answers[0], answers[2], answers[4], answers[5])]
    assert [b["consistency"] for b in bodies] == ["bounded", "bounded", "strong", "bounded"]
    assert all(b["ids"] == [10, bodies[0]["ids"][1]] for b in bodies)


def test_a_head_request_on_a_kept_alive_connection_is_answered(served):
    """A HEAD's answer has a head and no body: it was held for a body write that never came, so a client (a load
    balancer's health check) waited for nothing until the keep-alive timeout."""
    client, _, _ = served
    with socket.create_connection(("127.0.0.1", client.base_url.port), timeout=5) as s:
        s.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'"status":"ok"' not in answer:
            answer += s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 405") and b"allow: get" in answer.lower()
    assert answer.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 200" in answer


def test_http_1_0_closes_and_expect_100_continue_is_honoured(served):
    client, data, _ = served
    port = client.base_url.port
    q = data[20].astype("<f4").tobytes()
    client.post("/v1/collections/s1/search?k=1", content=q, headers=RAW)  # the lone cost of k=1, learnt
    before = synced(client)
    old = exchange(port, request("/v1/collections/s1/search?k=1", q, version="1.0"), 1)
    assert old[0][0].startswith(b"HTTP/1.1 200") and old[0][1][b"connection"] == b"close" and old[1][0] == b"closed"
    assert httpx.Response(200, content=old[0][2]).json()["ids"] == [20]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request("/v1/collections/s1/search?k=1", q, Expect="100-continue")[:-len(q)])  # headers only
        interim = s.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(q)
        answer = interim[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
        while not re.search(rb"\r\n\r\n.*\]", answer, re.S):
            answer += s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200") and b'"ids":[20]' in answer
    assert synced(client) - before == 2


class Recorded:
    """A transport that records each write (one write: one segment, one wakeup of the client)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def resume_reading(self) -> None:
        pass


def app_cycle(method: str = "GET", expect_100_continue: bool = False) -> tuple[RequestResponseCycle, Recorded]:
    """uvicorn's own ASGI cycle, as the protocol makes it for the app, writing through OneWrite."""
    transport = Recorded()
    cycle = RequestResponseCycle(
        scope={"type": "http", "method": method, "path": "/", "http_version": "1.1"},  # type: ignore[typeddict-item]
        transport=transport, flow=FlowControl(transport), logger=logging.getLogger("test"),  # type: ignore[arg-type]
        access_logger=logging.getLogger("test"), access_log=False, default_headers=[], message_event=asyncio.Event(),
        expect_100_continue=expect_100_continue, keep_alive=True, on_response=lambda: None)
    cycle.transport = express_protocol.OneWrite(cycle)  # type: ignore[assignment]
    return cycle, transport


def test_an_app_response_of_declared_length_is_written_once_head_and_body_together():
    async def scenario() -> None:
        cycle, transport = app_cycle()
        await cycle.send({"type": "http.response.start", "status": 200,
                          "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
        assert transport.writes == []  # held for the body
        await cycle.send({"type": "http.response.body", "body": b"{}"})
        assert len(transport.writes) == 1
        assert transport.writes[0].startswith(b"HTTP/1.1 200") and transport.writes[0].endswith(b"\r\n\r\n{}")

        streamed, transport = app_cycle()  # no declared length: chunked, the head goes at once
        await streamed.send({"type": "http.response.start", "status": 200, "headers": []})
        assert len(transport.writes) == 1 and b"transfer-encoding: chunked" in transport.writes[0]
        await streamed.send({"type": "http.response.body", "body": b"x", "more_body": True})
        assert transport.writes[1] == b"1\r\nx\r\n"

        waiting, transport = app_cycle("POST", expect_100_continue=True)  # the interim answer is never held
        waiting.more_body = False
        waiting.message_event.set()
        await waiting.receive()
        assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]

        head, transport = app_cycle("HEAD")  # uvicorn writes no body for HEAD: the head goes at once, whole
        await head.send({"type": "http.response.start", "status": 405,
                         "headers": [(b"allow", b"GET"), (b"content-length", b"146")]})
        assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 405")
        await head.send({"type": "http.response.body", "body": b"x" * 146})
        assert len(transport.writes) == 1 and head.response_complete and not transport.closed

        failed, transport = app_cycle()  # a close after the head (the app failed): the head is not lost
        await failed.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        failed.transport.close()
        assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200") and transport.closed

    asyncio.run(scenario())


def test_a_refusal_head_follows_the_server_date_and_the_reply_own_headers():
    """Refusal heads are kept per status and headers (a process under overload writes the same few thousands of
    times a second), but never past the server's Date: uvicorn replaces its default headers each second."""
    from service.process.messages import Reply

    first = [(b"date", b"Sat, 28 Nov 2026 01:00:00 GMT"), (b"server", b"uvicorn")]
    second = [(b"date", b"Sat, 28 Nov 2026 01:00:01 GMT"), (b"server", b"uvicorn")]
    problem = [("retry-after", "1"), ("content-type", "application/problem+json")]
    one = Reply(0, 503, b"{}", problem)
    two = Reply(0, 503, b"{}", [("retry-after", "2"), problem[1]])
    head = express_protocol._refusal_head(first, one)
    assert head.startswith(b"HTTP/1.1 503 ") and head.endswith(b"content-length: ")
    assert b"date: Sat, 28 Nov 2026 01:00:00 GMT\r\n" in head and b"retry-after: 1\r\n" in head
    assert express_protocol._refusal_head(first, one) == head
    assert b"retry-after: 2\r\n" in express_protocol._refusal_head(first, two)
    assert b"429 " in express_protocol._refusal_head(first, Reply(0, 429, b"{}", problem)).split(b"\r\n")[0]
    later = express_protocol._refusal_head(second, one)
    assert b"01:00:01 GMT\r\n" in later and b"01:00:00 GMT" not in later


def test_a_client_that_pipelines_searches_and_never_reads_is_not_read_without_end(served):
    """uvicorn parses all it reads and resumes reading after every answer: a client pipelining searches without
    reading its answers had 250,000 requests queued and the server 700 MB larger in 5 s. At most MAX_PIPELINED
    wait; past them reading stays paused (the client's sends block), and other clients are answered as before."""
    import time

    client, data, _ = served
    pid = client.get("/readyz").json()["pid"]

    def rss_mb() -> int:
        with open(f"/proc/{pid}/status") as status:
            return int(status.read().split("VmRSS:")[1].split()[0]) >> 10

    request = (b"POST /v1/collections/s1/search?k=10 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
               + b"\r\ncontent-type: application/octet-stream\r\ncontent-length: %d\r\n\r\n" % (4 * DIM))
    burst = b"".join(request + data[i % len(data)].tobytes() for i in range(500))
    port = int(str(client.base_url).rsplit(":", 1)[1])
    before = rss_mb()
    with socket.create_connection(("127.0.0.1", port)) as greedy:
        greedy.setblocking(False)
        sent, ends = 0, time.monotonic() + 5
        while time.monotonic() < ends:
            try:
                sent += greedy.send(burst[sent % len(burst):])
            except BlockingIOError:
                time.sleep(0.01)
        grown = rss_mb() - before
        r = client.post("/v1/collections/s1/search?k=1", content=data[7].tobytes(), headers=RAW)
        assert r.status_code == 200 and r.json()["ids"] == [7], r.text
    assert grown < 150, f"the server grew by {grown} MB reading {sent >> 20} MiB from a client that read nothing"
