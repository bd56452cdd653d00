"""GPU engine: cuDF with the SSB tables resident in device memory.

The 13 queries run as the dataframe plans of olap/plans.py, written against the API cuDF shares with pandas
(the CPU tests run the very same plan code on pandas and compare it with DuckDB). Ad-hoc SQL goes through the
Polars GPU engine (cudf-polars) with raise_on_fail=True, so a plan it cannot run on the GPU is an error the
service turns into a fallback, never a silent CPU run. Ad-hoc SQL cannot read the resident cuDF tables:
cudf-polars takes Polars frames, and an in-memory Polars frame is copied host to device on every collect
(shared/research/olap.md, cudf-polars `DataFrameScan`), so it scans the Parquet files on the GPU instead (kvikIO,
from the page cache once read); the 13 plans are the resident path. A collect cannot be interrupted, so it runs
under a BoundedRunner: past `timeout_s` the caller gets query-timeout at once and the GPU OLAP worker is free,
while the query finishes in its own thread (the next ad-hoc query meanwhile is refused, and `auto` serves it on
DuckDB).

cudf and polars are imported here only, on first use.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .bounded import BoundedRunner
from .plans import run_plan
from .results import Result, from_arrow
from .schema import TABLES


class CudfEngine:
    name = "cudf"
    kind = "gpu"

    def __init__(self) -> None:
        self.tables: dict[str, Any] = {}
        self.dataset: Path | None = None
        self.rows: dict[str, int] = {}
        self.sql_runner = BoundedRunner("cudf-sql")

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
        frame = run_plan(query_id, self.tables, params)
        # docs.rapids.ai cudf.DataFrame.to_arrow(preserve_index=None): the plan resets its index.
        return from_arrow(frame.to_arrow(preserve_index=False))

    def run_sql(self, sql: str, max_rows: int | None, timeout_s: float | None) -> Result:
        import polars as pl

        if self.dataset is None:
            raise RuntimeError("no SSB dataset is resident on the GPU")
        frames = {table: pl.scan_parquet(self.dataset / f"{table}.parquet") for table in TABLES}
        lazy = pl.SQLContext(frames=frames).execute(sql)  # eager=False: a LazyFrame
        if max_rows is not None:
            lazy = lazy.limit(max_rows + 1)
        # cudf-polars: GPUEngine(executor="in-memory", raise_on_fail=True) raises instead of running on the CPU.
        table = self.sql_runner.run(
            lambda: lazy.collect(engine=pl.GPUEngine(executor="in-memory", raise_on_fail=True)).to_arrow(), timeout_s)
        return from_arrow(table, max_rows)

    def close(self) -> None:
        self.tables = {}
