"""The SQL guard on its own: an allowlist over the tree that reads identifiers as PostgreSQL does, refuses calls in
attribute notation, session keywords, parameters and string-growth functions, and lets analytic SQL through.
(tests/test_olap_hostile.py sends the same probes through the service to each engine.)"""

from __future__ import annotations

import pyarrow as pa
import pytest

from olap.queries import QUERIES, render_sql
from olap.results import from_arrow
from olap.sqlguard import SqlRejected, check

# (probe, a fragment the refusal must carry)
REFUSED = [
    # item 9: a quoted CTE name is exact; the catalog stays out of reach
    ('WITH "PG_ROLES" AS (SELECT 1 AS x) SELECT rolname, rolsuper FROM pg_roles', "'pg_roles'"),
    ('WITH "PG_SETTINGS" AS (SELECT 1 AS x) SELECT name, setting FROM pg_settings', "'pg_settings'"),
    ('WITH "Pg_Class" AS (SELECT 1 AS x) SELECT relname FROM pg_class', "'pg_class'"),
    ('WITH "PG_STAT_ACTIVITY" AS (SELECT 1 AS x) SELECT query FROM pg_stat_activity', "'pg_stat_activity'"),
    ('WITH "PG_DATABASE" AS (SELECT 1 AS x) SELECT datname FROM pg_database', "'pg_database'"),
    ('SELECT * FROM "LINEORDER"', "'LINEORDER'"),
    ("SELECT * FROM information_schema.tables", "qualified table names"),
    ("SELECT * FROM duckdb_settings", "unknown table"),
    ("SELECT * FROM sqlite_master", "unknown table"),
    # attribute notation is a function call in PostgreSQL
    ("SELECT d.to_json FROM ddate d", "to_json(d)"),
    ("SELECT ddate.row_to_json FROM ddate", "row_to_json(ddate)"),
    ("WITH t AS (SELECT 1 AS to_json) SELECT d.to_json FROM ddate d, t", "to_json(d)"),
    ("SELECT s.to_json FROM (SELECT * EXCLUDE (d_year) FROM ddate) s", "to_json(s)"),
    ("SELECT (d).to_json FROM ddate d", "struct extract"),
    ("SELECT d.to_json() FROM ddate d", "method calls"),
    ("SELECT x.lo_revenue FROM lineorder", "not a table or alias"),
    ("SELECT d.d_year.x FROM ddate d", "no more parts"),
    # the session's identity and settings
    ("SELECT current_user", "session information"),
    ("SELECT session_user", "session information"),
    ('SELECT "current_user" FROM ddate', "session information"),
    ("SELECT current_role", "session information"),
    ("SELECT current_setting('data_directory')", "current_setting()"),
    ("SELECT version()", "version()"),
    ("SELECT pg_catalog.version()", "qualified function"),
    # item 5: strings (or lists) grown without a bound
    ("SELECT length(" + "replace(" * 9 + "'x'" + ", 'x', 'xxxxxxxxxx')" * 9 + ")", "replace()"),
    ("SELECT max(length(repeat(c_name, 100000000))) FROM customer", "repeat()"),
    ("SELECT lpad(c_name, 1000000000, 'x') FROM customer", "lpad()"),
    ("SELECT rpad('x', 1000000000)", "rpad()"),
    ("SELECT length(string_agg(c_name, ',')) FROM customer", "string_agg()"),
    ("SELECT concat(c_name, c_name) FROM customer", "concat()"),
    ("SELECT c_name || c_name FROM customer", "||"),
    ("WITH a AS (SELECT c_name || c_name AS s FROM customer) SELECT s FROM a", "||"),
    ("SELECT regexp_replace(c_name, '.', 'xxxxxxxxxx', 'g') FROM customer", "regexp_replace()"),
    ("SELECT array_agg(c_name) FROM customer", "array_agg()"),
    ("SELECT list(c_name) FROM customer", "list()"),
    ("SELECT CAST(c_name AS CHAR(10000000)) FROM customer", "at most"),
    ("SELECT CAST(c_name AS BPCHAR(10000000)) FROM customer", "at most"),
    # item 11: no parameters (none are sent)
    ("SELECT $1", "parameters"),
    ("SELECT lo_revenue FROM lineorder WHERE lo_orderkey = ?", "parameters"),
    # DuckDB-only forms that reach outside the allowlist
    ("SELECT #1 FROM ddate", "positional reference"),
    ("SELECT abs(x -> x) FROM ddate", "lambda"),
    ("SELECT ARRAY[1, 2]", "array constructor"),
    # sampling: TABLESAMPLE SYSTEM (10) is 10 rows in DuckDB, 10 percent in PostgreSQL (its size was a dict where
    # the walk read a node kind: a 500, not a refusal)
    ("select * from lineorder tablesample system (10) limit 1", "sampling"),
    ("select * from lineorder using sample 10 limit 1", "sampling"),
    ("SELECT count(*) FROM lineorder USING SAMPLE 10% (bernoulli, 5)", "sampling"),
    ("SELECT count(*) FROM (SELECT * FROM ddate) d TABLESAMPLE 5%", "sampling"),
    ("SELECT d.d_year FROM ddate d JOIN (SELECT * FROM lineorder TABLESAMPLE 1%) l ON l.lo_orderdate = d.d_datekey",
     "sampling"),
]


