"""The 13 SSB queries: dataframe plans (olap/plans.py, run here on pandas) equal DuckDB running olap/queries.py's SQL.

The data is a small SSB-shaped dataset made in the test: real domains (regions, nations, cities, MFGR patterns, the full
1992-1998 date table), olap/schema.py's columns and arrow types, and a hot spot of orders between a few cities and
brands so that every query, with its published parameters and with another set, selects rows.
"""

from __future__ import annotations

import calendar
import datetime as dt
import json

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from olap.plans import run_plan
from olap.queries import (
    NATIONS_BY_REGION,
    QUERIES,
    QueryParamError,
    UnknownQueryError,
    city_prefix,
    describe,
    render_sql,
    sql_literal,
    validate_params,
)
from olap.schema import TABLES

SEED = 20240611
N_CUSTOMERS, N_SUPPLIERS, N_PARTS, N_ORDERS = 2000, 200, 2000, 50_000   # ~200k lineorder rows (1..7 lines per order)
# Orders between customers and suppliers of these cities make up a hot spot (Q3.3/Q3.4 select ~1e-6 of uniform data).
HOT_CITIES = ["UNITED KI1", "UNITED KI5", "UNITED ST0", "UNITED ST9", "CHINA    3", "JAPAN    7"]
# Brands that the tests filter on get parts for sure (1,000 brands over 2,000 parts would leave some out).
ABSENT_BRAND = "MFGR#5540"   # no part has it
HOT_BRANDS = ["MFGR#2221", "MFGR#2222", "MFGR#2225", "MFGR#2228", "MFGR#2239", "MFGR#1340", "MFGR#511", "MFGR#5119"]

# One non-default parameter set per query (all select rows in the data below).
OTHER_PARAMS = {
    "1.1": {"year": 1995, "discount_min": 2, "discount_max": 5, "quantity_below": 30},
    "1.2": {"yearmonthnum": 199712, "discount_min": 0, "discount_max": 2, "quantity_min": 1, "quantity_max": 10},
    "1.3": {"year": 1996, "week": 20, "discount_min": 3, "discount_max": 4, "quantity_min": 10, "quantity_max": 40},
    "2.1": {"category": "MFGR#35", "region": "ASIA"},
    "2.2": {"brand_min": "MFGR#511", "brand_max": "MFGR#5119", "region": "EUROPE"},
    "2.3": {"brand": "MFGR#1340", "region": "AFRICA"},
    "3.1": {"customer_region": "EUROPE", "supplier_region": "AFRICA", "year_min": 1993, "year_max": 1996},
    "3.2": {"customer_nation": "CHINA", "supplier_nation": "JAPAN", "year_min": 1994, "year_max": 1998},
    "3.3": {"cities": ["CHINA    3", "JAPAN    7", "UNITED ST0"], "year_min": 1995, "year_max": 1998},
    "3.4": {"cities": ["UNITED ST0", "UNITED ST9"], "yearmonth": "Jul1996"},
    "4.1": {"customer_region": "EUROPE", "supplier_region": "ASIA", "mfgrs": ["MFGR#3", "MFGR#4", "MFGR#5"]},
    "4.2": {"customer_region": "ASIA", "supplier_region": "ASIA", "years": [1992, 1995, 1996], "mfgrs": ["MFGR#5"]},
    "4.3": {"customer_region": "EUROPE", "supplier_nation": "GERMANY", "years": [1993, 1994], "category": "MFGR#23"},
}
# Sets that select nothing: the plans must still give the SQL's shape (Q1.x: one row with 0).
EMPTY_PARAMS = [
    ("1.3", {"year": 1998, "week": 50}),           # lo_orderdate stops at 1998-08-02
    ("2.3", {"brand": ABSENT_BRAND}),
    ("3.4", {"yearmonth": "Dec1998"}),
]

NATIONS = [n for region in NATIONS_BY_REGION.values() for n in region]
REGION_OF = {n: r for r, nations in NATIONS_BY_REGION.items() for n in nations}


# ---------------------------------------------------------------------------------------------------------------------
# Data


def _to_arrow(name: str, columns: dict) -> pa.Table:
    schema = TABLES[name]
    assert list(columns) == schema.names, name
    return pa.Table.from_pandas(pd.DataFrame(columns), schema=schema, preserve_index=False)


