"""The typed messages between processes: a front and its engines, an ingress and its shard replicas.

One msgspec struct per kind of call, tagged, so a frame decodes straight into the struct it is (vLLM's
EngineCoreRequest is the model). Vectors travel as raw little-endian float32 bytes, never as lists of floats.
A call is wrapped in a `Request` (its id and what the caller knows of it: deadline, principal, time spent so far);
the answer is a `Reply` with the same id: an HTTP status and body for the hot calls, a `ShardAnswer` or a
`Failure` for the shard calls.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from indexes import errors as vector_errors


class SearchCall(msgspec.Struct, tag="search", frozen=True):
    """A search parsed and checked as far as it can be without its collection."""
    collection: str
    queries: bytes  # little-endian float32, row after row
    width: int | None  # floats per row as sent (JSON lists); None: a raw body, as wide as the collection
    field: str  # the request field the queries came in, for errors
    single: bool  # answer one list, not a list per query
    k: int = 10
    engine: str = "auto"
    params: dict[str, int | float] | None = None
    filter: dict[str, Any] | None = None
    recall_target: float | None = None
    consistency: str | None = None
    seq: int | None = None
    dim: int | None = None  # the dimension a raw or base64 body says its rows have, checked against the collection's

    def rows(self, dim: int) -> int:
        """How many query vectors it holds (before the bytes are checked)."""
        return len(self.queries) // (4 * (self.width or dim)) if (self.width or dim) else 0


class UpsertCall(msgspec.Struct, tag="upsert", frozen=True):
    """A JSON upsert parsed and checked as far as it can be without its collection."""
    collection: str
    ids: list[int]
    vectors: bytes  # little-endian float32, row after row
    width: int | None  # floats per row (JSON lists); None: base64 bytes, as wide as the collection
    field: str
    payloads: list[bytes | None] | None = None  # each payload's JSON text
    dim: int | None = None  # as SearchCall's


class UnparsedCall(msgspec.Struct, tag="unparsed", frozen=True):
    """A hot request a front could not parse (the engine parses it again, to answer with the exact problem), or a
    large JSON body, which the run parses off the event loop (service/pipeline.py)."""
    search: bool
    collection: str
    body: bytes
    media: str
    query: str


class ShardSearch(msgspec.Struct, tag="shard_search", frozen=True):
    """An ingress asking one shard replica for its top k (service/cluster/fanout.py)."""
    collection: str
    queries: bytes
    dim: int
    k: int
    params: dict[str, int | float] | None
    filter: dict[str, Any] | None
    consistency: str | None
    seq: int | None
    recall_target: float | None

    def matrix(self) -> np.ndarray:
        return np.frombuffer(self.queries, dtype="<f4").reshape(-1, self.dim)


class CatchUp(msgspec.Struct, tag="catch_up", frozen=True):
    """An ingress telling a shard replica to apply its change log up to `seq` (a write it just committed)."""
    collection: str
    seq: int


Call = SearchCall | UpsertCall | UnparsedCall | ShardSearch | CatchUp


class Request(msgspec.Struct, array_like=True):
    id: int
    call: Call
    deadline: float | None = None  # time.monotonic(): one clock for every process of a machine
    principal: str = ""  # who is charged for it, under quotas
    spent_s: float = 0.0  # the time the caller spent on it already, counted in the answer's latency
    # Requests the front refused itself since its last request to this engine, by reason (the throttle's
    # "throttled", its event loop's "loop_lag"): counted by the engine, where /metrics is read.
    refused: dict[str, int] = msgspec.field(default_factory=dict)


class ShardAnswer(msgspec.Struct, tag="shard_answer", frozen=True):
    ids: list[list[int]]
    distances: list[list[float]]
    watermark: int | None = None
    plan: dict[str, Any] | None = None
    engine: str = ""


class Failure(msgspec.Struct, tag="failure", frozen=True):
    """A shard call's failure: the domain error's class name, detail and field, raised again by the caller."""
    kind: str
    detail: str
    field: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, vector_errors.VectorError):
            return cls(type(exc).__name__, exc.detail, exc.field)
        return cls("EngineFailed", f"{type(exc).__name__}: {exc}")

    def error(self) -> vector_errors.VectorError:
        kind = getattr(vector_errors, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, vector_errors.VectorError)):
            kind = vector_errors.EngineFailed
        return kind(self.detail, field=self.field)


class Reply(msgspec.Struct, array_like=True):
    id: int
    status: int = 200  # the HTTP status of a hot call's answer
    body: bytes = b""  # its JSON, or problem+json
    headers: list[tuple[str, str]] = []  # a problem's own headers (Retry-After, WWW-Authenticate ...)
    value: ShardAnswer | Failure | int | None = None  # a shard call's answer


Message = Request | Reply
encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def float32_bytes(matrix: np.ndarray | bytes) -> bytes:
    """A float32 matrix's values as little-endian bytes, row after row (bytes pass through)."""
    if isinstance(matrix, bytes):
        return matrix
    return np.ascontiguousarray(matrix, dtype="<f4").tobytes()
