"""GPU engine: cuDF with the SSB tables resident in device memory.

The 13 queries run as olap/plans.py's dataframe plans (the CPU tests run the same plan code on pandas). Ad-hoc SQL
runs on the resident tables through olap/frame_sql.py, and what that does not cover through the Polars GPU engine
(cudf-polars, raise_on_fail=True) over the Parquet files, since cudf-polars copies in-memory frames to the device on
every collect; a plan the GPU cannot run is an error the service turns into a fallback, never a silent CPU run.
Ad-hoc SQL runs under a BoundedRunner, so a query past `timeout_s` frees the caller at once. cudf and polars are
imported here only, on first use. More: docs/design/olap.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from . import frame_sql
from .bounded import BoundedRunner
from .plans import run_plan
from .results import Result, from_arrow
from .schema import TABLES

log = logging.getLogger("switchyard.olap")


class CudfEngine:
    name = "cudf"
    kind = "gpu"

    def __init__(self) -> None:
        self.tables: dict[str, Any] = {}
        self.dataset: Path | None = None
        self.rows: dict[str, int] = {}
        self.sql_runner = BoundedRunner("cudf-sql")
        self.resident_sql = 0  # ad-hoc queries answered from the resident tables (frame_sql), not the Parquet files

    @property
    def ready(self) -> bool:
        return bool(self.tables)

    def load(self, dataset_dir: Path) -> dict[str, Any]:
        import cudf  # docs.rapids.ai cudf.read_parquet(filepath_or_buffer, engine="cudf", columns=None, ...)

        started = time.perf_counter()
        tables = {table: cudf.read_parquet(str(dataset_dir / f"{table}.parquet")) for table in TABLES}
        self.tables, self.dataset = tables, dataset_dir  # the old frames are freed when this drops them
        self.rows = {table: len(df) for table, df in tables.items()}
        return {"rows": self.rows, "load_s": round(time.perf_counter() - started, 3)}

    def run_query(self, query_id: str, params: dict[str, Any] | None) -> Result:
        if not self.tables:
            raise RuntimeError("no SSB dataset is resident on the GPU")
        return from_arrow(to_arrow(run_plan(query_id, self.tables, params)))

    def run_sql(self, sql: str, max_rows: int | None, timeout_s: float | None) -> Result:
        if self.dataset is None:
            raise RuntimeError("no SSB dataset is resident on the GPU")
        return self.sql_runner.run(lambda: self._sql(sql, max_rows), timeout_s)

    def _sql(self, sql: str, max_rows: int | None) -> Result:
        try:
            frame = frame_sql.run(sql, self.tables, max_rows)
        except MemoryError:
            raise  # the device is full: the service's out-of-memory answer, not another path
        except Exception as exc:  # noqa: BLE001 - Unsupported, or a form cuDF refuses: cudf-polars may run it
            log.debug("ad-hoc SQL through cudf-polars (not run on the resident tables: %s)", exc)
        else:
            self.resident_sql += 1
            return from_arrow(to_arrow(frame), max_rows, "cuDF")
        import polars as pl

        assert self.dataset is not None  # run_sql checked
        frames = {table: pl.scan_parquet(self.dataset / f"{table}.parquet") for table in TABLES}
        lazy = pl.SQLContext(frames=frames).execute(sql)  # eager=False: a LazyFrame
        if max_rows is not None:
            lazy = lazy.limit(max_rows + 1)
        # cudf-polars: GPUEngine(executor="in-memory", raise_on_fail=True) raises instead of running on the CPU.
        return from_arrow(lazy.collect(engine=pl.GPUEngine(executor="in-memory", raise_on_fail=True)).to_arrow(),
                          max_rows, "cuDF")

    def close(self) -> None:
        self.tables = {}


def to_arrow(frame: Any) -> Any:
    """docs.rapids.ai cudf.DataFrame.to_arrow(preserve_index=None); pandas frames (the CPU tests) through pyarrow.
    The plans and frame_sql reset their index, so it is left out."""
    if hasattr(frame, "to_arrow"):
        return frame.to_arrow(preserve_index=False)
    import pyarrow as pa

    return pa.Table.from_pandas(frame, preserve_index=False)