def _places(rng, n: int, prefix: str, hot: int) -> dict:
    """nation / region / city columns; the first `hot` rows cycle through HOT_CITIES."""
    nation = rng.choice(NATIONS, n).astype(object)
    city = np.array([city_prefix(x) + str(d) for x, d in zip(nation, rng.integers(0, 10, n))], dtype=object)
    for i in range(hot):
        city[i] = HOT_CITIES[i % len(HOT_CITIES)]
        nation[i] = next(x for x in NATIONS if city_prefix(x) == city[i][:9])
    return {f"{prefix}_city": city, f"{prefix}_nation": nation,
            f"{prefix}_region": np.array([REGION_OF[x] for x in nation], dtype=object)}


def _phone(rng, nation) -> list[str]:
    cc = [NATIONS.index(x) + 10 for x in nation]
    digits = rng.integers(100, 1000, (len(cc), 3))
    return [f"{c}-{a}-{b}-{d}{d % 10}" for c, (a, b, d) in zip(cc, digits)]


def _customer(rng) -> pa.Table:
    n = N_CUSTOMERS
    places = _places(rng, n, "c", hot=60)
    return _to_arrow("customer", {
        "c_custkey": np.arange(1, n + 1), "c_name": [f"Customer#{k:09d}" for k in range(1, n + 1)],
        "c_address": [f"addr{k}" for k in rng.integers(0, 10**6, n)],
        "c_city": places["c_city"], "c_nation": places["c_nation"], "c_region": places["c_region"],
        "c_phone": _phone(rng, places["c_nation"]),
        "c_mktsegment": rng.choice(["AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY"], n),
    })


def _supplier(rng) -> pa.Table:
    n = N_SUPPLIERS
    places = _places(rng, n, "s", hot=24)
    return _to_arrow("supplier", {
        "s_suppkey": np.arange(1, n + 1), "s_name": [f"Supplier#{k:09d}" for k in range(1, n + 1)],
        "s_address": [f"addr{k}" for k in rng.integers(0, 10**6, n)],
        "s_city": places["s_city"], "s_nation": places["s_nation"], "s_region": places["s_region"],
        "s_phone": _phone(rng, places["s_nation"]),
    })


def _part(rng) -> pa.Table:
    n = N_PARTS
    mfgr, cat, brand = rng.integers(1, 6, n), rng.integers(1, 6, n), rng.integers(1, 41, n)
    brands = [f"MFGR#{m}{c}{b}" for m, c, b in zip(mfgr, cat, brand)]
    brands = [ABSENT_BRAND[:-1] + "1" if b == ABSENT_BRAND else b for b in brands]
    for i in range(3 * len(HOT_BRANDS)):
        brands[i] = HOT_BRANDS[i % len(HOT_BRANDS)]
    colors = ["almond", "azure", "blue", "coral", "ivory", "navy", "red", "tan"]
    return _to_arrow("part", {
        "p_partkey": np.arange(1, n + 1), "p_name": [" ".join(rng.choice(colors, 2)) for _ in range(n)],
        "p_mfgr": [b[:6] for b in brands], "p_category": [b[:7] for b in brands], "p_brand1": brands,
        "p_color": rng.choice(colors, n), "p_type": rng.choice(["STANDARD BRUSHED TIN", "PROMO PLATED STEEL"], n),
        "p_size": rng.integers(1, 51, n), "p_container": rng.choice(["SM CASE", "LG BOX", "WRAP PACK"], n),
    })


