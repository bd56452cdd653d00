"""Turning what clients send (JSON float lists, base64 float32, Arrow IPC) into checked numpy arrays.

Every check names the field and the reason, and happens before anything is written.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import orjson
import simdjson

from .errors import InvalidInput

MAX_ID = 2**63 - 1
MAX_K = 1000  # most neighbours one search may ask for
MAX_DIM = 16_000  # the widest collection (pgvector's vector type holds up to 16,000 dimensions)
MAX_QUERIES = 10_000  # most query vectors in one search request, whatever their encoding
MAX_RESULTS = 1_000_000  # most (query, neighbour) pairs one search may answer: queries x k
MAX_VALUE = 1e15  # largest magnitude of a vector value (squared distances stay finite in float32)
MAX_PAYLOAD_VALUE_BYTES = 64 * 1024  # the JSON of one top-level payload value (SWITCHYARD_MAX_PAYLOAD_VALUE_BYTES)
MAX_PAYLOAD_ROW_BYTES = 1 << 20  # the JSON of one point's payload (SWITCHYARD_MAX_PAYLOAD_ROW_BYTES)
# A NUL character as orjson writes it (\u0000 after an even number of backslashes): PostgreSQL's jsonb and text
# cannot hold one (asyncpg's UntranslatableCharacterError).
_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


@dataclass(frozen=True)
class Points:
    ids: np.ndarray  # int64, unique
    vectors: np.ndarray  # float32 (n, dim), finite
    payloads: list[bytes | None] | None  # JSON text per point, or None when no point has one


def as_matrix(values: object, dim: int, field: str) -> np.ndarray:
    """A (n, dim) finite float32 matrix from nested lists or an array (one vector may come flat)."""
    return fit_matrix(unshaped_matrix(values, field, one_of=dim), dim, field)


def check_batch(n_queries: int, k: int, field: str) -> None:
    """Bound one search's work and answer size (200,000 queries at k=100 once built a 493 MB answer)."""
    if n_queries > MAX_QUERIES:
        raise InvalidInput(f"holds {n_queries:,} query vectors; at most {MAX_QUERIES:,} per request", field=field)
    if n_queries * k > MAX_RESULTS:
        raise InvalidInput(f"{n_queries:,} queries x k={k} asks for {n_queries * k:,} results; at most "
                           f"{MAX_RESULTS:,} per request (send fewer queries or a smaller k)", field=field)


def check_finite(matrix: np.ndarray, field: str) -> None:
    # One call for the common case: the sum of squares is at most MAX_VALUE**2 only if every value is within
    # MAX_VALUE (NaN and Inf make it NaN or Inf, which fail the comparison). Otherwise look value by value: large
    # sums can come from valid values too. Then, only for a bad matrix, which value.
    if not matrix.size or float(np.vdot(matrix, matrix)) <= MAX_VALUE * MAX_VALUE:
        return
    if float(np.abs(matrix).max()) <= MAX_VALUE:
        return
    finite = np.isfinite(matrix)
    if not finite.all():
        row, col = map(int, np.argwhere(~finite)[0])
        raise InvalidInput(f"vector {row} has a non-finite value (NaN or Inf) at position {col}",
                           field=f"{field}[{row}]")
    # float32 overflow: a finite float64 beyond 3.4e38 became inf above; values near it would overflow squared
    # distances.
    raise InvalidInput("vector values must be within +-1e15", field=field)


def check_nonzero(matrix: np.ndarray, metric: str, field: str) -> None:
    """Refuse zero vectors where the metric has no distance for them: under cosine a zero vector has no
    direction (pgvector answers NaN, a unit-vector index 1.0), so every engine would answer it differently.
    Every write and search of a cosine collection passes here, whatever its encoding."""
    if metric != "cosine" or not matrix.size:
        return
    zero = ~matrix.any(axis=1)
    if zero.any():
        row = int(np.argmax(zero))
        raise InvalidInput(f"vector {row} is all zeros: cosine distance is undefined for a zero vector "
                           "(a cosine collection takes only non-zero vectors)",
                           field=field if field == "vector" else f"{field}[{row}]")


