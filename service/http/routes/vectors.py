"""Vector collections over HTTP: create / list / get / delete, upsert and delete points, search, recall."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Callable, Literal

import numpy as np
import orjson
from fastapi import Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from indexes.vectors import (
    MAX_DIM,
    MAX_K,
    arrow_chunks,
    as_matrix,
    check_arrow_stream_start,
    check_batch,
    check_finite,
    check_ids,
    checked_points,
    scan_arrow,
)
from service.http.deps import RuntimeDep, domain, v1_router
from service.http.jsonnum import NUMBER_ONLY, UNIQUE_ITEMS, Float, Int, IntList, Number
from service.http.media import media_type
from service.http.vector_requests import (
    RAW_VECTORS,
    REQUEST_ERRORS,
    RecallTarget,
    SearchRequest,
    UpsertPoints,
    matrix_of,
)
from service.jobs.disk import BULK_BYTES_PER_BYTE, DiskNeed
from service.jobs.spool import spool
from service.pipeline import Pipeline, parse_call
from service.process.messages import Reply, SearchCall, UpsertCall

router = v1_router(tags=["vectors"])

ARROW_STREAM = "application/vnd.apache.arrow.stream"
FallbackBuild = Annotated[Literal["background", "wait"], Query(description=(
    "When the collection has a resident index, its pgvector index (the fallback) is built after the job ends, "
    "CONCURRENTLY, so writes go on (`background`), or before it ends (`wait`). Without one it is always waited for."))]
CollectionName = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$", description="Collection name.")]


class IndexSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "brute_force", "ivf_flat", "ivf_pq", "cagra", "hnsw"] = Field(
        default="auto", description="`auto`: exact below 20,000 vectors, HNSW (CPU) / CAGRA (GPU) above.")
    params: dict[str, Number] = Field(default_factory=dict, description=(
        "Build parameters: ivf_flat {n_lists}; ivf_pq {n_lists, pq_dim, pq_bits}; hnsw {m, ef_construction}; "
        "cagra {graph_degree, intermediate_graph_degree}."))


def _pgvector_index_schema(schema: dict[str, Any]) -> None:
    """Each index type with only its own parameters, as indexes/pgvector_search.check_index enforces."""
    props = schema["properties"]
    kinds = {"hnsw": ("m", "ef_construction"), "ivfflat": ("lists",), "none": ()}
    params = [name for names in kinds.values() for name in names]  # null counts as absent
    branches = [{"type": "object", "additionalProperties": False, "required": [] if kind == "hnsw" else ["type"],
                 "properties": {"type": {"enum": [kind, None] if kind == "hnsw" else [kind]},
                                **{name: props[name] if name in names else {"type": "null"} for name in params}}}
                for kind, names in kinds.items()]
    schema.clear()
    schema.update({"title": "PgvectorIndexSpec", "oneOf": branches, "description": (
        "`type` absent: hnsw, or none above 2,000 dimensions (pgvector indexes at most 2,000). HNSW's "
        "ef_construction defaults to max(64, 2 * m) and must be at least 2 * m.")})


class PgvectorIndexSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_pgvector_index_schema)
    type: Literal["hnsw", "ivfflat", "none"] | None = None
    # bounded optional integers as service/http/jsonnum.py says, so the schema has minimum/maximum
    m: Annotated[int, Field(ge=2, le=100), NUMBER_ONLY] | None = None
    ef_construction: Annotated[int, Field(ge=4, le=1000), NUMBER_ONLY] | None = None
    lists: Annotated[int, Field(ge=1, le=32768), NUMBER_ONLY] | None = None


class CreateCollection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
    dim: Int = Field(ge=1, le=MAX_DIM)
    metric: Literal["l2", "cosine", "inner_product"] = "l2"
    index: IndexSpec = Field(default_factory=IndexSpec)
    pgvector_index: PgvectorIndexSpec = Field(default_factory=PgvectorIndexSpec, description=(
        "The index pgvector builds in PostgreSQL (after a bulk load, or on POST .../build)."))


class CollectionOut(BaseModel):
    name: str
    dim: int
    metric: str
    index: dict[str, Any]
    pgvector_index: dict[str, Any]
    count: int | None = None
    engines: list[str] | None = None
    index_state: dict[str, Any] | None = None
    replication: dict[str, Any] | None = Field(default=None, description=(
        "PostgreSQL's head `seq` (and with ?verify=true its `rows` and content `digest`), and each process's "
        "replica: `watermark`, `lag_rows`, `lag_ms`, `rows`, `digest` (equal to PostgreSQL's when in step)."))
    shards: list[dict[str, Any]] | None = Field(default=None, description=(
        "On a Ray cluster (SWITCHYARD_RAY_ADDRESS): each shard's replicas, where each runs (`host`, `pid`), "
        "whether it is `ready`, and its `index_state` for this collection; null in one process."))


def _collection_out(c: Any, **extra: Any) -> CollectionOut:
    return CollectionOut(name=c.name, dim=c.dim, metric=c.metric,
                         index={"type": c.index_type, "params": c.index_params},
                         pgvector_index=c.pgvector_index, **extra)


class WriteOut(BaseModel):
    upserted: int | None = None
    deleted: int | None = None
    seq: int | None = Field(default=None, description=(
        "Change seq of the committed write (for a delete that found nothing, the collection's head): pass it as "
        "`seq` with consistency `session` to read your write from any process."))


class DeletePoints(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: IntList = Field(min_length=1, max_length=100_000, json_schema_extra=UNIQUE_ITEMS)


class SearchOut(BaseModel):
    ids: list[int] | list[list[int]] = Field(description="Nearest ids, closest first (a list per query for a batch).")
    distances: list[float] | list[list[float]] = Field(description=(
        "Smaller is closer: l2 = Euclidean distance, cosine = 1 - cosine similarity, inner_product = -dot."))
    engine: str
    took_ms: float
    fallback: str | None = Field(default=None, description="Why `auto` did not use its first choice.")
    consistency: str = Field(description="The level the search was served at.")
    watermark: int | None = Field(default=None, description=(
        "The change seq the resident replica had applied when it answered (null: pgvector read PostgreSQL)."))
    plan: dict[str, Any] | None = Field(default=None, description=(
        "Filtered or recall-targeted searches on the resident engine: `plan` (`exact` over the matching rows, "
        "`ann-filtered` the index with the filter as a bitmap, or `ann`), the `params` used, `matched_rows` and "
        "`selectivity` of the filter, and `calibrated_recall` for a `recall_target`."))


class RecallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: Int = Field(default=10, ge=1, le=MAX_K)
    engine: Literal["auto", "gpu", "cpu", "pgvector"] = "auto"
    params: dict[str, Number] | None = None
    sample: Int = Field(default=100, ge=1, le=10_000, description="Stored vectors used as queries.")
    queries: list[list[Float]] | None = Field(default=None, min_length=1, max_length=10_000,
                                              description="Queries to use instead.")
    seed: Int = Field(default=0, ge=0, description="Seed of the sample's random choice (0 or more).")
    recall_target: RecallTarget | None = Field(default=None,
                                               description="Search as a search with this recall_target would.")


def json_body(model: type[BaseModel], more: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAPI request body for routes that parse their body themselves (see parse_json)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}, **(more or {})}}}


class JobAccepted(BaseModel):
    job: str
    state: str
    location: str


@router.post("/collections", status_code=201, summary="Create a collection")
async def create_collection(body: CreateCollection, runtime: RuntimeDep) -> CollectionOut:
    pg = body.pgvector_index.model_dump(exclude_none=True)
    c = await domain(runtime, "vectors").create(body.name, body.dim, body.metric, body.index.type, body.index.params,
                                                pg)
    return _collection_out(c, count=0)


@router.get("/collections", summary="List collections")
async def list_collections(runtime: RuntimeDep) -> list[CollectionOut]:
    return [_collection_out(c) for c in await domain(runtime, "vectors").store.list()]


@router.get("/collections/{name}", summary="A collection with its count, index state, engines and replicas")
async def get_collection(name: CollectionName, runtime: RuntimeDep, verify: Annotated[bool, Query(description=(
        "Also read every stored vector to compute PostgreSQL's content digest (a full scan)."))] = False,
) -> CollectionOut:
    info = await domain(runtime, "vectors").describe(name, verify)
    return _collection_out(info["collection"], count=info["count"], engines=info["engines"],
                           index_state=info["index_state"], replication=info["replication"], shards=info.get("shards"))


@router.delete("/collections/{name}", status_code=204, summary="Delete a collection and its points")
async def delete_collection(name: CollectionName, runtime: RuntimeDep) -> Response:
    await domain(runtime, "vectors").drop(name)
    return Response(status_code=204)


@router.put(
    "/collections/{name}/points",
    summary="Upsert points (JSON), or bulk-load an Arrow IPC stream as a job",
    responses={202: {"model": JobAccepted, "description": "Arrow IPC body: loading as a job."}},
    openapi_extra=json_body(UpsertPoints,
                            {ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}, "description": (
        "Columns: id (int64), vector (list or fixed_size_list of float32), optional payload (JSON text).")}}),
)
async def upsert_points(name: CollectionName, request: Request, runtime: RuntimeDep,
                        pgvector: FallbackBuild = "background") -> Any:
    if media_type(request.headers.raw) == ARROW_STREAM.encode():  # the one parse express and the limits use
        job = await start_bulk_load(runtime, name, request, pgvector)
        location = f"/v1/jobs/{job.id}"
        return Response(JobAccepted(job=job.id, state=job.state, location=location).model_dump_json(), status_code=202,
                        media_type="application/json", headers={"Location": location})
    return _answered(await pipeline_of(runtime).run(parse_call(False, name, await request.body(), "", "")))


async def start_bulk_load(runtime: Any, name: str, request: Request, fallback: str) -> Any:
    """Spool an Arrow IPC body to disk, check all of it (a bad stream is a 422 before anything is written), then
    load it as a job that reads it a chunk at a time and removes the file when it ends."""
    vectors = domain(runtime, "vectors")
    c = await vectors.collection(name)
    jobs = domain(runtime, "jobs")
    path = await spool(request, jobs.disk, "the bulk load's body", check_start=check_arrow_stream_start)
    try:
        rows, keys = await asyncio.to_thread(scan_arrow, path, c.dim, c.metric, vectors.store.check_payload_sizes)
        await vectors.store.check_keys(c, keys)
        return await jobs.start(
            "bulk_upsert", name, lambda progress: vectors.bulk_upsert(name, arrow_chunks(path, c.dim, metric=c.metric),
                                                                      rows, progress, fallback=fallback),
            cleanup=lambda: path.unlink(missing_ok=True),
            disk=DiskNeed(BULK_BYTES_PER_BYTE * rows * (4 * c.dim + 8), f"loading {rows} points"))
    except BaseException:
        path.unlink(missing_ok=True)
        raise


async def answer_upsert(runtime: Any, call: UpsertCall) -> bytes:
    """The run step of a JSON upsert: store it (acknowledged after COMMIT) and answer it."""
    vectors = domain(runtime, "vectors")
    c = await vectors.collection(call.collection)
    points = checked_points(call.ids, matrix_of(call.vectors, call.width, c.dim, call.field, call.dim), call.payloads)
    async with runtime.admission.slot("writes", bound_run=False):
        seq = await vectors.upsert(call.collection, points, call.field)
    return WriteOut(upserted=len(points.ids), seq=seq).model_dump_json().encode()


@router.post("/collections/{name}/points/delete", summary="Delete points by id")
async def delete_points(name: CollectionName, body: DeletePoints, runtime: RuntimeDep) -> WriteOut:
    vectors = domain(runtime, "vectors")
    async with runtime.admission.slot("writes", bound_run=False):
        deleted, seq = await vectors.delete(name, check_ids(body.ids))
    return WriteOut(deleted=deleted, seq=seq)


async def answer_search(runtime: Any, call: SearchCall) -> bytes:
    """The run step of a search: its JSON answer."""
    vectors = domain(runtime, "vectors")
    c = await vectors.collection(call.collection)
    check_batch(call.rows(c.dim), call.k, call.field)  # counted before anything is decoded
    queries = matrix_of(call.queries, call.width, c.dim, call.field, call.dim)
    # A raw body is one query unless it says batch=true, which it can only tell once the dimension is known.
    single = call.single and (call.field != "body" or len(queries) == 1)
    consistency = call.consistency or vectors.consistency.default
    answer = await vectors.search(call.collection, queries, call.k, call.engine, call.params, call.filter,
                                  single=single, consistency=consistency, seq=call.seq,
                                  recall_target=call.recall_target)
    return search_json(answer, single, consistency)


def search_json(answer: Any, single: bool, consistency: str) -> bytes:
    ids, distances = answer.result.ids, answer.result.distances
    if single:
        ids, distances = ids[0], distances[0]
    out = {"ids": ids, "distances": distances, "engine": answer.engine, "took_ms": answer.took_ms,
           "fallback": answer.fallback, "consistency": consistency, "watermark": answer.result.watermark}
    if answer.result.plan is not None:
        out["plan"] = answer.result.plan
    return orjson.dumps(out)


def search_inline(runtime: Any, call: SearchCall, respond: Callable[[bytes], None]) -> bool:
    """answer_search's answer computed at once, without awaiting anything, and given to `respond` as soon as it is
    made; False, with nothing given, for a search that is not one query served by the resident CPU engine right
    away, or that fails in any way (answer_search then answers it, errors included)."""
    vectors = runtime.vectors
    c = vectors.catalog.get(call.collection) if vectors is not None else None
    if c is None or len(call.queries) != 4 * c.dim:
        return False
    if call.width not in (None, c.dim) or call.dim not in (None, c.dim):
        return False
    queries = np.frombuffer(call.queries, dtype="<f4").reshape(1, c.dim)
    try:
        if call.width is None:  # JSON lists were checked when parsed
            check_finite(queries, call.field)
    except REQUEST_ERRORS:
        return False
    single = call.single
    consistency = call.consistency or vectors.consistency.default
    answer = vectors.search_inline(call.collection, queries[0], call.k, call.engine, call.params, consistency, call.seq,
                                call.filter, call.recall_target,
                                lambda found: respond(search_json(found, single, consistency)))
    return answer is not None


@router.post(
    "/collections/{name}/search", summary="k nearest neighbours of one vector or a batch", response_model=SearchOut,
    openapi_extra=json_body(SearchRequest,
                            {RAW_VECTORS: {"schema": {"type": "string", "format": "binary"}, "description": (
        "Raw little-endian float32 vectors, row after row (no parsing at all). Options in the query string: "
        "`k`, `engine`, `consistency`, `seq`, `dim` (the vectors' dimension, checked against the collection's), "
        "`batch=true` (answer lists for one vector too), and any search "
        "parameter by name, e.g. `?k=10&engine=cpu&ef=64`.")}}),
)
async def search(name: CollectionName, request: Request) -> Response:
    # The body is parsed by pydantic-core straight from bytes (or not at all) and the answer written with orjson.
    content_type = media_type(request.headers.raw, b"application/json").decode("latin-1")
    call = parse_call(True, name, await request.body(), content_type, request.url.query)
    return _answered(await pipeline_of(request.app.state.switchyard).run(call))


def pipeline_of(runtime: Any) -> Pipeline:
    pipeline = runtime.pipeline
    assert pipeline is not None  # the app sets it when it is made
    return pipeline


def _answered(reply: Reply) -> Response:
    """A reply of the pipeline as the route's response."""
    return Response(reply.body, status_code=reply.status, headers=dict(reply.headers))


@router.post("/collections/{name}/recall", summary="recall@k of an engine against exact search")
async def recall(name: CollectionName, body: RecallRequest, runtime: RuntimeDep) -> dict[str, Any]:
    vectors = domain(runtime, "vectors")
    queries = None
    if body.queries is not None:
        c = await vectors.collection(name)
        queries = as_matrix(body.queries, c.dim, "queries")
    return await vectors.recall(name, body.k, body.engine, body.params, body.sample, queries, body.seed,
                                body.recall_target)


@router.post("/collections/{name}/build", status_code=202, summary="Rebuild (compact) the resident index and "
             "create the pgvector index, as a job")
async def build(name: CollectionName, runtime: RuntimeDep, response: Response,
                pgvector: FallbackBuild = "background") -> JobAccepted:
    vectors = domain(runtime, "vectors")
    await vectors.collection(name)  # 404 now rather than in the job
    job = await domain(runtime, "jobs").start("build", name,
                                              lambda progress: vectors.build(name, progress, fallback=pgvector))
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobAccepted(job=job.id, state=job.state, location=f"/v1/jobs/{job.id}")

