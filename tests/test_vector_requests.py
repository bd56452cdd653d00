"""service/http/vector_requests.py: what a raw search's query string becomes, and what is remembered of it."""

from __future__ import annotations

from service.http.vector_requests import CACHED_QUERY_CHARS, _cached_search_fields, raw_search_fields


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
