"""Every call of the API, written once as a plan (see _wire): Client and AsyncClient run the same plans."""

from __future__ import annotations

import base64
import functools
from typing import Any, Sequence
from urllib.parse import quote, urlencode

import numpy as np

from ._progress import ProgressArg, Reporter
from ._wire import ARROW, PARQUET, RAW, Plan, Request, RetryPolicy, Sessions, Sleep, call, dumps, json_request
from .errors import SwitchyardError
from .results import Counts, Pairs, SearchResult, WriteResult, neighbours, write_result

FINISHED = ("succeeded", "failed", "cancelled")
UPSERT_FIELDS = {"vectors_b64": "vectors", "dim": "vectors"}  # the wire fields of upsert()'s arguments
SEARCH_FIELDS = {"body": "vectors", "dim": "vectors"}  # and of search()'s (a raw body)


class JobFailed(RuntimeError):
    """A job the client followed ended failed or cancelled; `job` is its last state."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(f"job {job.get('id')} {job.get('state')}: {job.get('message')}")
        self.job = job


def collection_path(name: str, tail: str = "") -> str:
    return f"/v1/collections/{quote(name, safe='')}{tail}"


def float32_rows(vectors: Any) -> tuple[np.ndarray, bool]:
    """Vectors as a C-contiguous little-endian float32 matrix, and whether they came as a batch (2-D)."""
    array = np.asarray(vectors, dtype="<f4")
    if array.ndim == 1:
        return np.ascontiguousarray(array.reshape(1, -1)), False
    if array.ndim != 2:
        raise ValueError(f"vectors must be 1-D (one) or 2-D (a batch), not {array.ndim}-D")
    return np.ascontiguousarray(array), True


@functools.lru_cache(maxsize=256)
def search_path(collection: str, k: int, dim: int, engine: str, level: str | None, seq: int | None,
                filter_text: str | None, recall_target: float | None, batch: bool,
                params: tuple[tuple[str, float], ...]) -> str:
    """A raw search's path and query string; remembered, since a client sends the same one with every vector. `dim`
    (the rows' width) lets the service refuse vectors of another dimension, which raw bytes cannot show."""
    query: dict[str, Any] = {"k": k, "dim": dim}
    options = (("engine", None if engine == "auto" else engine), ("consistency", level), ("seq", seq),
               ("filter", filter_text), ("recall_target", recall_target), ("batch", "true" if batch else None))
    for name, value in options:
        if value is not None:
            query[name] = value
    query.update(params)
    return collection_path(collection, "/search?" + urlencode(query))


def id_list(ids: Any) -> list[int]:
    return np.asarray(ids, dtype=np.int64).reshape(-1).tolist()


class Operations:
    """The plans of every call. `sessions` is shared by the clients made with with_options()."""

    def __init__(self, sessions: Sessions, timeout: float | None = None, retry: RetryPolicy | None = None) -> None:
        self.sessions = sessions
        self.timeout = timeout
        self.retry = retry or RetryPolicy()

    def _call(self, request: Request, fields: dict[str, str] | None = None) -> Plan[Any]:
        """The request's answer; `fields` renames the wire fields an error may name to the caller's arguments."""
        try:
            return (yield from call(request, self.retry))
        except SwitchyardError as error:
            raise error.renamed(fields) if fields else error from None

    def _json(self, method: str, path: str, body: Any = None, idempotent: bool = True) -> Request:
        return json_request(method, path, body, idempotent, self.timeout)

    # -- service ------------------------------------------------------------------------------------------------
    def health(self) -> Plan[Any]:
        """The readiness check (GET /readyz): its JSON; raises Unavailable while the service is not ready."""
        return (yield from self._call(self._json("GET", "/readyz")))

    def engines(self, domain: str | None = None) -> Plan[Any]:
        """Every engine, with whether it is available and ready."""
        return (yield from self._call(self._json("GET", "/v1/engines" + (f"?domain={domain}" if domain else ""))))

    # -- collections -------------------------------------------------------------------------------------------
    def create_collection(self, name: str, dim: int, metric: str = "l2", index: dict[str, Any] | None = None,
                          pgvector_index: dict[str, Any] | None = None) -> Plan[Any]:
        """Create a collection (metric l2, cosine or inner_product; index e.g. {"type": "hnsw", "params":
        {"m": 16}}); its description."""
        body: dict[str, Any] = {"name": name, "dim": dim, "metric": metric}
        if index is not None:
            body["index"] = index
        if pgvector_index is not None:
            body["pgvector_index"] = pgvector_index
        return (yield from self._call(self._json("POST", "/v1/collections", body, idempotent=False)))

    def get_collection(self, name: str, verify: bool = False) -> Plan[Any]:
        return (yield from self._call(self._json("GET", collection_path(name, "?verify=true" if verify else ""))))

    def list_collections(self) -> Plan[Any]:
        return (yield from self._call(self._json("GET", "/v1/collections")))

    def delete_collection(self, name: str) -> Plan[None]:
        yield from self._call(self._json("DELETE", collection_path(name)))
        self.sessions.forget(name)

    # -- points ------------------------------------------------------------------------------------------------
    def upsert(self, collection: str, ids: Any, vectors: Any,
               payloads: Sequence[dict[str, Any] | None] | None = None) -> Plan[WriteResult]:
        """Insert or replace points by id, acknowledged once committed. Vectors travel as base64 float32 (no JSON
        floats); for many thousands of points, load() is faster."""
        matrix, _ = float32_rows(vectors)
        body: dict[str, Any] = {"ids": id_list(ids), "vectors_b64": base64.b64encode(matrix.data).decode(),
                                "dim": matrix.shape[1]}  # checked against the collection's: bytes have no shape
        if payloads is not None:
            body["payloads"] = list(payloads)
        answer = yield from self._call(self._json("PUT", collection_path(collection, "/points"), body), UPSERT_FIELDS)
        result = write_result(answer)
        self.sessions.wrote(collection, result.seq)
        return result

    def delete(self, collection: str, ids: Any) -> Plan[WriteResult]:
        """Delete points by id; `deleted` says how many existed."""
        answer = yield from self._call(self._json("POST", collection_path(collection, "/points/delete"),
                                            {"ids": id_list(ids)}))
        result = write_result(answer)
        self.sessions.wrote(collection, result.seq)
        return result

    def search(self, collection: str, vectors: Any, k: int = 10, *, filter: dict[str, Any] | None = None,
               params: dict[str, float] | None = None, recall_target: float | None = None,
               consistency: str | None = None, seq: int | None = None, engine: str = "auto") -> Plan[SearchResult]:
        """The k nearest neighbours of one vector (1-D arrays back) or of each row of a matrix (2-D). The query
        travels as raw float32. Without `consistency`, a collection this client wrote to is searched at `session`
        level with the seq of its last acknowledged write: the answer includes every write this client made."""
        matrix, batch = float32_rows(vectors)
        level, at = self.sessions.level(collection, consistency, seq)
        filter_text = None if filter is None else dumps(filter).decode()
        params_key = tuple(sorted(params.items())) if params else ()
        path = search_path(collection, k, matrix.shape[1], engine, level, at, filter_text, recall_target, batch,
                           params_key)
        request = Request("POST", path, matrix.tobytes(), RAW, True, self.timeout)
        return neighbours((yield from self._call(request, SEARCH_FIELDS)), batch, k)

    def load(self, collection: str, ids: Any, vectors: Any, payloads: Sequence[dict[str, Any] | None] | None = None,
             *, pgvector: str = "background", progress: ProgressArg = True, wait: bool = True,
             rows_per_batch: int = 50_000) -> Plan[Any]:
        """Bulk-load points of any number as one Arrow IPC stream (needs pyarrow), then follow the load job to
        its end with a progress bar (`progress=False` for none, or a function (done, total, message)); the job's
        result, or with wait=False its first state. The pgvector index is (re)built once at the end."""
        from ._arrow import points_stream

        body = points_stream(np.asarray(ids, dtype=np.int64).reshape(-1), float32_rows(vectors)[0], payloads,
                             rows_per_batch)
        request = Request("PUT", collection_path(collection, f"/points?pgvector={pgvector}"), body, ARROW, True,
                          self.timeout)
        try:
            job = yield from self._call(request)
        finally:
            body.close()  # the spooled stream: removed once sent
        result = (yield from self.wait_job(job["job"], progress, f"load {collection}")) if wait else job
        if wait:
            self.sessions.wrote(collection, (result or {}).get("seq"))
        return result

    def build(self, collection: str, *, pgvector: str = "background", progress: ProgressArg = False,
              wait: bool = True) -> Plan[Any]:
        """Compact and rebuild the resident index (and create the pgvector index if missing), as a job."""
        job = yield from self._call(self._json("POST", collection_path(collection, f"/build?pgvector={pgvector}"),
                                         idempotent=False))
        return (yield from self.wait_job(job["job"], progress, f"build {collection}")) if wait else job

    def recall(self, collection: str, *, k: int = 10, sample: int | None = None, queries: Any = None,
               engine: str = "auto", params: dict[str, float] | None = None, seed: int | None = None) -> Plan[Any]:
        """recall@k of an engine (and its params) against exact search."""
        body: dict[str, Any] = {"k": k, "engine": engine}
        for name, value in (("sample", sample), ("params", params), ("seed", seed)):
            if value is not None:
                body[name] = value
        if queries is not None:
            body["queries"] = float32_rows(queries)[0].tolist()
        return (yield from self._call(self._json("POST", collection_path(collection, "/recall"), body)))

    # -- jobs --------------------------------------------------------------------------------------------------
    def job(self, job_id: str) -> Plan[Any]:
        return (yield from self._call(self._json("GET", f"/v1/jobs/{quote(job_id, safe='')}")))

    def cancel_job(self, job_id: str) -> Plan[Any]:
        return (yield from self._call(self._json("POST", f"/v1/jobs/{quote(job_id, safe='')}/cancel")))

    def wait_job(self, job_id: str, progress: ProgressArg = False, description: str = "job",
                 poll_s: float = 0.2) -> Plan[Any]:
        """Follow a job to its end; its result. Raises JobFailed if it failed or was cancelled."""
        reporter = Reporter(progress, description)
        try:
            while True:
                job = yield from self.job(job_id)
                reporter(int(job.get("done") or 0), int(job.get("total") or 0), str(job.get("message") or ""))
                if job["state"] in FINISHED:
                    break
                yield Sleep(poll_s)
                poll_s = min(poll_s * 1.5, 2.0)
        finally:
            reporter.close()
        if job["state"] != "succeeded":
            raise JobFailed(job)
        return job.get("result")

    # -- spatial -----------------------------------------------------------------------------------------------
    def create_points(self, name: str, lon: Any, lat: Any, ids: Any = None) -> Plan[Any]:
        """A layer of points from longitude and latitude arrays (degrees)."""
        body: dict[str, Any] = {"name": name, "kind": "points", "lon": np.asarray(lon, dtype=np.float64).tolist(),
                                "lat": np.asarray(lat, dtype=np.float64).tolist()}
        if ids is not None:
            body["ids"] = id_list(ids)
        return (yield from self._call(self._json("POST", "/v1/spatial/layers", body, idempotent=False)))

    def create_polygons(self, name: str, geometries: Sequence[Any], ids: Any = None) -> Plan[Any]:
        """A layer of polygons from shapely (Multi)Polygons or WKT strings."""
        if all(isinstance(g, str) for g in geometries):
            body: dict[str, Any] = {"name": name, "kind": "polygons", "wkt": list(geometries)}
        else:
            import shapely

            wkb = shapely.to_wkb(np.asarray(geometries, dtype=object))
            body = {"name": name, "kind": "polygons", "wkb_b64": [base64.b64encode(w).decode() for w in wkb]}
        if ids is not None:
            body["ids"] = id_list(ids)
        return (yield from self._call(self._json("POST", "/v1/spatial/layers", body, idempotent=False)))

    def upload_geoparquet(self, name: str, kind: str, data: bytes) -> Plan[Any]:
        """A layer from GeoParquet bytes (WKB `geometry` column, optional `id`)."""
        request = Request("PUT", f"/v1/spatial/layers/{quote(name, safe='')}?kind={kind}", data, PARQUET, False,
                          self.timeout)
        return (yield from self._call(request))

    def list_layers(self) -> Plan[Any]:
        return (yield from self._call(self._json("GET", "/v1/spatial/layers")))

    def delete_layer(self, name: str) -> Plan[None]:
        yield from self._call(self._json("DELETE", f"/v1/spatial/layers/{quote(name, safe='')}"))

    def point_in_polygon_counts(self, points: str, polygons: str, engine: str = "auto") -> Plan[Counts]:
        """Points per polygon: (polygon_ids, counts) as int64 arrays, and the answering engine as `.engine`."""
        answer = yield from self._call(self._json("POST", "/v1/spatial/joins/point-in-polygon",
                                            {"points": points, "polygons": polygons, "mode": "counts",
                                             "engine": engine}))
        return Counts(np.asarray(answer["polygon_ids"], np.int64), np.asarray(answer["counts"], np.int64),
                      answer["engine"])

    def point_in_polygon(self, points: str, polygons: str, engine: str = "auto", page_size: int = 10_000, *,
                         cursor: str | None = None, max_pages: int | None = None) -> Plan[Pairs]:
        """Every (point id, polygon id) pair, all pages followed; or at most `max_pages` pages from `cursor` (a
        `next_cursor` of an earlier answer), the answer's `next_cursor` saying where to go on."""
        body = {"points": points, "polygons": polygons, "mode": "pairs", "engine": engine, "page_size": page_size}
        return (yield from self._pages("/v1/spatial/joins/point-in-polygon", body, cursor, max_pages))

    def within_distance(self, left: str, right: str, radius_m: float, engine: str = "auto",
                        page_size: int = 10_000, *, cursor: str | None = None,
                        max_pages: int | None = None) -> Plan[Pairs]:
        """Every pair of points within radius_m metres (a self-join when left == right: each pair once), with
        distances, all pages followed (or `max_pages` from `cursor`, as point_in_polygon)."""
        body = {"left": left, "right": right, "radius_m": radius_m, "engine": engine, "page_size": page_size}
        return (yield from self._pages("/v1/spatial/joins/within-distance", body, cursor, max_pages))

    def _pages(self, path: str, body: dict[str, Any], cursor: str | None,
               max_pages: int | None) -> Plan[Pairs]:
        pairs: list[Any] = []
        distances: list[float] = []
        engine, pages = "", 0
        while True:
            answer = yield from self._call(self._json("POST", path, {**body, "cursor": cursor}))
            pairs.extend(answer["pairs"])
            distances.extend(answer.get("distances_m") or ())
            engine, cursor, pages = answer["engine"], answer.get("next_cursor"), pages + 1
            if cursor is None or (max_pages is not None and pages >= max_pages):
                break
        matrix = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        return Pairs(matrix[:, 0], matrix[:, 1], np.asarray(distances, np.float64) if "radius_m" in body else None,
                     engine, cursor)

    # -- OLAP --------------------------------------------------------------------------------------------------
    def ssb_generate(self, scale_factor: float, seed: int = 0, *, progress: ProgressArg = False,
                     wait: bool = True) -> Plan[Any]:
        """Generate an SSB dataset of `scale_factor` (1: 6 million lineorder rows) and load it into the OLAP
        engines, as a job followed to its end (`progress` as in load()); the job's result (`dataset`: its directory,
        `rows`: per table, `engines`: what each engine loaded), or with wait=False its first state."""
        job = yield from self._call(self._json("POST", "/v1/olap/ssb/generate",
                                               {"scale_factor": scale_factor, "seed": seed}, idempotent=False))
        return (yield from self.wait_job(job["job"], progress, f"generate SSB SF {scale_factor:g}")) if wait else job

    def ssb_query(self, query_id: str, params: dict[str, Any] | None = None, engine: str = "auto",
                  output: str = "arrow") -> Plan[Any]:
        """Run SSB query `query_id` (1.1 ... 4.3): a pyarrow Table (output="arrow", the engine and took_ms in its
        schema's metadata), a pandas DataFrame ("pandas") or the JSON answer ("json")."""
        answer = yield from self._call(self._json("POST", f"/v1/olap/ssb/queries/{quote(query_id, safe='')}",
                                            {"engine": engine, "params": params or {}}))
        return shaped(answer, output)

    def sql(self, sql: str, engine: str = "auto", max_rows: int = 1000, timeout_s: float = 30,
            output: str = "arrow") -> Plan[Any]:
        """One read-only SELECT over the SSB tables, shaped as ssb_query's answer."""
        answer = yield from self._call(self._json("POST", "/v1/olap/sql", {"sql": sql, "engine": engine,
                                                                      "max_rows": max_rows, "timeout_s": timeout_s}))
        return shaped(answer, output)


def shaped(answer: dict[str, Any], output: str) -> Any:
    if output == "json":
        return answer
    from ._arrow import answer_table

    table = answer_table(answer)
    if output == "pandas":
        return table.to_pandas()
    if output != "arrow":
        raise ValueError(f"output must be arrow, pandas or json, not {output!r}")
    return table
