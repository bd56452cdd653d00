"""The one parse of a request's Content-Type, used by every layer that decides on it (express, the body limits,
the routes), so that no two of them can read a different media type from the same request.

The media type is the part before any `;` parameter, stripped and lower-cased (media types are case-insensitive,
RFC 9110 8.3.1). Content-Type is a singleton field: a request that repeats it is refused with 400 everywhere
(one layer taking the first and another the last once let a JSON body past the JSON size limit).
"""

from __future__ import annotations

from collections.abc import Iterable

from service.errors import BadRequest

CONTENT_TYPE = b"content-type"


def media_of(value: bytes) -> bytes:
    """A Content-Type value's media type: `Application/JSON; charset=utf-8` -> `application/json`."""
    return value.split(b";", 1)[0].strip().lower()


def media_type(headers: Iterable[tuple[bytes, bytes]], default: bytes = b"") -> bytes:
    """The media type of a request's (lower-cased name, value) headers, `default` when it has no Content-Type.
    Raises BadRequest (400, field Content-Type) when the header is repeated."""
    found: bytes | None = None
    for name, value in headers:
        if name == CONTENT_TYPE:
            if found is not None:
                raise BadRequest("Content-Type is given more than once; send it once", field="Content-Type")
            found = media_of(value)
    return default if found is None else found
