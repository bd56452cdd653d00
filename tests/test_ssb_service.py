"""SSB through the service: every query on every available engine equals DuckDB's answer on the same data (and
the GPU plans run on pandas agree), ad-hoc SQL is one read-only SELECT that cannot touch the host, imports are
checked, bad input is a 4xx naming the reason."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import duckdb
import orjson
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import run
from helpers import assert_problem, cudf_missing, ssb_service_client, wait_job
from olap.plans import run_plan
from olap.queries import QUERIES, render_sql
from olap.schema import TABLES, TBL_FILES

SF = 0.01
NON_DEFAULT = {  # one other parameter set per flight, so templates are exercised beyond the published values
    "1.1": {"year": 1995}, "2.1": {"category": "MFGR#33", "region": "ASIA"}, "3.1": {"customer_region": "EUROPE"},
    "4.1": {"customer_region": "ASIA", "supplier_region": "ASIA"},
}


ENGINES = [pytest.param("cudf", marks=pytest.mark.skipif(bool(cudf_missing()), reason=f"gpu engine: {cudf_missing()}")),
           "duckdb", "postgres"]


@pytest.fixture(scope="module")
def app(server_dsn, tmp_path_factory):
    with ssb_service_client(server_dsn, "ssb_service", tmp_path_factory.mktemp("ssb"), SF) as client:
        yield client


@pytest.fixture(scope="module")
def oracle(app):
    """DuckDB on the same Parquet files, run here in the test process, and the same tables as pandas frames."""
    con = duckdb.connect(":memory:")
    for table in TABLES:
        con.execute(f"CREATE TABLE {table} AS SELECT * FROM read_parquet(?)", [str(app.dataset / f"{table}.parquet")])
    frames = {t: pd.read_parquet(app.dataset / f"{t}.parquet") for t in TABLES}
    return con, frames


def rows_of(values) -> list[tuple]:
    return [tuple(int(v) if isinstance(v, float) and v.is_integer() else v for v in row) for row in values]


@pytest.mark.parametrize("query_id", list(QUERIES))
@pytest.mark.parametrize("engine", ENGINES)
def test_every_query_on_every_engine_equals_duckdb(app, oracle, engine, query_id):
    con, frames = oracle
    for params in ({}, NON_DEFAULT.get(query_id)):
        if params is None:
            continue
        r = app.post(f"/v1/olap/ssb/queries/{query_id}", json={"engine": engine, "params": params})
        assert r.status_code == 200, r.text
        body = r.json()
        want = rows_of(con.execute(render_sql(query_id, params)).fetchall())
        assert body["engine"] == engine and body["fallback"] is None
        assert rows_of(body["rows"]) == want, (engine, query_id, params)
        if query_id.startswith(("1.", "2.", "4.1", "4.2")):
            assert want, f"Q{query_id} {params} should return rows at SF {SF}"


@pytest.mark.parametrize("query_id", list(QUERIES))
def test_gpu_plans_on_pandas_equal_duckdb(oracle, query_id):
    con, frames = oracle
    for params in ({}, NON_DEFAULT.get(query_id) or {}):
        got = rows_of(run_plan(query_id, frames, params).itertuples(index=False, name=None))
        assert got == rows_of(con.execute(render_sql(query_id, params)).fetchall()), (query_id, params)


def test_measures_are_int64_everywhere(app):
    schema = pq.read_schema(app.dataset / "lineorder.parquet")
    for column in ("lo_extendedprice", "lo_revenue", "lo_supplycost", "lo_ordtotalprice"):
        assert str(schema.field(column).type) == "int64"


def test_listing_gives_sql_and_parameters(app):
    listing = app.get("/v1/olap/ssb/queries").json()
    assert [q["id"] for q in listing] == list(QUERIES)
    q13 = next(q for q in listing if q["id"] == "1.3")
    assert "d_weeknuminyear" in q13["sql"] and "JOIN" in q13["sql"].upper()


def test_bad_query_requests(app):
    assert_problem(app.post("/v1/olap/ssb/queries/5.1", json={}), 404, "not-found")  # one route per query
    assert_problem(app.post("/v1/olap/ssb/queries/1.4", json={}), 404, "not-found")
    body = assert_problem(app.post("/v1/olap/ssb/queries/1.1", json={"params": {"year": "1993; drop"}}),
                          422, "validation-error")
    assert body["field"] == "year"
    assert_problem(app.post("/v1/olap/ssb/queries/1.1", json={"params": {"colour": 1}}), 422, "validation-error")
    assert_problem(app.post("/v1/olap/ssb/queries/1.1", json={"engine": "oracle"}), 422, "validation-error", "engine")
    if cudf_missing():
        body = assert_problem(app.post("/v1/olap/ssb/queries/1.1", json={"engine": "gpu"}), 409, "engine-unavailable")
        assert "gpu" in body["detail"]


def test_adhoc_sql_runs_on_cpu_and_postgres_with_limits(app, oracle):
    con, _ = oracle
    sql = ("SELECT d_year, SUM(lo_revenue) AS revenue FROM lineorder JOIN ddate ON lo_orderdate = d_datekey "
           "GROUP BY d_year ORDER BY d_year")
    want = rows_of(con.execute(sql).fetchall())
    for engine in ("cpu", "postgres"):
        body = app.post("/v1/olap/sql", json={"sql": sql, "engine": engine}).json()
        assert rows_of(body["rows"]) == want and body["columns"] == ["d_year", "revenue"] and not body["truncated"]
        few = app.post("/v1/olap/sql", json={"sql": "SELECT lo_orderkey FROM lineorder", "engine": engine,
                                             "max_rows": 7}).json()
        assert few["row_count"] == 7 and few["truncated"] is True


def test_a_wide_answer_is_cut_at_the_byte_budget_on_every_engine(app, oracle, monkeypatch):
    """max_rows bounds rows, not bytes: 250 text columns of 100,000 rows once took 7.5 GB of the service's memory.
    An answer past ANSWER_MAX_BYTES is cut at a row, in order, and says truncated (a small budget here)."""
    from olap import results

    con, _ = oracle
    sql = ("SELECT lo_orderkey, lo_linenumber, " + ", ".join(f"md5(lo_shipmode) AS m{i}" for i in range(8))
           + " FROM lineorder ORDER BY lo_orderkey, lo_linenumber")
    want = [list(row) for row in con.execute(sql + " LIMIT 2000").fetchall()]
    monkeypatch.setattr(results, "ANSWER_MAX_BYTES", 64 << 10)  # 64 KiB: a few hundred of these rows
    for engine in ("cpu", "postgres"):
        body = app.post("/v1/olap/sql", json={"sql": sql, "engine": engine, "max_rows": 2000}).json()
        assert body["truncated"] is True and 0 < body["row_count"] < 2000, body.get("row_count")
        assert len(orjson.dumps(body["rows"])) < 4 * (64 << 10)
        assert body["rows"] == want[:body["row_count"]], engine
    narrow = app.post("/v1/olap/sql", json={"sql": "SELECT lo_orderkey FROM lineorder", "max_rows": 2000}).json()
    assert narrow["row_count"] == 2000  # 16 KB of values: under the budget, cut by max_rows only


def test_adhoc_sql_time_limit(app):
    slow = "SELECT count(*) FROM lineorder a JOIN lineorder b ON a.lo_quantity <> b.lo_quantity"
    for engine in ("cpu", "postgres"):
        r = app.post("/v1/olap/sql", json={"sql": slow, "engine": engine, "timeout_s": 0.3})
        assert_problem(r, 422, "query-timeout")


ATTACKS = [
    "SELECT * FROM read_text('{f}')",
    "SELECT * FROM read_csv('{f}')",
    "SELECT * FROM '{f}'",
    "SELECT pg_read_file('{f}')",
    "SELECT lo_revenue FROM lineorder WHERE lo_orderkey = length(pg_read_file('{f}'))",
    "WITH x AS (SELECT * FROM read_text('{f}')) SELECT * FROM x",
    "SELECT * FROM lineorder; SELECT pg_read_file('{f}')",
    "COPY lineorder FROM '{f}'",
    "ATTACH '{f}' AS stolen",
    "INSTALL httpfs",
    "CREATE TABLE t AS SELECT 1",
    "DELETE FROM lineorder",
    "SELECT * FROM pg_catalog.pg_authid",
    "SELECT current_setting('data_directory')",
    "SELECT set_config('role', 'postgres', false)",
    "SELECT '{f}'::regclass",
    "SELECT * FROM glob('/*')",
    "PRAGMA database_list",
]


@pytest.mark.parametrize("engine", ["cpu", "postgres"])
@pytest.mark.parametrize("attack", ATTACKS)
def test_adhoc_sql_cannot_read_a_host_file(app, tmp_path, engine, attack):
    secret = tmp_path / "secret.txt"
    secret.write_text("CANARY-7f3a")
    r = app.post("/v1/olap/sql", json={"sql": attack.format(f=secret), "engine": engine})
    assert 400 <= r.status_code < 500, r.text
    assert "CANARY" not in r.text


CATALOG_READS = [
    "WITH pg_roles AS (SELECT * FROM pg_roles) SELECT rolname, rolsuper FROM pg_roles",
    "WITH pg_settings AS (SELECT * FROM pg_settings) SELECT name, setting FROM pg_settings",
    "WITH a AS (SELECT 1 AS one), pg_roles AS (SELECT * FROM pg_roles, a) SELECT rolname FROM pg_roles",
    "WITH x AS (WITH pg_roles AS (SELECT * FROM pg_roles) SELECT * FROM pg_roles) SELECT * FROM x",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
]


@pytest.mark.parametrize("engine", ["cpu", "postgres"])
@pytest.mark.parametrize("sql", CATALOG_READS)
def test_a_cte_cannot_vouch_for_a_table_of_its_own_name(app, engine, sql):
    r = app.post("/v1/olap/sql", json={"sql": sql, "engine": engine})
    assert_problem(r, 422, "sql-rejected", "sql")


def test_ctes_read_earlier_ctes_and_shadow_names(app):
    sql = ("WITH a AS (SELECT lo_quantity AS q FROM lineorder), pg_roles AS (SELECT q FROM a) "
           "SELECT count(*) AS n FROM pg_roles")
    want = app.post("/v1/olap/sql", json={"sql": "SELECT count(*) AS n FROM lineorder", "engine": "cpu"}).json()
    for engine in ("cpu", "postgres"):
        r = app.post("/v1/olap/sql", json={"sql": sql, "engine": engine})
        assert r.status_code == 200, r.text
        assert r.json()["rows"] == want["rows"], engine


def test_second_wall_engines_refuse_file_access_even_without_the_guard(app, tmp_path):
    """Run attacks straight at the engines, past the guard: DuckDB has external access off, PostgreSQL runs
    ad-hoc SQL as an unprivileged role."""
    secret = tmp_path / "secret.txt"
    secret.write_text("CANARY-7f3a")
    olap = app.app.state.switchyard.olap
    with pytest.raises(Exception) as duck:
        olap.engines["cpu"].run_sql(f"SELECT * FROM read_text('{secret}')", 10, 5)
    assert "CANARY" not in str(duck.value)

    async def pg() -> None:
        from olap.postgres_engine import PostgresEngine
        from service.database.postgres import open_pool

        pool = await open_pool(app.dsn, min_size=1, max_size=2, command_timeout=30)
        try:
            engine = PostgresEngine(pool)
            engine.dataset = "loaded"
            with pytest.raises(Exception) as caught:
                await engine.run_sql(f"SELECT pg_read_file('{secret}')", 10, 5)
            assert "permission denied" in str(caught.value)
        finally:
            await pool.close()

    run(pg())


def write_tbl(dataset: Path, target: Path, quoted_dates: bool = False) -> None:
    """ssb-dbgen's .tbl format: '|'-separated with a trailing '|', no header."""
    target.mkdir(parents=True, exist_ok=True)
    for table, name in TBL_FILES.items():
        frame = pd.read_parquet(dataset / f"{table}.parquet")
        if quoted_dates:
            for col in ("lo_orderdate", "lo_commitdate", "d_datekey"):
                if col in frame:
                    s = frame[col].astype(str)
                    frame[col] = '"' + s.str[:4] + "-" + s.str[4:6] + "-" + s.str[6:] + '"'
        lines = frame.astype(str).agg("|".join, axis=1) + "|"
        (target / name).write_text("\n".join(lines) + "\n")


