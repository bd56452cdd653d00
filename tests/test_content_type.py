"""One Content-Type parse for every layer (service/http/media.py): the body limits, express and the routes read the
same media type from a request, whatever its case, and a repeated Content-Type is refused everywhere, so no layer
can take a body for a bulk load that another parses as JSON (past the JSON limit)."""

from __future__ import annotations

import gzip

import orjson
import pytest

from helpers import assert_problem, wait_ready

ARROW = "application/vnd.apache.arrow.stream"


def big_upsert(n: int = 300) -> bytes:
    """A JSON upsert well over the 4 KiB body limit of these tests."""
    return orjson.dumps({"ids": list(range(n)), "vectors": [[float(i), 1.0] for i in range(n)]})


@pytest.fixture
def small(make_client):
    client = make_client(raise_server_exceptions=False, max_body_bytes=4096)
    wait_ready(client)
    return client


def test_an_arrow_type_in_another_case_does_not_lift_the_json_limit(small):
    assert small.post("/v1/collections", json={"name": "ct1", "dim": 2}).status_code == 201
    body = big_upsert()
    assert_problem(small.put("/v1/collections/ct1/points", content=body, headers={"Content-Type": "application/json"}),
                   413, "payload-too-large")
    for media in ("Application/vnd.apache.arrow.stream", "APPLICATION/VND.APACHE.ARROW.STREAM; x=1"):
        r = small.put("/v1/collections/ct1/points", content=body, headers={"Content-Type": media})
        # an Arrow body on the bulk route: its stream is checked, and JSON is no Arrow stream
        assert_problem(r, 422, "validation-error")
    assert small.get("/v1/collections/ct1").json()["count"] == 0  # nothing was committed


@pytest.mark.parametrize("order", [("application/json", ARROW), (ARROW, "application/json")])
def test_a_repeated_content_type_is_refused_on_every_lane(small, order):
    assert small.post("/v1/collections", json={"name": "ct2", "dim": 2}).status_code in (201, 409)
    headers = [("Content-Type", media) for media in order]
    for method, path, body in (("PUT", "/v1/collections/ct2/points", big_upsert()),
                               ("PUT", "/v1/collections/ct2/points", big_upsert(2)),
                               ("POST", "/v1/collections/ct2/search", b'{"vector": [1.0, 2.0]}'),
                               ("POST", "/v1/olap/sql", b'{"sql": "SELECT 1"}')):
        r = small.request(method, path, content=body, headers=headers)
        assert_problem(r, 400, "bad-request", "Content-Type")
    assert small.get("/v1/collections/ct2").json()["count"] == 0


def test_the_media_type_is_read_the_same_in_any_case(small):
    assert small.post("/v1/collections", json={"name": "ct3", "dim": 2}).status_code == 201
    r = small.put("/v1/collections/ct3/points", content=big_upsert(3), headers={"Content-Type": "Application/JSON"})
    assert r.status_code == 200, r.text
    r = small.post("/v1/collections/ct3/search?k=1", content=b"\x00\x00\x80\x3f\x00\x00\x80\x3f",
                   headers={"Content-Type": "Application/Octet-Stream; charset=binary"})
    assert r.status_code == 200 and r.json()["ids"] == [1], r.text


def test_a_compressed_body_is_415_naming_content_encoding_on_every_lane(small):
    """Bodies are read as sent: a gzipped one was parsed as if plain ("invalid JSON", or worse, bytes taken as
    vectors). Refused before anything is read or committed, with the codings the service takes."""
    assert small.post("/v1/collections", json={"name": "ct4", "dim": 2}).status_code == 201
    plain = orjson.dumps({"ids": [1], "vectors": [[1.0, 2.0]]})
    lanes = (("PUT", "/v1/collections/ct4/points", gzip.compress(plain), "application/json"),
             ("PUT", "/v1/collections/ct4/points", b"\x1f\x8b" * 8, ARROW),
             ("POST", "/v1/collections/ct4/search", b"\x00\x00\x80\x3f" * 2, "application/octet-stream"),
             ("POST", "/v1/olap/sql", gzip.compress(b'{"sql": "SELECT 1"}'), "application/json"))
    for coding in ("gzip", "GZIP", "identity, br", "deflate"):
        for method, path, body, media in lanes:
            r = small.request(method, path, content=body, headers={"Content-Type": media, "Content-Encoding": coding})
            assert_problem(r, 415, "unsupported-media-type", "Content-Encoding")
            assert r.headers["accept-encoding"] == "identity"
    assert small.get("/v1/collections/ct4").json()["count"] == 0
    r = small.put("/v1/collections/ct4/points", content=plain,
                  headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    assert small.get("/v1/collections/ct4", headers={"Content-Encoding": "gzip"}).json()["count"] == 1  # no body