@pytest.mark.parametrize(("sql", "fragment"), REFUSED)
def test_probes_are_refused_saying_what(sql, fragment):
    with pytest.raises(SqlRejected) as refused:
        check(sql)
    assert fragment in str(refused.value), str(refused.value)
    assert refused.value.field == "sql"


@pytest.mark.parametrize("tree", [
    {"type": {"id": "BIGINT", "type_info": None}, "is_null": False, "value": 10},
    {"type": ["BIGINT"], "value": {"type": {"id": "DOUBLE"}}},
])
def test_a_type_that_is_not_a_node_kind_does_not_break_the_walk(tree):
    """A node kind is a string under "type"; a dict or list there (a value's type) is walked, not read."""
    from olap.schema import TABLES
    from olap.sqlguard import _Walk
    from olap.sqlscope import Scope

    _Walk(Scope(TABLES)).node(tree, ctes={})
    with pytest.raises(SqlRejected, match="parameters"):  # what such a child holds is still checked
        _Walk(Scope(TABLES)).node({"type": {"class": "PARAMETER"}}, ctes={})
    with pytest.raises(SqlRejected, match="not allowed"):  # a kind the walk cannot read is refused
        _Walk(Scope(TABLES)).node({"class": "OPERATOR", "type": {"id": "BIGINT"}}, ctes={})


def test_every_client_error_is_one_class():
    """The breaker tells client errors from engine failures by this class (olap/manager.py)."""
    from olap.errors import ClientError, QueryFailed, UnrepresentableResult
    from olap.queries import QueryParamError

    for kind in (SqlRejected, QueryFailed, UnrepresentableResult, QueryParamError):
        assert issubclass(kind, ClientError), kind


ALLOWED = [
    "WITH pg_roles AS (SELECT 1 AS x) SELECT x FROM pg_roles",  # the CTE is what the name means here
    'WITH "Totals" AS (SELECT sum(lo_revenue) AS r FROM lineorder) SELECT r FROM "Totals"',
    "SELECT L.lo_revenue FROM LINEORDER l",  # unquoted names fold on both sides
    "SELECT d.d_year, count(*) FROM ddate d GROUP BY d.d_year",
    "SELECT lineorder.lo_revenue FROM lineorder",
    "SELECT s.revenue, s.d_year FROM (SELECT d_year, sum(lo_revenue) AS revenue FROM lineorder "
    "JOIN ddate ON lo_orderdate = d_datekey GROUP BY d_year) s ORDER BY s.revenue DESC",
    "SELECT s.y FROM (SELECT * FROM ddate) s(y)",
    "SELECT t.c FROM (SELECT 1 AS c UNION ALL SELECT 2) t",
    "WITH t(a) AS (SELECT d_year FROM ddate) SELECT t.a FROM t",
    "SELECT v.x FROM (VALUES (1), (2)) v(x)",
    "SELECT upper(c_name), lower(c_city), substring(c_phone, 1, 3), round(avg(lo_revenue), 2), abs(-1), "
    "coalesce(min(lo_tax), 0), CASE WHEN count(*) > 1 THEN 'many' ELSE 'one' END, "
    "EXTRACT(year FROM DATE '1992-01-01'), CAST(c_custkey AS VARCHAR(20)) "
    "FROM customer JOIN lineorder ON lo_custkey = c_custkey GROUP BY c_name, c_city, c_phone, c_custkey",
    "SELECT d_year, rank() OVER (ORDER BY sum(lo_revenue) DESC) FROM lineorder, ddate "
    "WHERE lo_orderdate = d_datekey AND d_month LIKE 'J%' GROUP BY d_year",
    "SELECT DATE '1998-12-31' + 1",
]