def test_import_of_tbl_files_through_the_service(app, oracle):
    imports = app.app.state.switchyard.settings.ssb_imports
    write_tbl(app.dataset, imports / "dbgen", quoted_dates=True)
    r = app.post("/v1/olap/ssb/import", json={"path": "dbgen", "name": "fromtbl"})  # relative to the import dir
    assert r.status_code == 202, r.text
    job = wait_job(app, r.headers["location"])
    assert job["state"] == "succeeded", job
    con, _ = oracle
    for engine in ("cpu", "postgres"):  # the imported copy answers every query as the generated data did
        for query_id in QUERIES:
            got = app.post(f"/v1/olap/ssb/queries/{query_id}", json={"engine": engine}).json()
            assert rows_of(got["rows"]) == rows_of(con.execute(render_sql(query_id, {})).fetchall()), (engine, query_id)
    active = [d for d in app.get("/v1/olap/ssb/datasets").json() if d["active"]]
    assert len(active) == 1 and active[0]["path"].endswith("fromtbl")


def test_import_refuses_paths_outside_the_import_dir_and_incomplete_dirs(app, tmp_path):
    body = assert_problem(app.post("/v1/olap/ssb/import", json={"path": str(tmp_path)}), 403, "forbidden", "path")
    assert "SWITCHYARD_SSB_IMPORT_DIR" in body["detail"] and "relative" in body["detail"]
    for escape in ("..", "../import-elsewhere"):  # relative paths are taken from the import dir, not the cwd
        assert_problem(app.post("/v1/olap/ssb/import", json={"path": escape}), 403, "forbidden", "path")
    # no server user's home either: "~" is a directory of that name under the import dir (none here)
    assert_problem(app.post("/v1/olap/ssb/import", json={"path": "~"}), 422, "validation-error", "path")
    imports = app.app.state.switchyard.settings.ssb_imports
    (imports / "partial").mkdir(parents=True, exist_ok=True)
    (imports / "partial" / "part.tbl").write_text("1|x|\n")
    body = assert_problem(app.post("/v1/olap/ssb/import", json={"path": str(imports / "partial")}), 422,
                          "validation-error", "path")
    assert "lineorder.tbl" in body["detail"]


