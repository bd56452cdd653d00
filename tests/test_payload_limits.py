"""Payload size limits (issue 35, item 5): a point's payload is at most SWITCHYARD_MAX_PAYLOAD_ROW_BYTES of JSON, and
each top-level value at most SWITCHYARD_MAX_PAYLOAD_VALUE_BYTES; past either, a JSON upsert or an Arrow bulk load is a
422 naming the payload (and the key), with nothing stored."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from helpers import assert_problem, wait_job
from indexes.errors import InvalidInput
from indexes.vectors import check_payload_sizes
from test_vectors_bad_input import ARROW, DIM, arrow_body, count, new_collection

VALUE, ROW = 1024, 4096


@pytest.fixture
def limited(make_client):
    return make_client(max_payload_value_bytes=VALUE, max_payload_row_bytes=ROW)


def test_a_payload_value_over_the_limit_is_422_naming_it_and_nothing_is_stored(limited):
    name = new_collection(limited)
    big = "x" * VALUE  # its JSON has two quotes more than the limit
    r = limited.put(f"/v1/collections/{name}/points", json={
        "ids": [100, 101], "vectors": [[1, 2, 3, 4]] * 2, "payloads": [{"n": 1}, {"n": 2, "blob": big}]})
    problem = assert_problem(r, 422, "validation-error", "payloads[1].blob")
    assert "SWITCHYARD_MAX_PAYLOAD_VALUE_BYTES" in problem["detail"]
    assert count(limited, name) == 8
    # Nested values count whole: an object holding the string is as large.
    r = limited.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [{"deep": {"a": [big]}}]})
    assert_problem(r, 422, "validation-error", "payloads[0].deep")
    # Up to the limit is fine.
    r = limited.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [{"blob": "x" * (VALUE - 2)}]})
    assert r.status_code == 200, r.text
    assert count(limited, name) == 9


def test_a_payload_over_the_row_limit_is_422_naming_it(limited):
    name = new_collection(limited)
    many = {f"k{i}": "y" * 500 for i in range(9)}  # every value within its limit, over 4 KiB of JSON in all
    assert len(orjson.dumps(many)) > ROW
    problem = assert_problem(limited.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [many]}), 422, "validation-error", "payloads[0]")
    assert "SWITCHYARD_MAX_PAYLOAD_ROW_BYTES" in problem["detail"]
    assert count(limited, name) == 8


def test_arrow_bulk_loads_are_held_to_the_payload_limits_before_anything_is_written(limited):
    name = new_collection(limited)
    vectors = np.ones((3, DIM), np.float32)
    payloads = ['{"a": 1}', "{}", orjson.dumps({"blob": "z" * VALUE}).decode()]
    r = limited.put(f"/v1/collections/{name}/points", content=arrow_body([50, 51, 52], vectors, payloads),
                    headers=ARROW)
    assert_problem(r, 422, "validation-error", "payloads[2].blob")
    r = limited.put(f"/v1/collections/{name}/points", content=arrow_body(
        [50, 51, 52], vectors, [*payloads[:2], orjson.dumps({"many": ["w" * 300] * 12}).decode()]), headers=ARROW)
    assert_problem(r, 422, "validation-error", "payloads[2].many")
    assert count(limited, name) == 8
    r = limited.put(f"/v1/collections/{name}/points", content=arrow_body([50, 51, 52], vectors, [*payloads[:2], "{}"]),
                    headers=ARROW)
    assert r.status_code == 202, r.text
    assert wait_job(limited, r.headers["location"])["state"] == "succeeded"
    assert count(limited, name) == 11


def test_the_defaults_refuse_a_60_mb_string_and_take_ordinary_payloads(client):
    """The defaults (64 KiB a value, 1 MiB a point): the 60 MB string of issue 35 is refused."""
    name = new_collection(client)
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [{"blob": "q" * 60_000_000}]})
    assert_problem(r, 422, "validation-error", "payloads[0]")
    assert count(client, name) == 8
    ok = {"title": "t" * 60_000, "tags": ["a", "b"], "n": 1.5}
    assert client.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [ok]}).status_code == 200


def test_check_payload_sizes_numbers_rows_from_first():
    rows = [None, orjson.dumps({"a": "b" * 100})]
    check_payload_sizes(rows, 200, 400)
    with pytest.raises(InvalidInput) as caught:
        check_payload_sizes(rows, 50, 400, first=10)
    assert caught.value.field == "payloads[11].a"
    with pytest.raises(InvalidInput) as caught:
        check_payload_sizes(rows, 400, 50)
    assert caught.value.field == "payloads[1]"
