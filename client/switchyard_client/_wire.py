"""What crosses the wire, without doing any I/O: the requests an operation makes and what their answers mean.

Every operation is written once, as a generator that yields a Request (or a Sleep) and is sent back the Response;
Client drives it with blocking calls, AsyncClient with awaits (the sans-I/O pattern of h11 and hyper), so both
clients behave the same by construction.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Generator, Mapping, TypeVar


def _plain(value: Any) -> Any:
    """What the standard library's json cannot write by itself: numpy scalars and arrays."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


try:  # orjson when it is installed: about 3x the standard library on search answers
    import orjson

    def dumps(value: Any) -> bytes:
        try:
            return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError:  # an integer beyond 64 bits: sent as written, for the service to judge
            return json.dumps(value, separators=(",", ":"), default=_plain).encode()

    def loads(data: bytes) -> Any:
        return orjson.loads(data)
except ImportError:  # pragma: no cover - the standard library is enough
    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), default=_plain).encode()

    def loads(data: bytes) -> Any:
        return json.loads(data)


T = TypeVar("T")
JSON = "application/json"
RAW = "application/octet-stream"
ARROW = "application/vnd.apache.arrow.stream"
PARQUET = "application/vnd.apache.parquet"


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # with its query string
    body: bytes | BinaryIO | None = None  # a file (a bulk load's stream, spooled to disk) is sent from its start
    content_type: str | None = None
    idempotent: bool = True  # safe to send again after a 503 or 429 (a search, a read, an upsert by id)
    timeout: float | None = None  # this call's limit in seconds (also sent as X-Request-Timeout)
    accept: tuple[int, ...] = ()  # error statuses the operation reads itself instead of raising


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return loads(self.body) if self.body else None


@dataclass(frozen=True)
class Sleep:
    seconds: float


Plan = Generator["Request | Sleep", "Response | None", T]  # an operation: what it sends, then its result


def body_size(body: bytes | BinaryIO | None) -> int:
    """The body's length in bytes; a file's is measured, and the file rewound to send it from its start."""
    if body is None or isinstance(body, bytes):
        return len(body or b"")
    size = body.seek(0, 2)
    body.seek(0)
    return size


def call(request: Request) -> Generator[Request | Sleep, Response | None, Any]:
    """One request's JSON answer (None for an empty one)."""
    response = yield request
    assert response is not None
    return response.json()


def json_request(method: str, path: str, body: Any = None, idempotent: bool = True,
                 timeout: float | None = None) -> Request:
    data = None if body is None else dumps(body)
    return Request(method, path, data, JSON if data is not None else None, idempotent, timeout)


@dataclass
class Sessions:
    """Read-your-writes: the highest change seq this client's writes to each collection were acknowledged with.
    A search that names no consistency level asks for `session` at that seq, so it sees those writes whichever
    process answers; a collection this client never wrote to gets the service's default."""

    seqs: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrote(self, collection: str, seq: int | None) -> None:
        if seq is None:
            return
        with self.lock:
            if seq > self.seqs.get(collection, -1):
                self.seqs[collection] = seq

    def level(self, collection: str, consistency: str | None, seq: int | None) -> tuple[str | None, int | None]:
        """The (consistency, seq) a search sends: an explicit level as given, else the session's."""
        if consistency is not None:
            return consistency, seq
        held = self.seqs.get(collection)
        return ("session", held) if held is not None else (None, None)

    def forget(self, collection: str) -> None:
        with self.lock:
            self.seqs.pop(collection, None)
