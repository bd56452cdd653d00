"""PostgreSQL engine: the SSB tables as heap tables in the service's database (schema `ssb`), loaded with COPY.

The same SQL texts as DuckDB run here. Ad-hoc SQL runs in a read-only transaction with a statement timeout,
as the unprivileged role switchyard_reader when it exists (migration 0003), with only the ssb schema in the
search path.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any, AsyncIterator

import asyncpg
import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from . import results
from .errors import QueryFailed, UnrepresentableResult
from .queries import render_sql
from .results import Result, from_records, record_bytes
from .schema import TABLES

PG_TYPES = {pa.int32(): "integer", pa.int64(): "bigint", pa.string(): "text"}
FETCH_ROWS = 1_000  # records an ad-hoc answer is read in, between checks of its size
READER_ROLE = "switchyard_reader"


class PostgresEngine:
    name = "postgres"
    kind = "postgres"

    def __init__(self, pool: asyncpg.Pool, reader_pool: asyncpg.Pool | None = None) -> None:
        self.pool = pool  # loads
        self.reader_pool = reader_pool or pool  # queries: their own pool, never the connections of writes
        self.dataset: str | None = None
        self.rows: dict[str, int] = {}
        self.version: str | None = None

    @property
    def ready(self) -> bool:
        return self.dataset is not None

    async def load(self, dataset_dir: Path, progress=None) -> dict[str, Any]:
        """COPY the Parquet files into ssb.* unless these very files are already there: the key is the dataset's
        path and a fingerprint of its files, so data imported again under the same name is loaded again."""
        started = time.perf_counter()
        path = str(dataset_dir.resolve())
        key = f"{path}#{await asyncio.to_thread(fingerprint, dataset_dir)}"
        self.version = await self.pool.fetchval("SHOW server_version")
        row = await self.pool.fetchrow("SELECT rows FROM ssb_datasets WHERE dataset = $1", key)
        if row is not None and await self._tables_match(orjson.loads(row["rows"])):
            self.dataset, self.rows = path, orjson.loads(row["rows"])
            return {"rows": self.rows, "load_s": 0.0, "reused": True}
        rows: dict[str, int] = {}
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM ssb_datasets")
            for table, schema in TABLES.items():
                columns = ", ".join(f"{f.name} {PG_TYPES[f.type]} NOT NULL" for f in schema)
                await conn.execute(f"DROP TABLE IF EXISTS ssb.{table}")
                await conn.execute(f"CREATE TABLE ssb.{table} ({columns})")
                if progress:
                    progress(0, None, f"copying {table} into PostgreSQL")
                await conn.copy_to_table(table, schema_name="ssb", source=_csv_chunks(dataset_dir / f"{table}.parquet"),
                                         format="csv")
                rows[table] = await conn.fetchval(f"SELECT count(*) FROM ssb.{table}")
            await self._grant(conn)
            await conn.execute("INSERT INTO ssb_datasets (dataset, rows) VALUES ($1, $2)", key,
                               orjson.dumps(rows).decode())
        async with self.pool.acquire() as conn:
            for table in TABLES:
                await conn.execute(f"ANALYZE ssb.{table}")
        self.dataset, self.rows = path, rows
        return {"rows": rows, "load_s": round(time.perf_counter() - started, 3), "reused": False}

    async def _tables_match(self, rows: dict[str, int]) -> bool:
        for table, n in rows.items():
            exists = await self.pool.fetchval("SELECT to_regclass($1) IS NOT NULL", f"ssb.{table}")
            if not exists or await self.pool.fetchval(f"SELECT count(*) FROM ssb.{table}") != n:
                return False
        return True

    @staticmethod
    async def _grant(conn: asyncpg.Connection) -> None:
        if await conn.fetchval("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", READER_ROLE):
            await conn.execute(f"GRANT USAGE ON SCHEMA ssb TO {READER_ROLE}")
            await conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA ssb TO {READER_ROLE}")

    async def run_query(self, query_id: str, params: dict[str, Any] | None) -> Result:
        return await self._fetch(render_sql(query_id, params or {}), max_rows=None, timeout_s=None, as_reader=False)

    async def run_sql(self, sql: str, max_rows: int | None, timeout_s: float | None) -> Result:
        return await self._fetch(sql, max_rows, timeout_s, as_reader=True)

    async def _fetch(self, sql: str, max_rows: int | None, timeout_s: float | None, as_reader: bool) -> Result:
        if not self.ready:
            raise RuntimeError("no SSB dataset is loaded in PostgreSQL")
        async with self.reader_pool.acquire() as conn, conn.transaction(readonly=True):
            await conn.execute("SET LOCAL search_path = ssb")
            if timeout_s:
                await conn.execute(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
            if as_reader and await conn.fetchval("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)",
                                                 READER_ROLE):
                await conn.execute(f"SET LOCAL ROLE {READER_ROLE}")
            try:
                stmt = await conn.prepare(sql)
                if stmt.get_parameters():  # asyncpg would raise InterfaceError at fetch (no values are sent)
                    raise QueryFailed("PostgreSQL: parameters ($1, ...) are not allowed; write the values into the SQL")
                columns = [a.name for a in stmt.get_attributes()]
                sizes = None
                if max_rows is None:
                    records = await stmt.fetch()
                else:
                    records, sizes = await _fetch_within(await stmt.cursor(), max_rows + 1)
            except (OverflowError, ValueError) as exc:
                if isinstance(exc, QueryFailed):
                    raise
                # asyncpg decodes as it reads: a date past 9999 or before year 1 fails in Python's date type.
                raise UnrepresentableResult("PostgreSQL", exc) from None
            except asyncpg.QueryCanceledError:
                raise TimeoutError(f"the query ran longer than {timeout_s} s") from None
            except (asyncpg.OperatorInterventionError, asyncpg.PostgresConnectionError):
                raise  # the server is going away: not the query's fault (503, service/errors.py)
            except asyncpg.PostgresError as exc:
                raise QueryFailed(f"PostgreSQL: {exc}") from None
        return from_records(columns, records, max_rows, sizes)


def fingerprint(dataset_dir: Path) -> str:
    """What changes whenever the dataset's data does: meta.json's text and each table file's size, modification
    time and inode (a generation or an import writes a new directory and renames it into place)."""
    digest = hashlib.sha256((dataset_dir / "meta.json").read_bytes())
    for table in TABLES:
        st = (dataset_dir / f"{table}.parquet").stat()
        digest.update(f"|{table}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    return digest.hexdigest()[:32]


async def _csv_chunks(path: Path) -> AsyncIterator[bytes]:
    """The Parquet file as CSV, one row group at a time (no header), for COPY ... (FORMAT csv). The conversion
    runs in a worker thread so the event loop keeps serving while a large table loads."""
    parquet = pq.ParquetFile(path)
    options = pacsv.WriteOptions(include_header=False)

    def row_group_csv(i: int) -> bytes:
        sink = pa.BufferOutputStream()
        pacsv.write_csv(parquet.read_row_group(i), sink, options)
        return sink.getvalue().to_pybytes()

    for i in range(parquet.num_row_groups):
        yield await asyncio.to_thread(row_group_csv, i)


async def _fetch_within(cursor: Any, limit: int) -> tuple[list[Any], list[int]]:
    """Up to `limit` records and their record_bytes, FETCH_ROWS at a time, stopping once they pass
    ANSWER_MAX_BYTES (from_records cuts the answer there): a wide answer is not read whole."""
    records: list[Any] = []
    sizes: list[int] = []
    total = 0
    while len(records) < limit and total <= results.ANSWER_MAX_BYTES:
        chunk = await cursor.fetch(min(FETCH_ROWS, limit - len(records)))
        if not chunk:
            break
        records.extend(chunk)
        sizes.extend(record_bytes(record) for record in chunk)
        total = sum(sizes[-len(chunk):], total)
    return records, sizes
