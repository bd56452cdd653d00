"""Bad vector input through front processes (`SWITCHYARD_FRONTS=2`), which parse upserts and searches before an
engine process sees them: each a 422 application/problem+json naming the field, never a plain-text 500 (issue 34,
items 11 and 13)."""

from __future__ import annotations

import httpx
import pytest

from helpers import assert_problem
from loadtests.processes import local_service

KEY = "fronted-input-key"


@pytest.fixture(scope="module")
def fronted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fronted-input")
    with local_service(1, folder / "data", folder / "serve.log",
                       env={"SWITCHYARD_FRONTS": "2", "SWITCHYARD_API_KEY": KEY,
                            "SWITCHYARD_MAX_PAYLOAD_KEYS": "8"}) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            assert client.post("/v1/collections", json={"name": "fc", "dim": 2, "metric": "cosine"}).status_code == 201
            assert client.put("/v1/collections/fc/points", json={
                "ids": [1, 2], "vectors": [[1, 0], [0, 1]], "payloads": [{"n": 1}, None]}).status_code == 200
            yield client


@pytest.mark.parametrize("payload", [{"big": 2**64}, {"text": "\u0000"}])
def test_unstorable_payloads_are_422_through_a_front(fronted, payload):
    r = fronted.put("/v1/collections/fc/points", json={"ids": [9], "vectors": [[1, 1]], "payloads": [payload]})
    assert_problem(r, 422, "validation-error", "payloads[0]")


def test_the_payload_key_limit_holds_through_a_front(fronted):
    r = fronted.put("/v1/collections/fc/points", json={
        "ids": [9], "vectors": [[1, 1]], "payloads": [{f"k{i}": i for i in range(8)}]})
    assert_problem(r, 422, "validation-error", "payloads")


def test_zero_vectors_and_huge_filter_numbers_are_422_through_a_front(fronted):
    assert_problem(fronted.put("/v1/collections/fc/points", json={"ids": [9], "vectors": [[0, 0]]}), 422,
                   "validation-error", "vectors[0]")
    assert_problem(fronted.post("/v1/collections/fc/search", json={"vector": [0, 0]}), 422,
                   "validation-error", "vector")
    assert_problem(fronted.post("/v1/collections/fc/search", json={"vector": [1, 0], "filter": {"n": int("9" * 400)}}),
                   422, "validation-error", "filter.n")
    assert fronted.get("/v1/collections/fc").json()["count"] == 2


def test_integers_beyond_64_bits_never_break_the_link_to_the_engine(fronted):
    """A front sends each parsed call to an engine process as msgpack, which holds 64-bit integers at most."""
    assert_problem(fronted.put("/v1/collections/fc/points", json={"ids": [2**64], "vectors": [[1, 1]]}), 422,
                   "validation-error", "ids")
    assert_problem(fronted.post("/v1/collections/fc/search", json={
        "vector": [1, 0], "consistency": "session", "seq": 10**30}), 422, "validation-error", "seq")
    assert_problem(fronted.post("/v1/collections/fc/search", json={"vector": [1, 0], "params": {"ef": 10**30}}), 422,
                   "validation-error", "params")
    # A filter number means a float64 wherever it is evaluated: a 30-digit one is a float, and matches nothing here.
    r = fronted.post("/v1/collections/fc/search", json={"vector": [1, 0], "filter": {"n": {"$lt": 10**30}}})
    assert r.status_code == 200, r.text
    assert r.json()["ids"] == [1]
    r = fronted.post("/v1/collections/fc/search", json={"vector": [1, 0], "filter": {"n": 10**30}})
    assert r.status_code == 200 and r.json()["ids"] == [], r.text


def test_the_payload_size_limits_hold_through_a_front(fronted):
    """The default SWITCHYARD_MAX_PAYLOAD_VALUE_BYTES (64 KiB), checked by the engine's store for a front's call."""
    r = fronted.put("/v1/collections/fc/points", json={"ids": [9], "vectors": [[1, 1]],
                                                        "payloads": [{"n": 3, "blob": "b" * 100_000}]})
    assert_problem(r, 422, "validation-error", "payloads[0].blob")
    assert fronted.get("/v1/collections/fc").json()["count"] == 2


@pytest.mark.parametrize(("target", "status"), [
    (b"/v1/collections/fc", 200), (b"/v1/collections/f%63", 200),  # escapes mean what they do in one process
    (b"//v1/collections/fc", 404), (b"/v1/collections/fc%00", 422), (b"/v1/collections/fc%3Fverify=true", 422),
    (b"/v1/jobs/%2e%2e/%2e%2e/healthz", 404), (b"/v1/collections/../../healthz", 404)])
def test_a_front_passes_the_path_on_as_sent(fronted, target, status):
    """The front rebuilt the engine's URL from the decoded path: `%00` and `//` were a 500 with a traceback, and
    dot segments were resolved, so `/v1/jobs/%2e%2e/%2e%2e/healthz` reached /healthz (200). The engine now sees
    the target as sent and answers as a lone process does."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(str(fronted.base_url))
    with socket.create_connection((where.hostname, where.port), timeout=30) as conn:
        conn.sendall(b"GET " + target + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
                     + b"\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert int(answer.split(b" ", 2)[1]) == status, answer[:400]
