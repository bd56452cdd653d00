"""SSB across several workers: lineorder split into partitions, the dimension tables with every partition, and the
13 queries answered as partial aggregates merged into the one-process answer.

Every SSB query is a SUM grouped by its other columns (the measure is its last column), so the sums of the
partitions' groups are the groups of the whole; the merged rows are then ordered by the query's ORDER BY.
Engine-neutral and free of any distribution library: service/cluster places the partitions.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from functools import cmp_to_key
from pathlib import Path
from typing import Any

import numpy as np

from .queries import QUERIES
from .results import Result
from .schema import TABLES

PARTITION_KEY = "lo_orderkey"  # an order's lines stay together


def partition_dir(dataset: Path, part: int, parts: int) -> Path:
    return dataset / "partitions" / f"{part}-of-{parts}"


def write_partition(dataset: Path, part: int, parts: int) -> Path:
    """A dataset directory with the lineorder rows of partition `part` (lo_orderkey % parts) and every dimension
    table (hard links, or copies across file systems). Written once, then reused; concurrent writers each build
    their own and the first rename wins (the contents are the same)."""
    import pyarrow.parquet as pq

    if not 0 <= part < parts:
        raise ValueError(f"partition {part} of {parts} does not exist")
    target = partition_dir(dataset, part, parts)
    if (target / "meta.json").exists():
        return target
    building = target.with_name(f"{target.name}.building-{uuid.uuid4().hex[:8]}")
    building.mkdir(parents=True)
    try:
        for table in TABLES:
            if table != "lineorder":
                _link(dataset / f"{table}.parquet", building / f"{table}.parquet")
        source = pq.ParquetFile(dataset / "lineorder.parquet")
        kept = 0
        with pq.ParquetWriter(building / "lineorder.parquet", source.schema_arrow) as writer:
            for batch in source.iter_batches(batch_size=1 << 20):
                keys = batch.column(PARTITION_KEY).to_numpy()
                mine = batch.filter(np.asarray(keys % parts == part))
                kept += mine.num_rows
                writer.write_batch(mine)
        meta = json.loads((dataset / "meta.json").read_text())
        meta["partition"] = {"part": part, "parts": parts, "key": PARTITION_KEY, "lineorder_rows": kept,
                             "dataset": str(dataset)}
        (building / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(building, target)
        except OSError:
            if not (target / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def merge_partials(query_id: str, parts: list[Result]) -> Result:
    """The answer of the whole dataset from each partition's answer to the same SSB query."""
    query = QUERIES[query_id]
    columns = list(query.columns)
    sums: dict[tuple, Any] = {}
    for result in parts:
        if list(result.columns) != columns:
            raise ValueError(f"a partition answered Q{query_id} with columns {result.columns}, not {columns}")
        for row in result.rows:
            key = tuple(row[:-1])
            sums[key] = sums.get(key, 0) + row[-1]
    rows = [[*key, total] for key, total in sums.items()]
    position = {name: i for i, name in enumerate(columns)}
    order = [(position[name], ascending) for name, ascending in query.order_by]

    def compare(a: list, b: list) -> int:
        for i, ascending in order:
            if a[i] != b[i]:
                return (-1 if a[i] < b[i] else 1) * (1 if ascending else -1)
        return 0

    return Result(columns, sorted(rows, key=cmp_to_key(compare)))
