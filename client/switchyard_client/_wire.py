"""What crosses the wire, without doing any I/O: the requests an operation makes and what their answers mean.

Every operation is written once, as a generator that yields a Request (or a Sleep) and is sent back the Response;
Client drives it with blocking calls, AsyncClient with awaits (the sans-I/O pattern of h11 and hyper), so both
clients behave the same by construction, retries included (call()).
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Generator, Mapping, TypeVar

from .errors import DeadlineExceeded, Retryable, SwitchyardError, TransportError, error_of


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


@dataclass(frozen=True)
class RetryPolicy:
    """Idempotent calls refused with 503 or 429 (but a passed deadline) are sent again after the answer's
    Retry-After (else a jittered backoff from `base_s`), at most `max_retries` times and `budget_s` seconds of
    waiting in all. Nothing that is not idempotent is ever sent twice."""

    max_retries: int = 3
    budget_s: float = 30.0
    base_s: float = 0.05

    def wait_s(self, error: SwitchyardError, attempt: int, waited_s: float) -> float | None:
        """Seconds to wait before sending again, or None to raise `error`. A passed deadline is never retried: the
        call's time is spent, and another try would have a deadline of its own."""
        if not isinstance(error, Retryable) or isinstance(error, DeadlineExceeded) or attempt >= self.max_retries:
            return None
        wait = error.retry_after if error.retry_after is not None else self.base_s * 2 ** attempt
        wait *= random.uniform(1.0, 1.25)  # apart, so that refused clients do not all come back at once
        return wait if waited_s + wait <= self.budget_s else None


def call(request: Request, retry: RetryPolicy) -> Generator[Request | Sleep, Response | None, Any]:
    """One request's JSON answer (None for an empty one); an error answer raised as its typed exception, after
    the retries `retry` allows an idempotent request."""
    waited, attempt = 0.0, 0
    while True:
        response = yield request
        assert response is not None
        if response.status < 400:
            try:
                return response.json()
            except ValueError:  # not from the service: a proxy's page, a truncated answer
                raise TransportError(f"{request.method} {request.path.split('?', 1)[0]}: the {response.status} "
                                     f"answer is not JSON: {response.body[:200]!r}") from None
        error = error_of(response.status, response.body, response.headers.get("retry-after"), request.method,
                         request.path.split("?", 1)[0])
        wait = retry.wait_s(error, attempt, waited) if request.idempotent else None
        if wait is None:
            raise error
        yield Sleep(wait)
        waited, attempt = waited + wait, attempt + 1


def json_request(method: str, path: str, body: Any = None, idempotent: bool = True,
                 timeout: float | None = None) -> Request:
    data = None if body is None else dumps(body)
    return Request(method, path, data, JSON if data is not None else None, idempotent, timeout)


SERVICE_DEFAULT = "default"  # consistency= for a search that sends no level, even after this client's writes


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
        """The (consistency, seq) a search sends: an explicit level as given (SERVICE_DEFAULT: none at all, so the
        service's default applies), else the session's."""
        if consistency == SERVICE_DEFAULT:
            return None, None
        if consistency is not None:
            return consistency, seq
        held = self.seqs.get(collection)
        return ("session", held) if held is not None else (None, None)

    def forget(self, collection: str) -> None:
        with self.lock:
            self.seqs.pop(collection, None)
