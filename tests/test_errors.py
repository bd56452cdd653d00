"""Every error is problem+json: unknown routes, bad methods, bad bodies, bad query values, 413, 500."""

from __future__ import annotations

import orjson
import pytest
from pydantic import BaseModel, Field

from helpers import assert_problem


class Echo(BaseModel):
    k: int = Field(ge=1, le=100)
    name: str


@pytest.fixture
def echo_client(make_client):
    """The app with two extra routes that exercise body parsing and internal errors."""
    client = make_client(raise_server_exceptions=False, max_body_bytes=4096)

    @client.app.post("/v1/echo")
    async def echo(body: Echo) -> Echo:
        return body

    @client.app.get("/v1/explode")
    async def explode() -> None:
        raise RuntimeError("secret internal detail")

    return client


def test_unknown_route_is_404_problem(client):
    body = assert_problem(client.get("/v1/nothing-here"), 404, "not-found")
    assert body["instance"] == "/v1/nothing-here"
    assert "/v1/nothing-here" in body["detail"]


def test_wrong_method_is_405_problem(client):
    assert_problem(client.delete("/v1/engines"), 405, "method-not-allowed")


def test_bad_query_value_names_the_field(client):
    body = assert_problem(client.get("/v1/engines", params={"domain": "astrology"}), 422, "validation-error", "domain")
    assert body["errors"][0]["in"] == "query"


def test_invalid_json_body_is_422_problem(echo_client):
    r = echo_client.post("/v1/echo", content=b'{"k": 3, "name": ', headers={"content-type": "application/json"})
    body = assert_problem(r, 422, "validation-error")
    assert "JSON" in body["detail"]


def test_body_field_out_of_range_names_the_field(echo_client):
    body = assert_problem(echo_client.post("/v1/echo", json={"k": 0, "name": "x"}), 422, "validation-error", "k")
    assert "greater than or equal to 1" in body["detail"]


def test_missing_and_wrong_typed_fields_are_all_listed(echo_client):
    body = assert_problem(echo_client.post("/v1/echo", json={"k": "many"}), 422, "validation-error")
    assert {e["field"] for e in body["errors"]} == {"k", "name"}


def test_good_body_passes(echo_client):
    r = echo_client.post("/v1/echo", json={"k": 5, "name": "ok"})
    assert r.status_code == 200 and r.json() == {"k": 5, "name": "ok"}


def test_declared_body_over_the_limit_is_413_before_parsing(echo_client):
    big = orjson.dumps({"k": 1, "name": "x" * 10_000})
    body = assert_problem(echo_client.post("/v1/echo", content=big, headers={"content-type": "application/json"}),
                          413, "payload-too-large")
    assert body["limit_bytes"] == 4096


def test_streamed_body_over_the_limit_is_413(echo_client):
    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"k": 1, "name": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = echo_client.post("/v1/echo", content=chunks(), headers={"content-type": "application/json"})
    assert_problem(r, 413, "payload-too-large")


def test_internal_error_is_500_problem_without_leaking(echo_client):
    body = assert_problem(echo_client.get("/v1/explode"), 500, "internal-error")
    assert "secret" not in body["detail"]
    assert len(body["error_id"]) == 16 and body["error_id"] in body["detail"]
    # The process is still serving.
    assert echo_client.get("/healthz").status_code == 200


@pytest.mark.parametrize("method, path", [("POST", "/v1/echo"), ("POST", "/v1/collections/c/search"),
                                          ("PUT", "/v1/spatial/layers/x"), ("POST", "/v1/collections/c/points/delete")])
def test_a_bulk_content_type_lifts_no_limit_outside_bulk_routes(make_client, method, path):
    client = make_client(raise_server_exceptions=False, max_body_bytes=4096, max_bulk_bytes=1 << 20)
    r = client.request(method, path, content=b"\0" * 10_000,
                       headers={"content-type": "application/vnd.apache.arrow.stream"})
    assert_problem(r, 413, "payload-too-large")


def test_bulk_routes_take_the_bulk_limit(make_client):
    from helpers import wait_ready

    client = make_client(raise_server_exceptions=False, max_body_bytes=4096, max_bulk_bytes=1 << 20)
    wait_ready(client)
    client.post("/v1/collections", json={"name": "bulky", "dim": 4})
    # Over the body limit, within the bulk one: past the size check (not Arrow, so refused as a bad stream).
    r = client.put("/v1/collections/bulky/points", content=b"\0" * 10_000,
                   headers={"content-type": "application/vnd.apache.arrow.stream"})
    assert r.status_code == 422, r.text
    r = client.put("/v1/collections/bulky/points", content=b"\0" * (2 << 20),
                   headers={"content-type": "application/vnd.apache.arrow.stream"})
    body = assert_problem(r, 413, "payload-too-large")
    assert "SWITCHYARD_MAX_BULK_BYTES" in body["detail"]