def test_malformed_import_fails_the_job_and_loads_nothing(app):
    imports = app.app.state.switchyard.settings.ssb_imports
    write_tbl(app.dataset, imports / "bad")
    lines = (imports / "bad" / "lineorder.tbl").read_text().splitlines()
    lines[3] = "not|a|lineorder|row|"
    (imports / "bad" / "lineorder.tbl").write_text("\n".join(lines) + "\n")
    before = [d for d in app.get("/v1/olap/ssb/datasets").json() if d["active"]]
    r = app.post("/v1/olap/ssb/import", json={"path": str(imports / "bad"), "name": "broken"})
    job = wait_job(app, r.headers["location"])
    assert job["state"] == "failed" and "lineorder.tbl" in job["message"]
    assert not (app.app.state.switchyard.settings.data_dir / "ssb" / "broken").exists()
    assert [d for d in app.get("/v1/olap/ssb/datasets").json() if d["active"]] == before


@pytest.mark.parametrize("sql", [
    "SELECT max(length(repeat(c_name, 100000000))) FROM customer",
    "SELECT lpad(c_name, 1000000000, 'x') FROM customer",
])
def test_string_blowups_are_refused(app, sql):
    for engine in ("cpu", "postgres"):
        assert_problem(app.post("/v1/olap/sql", json={"sql": sql, "engine": engine}), 422, "sql-rejected", "sql")


