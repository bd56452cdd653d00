"""Ad-hoc SQL over resident frames (olap/frame_sql.py), run here on pandas, against DuckDB on the same data: the 13
SSB queries' SQL and ad-hoc queries of every form it runs; what it does not run is refused, never answered wrong."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from helpers import cudf_missing
from olap.frame_sql import Unsupported, run
from olap.queries import QUERIES, render_sql
from test_ssb_queries import duckdb_over, make_tables


@pytest.fixture(scope="module")
def pandas_frames() -> dict[str, pd.DataFrame]:
    return {name: table.to_pandas() for name, table in make_tables().items()}


@pytest.fixture(scope="module", params=["pandas", pytest.param("cudf", marks=pytest.mark.skipif(
    bool(cudf_missing()), reason=f"cuDF: {cudf_missing()}"))])
def frames(request, pandas_frames):
    """The tables as the engine holds them: pandas here, cuDF frames on the device (make gpu-check)."""
    if request.param == "pandas":
        return pandas_frames
    import cudf

    return {name: cudf.from_pandas(frame) for name, frame in pandas_frames.items()}


@pytest.fixture(scope="module")
def duck(pandas_frames):
    con = duckdb_over(pandas_frames)
    yield con
    con.close()


def on_host(frame):
    return frame.to_pandas() if hasattr(frame, "to_pandas") else frame


AD_HOC = [
    # comma joins with the equalities in WHERE, OR / NOT / NOT IN, arithmetic over aggregates, HAVING, ORDER BY alias
    """select d_year, c_nation, sum(lo_revenue - lo_supplycost) as profit, count(*) as n,
              sum(lo_revenue) / count(lo_revenue) as mean_revenue
       from lineorder, ddate, customer
       where lo_orderdate = d_datekey and lo_custkey = c_custkey and (c_region = 'AMERICA' or c_region = 'ASIA')
         and not (lo_discount in (1, 2)) and lo_tax not in (0, 8)
       group by d_year, c_nation having count(*) > 3 order by profit desc, d_year, c_nation""",
    # GROUP BY positions and expressions, ORDER BY a position, avg / min / max, LIMIT and OFFSET
    """select lo_discount * 10 as d10, min(lo_quantity) as lo, max(lo_quantity) as hi, avg(lo_extendedprice) as a
       from lineorder where lo_quantity between 10 and 20 group by 1 order by 1 desc limit 4 offset 2""",
    # a global aggregate over nothing: SUM is NULL, COUNT 0, COALESCE and CAST over them
    """select cast(coalesce(sum(lo_revenue), 0) as bigint) as revenue, count(*) as n, sum(lo_tax) as t
       from lineorder join ddate on lo_orderdate = d_datekey where d_year = 2050""",
    # explicit joins with a table alias and qualified columns, a filter across two tables, no aggregate
    """select l.lo_orderkey, l.lo_linenumber, s.s_city, lo_revenue * 2 + 1 as x
       from lineorder l join supplier s on l.lo_suppkey = s.s_suppkey
       where s_nation = 'CHINA' and lo_quantity > lo_discount * 5
       order by lo_orderkey, lo_linenumber limit 50""",
    # GROUP BY without aggregates, ORDER BY an expression not selected
    """select p_mfgr, p_category from part group by p_mfgr, p_category order by p_category desc""",
    # LIKE / NOT LIKE (regex characters in the pattern are literal), count(DISTINCT), SELECT DISTINCT
    """select p_mfgr, count(distinct p_brand1) as brands, count(*) as parts from part
       where p_brand1 like 'MFGR#2_2%' and p_category not like '%#1_' group by p_mfgr order by p_mfgr""",
    """select distinct c_region, c_nation from customer where c_nation like 'UNITED%' or c_city like '%.%'
       order by c_region, c_nation""",
    """select count(distinct lo_tax) as taxes, count(distinct lo_custkey) as customers from lineorder""",
    # strings: BETWEEN and comparisons, a cast to double
    """select p_brand1, cast(sum(lo_quantity) as double) as q from lineorder join part on lo_partkey = p_partkey
       where p_brand1 between 'MFGR#2221' and 'MFGR#2228' and p_color <> 'red' group by p_brand1 order by p_brand1""",
]

REFUSED = [
    "select distinct on (lo_tax) lo_tax, lo_discount from lineorder",
    "select sum(distinct lo_tax) from lineorder",
    "select c_name from customer left join lineorder on lo_custkey = c_custkey",
    "select count(*) from lineorder where lo_custkey in (select c_custkey from customer)",
    "select lo_orderkey, row_number() over (order by lo_revenue) from lineorder",
    "select count(*) from part, supplier",
    "with x as (select 1 as one) select one from x",
    "select * from ddate",
    "select lo_tax from lineorder union select lo_discount from lineorder",
    "select abs(lo_tax) from lineorder",
    "select lo_tax, count(*) from lineorder group by 0",
    "select lo_tax from lineorder order by 3",
    "select supplier.c_name from customer, supplier, lineorder where lo_custkey = c_custkey and lo_suppkey = s_suppkey",
]


def _normalised(frame: pd.DataFrame, ordered: bool) -> pd.DataFrame:
    out = {}
    for name in frame.columns:
        col = frame[name]
        if pd.api.types.is_integer_dtype(col.dtype) or pd.api.types.is_bool_dtype(col.dtype):
            out[name] = col.astype("int64")
        elif pd.api.types.is_float_dtype(col.dtype):
            out[name] = col.astype("float64")
        else:
            out[name] = col.astype(object)
    frame = pd.DataFrame(out)
    if not ordered:
        frame = frame.sort_values(list(frame.columns))
    return frame.reset_index(drop=True)


def _check(sql: str, frames, duck, ordered: bool = True) -> pd.DataFrame:
    expected = duck.execute(sql).df()
    got = on_host(run(sql, frames))
    assert len(got.columns) == len(expected.columns)
    assert isinstance(got.index, pd.RangeIndex) and got.index.start == 0
    got.columns = expected.columns  # unaliased expressions are named by their text, DuckDB's otherwise
    pd.testing.assert_frame_equal(_normalised(got, ordered), _normalised(expected, ordered), check_exact=False,
                                  rtol=1e-9, check_dtype=False)
    return got


@pytest.mark.parametrize("query_id", sorted(QUERIES))
def test_the_thirteen_queries_sql_runs_on_frames(query_id, frames, duck):
    got = _check(render_sql(query_id), frames, duck)
    assert list(got.columns) == list(QUERIES[query_id].columns)
    assert got[QUERIES[query_id].columns[-1]].dtype == np.int64


@pytest.mark.parametrize("sql", AD_HOC, ids=[f"q{i}" for i in range(len(AD_HOC))])
def test_ad_hoc_queries_equal_duckdb(sql, frames, duck):
    got = _check(sql, frames, duck, ordered="order by" in sql.lower())
    assert len(got) > 0 or "2050" in sql


def test_an_empty_global_aggregate_gives_sqls_nulls(frames, duck):
    got = _check(AD_HOC[2], frames, duck)
    assert got["revenue"].tolist() == [0] and got["n"].tolist() == [0] and got["t"].isna().all()


def test_max_rows_cuts_after_one_more_row(frames):
    sql = "select lo_orderkey from lineorder order by lo_orderkey"
    assert len(run(sql, frames, max_rows=5)) == 6
    assert len(run(sql + " limit 3", frames, max_rows=5)) == 3


def test_only_needed_columns_and_matching_rows_are_joined(pandas_frames, monkeypatch):
    seen = []
    merge = pd.DataFrame.merge

    def spy(self, right, **kwargs):
        seen.append((len(right), list(right.columns)))
        return merge(self, right, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "merge", spy)
    run("select sum(lo_revenue) from lineorder join ddate on lo_orderdate = d_datekey where d_year = 1993",
        pandas_frames)
    rows_1993 = int((pandas_frames["ddate"]["d_year"] == 1993).sum())
    assert seen == [(rows_1993, ["d_datekey", "d_year"])]


@pytest.mark.parametrize("sql", REFUSED)
def test_what_it_cannot_run_is_refused(sql, frames):
    with pytest.raises(Unsupported):
        run(sql, frames)


def test_integer_arithmetic_is_exact_past_32_bits(frames, duck):
    assert str(frames["lineorder"]["lo_quantity"].dtype) == "int32"
    power = " * ".join(["lo_quantity"] * 6)  # 50**6 > 2**31: one row's product overflows 32 bits
    got = on_host(run(f"select max({power}) as m, sum({power}) as s from lineorder", frames))
    want = duck.execute(f"select max(cast(lo_quantity as bigint) * {power[14:]}) as m, "
                        f"sum(cast(lo_quantity as bigint) * {power[14:]}) as s from lineorder").fetchone()
    assert want[0] > 2**31 and (int(got["m"][0]), int(got["s"][0])) == want


def test_the_cudf_engine_answers_ad_hoc_sql_from_its_resident_tables(frames, duck, tmp_path):
    """CudfEngine.run_sql with pandas frames standing in for its resident cuDF tables: a query frame_sql runs is
    answered from them (no Parquet file exists here to read); one it does not run goes to cudf-polars, absent
    here, and fails rather than answering anything else."""
    from olap.cudf_engine import CudfEngine

    engine = CudfEngine()
    engine.tables, engine.dataset = frames, tmp_path
    sql = render_sql("3.1")
    result = engine.run_sql(sql, max_rows=None, timeout_s=30)
    expected = duck.execute(sql).fetchall()
    assert engine.resident_sql == 1 and [tuple(r) for r in result.rows] == [tuple(r) for r in expected]
    with pytest.raises(Exception) as refused:
        engine.run_sql("select sum(distinct lo_tax) from lineorder", max_rows=None, timeout_s=30)
    assert "polars" in str(refused.value) and engine.resident_sql == 1


def test_like_patterns_are_literal_but_for_percent_and_underscore():
    from olap.frame_sql import like_regex

    cases = {"MFGR#2_2%": ["MFGR#222", "MFGR#2a2x"], "%.%": ["a.b", "."], "a+b": ["a+b"], "(x)%": ["(x)", "(x)y"],
             "UNITED K%": ["UNITED KI1"], "x\\y": ["x\\y"], "[a]%": ["[a]b"]}
    misses = {"MFGR#2_2%": ["MFGR#22", "xMFGR#222"], "%.%": ["ab"], "a+b": ["aab"], "(x)%": ["x"],
              "UNITED K%": ["UNITED ST0"], "x\\y": ["xy"], "[a]%": ["ab"]}
    assert like_regex("MFGR#1 %") == "^MFGR#1 .*$"  # only metacharacters escaped (cuDF's regex engine reads it)
    for pattern, hits in cases.items():
        series = pd.Series(hits + misses[pattern])
        assert series.str.contains(like_regex(pattern), regex=True).tolist() == [True] * len(hits) + [False] * len(
            misses[pattern]), pattern
