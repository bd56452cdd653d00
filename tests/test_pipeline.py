"""The request pipeline's shared steps (service/pipeline.py): here, the problem replies refusals are made of."""

from __future__ import annotations

import orjson

from service import pipeline
from service.admission.control import Shed
from service.errors import Unprocessable


def test_a_repeated_refusal_is_encoded_once_but_each_reply_is_its_own():
    """Under overload the same refusal is sent thousands of times a second: its body is made once, but each Reply
    is a fresh object, since the engine process sets its id before sending it to a front."""
    exc = Shed("the service is serving 4 light requests", 1.0, reason="inflight", work_class="light")
    first = pipeline.problem_reply_of(exc, "/v1/collections/a/search")
    again = pipeline.problem_reply_of(Shed("the service is serving 4 light requests", 1.0, reason="inflight",
                                           work_class="light"), "/v1/collections/a/search")
    assert again is not first and again.body is first.body
    again.id = 7
    assert first.id == 0
    problem = orjson.loads(first.body)
    assert (problem["status"], problem["instance"], problem["work_class"]) == (503, "/v1/collections/a/search", "light")
    assert ("retry-after", "1") in first.headers
    other_path = orjson.loads(pipeline.problem_reply_of(exc, "/v1/collections/b/search").body)
    other_count = orjson.loads(pipeline.problem_reply_of(
        Shed("the service is serving 5 light requests", 2.0, reason="inflight", work_class="light"), None).body)
    assert other_path["instance"] == "/v1/collections/b/search"
    assert "5 light" in other_count["detail"] and other_count["retry_after_s"] == 2 and "instance" not in other_count


def test_problems_with_unhashable_parts_are_answered_and_the_kept_ones_stay_bounded():
    errors = [{"field": "vector", "message": "too short"}]
    reply = pipeline.problem_reply_of(Unprocessable("bad", field="vector", errors=errors), "/v1/x")
    assert reply.status == 422 and orjson.loads(reply.body)["errors"] == errors
    for i in range(3 * pipeline.PROBLEMS_KEPT):
        pipeline.problem_reply_of(Shed(f"serving {i}", 1.0), "/v1/x")
    big = Shed("x" * (2 * pipeline.PROBLEM_KEPT_BYTES), 1.0)
    assert len(pipeline.problem_reply_of(big, "/v1/x").body) > pipeline.PROBLEM_KEPT_BYTES
    assert len(pipeline._problems) <= pipeline.PROBLEMS_KEPT
    assert all(len(body) <= pipeline.PROBLEM_KEPT_BYTES for body, _ in pipeline._problems.values())
