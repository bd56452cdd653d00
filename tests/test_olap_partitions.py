"""SSB across partitions without Ray: lineorder split by order key, every query merged from partial aggregates,
equal to the one-process answer (DuckDB over the whole dataset) row for row."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from olap import generate as gen
from olap.duckdb_engine import DuckDBEngine
from olap.partitions import merge_partials, write_partition
from olap.queries import QUERIES
from olap.results import Result

PARTS = 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ssb") / "sf0.02"
    gen.generate(0.02, out, seed=4)
    return out


def test_the_partitions_split_lineorder_and_carry_every_dimension(dataset):
    dirs = [write_partition(dataset, p, PARTS) for p in range(PARTS)]
    assert write_partition(dataset, 0, PARTS) == dirs[0]  # written once, then reused
    whole = pq.read_table(dataset / "lineorder.parquet")
    parts = [pq.read_table(d / "lineorder.parquet") for d in dirs]
    assert sum(p.num_rows for p in parts) == whole.num_rows and min(p.num_rows for p in parts) > 0
    for p, table in enumerate(parts):
        assert all(k % PARTS == p for k in table.column("lo_orderkey").to_pylist())
        assert (pq.read_table(dirs[p] / "customer.parquet").num_rows
                == pq.read_table(dataset / "customer.parquet").num_rows)
    with pytest.raises(ValueError):
        write_partition(dataset, PARTS, PARTS)


@pytest.mark.parametrize("query_id", sorted(QUERIES))
def test_merged_partial_aggregates_equal_the_one_process_answer(dataset, query_id):
    whole = DuckDBEngine()
    whole.load(dataset)
    parts = []
    for p in range(PARTS):
        engine = DuckDBEngine()
        engine.load(write_partition(dataset, p, PARTS))
        parts.append(engine.run_query(query_id, None))
    expected = whole.run_query(query_id, None)
    merged = merge_partials(query_id, parts)
    assert merged.columns == expected.columns
    assert merged.rows == expected.rows


def test_merging_orders_by_the_query_and_refuses_foreign_columns():
    q = QUERIES["3.1"]  # ORDER BY d_year ASC, revenue DESC, ...
    cols = list(q.columns)
    a = Result(cols, [["CHINA", "INDIA", 1995, 10], ["JAPAN", "INDIA", 1994, 5]])
    b = Result(cols, [["CHINA", "INDIA", 1995, 7], ["PERU", "PERU", 1995, 20]])
    merged = merge_partials("3.1", [a, b])
    assert merged.rows == [["JAPAN", "INDIA", 1994, 5], ["PERU", "PERU", 1995, 20], ["CHINA", "INDIA", 1995, 17]]
    with pytest.raises(ValueError):
        merge_partials("3.1", [Result(["x"], [[1]])])