def unshaped_matrix(values: object, field: str, one_of: int | None = None) -> np.ndarray:
    """A finite float32 matrix from nested lists, checked as far as it can be before the dimension is known
    (`one_of`: a flat list of that many numbers is one vector)."""
    try:
        matrix = np.asarray(values, dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"must be a list of equal-length lists of numbers ({exc})", field=field) from None
    if matrix.ndim == 1 and one_of is not None and matrix.size == one_of:
        matrix = matrix.reshape(1, one_of)
    if matrix.ndim != 2:
        raise InvalidInput("must be a list of vectors", field=field)
    check_finite(matrix, field)
    return matrix


def fit_matrix(values: np.ndarray | bytes, dim: int, field: str) -> np.ndarray:
    """An unshaped matrix, or raw float32 bytes, checked against the collection's dimension."""
    if isinstance(values, bytes):
        return from_raw(values, dim, field, allow_empty=field != "body")
    if values.shape[1] != dim:
        raise InvalidInput(f"vectors have dimension {values.shape[1]}, the collection has {dim}", field=field)
    return np.ascontiguousarray(values)


def decode_base64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("is not valid base64", field=field) from None


def from_raw(raw: bytes, dim: int, field: str, allow_empty: bool = False) -> np.ndarray:
    """Little-endian float32 values, row after row, as sent (application/octet-stream): no parsing at all."""
    if (not raw and not allow_empty) or len(raw) % (4 * dim):
        raise InvalidInput(f"holds {len(raw)} bytes, not a whole number of {dim}-dimensional float32 vectors",
                           field=field)
    return as_matrix(np.frombuffer(raw, dtype="<f4").reshape(-1, dim), dim, field)


def check_ids(ids: object, field: str = "ids") -> np.ndarray:
    try:
        array = np.asarray(ids, dtype=np.int64)
    except (OverflowError, ValueError, TypeError):
        raise InvalidInput("ids must be integers between 0 and 2^63-1", field=field) from None
    if array.ndim != 1:
        raise InvalidInput("must be a list of integers", field=field)
    if array.size and array.min() < 0:
        raise InvalidInput(f"ids must be >= 0 (got {int(array.min())})", field=field)
    unique, counts = np.unique(array, return_counts=True)
    if (counts > 1).any():
        raise InvalidInput(f"id {int(unique[counts > 1][0])} appears more than once in one request", field=field)
    return array


def encode_payloads(payloads: list[object] | None, n: int, first: int = 0) -> list[bytes | None] | None:
    """Payloads as the JSON text stored, or InvalidInput naming `payloads[i]` (`first`: the row the list starts
    at, in a chunk of a longer stream)."""
    if payloads is None:
        return None
    if len(payloads) != n:
        raise InvalidInput(f"has {len(payloads)} entries for {n} points", field="payloads")
    out: list[bytes | None] = []
    for i, p in enumerate(payloads, first):
        if p is None:
            out.append(None)
            continue
        if not isinstance(p, dict):
            raise InvalidInput("each payload must be a JSON object or null", field=f"payloads[{i}]")
        try:
            text = orjson.dumps(p)
        except orjson.JSONEncodeError as exc:  # integers beyond 64 bits, and what JSON cannot hold
            raise InvalidInput(f"is not storable JSON ({exc}): integers must fit in 64 bits",
                               field=f"payloads[{i}]") from None
        if b"null" in text and _non_finite(p):  # orjson writes NaN and +-Infinity (1e309 too) as null
            raise InvalidInput("holds a number that is not finite (NaN, Infinity, or beyond float64 like 1e309)",
                               field=f"payloads[{i}]")
        if b"\\u0000" in text and _NUL.search(text):
            raise InvalidInput("holds a NUL character (\\u0000), which PostgreSQL cannot store in JSON",
                               field=f"payloads[{i}]")
        out.append(text)
    return out if any(p is not None for p in out) else None


def _non_finite(value: object) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def payload_keys(payloads: list[bytes | None] | None) -> set[str]:
    """The distinct top-level keys of encoded payloads."""
    keys: set[str] = set()
    for p in payloads or ():
        if p is not None:
            keys.update(orjson.loads(p))
    return keys


_parsers = threading.local()
KEPT_PARSER_BYTES = 4 << 20  # a thread keeps its simdjson parser (and its buffers) for bodies up to this size


def _key_parser(size: int) -> Any:
    """A simdjson parser: the thread's own for a body of up to KEPT_PARSER_BYTES (a new one's buffers cost page
    faults: 5 ms instead of 1.5 for 900 KB on this VM), a new one for a larger body or when a document of the
    thread's own is still referred to (simdjson refuses to parse again then)."""
    if size > KEPT_PARSER_BYTES:
        return simdjson.Parser()
    parser = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = simdjson.Parser()
    return parser


