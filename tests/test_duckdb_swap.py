"""A DuckDB dataset swap while queries run: the new dataset is loaded (no failed load), queries go on, and the
old in-memory database is closed once the queries running on it have finished."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import duckdb
import pytest

from olap import generate as gen
from olap.duckdb_engine import DuckDBEngine
from olap.manager import OlapManager

SWAPS = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ssb") / "sf0.01"
    gen.generate(0.01, out)
    return out


def test_a_swap_during_queries_loads_cleanly_and_closes_the_old_database(dataset, tmp_path, caplog):
    engine = DuckDBEngine(threads=1)
    olap = OlapManager(tmp_path, guard=None)
    olap.attach(engine)
    caplog.set_level(logging.INFO)
    stop, answered, failures = threading.Event(), [0], []

    def query_loop() -> None:
        while not stop.is_set():
            try:
                assert engine.run_query("1.1", None).rows
                answered[0] += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                failures.append(repr(exc))

    async def scenario() -> list[duckdb.DuckDBPyConnection]:
        await olap.activate(dataset)
        threads = [threading.Thread(target=query_loop) for _ in range(4)]
        for t in threads:
            t.start()
        swapped_out = []
        try:
            for _ in range(SWAPS):
                while answered[0] < 3:  # queries are running on the database about to be swapped out
                    await asyncio.sleep(0.005)
                answered[0] = 0
                swapped_out.append(engine._db.con)
                loaded = await olap.activate(dataset)
                assert "error" not in loaded["duckdb"], loaded
        finally:
            stop.set()
            for t in threads:
                t.join()
        return swapped_out

    try:
        swapped_out = asyncio.run(scenario())
        assert failures == [] and olap.load_errors == {}
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        for con in swapped_out:  # every old database is closed, none leaked
            with pytest.raises(duckdb.ConnectionException):
                con.execute("SELECT 1")
        assert engine.run_query("1.1", None).rows  # the last one serves
    finally:
        engine.close()
        for executor in olap.executors.values():
            executor.shutdown()
