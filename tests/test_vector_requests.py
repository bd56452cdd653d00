"""service/http/vector_requests.py: what a raw search's query string becomes, and what is remembered of it."""

from __future__ import annotations

import orjson
import pytest
from fastapi.exceptions import RequestValidationError

from service.http.vector_requests import CACHED_QUERY_CHARS, _cached_search_fields, parse_search, raw_search_fields


def test_long_query_strings_are_parsed_each_time_and_not_remembered():
    """A filter can make a query string as long as the URL limit: only short ones (a client's fixed k and params)
    are cached, so distinct filters cannot grow the cache by their length."""
    short = "k=7"
    long = "k=7&filter=" + "%7B%22tag%22%3A%22" + "x" * CACHED_QUERY_CHARS + "%22%7D"
    before = _cached_search_fields.cache_info().currsize
    fields, batch = raw_search_fields(long)
    assert fields["k"] == 7 and fields["filter"] == {"tag": "x" * CACHED_QUERY_CHARS} and not batch
    assert _cached_search_fields.cache_info().currsize == before
    assert raw_search_fields(short)[0]["k"] == 7
    assert raw_search_fields(short) is raw_search_fields(short)


@pytest.mark.parametrize(("body", "field"), [
    ({"vector": [1.0], "k": "3"}, "k"), ({"vector": [1.0], "k": True}, "k"),
    ({"vector": [1.0], "params": {"ef": "64"}}, "params.ef"), ({"vector": [1.0], "params": {"ef": True}}, "params.ef"),
    ({"vector": [1.0], "recall_target": "0.9"}, "recall_target"),
    ({"vector": [1.0], "recall_target": 0}, "recall_target"),
    ({"vector": [1.0], "recall_target": 1.01}, "recall_target"),
    ({"vector": [1.0], "seq": "4", "consistency": "session"}, "seq"),
    ({"vectors_b64": ""}, "vectors_b64"),  # no vectors: a search of nothing
])
def test_numbers_are_json_numbers(body, field):
    """A string or a boolean where the schema says number is refused, naming the field, as the schema says."""
    with pytest.raises(RequestValidationError) as caught:
        parse_search("c", orjson.dumps(body))
    assert [".".join(map(str, e["loc"][1:])) for e in caught.value.errors()] == [field]


def test_numbers_keep_their_kind():
    """An integral number is taken by an integer field (2.0 is JSON Schema's integer), and a search parameter stays
    the integer or float it was sent as."""
    call = parse_search("c", orjson.dumps({"vector": [1.0], "k": 2.0, "params": {"ef": 64, "ratio": 1.5},
                                           "recall_target": None}))
    assert call.k == 2 and type(call.params["ef"]) is int and call.params["ratio"] == 1.5


def test_query_string_numbers():
    """A raw search's query string carries numbers as text: they are read as numbers, and a word is refused."""
    fields, _ = raw_search_fields("k=5&recall_target=1&ef=64&refine=1.5&seq=3&consistency=session&r=.5&x=2e1")
    assert (fields["k"], fields["recall_target"], fields["seq"]) == (5, 1.0, 3)
    assert fields["params"] == {"ef": 64, "refine": 1.5, "r": 0.5, "x": 20} and type(fields["params"]["ef"]) is int
    assert raw_search_fields("batch=TRUE")[1] and not raw_search_fields("batch=0")[1]
    for bad, field in (("k=five", "k"), ("k=true", "k"), ("recall_target=2", "recall_target"), ("ef=x", "ef"),
                       ("batch=maybe", "batch"), ("batch=", "batch"), ("batch=on", "batch"), ("k=1_0", "k"),
                       ("ef=nan", "ef"), ("ef=inf", "ef"), ("ef=1e999", "ef"), ("k=%205", "k")):
        with pytest.raises(RequestValidationError) as caught:
            raw_search_fields(bad)
        assert caught.value.errors()[0]["loc"] == ("query", field), bad