def test_duckdb_runs_within_its_memory_limit(app):
    engine = app.app.state.switchyard.olap.engines["cpu"]
    limit = engine.run_sql("SELECT current_setting('memory_limit')", None, None).rows[0][0]
    threads = engine.run_sql("SELECT current_setting('threads')", None, None).rows[0][0]
    number, unit = limit.split()
    got_mb = float(number) * {"MiB": 1.048576, "GiB": 1073.741824, "MB": 1, "GB": 1000}[unit]
    want_mb = int(app.app.state.switchyard.settings.duckdb_memory.removesuffix("MB"))
    assert abs(got_mb - want_mb) <= 0.05 * want_mb, (limit, want_mb)
    assert int(threads) == app.app.state.switchyard.settings.engine_threads


def test_a_generation_cancelled_while_loading_leaves_every_engine_on_the_active_dataset(app, oracle):
    """A job cancelled while PostgreSQL copied the new tables left DuckDB answering from the new dataset and
    PostgreSQL (and `active`) from the old. Every engine moves or none does: the engines that took the new one
    load the old one back."""
    import threading

    olap = app.app.state.switchyard.olap
    before = olap.active
    postgres = olap.engines["postgres"]
    real, held, release = postgres.load, threading.Event(), threading.Event()

    async def held_load(path, progress=None):
        if path != before:  # the new dataset: held until the job is cancelled
            held.set()
            await asyncio.to_thread(release.wait, 60)
        return await real(path, progress)

    postgres.load = held_load
    try:
        r = app.post("/v1/olap/ssb/generate", json={"scale_factor": SF, "seed": 77})
        assert r.status_code == 202, r.text
        assert held.wait(120), "the generation never reached PostgreSQL's load"
        cancelling = threading.Thread(target=lambda: app.post(f"/v1/jobs/{r.json()['job']}/cancel"))
        cancelling.start()
        time.sleep(0.3)  # the cancel is requested, then the held load goes on and reports progress
        release.set()
        cancelling.join(120)
        job = wait_job(app, r.headers["location"])
    finally:
        postgres.load = real
        release.set()
    assert job["state"] == "cancelled", job
    deadline = time.monotonic() + 60
    while getattr(olap, "_activations", ()) and time.monotonic() < deadline:  # the old one loaded back meanwhile
        time.sleep(0.05)
    assert olap.active == before and olap.engines["cpu"].dataset == str(before)
    con, _ = oracle
    sql = "SELECT count(*), sum(lo_revenue) FROM lineorder"
    for engine in ("cpu", "postgres"):
        body = app.post("/v1/olap/sql", json={"sql": sql, "engine": engine}).json()
        assert rows_of(body["rows"]) == rows_of(con.execute(sql).fetchall()), engine