def _ddate() -> pa.Table:
    days = [dt.date(1992, 1, 1) + dt.timedelta(i)
            for i in range((dt.date(1998, 12, 31) - dt.date(1992, 1, 1)).days + 1)]
    season = {12: "Christmas", 1: "Winter", 2: "Winter", 3: "Spring", 4: "Spring", 5: "Summer", 6: "Summer",
              7: "Summer", 8: "Summer", 9: "Fall", 10: "Fall", 11: "Fall"}
    daynum = [d.timetuple().tm_yday for d in days]
    return _to_arrow("ddate", {
        "d_datekey": [d.year * 10000 + d.month * 100 + d.day for d in days],
        "d_date": [f"{calendar.month_name[d.month]} {d.day}, {d.year}" for d in days],
        "d_dayofweek": [calendar.day_name[d.weekday()] for d in days],
        "d_month": [calendar.month_name[d.month] for d in days],
        "d_year": [d.year for d in days],
        "d_yearmonthnum": [d.year * 100 + d.month for d in days],
        "d_yearmonth": [f"{calendar.month_abbr[d.month]}{d.year}" for d in days],
        "d_daynuminweek": [(d.weekday() + 1) % 7 + 1 for d in days],
        "d_daynuminmonth": [d.day for d in days],
        "d_daynuminyear": daynum,
        "d_monthnuminyear": [d.month for d in days],
        "d_weeknuminyear": [n // 7 + 1 for n in daynum],
        "d_sellingseason": [season[d.month] for d in days],
        "d_lastdayinweekfl": [int(d.weekday() == 5) for d in days],
        "d_lastdayinmonthfl": [int((d + dt.timedelta(1)).month != d.month) for d in days],
        "d_holidayfl": [int((d.month, d.day) in {(1, 1), (7, 4), (12, 25)}) for d in days],
        "d_weekdayfl": [int(d.weekday() < 5) for d in days],
    })


def _lineorder(rng, ddate: pa.Table) -> pa.Table:
    datekeys = np.asarray(ddate.column("d_datekey"))
    n_order_days = int(np.searchsorted(datekeys, 19980802)) + 1       # orders run to 1998-08-02, as in dbgen
    lines = rng.integers(1, 8, N_ORDERS)
    order = np.repeat(np.arange(N_ORDERS), lines)
    n = len(order)
    hot_order = rng.random(N_ORDERS) < 0.15                               # 15% of orders: hot customers and suppliers
    custkey = np.where(hot_order, rng.integers(1, 61, N_ORDERS), rng.integers(1, N_CUSTOMERS + 1, N_ORDERS))
    day = rng.integers(0, n_order_days, N_ORDERS)
    suppkey = np.where(hot_order[order], rng.integers(1, 25, n), rng.integers(1, N_SUPPLIERS + 1, n))
    partkey = rng.integers(1, N_PARTS + 1, n)
    quantity, discount, tax = rng.integers(1, 51, n), rng.integers(0, 11, n), rng.integers(0, 9, n)
    rprice = 90000 + (partkey // 10) % 20001 + 100 * (partkey % 1000)
    extended = rprice * quantity
    revenue = extended * (100 - discount) // 100
    line_total = revenue * (100 + tax) // 100
    ordtotal = np.bincount(order, weights=line_total).astype(np.int64)[order]
    return _to_arrow("lineorder", {
        "lo_orderkey": (order + 1).astype(np.int64) * 4,
        "lo_linenumber": np.arange(n) - np.repeat(np.cumsum(lines) - lines, lines) + 1,
        "lo_custkey": custkey[order], "lo_partkey": partkey, "lo_suppkey": suppkey,
        "lo_orderdate": datekeys[day][order],
        "lo_orderpriority": rng.choice(["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECI", "5-LOW"], N_ORDERS)[order],
        "lo_shippriority": np.full(n, "0"),
        "lo_quantity": quantity, "lo_extendedprice": extended, "lo_ordtotalprice": ordtotal, "lo_discount": discount,
        "lo_revenue": revenue, "lo_supplycost": 6 * rprice // 10, "lo_tax": tax,
        "lo_commitdate": datekeys[day[order] + rng.integers(30, 91, n)],
        "lo_shipmode": rng.choice(["AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK"], n),
    })


def make_tables() -> dict[str, pa.Table]:
    """The SSB-shaped data (tests/test_frame_sql.py uses it too)."""
    rng = np.random.default_rng(SEED)
    ddate = _ddate()
    return {"customer": _customer(rng), "supplier": _supplier(rng), "part": _part(rng), "ddate": ddate,
            "lineorder": _lineorder(rng, ddate)}


@pytest.fixture(scope="module")
def arrow_tables() -> dict[str, pa.Table]:
    return make_tables()


@pytest.fixture(scope="module")
def frames(arrow_tables) -> dict[str, pd.DataFrame]:
    return {name: table.to_pandas() for name, table in arrow_tables.items()}


def duckdb_over(frames: dict[str, pd.DataFrame]) -> duckdb.DuckDBPyConnection:
    """DuckDB with the frames as its tables: the oracle the dataframe code is held to."""
    con = duckdb.connect(":memory:")
    for name, frame in frames.items():
        con.register(name, frame)
    return con


@pytest.fixture(scope="module")
def duck(frames):
    con = duckdb_over(frames)
    yield con
    con.close()


# ---------------------------------------------------------------------------------------------------------------------
# Comparison


def _normalised(frame: pd.DataFrame) -> pd.DataFrame:
    out = {}
    for name in frame.columns:
        col = frame[name]
        if pd.api.types.is_integer_dtype(col.dtype):
            out[name] = col.astype("int64")
        else:
            assert pd.api.types.is_string_dtype(col.dtype) or col.dtype == object, (name, col.dtype)
            out[name] = col.astype(object)
    return pd.DataFrame(out, index=pd.RangeIndex(len(frame)))


def _check_same(query_id: str, params, frames, duck) -> pd.DataFrame:
    expected = duck.execute(render_sql(query_id, params)).df()
    got = run_plan(query_id, frames, params)
    assert list(got.columns) == list(QUERIES[query_id].columns) == list(expected.columns)
    assert isinstance(got.index, pd.RangeIndex) and got.index.start == 0
    aggregate = QUERIES[query_id].columns[-1]
    assert got[aggregate].dtype == np.int64
    pd.testing.assert_frame_equal(_normalised(got), _normalised(expected), check_exact=True)
    return got


# ---------------------------------------------------------------------------------------------------------------------
# Plans == SQL


def test_the_data_follows_the_schema_contract(arrow_tables):
    for name, table in arrow_tables.items():
        assert table.schema.equals(TABLES[name]), name
    assert arrow_tables["ddate"].num_rows == 2557
    assert 150_000 < arrow_tables["lineorder"].num_rows < 250_000


@pytest.mark.parametrize("query_id", list(QUERIES))
def test_plan_equals_sql_with_published_parameters(query_id, frames, duck):
    got = _check_same(query_id, None, frames, duck)
    assert len(got) > 0
    if query_id.startswith("1."):
        assert got["revenue"].iloc[0] > 0


@pytest.mark.parametrize("query_id", list(QUERIES))
def test_plan_equals_sql_with_other_parameters(query_id, frames, duck):
    got = _check_same(query_id, OTHER_PARAMS[query_id], frames, duck)
    assert len(got) > 0
    if query_id.startswith("1."):
        assert got["revenue"].iloc[0] > 0
    assert not got.equals(run_plan(query_id, frames))


@pytest.mark.parametrize(("query_id", "params"), EMPTY_PARAMS, ids=[q for q, _ in EMPTY_PARAMS])
def test_plan_equals_sql_when_nothing_qualifies(query_id, params, frames, duck):
    got = _check_same(query_id, params, frames, duck)
    if query_id.startswith("1."):
        assert got["revenue"].tolist() == [0]
    else:
        assert len(got) == 0


def test_q3_ties_on_revenue_are_broken_by_the_group_keys(duck, frames):
    """Give two Q3.1 groups of one year the same revenue: both engines order them by c_nation, s_nation."""
    sql = render_sql("3.1")
    base = duck.execute(sql).df()
    a, b = base.iloc[0], base.iloc[1]
    assert a["d_year"] == b["d_year"]
    # Make group b's revenue equal to a's by adding the difference to one of b's lineorder rows.
    lo = frames["lineorder"].copy()
    cust = frames["customer"].set_index("c_custkey")
    supp = frames["supplier"].set_index("s_suppkey")
    year = lo["lo_orderdate"] // 10000
    row = lo.index[(cust.loc[lo["lo_custkey"], "c_nation"].to_numpy() == b["c_nation"])
                   & (supp.loc[lo["lo_suppkey"], "s_nation"].to_numpy() == b["s_nation"])
                   & (year == b["d_year"])][0]
    lo.loc[row, "lo_revenue"] += int(a["revenue"] - b["revenue"])
    tables = {**frames, "lineorder": lo}
    con = duckdb.connect(":memory:")
    for name, frame in tables.items():
        con.register(name, frame)
    expected = con.execute(sql).df()
    got = run_plan("3.1", tables)
    tied = got[(got["d_year"] == a["d_year"]) & (got["revenue"] == a["revenue"])]
    assert len(tied) == 2
    assert tied[["c_nation", "s_nation"]].values.tolist() == sorted(tied[["c_nation", "s_nation"]].values.tolist())
    pd.testing.assert_frame_equal(_normalised(got), _normalised(expected), check_exact=True)
    con.close()


# ---------------------------------------------------------------------------------------------------------------------
# Query definitions and parameters


def test_thirteen_queries_with_the_published_semantics():
    assert list(QUERIES) == ["1.1", "1.2", "1.3", "2.1", "2.2", "2.3", "3.1", "3.2", "3.3", "3.4", "4.1", "4.2", "4.3"]
    assert validate_params("1.1") == {"year": 1993, "discount_min": 1, "discount_max": 3, "quantity_below": 25}
    assert "d_weeknuminyear = 6 AND d_year = 1994" in render_sql("1.3")
    assert "p_brand1 = 'MFGR#2221'" in render_sql("2.3")
    assert "c_region = 'AMERICA'" in render_sql("4.3")
    assert "ORDER BY d_year ASC, revenue DESC, c_nation ASC, s_nation ASC" in render_sql("3.1")
    for q in QUERIES.values():
        sql = render_sql(q.id)
        assert "\nJOIN " in sql and "," not in sql.split("FROM")[1].split("WHERE")[0]   # explicit joins only
        assert sql.index("JOIN ddate") > max(sql.find(f"JOIN {t} ") for t in ("part", "supplier", "customer"))
        if q.order_by:
            assert sql.endswith("ORDER BY " + ", ".join(f"{c} {'ASC' if asc else 'DESC'}" for c, asc in q.order_by))
            assert set(q.columns[:-1]) <= {c for c, _ in q.order_by}   # the full group key is in ORDER BY


def test_describe_lists_every_query_with_defaults():
    listing = json.loads(json.dumps(describe()))
    assert [q["id"] for q in listing] == list(QUERIES)
    q34 = listing[9]
    assert q34["sql"] == render_sql("3.4") and "{yearmonth}" in q34["sql_template"]
    params = {p["name"]: p for p in q34["params"]}
    assert params["cities"]["default"] == ["UNITED KI1", "UNITED KI5"] and params["cities"]["type"] == "array"
    assert params["yearmonth"]["default"] == "Dec1997" and params["yearmonth"]["type"] == "string"
    q11 = {p["name"]: p for p in listing[0]["params"]}
    assert q11["year"] == {**q11["year"], "type": "integer", "default": 1993, "minimum": 1992, "maximum": 1998}


@pytest.mark.parametrize(("query_id", "params", "field"), [
    ("1.1", {"yaer": 1994}, "yaer"),                                    # unknown name
    ("1.1", {"year": "1994"}, "year"),                                  # wrong type
    ("1.1", {"year": True}, "year"),                                    # bool is not an integer here
    ("1.1", {"year": 1999}, "year"),                                    # out of range
    ("1.1", {"discount_min": 5, "discount_max": 3}, "discount_max"),    # empty range
    ("1.2", {"yearmonthnum": 199413}, "yearmonthnum"),
    ("1.3", {"week": 54}, "week"),
    ("2.1", {"category": "MFGR#1"}, "category"),                        # a mfgr, not a category
    ("2.1", {"category": "MFGR#16"}, "category"),
    ("2.2", {"brand_min": "MFGR#2241"}, "brand_min"),                   # brands end at 40
    ("2.2", {"brand_min": "MFGR#2228", "brand_max": "MFGR#2221"}, "brand_max"),
    ("2.3", {"region": "america"}, "region"),
    ("2.3", {"region": "x' OR 1=1 --"}, "region"),                      # injection attempt
    ("3.1", {"year_min": 1996, "year_max": 1993}, "year_max"),
    ("3.2", {"customer_nation": "ATLANTIS"}, "customer_nation"),
    ("3.3", {"cities": "UNITED KI1"}, "cities"),                        # a string, not a list
    ("3.3", {"cities": []}, "cities"),
    ("3.3", {"cities": ["UNITED KI1", "UNITED KI"]}, "cities"),         # 9 characters
    ("3.3", {"cities": ["UNITED KI1", "NARNIA   1"]}, "cities"),
    ("3.3", {"cities": ["UNITED KI1'); DROP TABLE lineorder; --"]}, "cities"),
    ("3.4", {"yearmonth": "December1997"}, "yearmonth"),
    ("3.4", {"yearmonth": "Dec1999"}, "yearmonth"),
    ("4.1", {"mfgrs": ["MFGR#1", "MFGR#6"]}, "mfgrs"),
    ("4.2", {"years": [1997, "1998"]}, "years"),
    ("4.3", {"supplier_nation": "UNITED STATES\n"}, "supplier_nation"),
])
def test_bad_parameters_name_the_field(query_id, params, field):
    with pytest.raises(QueryParamError) as err:
        render_sql(query_id, params)
    assert err.value.field == field and field in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(QueryParamError):
        run_plan(query_id, {}, params)                                  # validated before any table is touched


def test_unknown_query_and_non_mapping_params():
    with pytest.raises(UnknownQueryError):
        render_sql("5.1")
    with pytest.raises(QueryParamError) as err:
        render_sql("1.1", [("year", 1993)])
    assert err.value.field == "params"


def test_values_never_reach_the_sql_unchecked():
    for value in ["x' OR 1=1 --", "ASIA'", "ASIA; DROP TABLE lineorder", "ASIA\u0000"]:
        with pytest.raises(QueryParamError):
            render_sql("2.1", {"region": value})
    assert sql_literal("O'Brien") == "'O''Brien'"
    assert sql_literal(["a", "b'c"]) == "'a', 'b''c'"
    assert sql_literal(np.int32(7)) == "7"
    assert "'MIDDLE EAST'" in render_sql("2.1", {"region": "MIDDLE EAST"})
    assert "IN (1992, 1998)" in render_sql("4.3", {"years": (1992, np.int64(1998))})
