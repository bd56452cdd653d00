"""pgvector: search inside PostgreSQL (HNSW, IVFFlat or an exact scan), and its index's construction.

pgvector's operators already give the response convention: <-> Euclidean, <=> 1 - cosine, <#> -dot.
Per-query knobs go through set_config(..., is_local => true) inside the query's transaction.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import asyncpg
import numpy as np

from . import filters
from .errors import InvalidInput
from .resident import SearchResult
from .store import OPCLASSES, Collection

INDEX_DEFAULTS: dict[str, dict[str, int | None]] = {"hnsw": {"m": 16, "ef_construction": 64},
                                                    "ivfflat": {"lists": None}, "none": {}}
SEARCH_KNOBS = {"ef_search": ("hnsw.ef_search", 1, 1000), "probes": ("ivfflat.probes", 1, 32768)}


PGVECTOR_MAX_INDEXED_DIM = 2000  # pgvector's HNSW and IVFFlat index `vector` columns of at most 2,000 dimensions


def check_index(spec: dict[str, Any] | None, dim: int) -> dict[str, Any]:
    """The pgvector index a collection asks for: {"type": "hnsw"|"ivfflat"|"none", ...its parameters}.
    Without a type: HNSW, or none above pgvector's dimension limit (searches there scan exactly)."""
    spec = dict(spec or {})
    kind = spec.pop("type", None) or ("hnsw" if dim <= PGVECTOR_MAX_INDEXED_DIM else "none")
    if kind not in INDEX_DEFAULTS:
        raise InvalidInput("must be 'hnsw', 'ivfflat' or 'none'", field="pgvector_index.type")
    if kind != "none" and dim > PGVECTOR_MAX_INDEXED_DIM:
        raise InvalidInput(f"pgvector indexes at most {PGVECTOR_MAX_INDEXED_DIM} dimensions, this collection has "
                           f"{dim}: use 'none' (exact scans)", field="pgvector_index.type")
    unknown = sorted(set(spec) - set(INDEX_DEFAULTS[kind]))
    if unknown:
        raise InvalidInput(f"unknown parameter for {kind}", field=f"pgvector_index.{unknown[0]}")
    limits = {"m": (2, 100), "ef_construction": (4, 1000), "lists": (1, 32768)}
    for name, value in spec.items():
        low, high = limits[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise InvalidInput(f"must be an integer from {low} to {high}", field=f"pgvector_index.{name}")
    out = {"type": kind, **INDEX_DEFAULTS[kind], **{k: v for k, v in spec.items() if v is not None}}
    if kind == "hnsw":
        if spec.get("ef_construction") is None:
            out["ef_construction"] = max(out["ef_construction"], 2 * out["m"])
        elif out["ef_construction"] < 2 * out["m"]:  # pgvector refuses such a build
            raise InvalidInput(f"must be at least 2 * m ({2 * out['m']})", field="pgvector_index.ef_construction")
    return out


def check_search_params(params: dict[str, Any] | None) -> dict[str, int]:
    out = {}
    for name, value in (params or {}).items():
        if name not in SEARCH_KNOBS:
            raise InvalidInput(f"unknown pgvector parameter; known: {sorted(SEARCH_KNOBS)}", field=f"params.{name}")
        _, low, high = SEARCH_KNOBS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidInput(f"must be an integer from {low} to {high}", field=f"params.{name}")
        out[name] = value
    return out


async def build_index(pool: asyncpg.Pool, c: Collection, n_rows: int, concurrently: bool = False,
                      background: Callable[[int], None] | None = None) -> str | None:
    """Create the collection's pgvector index if it does not exist yet; returns its kind, or None.

    `concurrently`: CREATE INDEX CONCURRENTLY, which lets writes go on meanwhile (a plain build holds them
    for its whole length) at the price of a second pass over the table. `background`, where PostgreSQL's
    processes are ours to renice: a build that yields the CPU to searches, in one backend (no parallel workers)
    whose priority `background(pid)` lowers; that connection is closed after, so no query runs on it again."""
    spec = c.pgvector_index or {"type": "hnsw", **INDEX_DEFAULTS["hnsw"]}
    kind = spec.get("type", "hnsw")
    if kind == "none" or c.dim > PGVECTOR_MAX_INDEXED_DIM:  # the latter: a collection made before the check
        return None
    if kind == "hnsw":
        with_ = f"m = {int(spec['m'])}, ef_construction = {int(spec['ef_construction'])}"
    else:
        lists = spec.get("lists") or max(1, min(32768, n_rows // 1000 if n_rows <= 1_000_000 else int(n_rows ** 0.5)))
        with_ = f"lists = {int(lists)}"
    name = f"{c.table}_ann"
    async with pool.acquire() as conn:
        # Builds go faster with more memory for the graph; this is local to the session.
        await conn.execute("SET maintenance_work_mem = '1GB'")
        if background is not None:
            await conn.execute("SET max_parallel_maintenance_workers = 0")
            background(await conn.fetchval("SELECT pg_backend_pid()"))
        try:
            while await conn.fetchval(INDEX_VALID, name) is False:  # invalid: being built, or left by a failed build
                if not await conn.fetchval(BUILDING, c.table):
                    await conn.execute(f"DROP INDEX {name}")  # left by a concurrent build that failed or was cancelled
                    break
                await asyncio.sleep(0.2)  # another build of it (any process's) runs: dropping it would deadlock
            await conn.execute(
                f"CREATE INDEX {'CONCURRENTLY ' if concurrently else ''}IF NOT EXISTS {name} ON {c.table} "
                f"USING {kind} (embedding {OPCLASSES[c.metric]}) WITH ({with_})"
            )
            await conn.execute(f"ANALYZE {c.table}")
        finally:
            if background is not None:
                conn.terminate()  # its backend's lower priority is for good: the pool makes a new one
    return kind


INDEX_VALID = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)"  # NULL: no such index
# Whether another backend is building an index on the table ($1).
BUILDING = ("SELECT count(*) > 0 FROM pg_stat_progress_create_index "
            "WHERE relid = to_regclass($1) AND pid <> pg_backend_pid()")


async def has_index(pool: asyncpg.Pool, c: Collection) -> bool:
    """The index exists and is valid (a concurrent build under way, or one that failed, leaves an invalid one)."""
    return bool(await pool.fetchval(INDEX_VALID, f"{c.table}_ann"))


async def search(pool: asyncpg.Pool, c: Collection, queries: np.ndarray, k: int, params: dict[str, int],
                 payload_filter: filters.Node | None) -> SearchResult:
    op = c.operator
    extra: list[Any] = [None, None]  # $1 the query, $2 k; the filter's values follow
    where = f"WHERE {filters.to_sql(payload_filter, extra)}" if payload_filter is not None else ""
    extra = extra[2:]
    # A filtered approximate scan stops early; iterative scans keep going until k rows pass the filter,
    # and the outer ORDER BY restores strict order after the relaxed scan ("+ 0" keeps it a sort on PG 17+).
    sql = (f"WITH r AS MATERIALIZED (SELECT id, embedding {op} $1 AS distance FROM {c.table} {where} "
           f"ORDER BY embedding {op} $1 LIMIT $2) SELECT id, distance FROM r ORDER BY distance + 0")
    ids: list[list[int]] = []
    distances: list[list[float]] = []
    async with pool.acquire() as conn, conn.transaction():
        for name, value in params.items():
            await conn.execute("SELECT set_config($1, $2, true)", SEARCH_KNOBS[name][0], str(value))
        if payload_filter is not None:
            await conn.execute("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)")
            await conn.execute("SELECT set_config('ivfflat.iterative_scan', 'relaxed_order', true)")
        stmt = await conn.prepare(sql)
        for q in queries:
            rows = await stmt.fetch(q, k, *extra)
            ids.append([r["id"] for r in rows])
            distances.append([float(r["distance"]) for r in rows])
    return SearchResult(ids, distances)
