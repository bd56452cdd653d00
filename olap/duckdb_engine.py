"""CPU engine: DuckDB with the SSB tables resident in an in-memory database.

Tables are loaded once from the Parquet files; after that the connection runs with external access off and its
configuration locked, so no query (ad-hoc or not) can read or write a file, attach a database or load an
extension. A new dataset means a new in-memory database, swapped in when loaded; the old one is closed once the
queries that run on it have finished (DuckDB refuses to close a connection whose cursors are busy).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from .queries import render_sql
from .results import QueryFailed, Result, from_arrow_batches
from .schema import TABLES


@dataclass
class _Database:
    """One loaded dataset's connection and the queries running on it."""

    con: duckdb.DuckDBPyConnection
    users: int = 0
    retired: bool = False  # swapped out (or the engine closed): closed when its last query ends


class DuckDBEngine:
    name = "duckdb"
    kind = "cpu"

    def __init__(self, threads: int | None = None, memory_limit: str | None = None) -> None:
        self.threads, self.memory_limit = threads, memory_limit
        self._db: _Database | None = None
        self._lock = threading.Lock()  # the current database, and every database's users and retirement
        self.dataset: str | None = None
        self.rows: dict[str, int] = {}

    @property
    def ready(self) -> bool:
        return self._db is not None

    @property
    def version(self) -> str:
        return duckdb.__version__

    def load(self, dataset_dir: Path) -> dict[str, Any]:
        """Read the Parquet files into a fresh in-memory database, then lock it down."""
        started = time.perf_counter()
        con = duckdb.connect(":memory:")
        if self.threads:
            con.execute(f"SET threads = {int(self.threads)}")
        if self.memory_limit:
            con.execute("SET memory_limit = ?", [self.memory_limit])
        rows = {}
        for table in TABLES:
            path = dataset_dir / f"{table}.parquet"
            con.execute(f"CREATE TABLE {table} AS SELECT * FROM read_parquet(?)", [str(path)])
            count = con.execute(f"SELECT count(*) FROM {table}").fetchone()
            assert count is not None  # count(*): one row
            rows[table] = count[0]
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        with self._lock:
            old, self._db = self._db, _Database(con)
            self.dataset, self.rows = str(dataset_dir), rows
        if old is not None:
            self._retire(old)
        return {"rows": rows, "load_s": round(time.perf_counter() - started, 3)}

    def _open(self) -> tuple[_Database, duckdb.DuckDBPyConnection]:
        """The current database and a cursor on it (one per query: cursors may run concurrently); the database
        counts the query as its user until _release."""
        with self._lock:
            db = self._db
            if db is None:
                raise RuntimeError("no SSB dataset is loaded in DuckDB")
            cursor = db.con.cursor()
            db.users += 1
        return db, cursor

    def _release(self, db: _Database) -> None:
        with self._lock:
            db.users -= 1
            last = db.retired and db.users == 0
        if last:
            db.con.close()

    def _retire(self, db: _Database) -> None:
        with self._lock:
            db.retired = True
            idle = db.users == 0
        if idle:
            db.con.close()

    def run_query(self, query_id: str, params: dict[str, Any] | None) -> Result:
        return self.run_sql(render_sql(query_id, params or {}), max_rows=None, timeout_s=None)

    def run_sql(self, sql: str, max_rows: int | None, timeout_s: float | None) -> Result:
        db, cursor = self._open()
        timer = threading.Timer(timeout_s, cursor.interrupt) if timeout_s else None
        if timer:
            timer.start()
        try:
            reader = cursor.sql(sql).to_arrow_reader(8_192)  # streamed: a huge result is read only to the limits
            return from_arrow_batches(reader, max_rows, "DuckDB")
        except duckdb.InterruptException:
            raise TimeoutError(f"the query ran longer than {timeout_s} s") from None
        except duckdb.OutOfMemoryException:
            raise QueryFailed(f"DuckDB: the query needs more memory than its limit ({self.memory_limit or 'default'}); "
                              "aggregate more or select fewer rows") from None
        except (duckdb.BinderException, duckdb.CatalogException, duckdb.ParserException,
                duckdb.ConversionException, duckdb.OutOfRangeException, duckdb.InvalidInputException) as exc:
            raise QueryFailed(f"DuckDB: {str(exc).splitlines()[0]}") from None
        finally:
            if timer:
                timer.cancel()
            cursor.close()
            self._release(db)

    def close(self) -> None:
        with self._lock:
            db, self._db = self._db, None
        if db is not None:
            self._retire(db)
