"""Hostile and careless OLAP requests through the service, on DuckDB and on PostgreSQL (issue 34, items 5, 9, 10,
11 and 12): the guard holds on both engines, a result no answer can hold is a 422 that leaves the circuit breaker
closed, bad import paths and parameters are 422s, and data imported again under one name reaches every engine."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from fastapi.testclient import TestClient

from conftest import run
from helpers import assert_problem, ssb_service_client, wait_job
from olap.schema import TABLES, TBL_FILES
from test_sqlguard import REFUSED

ENGINES = ["duckdb", "postgres"]


@pytest.fixture(scope="module")
def app(server_dsn, tmp_path_factory):
    with ssb_service_client(server_dsn, "olap_hostile", tmp_path_factory.mktemp("ssb-hostile"), 0.01) as client:
        yield client


def sql(app: TestClient, text: str, engine: str):
    return app.post("/v1/olap/sql", json={"sql": text, "engine": engine})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("probe", "fragment"), REFUSED)
def test_every_guard_probe_is_refused_on_each_engine(app, engine, probe, fragment):
    body = assert_problem(sql(app, probe, engine), 422, "sql-rejected", "sql")
    assert fragment in body["detail"]


def test_ssb_column_names_name_no_postgresql_function(app):
    """The guard lets `t.c` through for any SSB column c: sound because PostgreSQL has no function of that name, so
    attribute notation with one can only fail."""
    import asyncpg

    async def clashes() -> list[str]:
        conn = await asyncpg.connect(app.dsn)
        try:
            names = [name for schema in TABLES.values() for name in schema.names]
            return [r[0] for r in await conn.fetch("SELECT proname FROM pg_proc WHERE proname = ANY($1)", names)]
        finally:
            await conn.close()

    assert run(clashes()) == []


UNREPRESENTABLE = ["SELECT DATE '9999-12-31' + 1 AS d", "SELECT DATE '0001-01-01' - 1 AS d"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("text", UNREPRESENTABLE)
def test_a_date_past_the_range_is_a_422(app, engine, text):
    body = assert_problem(sql(app, text, engine), 422, "query-failed", "sql")
    assert "cannot be represented" in body["detail"]


def test_client_errors_leave_the_breaker_closed(app):
    failures = app.app.state.switchyard.settings.admission.breaker_failures
    statuses = set()
    for text in (*UNREPRESENTABLE, "SELECT no_such_column FROM lineorder", "SELECT CAST('x' AS INTEGER)"):
        for _ in range(failures + 1):  # in a row: one success would close the breaker again
            statuses.add(sql(app, text, "duckdb").status_code)
    named = app.post("/v1/olap/ssb/queries/1.1", json={"engine": "duckdb"})
    assert named.status_code == 200, named.text  # not 503 engine-cooling-down
    auto = sql(app, "SELECT count(*) AS n FROM lineorder", "auto").json()
    assert auto["engine"] == "duckdb" and auto["fallback"] is None, auto  # not sent to PostgreSQL
    assert statuses == {422}


@pytest.mark.parametrize("engine", ENGINES)
def test_parameters_are_a_422(app, engine):
    body = assert_problem(sql(app, "SELECT $1", engine), 422, "sql-rejected", "sql")
    assert "parameters" in body["detail"]


def test_postgresql_refuses_parameters_even_past_the_guard(app):
    from olap.errors import QueryFailed
    from olap.postgres_engine import PostgresEngine
    from service.database.postgres import open_pool

    async def direct() -> str:
        pool = await open_pool(app.dsn, min_size=1, max_size=2, command_timeout=30)
        try:
            engine = PostgresEngine(pool)
            engine.dataset = "loaded"
            with pytest.raises(QueryFailed) as caught:
                await engine.run_sql("SELECT $1", 10, 5)
            return str(caught.value)
        finally:
            await pool.close()

    assert "parameters" in run(direct())


@pytest.mark.parametrize("path", ["/tmp/ssb\x00/x", "\x00", "imports/\x00"])
def test_an_import_path_with_nul_is_a_422_naming_the_path(app, path):
    assert_problem(app.post("/v1/olap/ssb/import", json={"path": path}), 422, "validation-error", "path")


def test_an_unreadable_import_path_is_a_422(app):
    imports = app.app.state.switchyard.settings.ssb_imports
    long = str(imports / ("x" * 300) / "y")
    assert_problem(app.post("/v1/olap/ssb/import", json={"path": long}), 422, "validation-error", "path")


def write_tbl(dataset: Path, target: Path, revenue_factor: int = 1) -> None:
    """ssb-dbgen's .tbl format; lo_revenue multiplied by revenue_factor (the row counts stay the same)."""
    target.mkdir(parents=True, exist_ok=True)
    for table, name in TBL_FILES.items():
        frame = pd.read_parquet(dataset / f"{table}.parquet")
        if table == "lineorder":
            frame["lo_revenue"] = frame["lo_revenue"] * revenue_factor
        (target / name).write_text("\n".join(frame.astype(str).agg("|".join, axis=1) + "|") + "\n")


def test_reimport_under_the_active_name_reaches_postgresql(app):
    imports = app.app.state.switchyard.settings.ssb_imports
    totals = {}
    for factor in (1, 2):
        source = imports / f"revenue-x{factor}"
        write_tbl(app.dataset, source, factor)
        r = app.post("/v1/olap/ssb/import", json={"path": str(source), "name": "reimported"})
        assert r.status_code == 202, r.text
        job = wait_job(app, r.headers["location"])
        assert job["state"] == "succeeded", job
        totals[factor] = {engine: sql(app, "SELECT sum(lo_revenue) AS r FROM lineorder", engine).json()["rows"][0][0]
                          for engine in ENGINES}
    assert totals[1]["duckdb"] == totals[1]["postgres"]
    assert totals[2]["duckdb"] == totals[2]["postgres"] == 2 * totals[1]["duckdb"], totals
