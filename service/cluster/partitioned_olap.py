"""SSB at an ingress whose lineorder is partitioned across OLAP hosts elsewhere (a Ray cluster).

The 13 SSB queries go to one replica of every partition and their partial aggregates merge into the answer of
the whole (olap/partitions.py). Everything else stays as in one process, on this process's own engines: the
dataset's generation and import, the PostgreSQL engine, and ad-hoc SQL (not decomposable in general), for which
this process is the one worker holding everything. When a partition has no replica able to answer, `auto` falls
back to those engines too and says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from indexes.errors import ShardUnavailable
from olap.manager import Answer, OlapManager
from olap.partitions import merge_partials
from olap.queries import QUERIES, render_sql
from service.cluster.fanout import ShardSet
from service.cluster.parts import WatchesParts

PARTITION_ENGINES = ("auto", "cudf", "duckdb", "gpu", "cpu")  # what partitions serve; postgres stays here


class PartitionedOlap(WatchesParts, OlapManager):
    def __init__(self, data_dir: Path, guard: Any, partitions: ShardSet,
                 observe: Callable[[str, str, float, bool], None] | None = None) -> None:
        super().__init__(data_dir, guard, observe)
        self.parts = partitions

    def watch_args(self) -> tuple:
        """Every replica is told the active dataset: a new or restarted one loads its partition of it."""
        return (str(self.active) if self.active is not None else None,)

    async def run_query(self, query_id: str, params: dict[str, Any] | None, engine: str = "auto") -> Answer:
        if query_id not in QUERIES:
            raise KeyError(query_id)
        if engine not in PARTITION_ENGINES or self.active is None:
            return await super().run_query(query_id, params, engine)
        render_sql(query_id, params or {})  # parameters checked once, before any partition runs the query
        started = time.perf_counter()
        try:
            parts = await self.parts.on_every_shard("run_query", str(self.active), query_id, params or {})
        except ShardUnavailable as exc:
            if engine != "auto":
                raise
            answer = await super().run_query(query_id, params, engine)
            answer.fallback = f"{exc.detail}; served by {answer.engine} here"
            return answer
        took = time.perf_counter() - started
        served = parts[0][1]
        self.observe(served, "ssb_query", took, True)
        return Answer(merge_partials(query_id, [result for result, _ in parts]), served, round(took * 1000, 3))
