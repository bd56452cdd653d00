"""What a search or JSON upsert says, parsed and checked as far as it can be without its collection.

The parse step of the request pipeline (service/pipeline.py): a body becomes a typed call, which a front process
sends to an engine process and a single process answers itself. Light on purpose: front processes import this and
no engine.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

import numpy as np
import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from indexes import filters
from indexes.errors import InvalidInput, VectorError
from indexes.vectors import (
    MAX_DIM,
    MAX_ID,
    MAX_K,
    decode_base64,
    encode_payloads,
    fit_matrix,
    refuse_excess_keys,
    unshaped_matrix,
)
from service.errors import ProblemError
from service.http.jsonnum import NUMBER_ONLY, UNIQUE_ITEMS, Float, Int, IntList, Number, decimal
from service.http.openapi import exactly_one_of
from service.process.messages import SearchCall, UpsertCall, float32_bytes

RAW_VECTORS = "application/octet-stream"
# What parsing or answering a bad request raises: the full app formats each as its problem+json.
REQUEST_ERRORS = (ProblemError, VectorError, RequestValidationError, ValueError)


Base64Text = Annotated[str, Field(min_length=1)]  # an empty one holds no vectors
RecallTarget = Annotated[Float, Field(gt=0, le=1)]  # the schema says exclusiveMinimum 0, maximum 1


StatedDim = Annotated[int, Field(ge=1, le=MAX_DIM), NUMBER_ONLY]
STATED_DIM = ("With `vectors_b64` (or a raw float32 body, as a query parameter): the dimension of the vectors sent, "
              "checked against the collection's (a 422 naming `dim` if they differ). Without it the bytes are cut "
              "into rows of the collection's dimension, so vectors of another one go unnoticed when the byte counts "
              "happen to agree.")


class SearchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: Int = Field(default=10, ge=1, le=MAX_K)
    engine: Literal["auto", "gpu", "cpu", "pgvector"] = "auto"
    params: dict[str, Number] | None = Field(default=None, description=(
        "Search parameters of the engine: ivf_flat {n_probes}; ivf_pq {n_probes, refine_ratio}; hnsw {ef}; "
        "cagra {itopk_size, search_width}; pgvector {ef_search, probes}."))
    filter: dict[str, Any] | None = Field(default=None, description=(
        "Payload filter, MongoDB-style: `{\"color\": \"red\"}` (equality), `{\"price\": {\"$gte\": 10, \"$lt\": 20}}`, "
        "`$eq $ne $in $nin $gt $gte $lt $lte $exists` on top-level payload keys, `$and $or $not` to compose; "
        "range bounds are numbers or ISO-8601 dates. The same meaning on every engine; see docs/api.md, "
        "'Filtered search'. A bad filter is a 422 naming the path inside it."),
        examples=[{"$and": [{"category": {"$in": ["books", "music"]}}, {"price": {"$lt": 20}}]}])
    recall_target: RecallTarget | None = Field(default=None, description=(
        "Instead of `params`: the recall@10 wanted (e.g. 0.95). The resident engine uses the cheapest search "
        "parameters whose recall, calibrated after the index's last build, reaches it (exact search if none "
        "does); the answer's `plan` says which."))
    consistency: Literal["strong", "session", "bounded", "eventually"] | None = Field(default=None, description=(
        "What the resident replica must have applied first: `strong` every commit before this search, `session` "
        "at least `seq`, `bounded` (default) every commit older than the staleness bound (1 s), `eventually` "
        "nothing. pgvector always reads the latest commit."))
    seq: Annotated[int, Field(ge=0, le=MAX_ID), NUMBER_ONLY] | None = Field(
        default=None, description="With `session`: the seq a write of yours returned.")
    dim: StatedDim | None = Field(default=None, description=STATED_DIM)

    @field_validator("params")
    @classmethod
    def _params_in_range(cls, params: dict[str, int | float] | None) -> dict[str, int | float] | None:
        """Search parameters cross process links as 64-bit integers: a larger one is refused here, not a 500."""
        for name, value in (params or {}).items():
            if isinstance(value, int) and not -MAX_ID - 1 <= value <= MAX_ID:
                raise ValueError(f"search parameter {name!r} is beyond 64 bits")
        return params


class SearchRequest(SearchOptions):
    model_config = ConfigDict(extra="forbid",
                              json_schema_extra=exactly_one_of(("vector",), ("vectors",), ("vectors_b64",)))
    vector: list[Float] | None = Field(default=None, min_length=1, description="One query vector.")
    vectors: list[list[Float]] | None = Field(default=None, min_length=1, max_length=10_000,
                                              description="A batch of query vectors.")
    vectors_b64: Base64Text | None = Field(default=None, description="A batch as base64 little-endian float32.")

    @model_validator(mode="after")
    def _one_query(self) -> "SearchRequest":
        given = [x for x in (self.vector, self.vectors, self.vectors_b64) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'vector', 'vectors' and 'vectors_b64'")
        return stated_with_base64(self)


RAW_QUERY_FIELDS = {"k", "engine", "consistency", "seq", "recall_target", "dim"}
RAW_NUMBER_FIELDS = {"k", "seq", "recall_target", "dim"}
QUERY_BOOLEANS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def raw_search_options(query_string: str) -> tuple[SearchOptions, bool]:
    """Options of a raw float32 search from its query string: k, engine, consistency, seq, recall_target, dim, filter
    (JSON text), `batch=true` (answer lists even for one vector); any other name is a search parameter (`ef=64`).
    Returns (options, batch)."""
    fields: dict[str, Any] = {}
    params: dict[str, float] = {}
    batch = False
    for name, value in parse_qsl(query_string, keep_blank_values=True):
        if name in RAW_NUMBER_FIELDS:
            fields[name] = _query_number(name, value)
        elif name in RAW_QUERY_FIELDS:
            fields[name] = value
        elif name == "filter":  # the filter language, as JSON text
            try:
                fields["filter"] = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise RequestValidationError([{"type": "json_invalid", "loc": ("query", "filter"), "input": value,
                                               "msg": f"the filter is not JSON ({exc})"}]) from None
        elif name == "batch":
            if value.lower() not in QUERY_BOOLEANS:
                raise RequestValidationError([{"type": "bool_parsing", "loc": ("query", name), "input": value,
                                               "msg": f"batch must be one of {', '.join(QUERY_BOOLEANS)}"}])
            batch = QUERY_BOOLEANS[value.lower()]
        else:
            params[name] = _query_number(name, value)
    if params:
        fields["params"] = params
    try:
        return SearchOptions.model_validate(fields), batch
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in exc.errors()]) from None


def _query_number(name: str, value: str) -> int | float:
    """A number written in a query string; an integral one as an int, so that integer options take it."""
    number = decimal(value)
    if not math.isfinite(number):
        raise RequestValidationError([{"type": "float_parsing", "loc": ("query", name), "input": value,
                                       "msg": f"{name} must be a finite decimal number"}]) from None
    return int(number) if number.is_integer() else number


class UpsertPoints(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of(("vectors",), ("vectors_b64",)))
    ids: IntList = Field(min_length=1, max_length=100_000, json_schema_extra=UNIQUE_ITEMS)
    vectors: list[list[Float]] | None = Field(default=None, min_length=1, description="One float list per id.")
    vectors_b64: Base64Text | None = Field(
        default=None, description="All vectors as base64 of little-endian float32, row after row.")
    payloads: list[dict[str, Any] | None] | None = Field(default=None, description="A JSON object (or null) per id.")
    dim: StatedDim | None = Field(default=None, description=STATED_DIM)

    @model_validator(mode="after")
    def _one_encoding(self) -> "UpsertPoints":
        if (self.vectors is None) == (self.vectors_b64 is None):
            raise ValueError("give exactly one of 'vectors' and 'vectors_b64'")
        return stated_with_base64(self)


def stated_with_base64(body: Any) -> Any:
    """`dim` states the width of base64 rows; JSON lists carry their own."""
    if body.dim is not None and body.vectors_b64 is None:
        raise ValueError("'dim' goes with 'vectors_b64' only: JSON lists carry their own dimension")
    return body


def parse_json(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:  # the same 422 problem FastAPI gives for bodies it parses itself
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


OPTION_FIELDS = tuple(SearchOptions.model_fields)


def raw_search_fields(query_string: str) -> tuple[dict[str, Any], bool]:
    """raw_search_options as a SearchCall's fields, remembered per query string up to CACHED_QUERY_CHARS (a client
    sends the same one with every vector; longer ones, which only a filter makes, are parsed each time so the cache
    stays small); callers must not change them. Errors are not remembered: a bad query string is refused each time."""
    if len(query_string) > CACHED_QUERY_CHARS:
        return _raw_search_fields(query_string)
    return _cached_search_fields(query_string)


def _raw_search_fields(query_string: str) -> tuple[dict[str, Any], bool]:
    options, batch = raw_search_options(query_string)
    return checked_fields(options), batch


CACHED_QUERY_CHARS = 1_024
_cached_search_fields = functools.lru_cache(maxsize=1024)(_raw_search_fields)


def checked_fields(options: SearchOptions) -> dict[str, Any]:
    """A SearchCall's option fields, with the filter checked here, where the request is parsed (a front process
    too: a 422 naming the path inside it), and its integers beyond 64 bits as the floats they mean, so that the
    call can cross to an engine process."""
    fields = {name: getattr(options, name) for name in OPTION_FIELDS}
    if fields["filter"] is not None:
        filters.parse(fields["filter"])  # remembered by its text: the engine's own parse of it is a look-up
        fields["filter"] = filters.portable(fields["filter"])
    return fields


def parse_search(collection: str, raw: bytes, content_type: str = "application/json",
                 query_string: str = "") -> SearchCall:
    """The parse step of every search: its body (JSON, or raw float32 with options in the query string) as a
    SearchCall, checked as far as it can be without its collection."""
    if content_type == RAW_VECTORS:
        fields, batch = raw_search_fields(query_string)
        return SearchCall(collection, raw, None, "body", not batch, **fields)
    body = parse_json(SearchRequest, raw)
    fields = checked_fields(body)
    if body.vector is not None:
        matrix, field, single = unshaped_matrix([body.vector], "vector"), "vector", True
    elif body.vectors is not None:
        matrix, field, single = unshaped_matrix(body.vectors, "vectors"), "vectors", False
    else:
        data = decode_base64(body.vectors_b64, "vectors_b64")
        return SearchCall(collection, data, None, "vectors_b64", False, **fields)
    return SearchCall(collection, float32_bytes(matrix), matrix.shape[1], field, single, **fields)


def parse_upsert(collection: str, raw: bytes, max_keys: int | None = None) -> UpsertCall:
    """The parse step of a JSON upsert, as an UpsertCall checked as far as it can be without its collection;
    with `max_keys` (the engine's SWITCHYARD_MAX_PAYLOAD_KEYS), payloads with more keys are refused unbuilt."""
    if max_keys is not None:
        refuse_excess_keys(raw, max_keys)
    body = parse_json(UpsertPoints, raw)
    if max(body.ids) > MAX_ID or min(body.ids) < -MAX_ID - 1:  # ids cross process links as 64-bit integers
        raise InvalidInput("ids must be integers between 0 and 2^63-1", field="ids")
    payloads = encode_payloads(body.payloads, len(body.ids))
    if body.vectors is not None:
        matrix = unshaped_matrix(body.vectors, "vectors")
        return UpsertCall(collection, body.ids, float32_bytes(matrix), matrix.shape[1], "vectors", payloads)
    return UpsertCall(collection, body.ids, decode_base64(body.vectors_b64, "vectors_b64"), None, "vectors_b64",
                      payloads, body.dim)


def matrix_of(data: bytes, width: int | None, dim: int, field: str, stated: int | None = None) -> np.ndarray:
    """A call's vectors as a (n, dim) float32 matrix, checked against the collection's dimension: JSON lists' own
    `width`, or for bytes the dimension the request `stated`, if it did."""
    if stated is not None and stated != dim:
        raise InvalidInput(f"the vectors sent have dimension {stated}, the collection has {dim}", field="dim")
    if width is None:
        return fit_matrix(data, dim, field)
    if width != dim:
        raise InvalidInput(f"vectors have dimension {width}, the collection has {dim}", field=field)
    return np.frombuffer(data, dtype="<f4").reshape(-1, dim)
