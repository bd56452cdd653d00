"""The Star Schema Benchmark tables as every OLAP engine here stores them.

Contract (shared by the generator, the .tbl importer, and the cuDF/pandas, DuckDB and PostgreSQL engines):
- Keys and yyyymmdd dates are int32 (lo_orderkey int64: it reaches 6,000,000 x SF); measures that are summed
  (lo_extendedprice, lo_ordtotalprice, lo_revenue, lo_supplycost) are int64, because Q1.1 at SF 1 is 4.5e11.
- Strings are plain UTF-8 (no categoricals): `p_brand1` sorts as a string ('MFGR#2210' < 'MFGR#222').
- The date dimension is the table `ddate` (as in the Crystal SSB kit): `date` is a type name in SQL.
- Layout on disk: <data_dir>/ssb/sf<SF>/<table>.parquet plus meta.json (scale factor, source, row counts).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

I32, I64, STR = pa.int32(), pa.int64(), pa.string()

TABLES: dict[str, pa.Schema] = {
    "lineorder": pa.schema([
        ("lo_orderkey", I64), ("lo_linenumber", I32), ("lo_custkey", I32), ("lo_partkey", I32),
        ("lo_suppkey", I32), ("lo_orderdate", I32), ("lo_orderpriority", STR), ("lo_shippriority", STR),
        ("lo_quantity", I32), ("lo_extendedprice", I64), ("lo_ordtotalprice", I64), ("lo_discount", I32),
        ("lo_revenue", I64), ("lo_supplycost", I64), ("lo_tax", I32), ("lo_commitdate", I32), ("lo_shipmode", STR),
    ]),
    "part": pa.schema([
        ("p_partkey", I32), ("p_name", STR), ("p_mfgr", STR), ("p_category", STR), ("p_brand1", STR),
        ("p_color", STR), ("p_type", STR), ("p_size", I32), ("p_container", STR),
    ]),
    "supplier": pa.schema([
        ("s_suppkey", I32), ("s_name", STR), ("s_address", STR), ("s_city", STR), ("s_nation", STR),
        ("s_region", STR), ("s_phone", STR),
    ]),
    "customer": pa.schema([
        ("c_custkey", I32), ("c_name", STR), ("c_address", STR), ("c_city", STR), ("c_nation", STR),
        ("c_region", STR), ("c_phone", STR), ("c_mktsegment", STR),
    ]),
    "ddate": pa.schema([
        ("d_datekey", I32), ("d_date", STR), ("d_dayofweek", STR), ("d_month", STR), ("d_year", I32),
        ("d_yearmonthnum", I32), ("d_yearmonth", STR), ("d_daynuminweek", I32), ("d_daynuminmonth", I32),
        ("d_daynuminyear", I32), ("d_monthnuminyear", I32), ("d_weeknuminyear", I32), ("d_sellingseason", STR),
        ("d_lastdayinweekfl", I32), ("d_lastdayinmonthfl", I32), ("d_holidayfl", I32), ("d_weekdayfl", I32),
    ]),
}

# ssb-dbgen file names of the tables (the date table is date.tbl).
TBL_FILES = {"lineorder": "lineorder.tbl", "part": "part.tbl", "supplier": "supplier.tbl",
             "customer": "customer.tbl", "ddate": "date.tbl"}


def sf_label(scale_factor: float) -> str:
    """Directory-safe scale factor: 1 -> '1', 0.01 -> '0.01'."""
    return f"{scale_factor:g}"


def dataset_dir(data_dir: Path, scale_factor: float) -> Path:
    return data_dir / "ssb" / f"sf{sf_label(scale_factor)}"