def refuse_excess_keys(body: bytes, max_keys: int) -> None:
    """Refuse (InvalidInput) a JSON upsert body whose payloads alone hold more than `max_keys` distinct top-level
    keys, before any of it is built into Python objects: building a 50,000-key payload holds the GIL for about
    10 ms wherever it runs, simdjson's lazy parse counts its keys in about 1. A body with no more colons than
    `max_keys` cannot, and costs one count; one that does not parse is left to the full parse to answer."""
    if body.count(b":") <= max_keys:
        return
    parser = _key_parser(len(body))
    try:
        try:
            doc = parser.parse(body)
        except RuntimeError:  # the thread's parser is still held: use a new one, and keep that
            parser = _parsers.parser = simdjson.Parser()
            doc = parser.parse(body)
    except ValueError:
        return
    verdict = _excess_keys(doc, max_keys)
    del doc  # nothing may refer to the parser's document when it parses the next body
    if verdict is not None:
        raise InvalidInput(verdict[1], field=verdict[0])


def _excess_keys(doc: Any, max_keys: int) -> tuple[str, str] | None:
    """(field, detail) of the first payload, or the payloads together, past `max_keys` keys; None if none is."""
    payloads = doc.get("payloads") if isinstance(doc, simdjson.Object) else None
    if not isinstance(payloads, simdjson.Array):
        return None
    keys: set[str] = set()
    for i, payload in enumerate(payloads):
        if not isinstance(payload, simdjson.Object):
            continue
        if len(payload) > max_keys:
            return (f"payloads[{i}]", f"has {len(payload):,} top-level keys; a collection holds at most "
                    f"{max_keys:,} (SWITCHYARD_MAX_PAYLOAD_KEYS)")
        keys.update(payload.keys())
        if len(keys) > max_keys:
            return ("payloads", f"hold more than {max_keys:,} distinct top-level keys by payloads[{i}]; a "
                    f"collection holds at most {max_keys:,} (SWITCHYARD_MAX_PAYLOAD_KEYS)")
    return None


def check_payload_sizes(payloads: list[bytes | None] | None, max_value: int = MAX_PAYLOAD_VALUE_BYTES,
                        max_row: int = MAX_PAYLOAD_ROW_BYTES, first: int = 0) -> None:
    """Refuse (InvalidInput naming `payloads[i]`, or `payloads[i].<key>` for one value) a payload whose JSON is over
    `max_row` bytes, or one with a top-level value whose JSON is over `max_value` bytes: each string value is
    held in every resident replica's payload index, so one 60 MB string would cost every process 60 MB. `first`:
    the number of the first row (a bulk load's chunk). Rows within both limits cost a length comparison."""
    for i, text in enumerate(payloads or (), first):
        if text is None or len(text) <= min(max_value, max_row):
            continue
        if len(text) > max_row:
            raise InvalidInput(f"is {len(text):,} bytes of JSON; a payload may have at most {max_row:,} "
                               "(SWITCHYARD_MAX_PAYLOAD_ROW_BYTES)", field=f"payloads[{i}]")
        for key, value in orjson.loads(text).items():
            if (size := len(orjson.dumps(value))) > max_value:
                raise InvalidInput(f"is {size:,} bytes of JSON; a payload value may have at most {max_value:,} "
                                   "(SWITCHYARD_MAX_PAYLOAD_VALUE_BYTES)", field=f"payloads[{i}].{key}")


def make_points(ids: np.ndarray, vectors: np.ndarray, payloads: list[object] | None, first: int = 0) -> Points:
    return checked_points(ids, vectors, encode_payloads(payloads, len(ids), first))


def checked_points(ids: object, vectors: np.ndarray, payloads: list[bytes | None] | None) -> Points:
    """Points from ids, a checked matrix and payloads already encoded (encode_payloads)."""
    id_array = check_ids(ids)
    if len(id_array) != len(vectors):
        raise InvalidInput(f"{len(id_array)} ids for {len(vectors)} vectors", field="ids")
    return Points(id_array, vectors, payloads)