@pytest.mark.parametrize("sql", ALLOWED)
def test_analytic_sql_passes(sql):
    assert check(sql) == sql


@pytest.mark.parametrize("query_id", list(QUERIES))
def test_every_named_query_passes_the_guard(query_id):
    check(render_sql(query_id, {}))


def test_a_value_no_answer_can_hold_is_the_querys_fault():
    from olap.errors import ClientError, UnrepresentableResult

    table = pa.table({"d": pa.array([3_000_000], pa.date32())})  # 10183-11-26
    with pytest.raises(UnrepresentableResult) as caught:
        from_arrow(table, engine="DuckDB")
    assert "cannot be represented" in str(caught.value) and isinstance(caught.value, ClientError)


def test_only_short_texts_are_remembered():
    """A syntax tree takes about 50 bytes per character: distinct long queries must not fill the parse cache."""
    from olap.sqlguard import CACHED_SQL_CHARS, _cached_tree

    columns = ", ".join(["lo_revenue"] * (CACHED_SQL_CHARS // 10))
    long_sql = f"SELECT {columns} FROM lineorder"
    short_sql = "SELECT count(*) AS n FROM lineorder -- remembered"
    before = _cached_tree.cache_info().currsize
    check(long_sql)
    check(long_sql + " ")
    assert _cached_tree.cache_info().currsize == before
    check(short_sql)
    assert _cached_tree.cache_info().currsize == before + 1


@pytest.mark.parametrize(("sql", "fragment"), [
    ("SELECT 1; SELECT 2", "exactly one statement is allowed, this has 2"),
    ("", "exactly one statement is allowed, this has 0"),
    ("DELETE FROM lineorder", "only SELECT is allowed, not DELETE"),
    ("SELECT 1; DELETE FROM lineorder", "exactly one statement is allowed, this has 2"),
    ("COPY lineorder TO 'out.csv'", "only SELECT is allowed, not COPY"),
    ("SELEC 1", "not valid SQL"),
])
def test_statements_other_than_one_select_are_refused_saying_why(sql, fragment):
    with pytest.raises(SqlRejected) as refused:
        check(sql)
    assert fragment in str(refused.value), str(refused.value)


def test_an_allowed_query_is_not_split_into_statements(monkeypatch):
    """duckdb.extract_statements holds the GIL (9 ms in one piece for 20,000 characters, which the event loop's
    thread waits out): a query the parse accepts never calls it."""
    import olap.sqlguard as guard

    def split(sql):
        raise AssertionError("extract_statements was called")

    monkeypatch.setattr(guard.duckdb, "extract_statements", split)
    sql = "SELECT d_year, count(*) FROM ddate GROUP BY d_year -- not remembered: " + "x" * 10
    assert check(sql + ";") == sql


def test_the_guard_runs_off_the_event_loop(tmp_path, monkeypatch):
    """Up to 38 ms of CPU a query: on the event loop, every other request of the process would wait for it."""
    import asyncio
    import threading

    import olap.sqlguard as guard
    from olap.manager import EngineNotReady, OlapManager

    ran_on: list[str] = []
    original = guard.check

    def recording(sql: str) -> str:
        ran_on.append(threading.current_thread().name)
        return original(sql)

    monkeypatch.setattr(guard, "check", recording)
    olap = OlapManager(tmp_path, guard=None)

    async def scenario() -> str:
        loop_thread = threading.current_thread().name
        with pytest.raises(SqlRejected):
            await olap.run_sql("SELECT current_user", "postgres", 10, 5.0)
        with pytest.raises(EngineNotReady):  # checked, then no engine to run it
            await olap.run_sql("SELECT count(*) FROM ddate", "postgres", 10, 5.0)
        await olap.stop()
        return loop_thread

    loop_thread = asyncio.run(scenario())
    assert len(ran_on) == 2 and loop_thread not in ran_on, (loop_thread, ran_on)
    assert all(name.startswith("olap-sqlguard") for name in ran_on), ran_on
