"""Star Schema Benchmark over HTTP: datasets (generate, import), the 13 queries, ad-hoc read-only SQL."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Path as PathParam
from fastapi import Request, Response
from pydantic import BaseModel, ConfigDict, Field

from olap.queries import QUERIES, params_schema
from service.admission.deadlines import remaining
from service.errors import Forbidden, NotFound, Unprocessable
from service.http.deps import RuntimeDep, domain, v1_router
from service.http.jsonnum import Float, Int
from service.http.routes.vectors import JobAccepted
from service.http.vector_requests import parse_json
from service.jobs.disk import SSB_BYTES_PER_SF, DiskNeed, ssb_import_bytes

router = v1_router(tags=["olap"])

Engine = Literal["auto", "gpu", "cpu", "postgres", "cudf", "duckdb"]



class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale_factor: Float = Field(gt=0, le=100, description="SSB scale factor: 1 is 6 million lineorder rows.")
    seed: Int = Field(default=0, ge=0, le=2**31 - 1)


class ImportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Directory of the five ssb-dbgen .tbl files, inside SWITCHYARD_SSB_IMPORT_DIR: "
                                  "absolute, or relative to that directory.")
    name: str = Field(default="imported", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
                      description="Dataset name (directory under <data_dir>/ssb).")
    expected_rows: dict[str, Int] | None = Field(default=None, description="Row counts to check, per table.")


class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine: Engine = "auto"
    params: dict[str, Any] | None = Field(default=None,
                                          description="Template parameters; the published values by default.")


class SqlRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sql: str = Field(min_length=1, max_length=20_000, description="One read-only SELECT over the SSB tables.")
    engine: Engine = "auto"
    max_rows: Int = Field(default=1000, ge=1, le=100_000)
    timeout_s: Float = Field(default=30.0, gt=0, le=300)


class ResultOut(BaseModel):
    columns: list[str]
    rows: list[list[Any]]
    row_count: int
    truncated: bool = Field(description=(
        "More rows existed than the answer holds: max_rows, or 32 MiB of values (select fewer or narrower columns)."))
    engine: str
    took_ms: float
    fallback: str | None = None


def _result(answer: Any) -> ResultOut:
    r = answer.result
    return ResultOut(columns=r.columns, rows=r.rows, row_count=len(r.rows), truncated=r.truncated,
                     engine=answer.engine, took_ms=answer.took_ms, fallback=answer.fallback)


def _job(job: Any, response: Response) -> JobAccepted:
    location = f"/v1/jobs/{job.id}"
    response.headers["Location"] = location
    return JobAccepted(job=job.id, state=job.state, location=location)


async def _ssb_need(runtime: Any, manager: Any, need: float, what: str, field: str) -> DiskNeed:
    """What a new dataset asks of the disk (its Parquet files and PostgreSQL copy), with what SSB uses now: the job
    runner admits it against free disk, the reserve, the SSB quota and every claim of jobs admitted before it."""
    usage = await domain(runtime, "jobs").disk.ssb_usage(runtime.pool, manager.root)
    return DiskNeed(need, what, field, ssb=usage)


@router.get("/olap/ssb/datasets", summary="SSB datasets on disk, and which one the engines hold")
async def datasets(runtime: RuntimeDep) -> list[dict[str, Any]]:
    return domain(runtime, "olap").datasets()


@router.delete("/olap/ssb/datasets/{name}", status_code=204, summary="Delete an SSB dataset from disk",
               responses={404: {"description": "No such dataset."},
                          409: {"description": "The dataset is the one the engines hold."}})
async def delete_dataset(runtime: RuntimeDep, name: str = PathParam(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="The dataset's directory name (see GET datasets).")) -> Response:
    try:
        await domain(runtime, "olap").delete_dataset(name)
    except KeyError:
        raise NotFound(f"no SSB dataset {name!r}", field="name") from None
    return Response(status_code=204)


@router.post("/olap/ssb/generate", status_code=202, summary="Generate an SSB dataset and load it (a job)")
async def generate(body: GenerateRequest, runtime: RuntimeDep, response: Response) -> JobAccepted:
    manager = domain(runtime, "olap")
    need = await _ssb_need(runtime, manager, SSB_BYTES_PER_SF * body.scale_factor,
                           f"an SSB dataset of scale factor {body.scale_factor:g}", "scale_factor")
    job = await domain(runtime, "jobs").start("ssb_generate", f"sf{body.scale_factor:g}",
                                              lambda progress: manager.generate(body.scale_factor, body.seed, progress),
                                              disk=need)
    return _job(job, response)


@router.post("/olap/ssb/import", status_code=202, summary="Import ssb-dbgen .tbl files and load them (a job)")
async def import_tbl(body: ImportRequest, runtime: RuntimeDep, response: Response) -> JobAccepted:
    from olap.schema import TBL_FILES

    manager = domain(runtime, "olap")
    root = runtime.settings.ssb_imports.resolve()
    if "\x00" in body.path:  # no file system takes it; os calls raise ValueError (a 500 if it got that far)
        raise Unprocessable("the path contains a NUL character", field="path")
    try:
        source = (root / body.path).resolve()  # a relative path is taken from the import directory, not the cwd
        if source != root and root not in source.parents:
            raise Forbidden(f"imports are read only from inside {root} (SWITCHYARD_SSB_IMPORT_DIR): give a path "
                            "under it, absolute or relative to it", field="path")
        missing = [name for name in TBL_FILES.values() if not (source / name).is_file()]
        if missing:
            raise Unprocessable(f"{source} lacks {', '.join(missing)}", field="path")
        tbl_bytes = sum((source / name).stat().st_size for name in TBL_FILES.values())
    except (OSError, RuntimeError) as exc:  # a name too long, a symlink loop, a file that vanished
        raise Unprocessable(f"the path cannot be read: {exc.strerror if isinstance(exc, OSError) else exc}",
                            field="path") from None
    need = await _ssb_need(runtime, manager, ssb_import_bytes(tbl_bytes), f"importing {source}", "path")
    job = await domain(runtime, "jobs").start("ssb_import", body.name, lambda progress: manager.import_tbl(
        source, body.name, body.expected_rows, progress), disk=need)
    return _job(job, response)


@router.get("/olap/ssb/queries", summary="The 13 SSB queries with their SQL and parameters")
async def list_queries() -> list[dict[str, Any]]:
    from olap.queries import describe

    return describe()


def _query_route(query_id: str, title: str) -> None:
    """One operation per SSB query, so the document gives each its own parameters (a generated client gets a
    typed method per query)."""
    schema = QueryRequest.model_json_schema()
    schema["properties"]["params"] = {"anyOf": [params_schema(query_id), {"type": "null"}],
                                      "description": QueryRequest.model_fields["params"].description}

    async def run_query(request: Request, runtime: RuntimeDep) -> ResultOut:
        body = parse_json(QueryRequest, await request.body())
        return _result(await domain(runtime, "olap").run_query(query_id, body.params, body.engine))

    router.add_api_route(f"/olap/ssb/queries/{query_id}", run_query, methods=["POST"],
                         summary=f"SSB Q{query_id}: {title}",
                         operation_id=f"ssb_query_{query_id.replace('.', '_')}", response_model=ResultOut,
                         openapi_extra={"requestBody": {"required": True,
                                                        "content": {"application/json": {"schema": schema}}}})


for _query in QUERIES.values():
    _query_route(_query.id, _query.title)


@router.post("/olap/ssb/queries/{query_id}", include_in_schema=False)
async def unknown_query(query_id: str) -> None:
    raise NotFound(f"no SSB query {query_id}; they are {', '.join(QUERIES)}", field="query_id")


@router.post("/olap/sql", summary="Ad-hoc read-only SQL over the SSB tables")
async def run_sql(body: SqlRequest, runtime: RuntimeDep) -> ResultOut:
    left = remaining()  # the request's deadline (X-Request-Timeout) caps the query's own limit
    timeout_s = body.timeout_s if left is None else max(0.001, min(body.timeout_s, left))
    return _result(await domain(runtime, "olap").run_sql(body.sql, body.engine, body.max_rows, timeout_s))