def arrow_chunks(path: str | Path, dim: int, rows: int = 20_000, metric: str = "l2") -> Iterator[Points]:
    """The points of an Arrow IPC stream file, `rows` at a time: columns id (integer), vector (or embedding:
    fixed-size or plain list of float), and optionally payload (JSON text or struct). The file is memory-mapped,
    so only one chunk is ever decoded in memory."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            columns = set(reader.schema.names)
            vector_column = "vector" if "vector" in columns else "embedding" if "embedding" in columns else None
            if "id" not in columns or vector_column is None:
                raise InvalidInput(f"needs columns 'id' and 'vector'; it has {sorted(columns)}", field="body")
            pending: list[pa.RecordBatch] = []
            held = done = 0  # rows pending, rows yielded
            for batch in reader:
                while len(batch):
                    take = batch.slice(0, rows - held)
                    batch = batch.slice(len(take))
                    pending.append(take)
                    held += len(take)
                    if held == rows:
                        yield _arrow_points(pa.Table.from_batches(pending), vector_column, dim, metric, done)
                        pending, held, done = [], 0, done + held
            if held:
                yield _arrow_points(pa.Table.from_batches(pending), vector_column, dim, metric, done)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise InvalidInput(f"is not a readable Arrow IPC stream ({exc})", field="body") from None


def check_arrow(path: str | Path, dim: int, metric: str = "l2") -> int:
    """Read a whole Arrow IPC stream file as arrow_chunks will, so that a bad one is refused before anything is
    written; its number of rows. Ids must be unique across the whole stream, as in any one request."""
    return scan_arrow(path, dim, metric)[0]


ARROW_CONTINUATION = b"\xff\xff\xff\xff"  # what every message of an Arrow IPC stream (format >= 0.15) starts with


def check_arrow_stream_start(head: bytes) -> None:
    """The first bytes of a body said to be an Arrow IPC stream, checked before the rest is read: a JSON body sent
    with the Arrow content type is refused at once instead of after megabytes. A stream starts with the
    continuation marker, or (the legacy format) with its first message's length, a small positive int32."""
    if len(head) < 4 or head[:4] == ARROW_CONTINUATION:
        return
    if not 0 < int.from_bytes(head[:4], "little", signed=True) < 1 << 24:
        raise InvalidInput(f"the body is not an Arrow IPC stream (it starts with {head[:16]!r})", field="body")


def scan_arrow(path: str | Path, dim: int, metric: str = "l2",
               check: Callable[[list[bytes | None] | None, int], None] | None = None) -> tuple[int, set[str]]:
    """check_arrow's reading, also giving the distinct top-level payload keys of the stream (the store bounds
    them per collection, before the first chunk is written); `check(payloads, first row)` sees each chunk's
    payloads (the store's size limits)."""
    ids, keys = [], set()
    rows = 0
    for points in arrow_chunks(path, dim, metric=metric):
        if check is not None:
            check(points.payloads, rows)
        rows += len(points.ids)
        ids.append(points.ids)
        keys |= payload_keys(points.payloads)
    check_ids(np.concatenate(ids) if ids else np.empty(0, np.int64))
    return sum(len(chunk) for chunk in ids), keys


def _arrow_points(table: Any, vector_column: str, dim: int, metric: str, first: int) -> Points:
    import pyarrow as pa

    if table.column("id").null_count or table.column(vector_column).null_count:
        raise InvalidInput("ids and vectors must not be null", field="body")
    ids = table.column("id").to_numpy()
    vec = table.column(vector_column).combine_chunks()
    if (not pa.types.is_list(vec.type) and not pa.types.is_fixed_size_list(vec.type)
            and not pa.types.is_large_list(vec.type)):
        raise InvalidInput(f"column {vector_column!r} must be a list of floats, not {vec.type}", field=vector_column)
    flat = vec.flatten().to_numpy(zero_copy_only=False)
    if len(flat) != len(vec) * dim:
        raise InvalidInput(f"vectors must all have dimension {dim}", field=vector_column)
    vectors = as_matrix(flat.reshape(len(vec), dim), dim, vector_column)
    check_nonzero(vectors, metric, vector_column)
    payloads = None
    if "payload" in table.column_names:
        payloads = []
        for i, value in enumerate(table.column("payload").to_pylist(), first):
            if isinstance(value, str):
                try:
                    value = orjson.loads(value)
                except orjson.JSONDecodeError as exc:  # 1e309 too: orjson reads no number past float64
                    raise InvalidInput(f"is not a JSON object ({exc})", field=f"payloads[{i}]") from None
            payloads.append(value)
    return make_points(ids, vectors, payloads, first)
