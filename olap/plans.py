"""The 13 SSB queries as dataframe plans, for pandas and cuDF alike.

Each plan uses only methods that cuDF's DataFrame/Series share with pandas: boolean masks (`==`, `<`, `&`,
`Series.isin`, `Series.between`), `DataFrame.loc[mask, columns]`, `DataFrame.merge(right, how="inner", left_on=...,
right_on=...)`, column `__setitem__`, Series arithmetic and `astype("int64")`,
`DataFrame.groupby(keys, sort=False).agg({...})`, `reset_index`, `sort_values(by=[...], ascending=[...])`,
`Series.sum()`, and the frame's own constructor `type(frame)(dict)`. Neither pandas nor cuDF is imported here: the
frames passed in decide which library runs the plan.

Shape of every plan: filter each dimension table and keep only its join key and the columns the query needs, apply the
fact table's own predicates while projecting lineorder, inner-merge the fact rows with the (small) filtered dimensions,
aggregate, then sort exactly as the SQL does (olap/queries.py `Query.order_by`, tie-breakers included) and reset the
index. The result has the SQL's columns in the SQL's order, with the aggregate as int64; run_plan(q, tables, params)
equals DuckDB's result of render_sql(q, params) row for row (tests/test_ssb_queries.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from olap.queries import get_query, validate_params

Frame = Any     # a pandas.DataFrame or a cudf.DataFrame
Series = Any
Params = Mapping[str, Any]


# ---------------------------------------------------------------------------------------------------------------------
# Building blocks


def _select(frame: Frame, mask: Series, columns: list[str]) -> Frame:
    """Rows where mask holds, only these columns."""
    return frame.loc[mask, columns]


def _join(fact: Frame, fact_key: str, dim: Frame, dim_key: str) -> Frame:
    return fact.merge(dim, how="inner", left_on=fact_key, right_on=dim_key)


def _finish(query_id: str, result: Frame) -> Frame:
    """Sort as the SQL does (full key, so the order is deterministic), clean index, SQL column order."""
    query = get_query(query_id)
    if query.order_by:
        result = result.sort_values(by=[c for c, _ in query.order_by], ascending=[asc for _, asc in query.order_by])
    return result.reset_index(drop=True)[list(query.columns)]


def _group_sum(query_id: str, joined: Frame, keys: list[str], measure: str, values: Series) -> Frame:
    """SUM(values) AS measure ... GROUP BY keys, sorted like the SQL. `joined` is the plan's own merge result."""
    joined[measure] = values.astype("int64")
    result = joined[[*keys, measure]].groupby(keys, sort=False).agg({measure: "sum"}).reset_index()
    result[measure] = result[measure].astype("int64")
    return _finish(query_id, result)


def _total(query_id: str, joined: Frame, measure: str, values: Series) -> Frame:
    """A one-row frame with SUM(values) AS measure; 0 when no row qualifies (the SQL says COALESCE(SUM(...), 0))."""
    total = int(values.astype("int64").sum()) if len(joined) else 0
    result = type(joined)({measure: [total]})
    result[measure] = result[measure].astype("int64")
    return _finish(query_id, result)


def _dates(tables: Mapping[str, Frame], mask_of: Callable[[Frame], Series], columns: list[str]) -> Frame:
    ddate = tables["ddate"]
    return _select(ddate, mask_of(ddate), columns)


def _suppliers(tables: Mapping[str, Frame], column: str, values: list[str] | str, keep: list[str]) -> Frame:
    """Suppliers whose `column` equals values (a string) or is in values (a list); key plus `keep` columns."""
    supplier = tables["supplier"]
    return _select(supplier, _matches(supplier[column], values), ["s_suppkey", *keep])


def _customers(tables: Mapping[str, Frame], column: str, values: list[str] | str, keep: list[str]) -> Frame:
    customer = tables["customer"]
    return _select(customer, _matches(customer[column], values), ["c_custkey", *keep])


def _matches(series: Series, values: list | str | int) -> Series:
    return series.isin(values) if isinstance(values, list) else series == values


# ---------------------------------------------------------------------------------------------------------------------
# Flight 1: revenue from discounts (lineorder x ddate, no grouping)


def _q1(query_id: str, tables: Mapping[str, Frame], p: Params, date_mask: Callable[[Frame], Series],
        quantity_mask: Callable[[Series], Series]) -> Frame:
    lineorder = tables["lineorder"]
    fact_mask = lineorder["lo_discount"].between(p["discount_min"], p["discount_max"]) \
        & quantity_mask(lineorder["lo_quantity"])
    fact = _select(lineorder, fact_mask, ["lo_orderdate", "lo_extendedprice", "lo_discount"])
    j = _join(fact, "lo_orderdate", _dates(tables, date_mask, ["d_datekey"]), "d_datekey")
    return _total(query_id, j, "revenue", j["lo_extendedprice"].astype("int64") * j["lo_discount"].astype("int64"))


def q1_1(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q1("1.1", tables, p, lambda d: d["d_year"] == p["year"], lambda q: q < p["quantity_below"])


def q1_2(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q1("1.2", tables, p, lambda d: d["d_yearmonthnum"] == p["yearmonthnum"],
               lambda q: q.between(p["quantity_min"], p["quantity_max"]))


def q1_3(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q1("1.3", tables, p, lambda d: (d["d_weeknuminyear"] == p["week"]) & (d["d_year"] == p["year"]),
               lambda q: q.between(p["quantity_min"], p["quantity_max"]))


# ---------------------------------------------------------------------------------------------------------------------
# Flight 2: revenue by year and brand (lineorder x part x supplier x ddate)


def _q2(query_id: str, tables: Mapping[str, Frame], p: Params, part_mask: Callable[[Frame], Series]) -> Frame:
    part = tables["part"]
    parts = _select(part, part_mask(part), ["p_partkey", "p_brand1"])
    suppliers = _suppliers(tables, "s_region", p["region"], [])
    fact = tables["lineorder"][["lo_partkey", "lo_suppkey", "lo_orderdate", "lo_revenue"]]
    j = _join(fact, "lo_partkey", parts, "p_partkey")
    j = _join(j, "lo_suppkey", suppliers, "s_suppkey")
    j = _join(j, "lo_orderdate", tables["ddate"][["d_datekey", "d_year"]], "d_datekey")
    return _group_sum(query_id, j, ["d_year", "p_brand1"], "revenue", j["lo_revenue"])


def q2_1(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q2("2.1", tables, p, lambda part: part["p_category"] == p["category"])


def q2_2(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q2("2.2", tables, p, lambda part: part["p_brand1"].between(p["brand_min"], p["brand_max"]))


def q2_3(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q2("2.3", tables, p, lambda part: part["p_brand1"] == p["brand"])


# ---------------------------------------------------------------------------------------------------------------------
# Flight 3: revenue by customer and supplier nation/city and year (lineorder x customer x supplier x ddate)


def _q3(query_id: str, tables: Mapping[str, Frame], p: Params, level: str, customer_filter: tuple[str, Any],
        supplier_filter: tuple[str, Any], date_mask: Callable[[Frame], Series]) -> Frame:
    c_key, s_key = f"c_{level}", f"s_{level}"
    customers = _customers(tables, *customer_filter, [c_key])
    suppliers = _suppliers(tables, *supplier_filter, [s_key])
    dates = _dates(tables, date_mask, ["d_datekey", "d_year"])
    fact = tables["lineorder"][["lo_custkey", "lo_suppkey", "lo_orderdate", "lo_revenue"]]
    j = _join(fact, "lo_custkey", customers, "c_custkey")
    j = _join(j, "lo_suppkey", suppliers, "s_suppkey")
    j = _join(j, "lo_orderdate", dates, "d_datekey")
    return _group_sum(query_id, j, [c_key, s_key, "d_year"], "revenue", j["lo_revenue"])


def _year_range(p: Params) -> Callable[[Frame], Series]:
    return lambda d: (d["d_year"] >= p["year_min"]) & (d["d_year"] <= p["year_max"])


def q3_1(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q3("3.1", tables, p, "nation", ("c_region", p["customer_region"]), ("s_region", p["supplier_region"]),
               _year_range(p))


def q3_2(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q3("3.2", tables, p, "city", ("c_nation", p["customer_nation"]), ("s_nation", p["supplier_nation"]),
               _year_range(p))


def q3_3(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q3("3.3", tables, p, "city", ("c_city", p["cities"]), ("s_city", p["cities"]), _year_range(p))


def q3_4(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q3("3.4", tables, p, "city", ("c_city", p["cities"]), ("s_city", p["cities"]),
               lambda d: d["d_yearmonth"] == p["yearmonth"])


# ---------------------------------------------------------------------------------------------------------------------
# Flight 4: profit (lineorder x customer x supplier x part x ddate)


def _q4(query_id: str, tables: Mapping[str, Frame], p: Params, keys: list[str], supplier_filter: tuple[str, Any],
        part_mask: Callable[[Frame], Series], date_mask: Callable[[Frame], Series] | None) -> Frame:
    def kept(prefix: str) -> list[str]:
        return [k for k in keys if k.startswith(prefix)]

    part = tables["part"]
    customers = _customers(tables, "c_region", p["customer_region"], kept("c_"))
    suppliers = _suppliers(tables, *supplier_filter, kept("s_"))
    parts = _select(part, part_mask(part), ["p_partkey", *kept("p_")])
    if date_mask is None:
        dates = tables["ddate"][["d_datekey", "d_year"]]
    else:
        dates = _dates(tables, date_mask, ["d_datekey", "d_year"])
    fact = tables["lineorder"][["lo_custkey", "lo_suppkey", "lo_partkey", "lo_orderdate", "lo_revenue",
                                "lo_supplycost"]]
    j = _join(fact, "lo_custkey", customers, "c_custkey")
    j = _join(j, "lo_suppkey", suppliers, "s_suppkey")
    j = _join(j, "lo_partkey", parts, "p_partkey")
    j = _join(j, "lo_orderdate", dates, "d_datekey")
    profit = j["lo_revenue"].astype("int64") - j["lo_supplycost"].astype("int64")
    return _group_sum(query_id, j, keys, "profit", profit)


def _years_in(p: Params) -> Callable[[Frame], Series]:
    return lambda d: d["d_year"].isin(p["years"])


def q4_1(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q4("4.1", tables, p, ["d_year", "c_nation"], ("s_region", p["supplier_region"]),
               lambda part: part["p_mfgr"].isin(p["mfgrs"]), None)


def q4_2(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q4("4.2", tables, p, ["d_year", "s_nation", "p_category"], ("s_region", p["supplier_region"]),
               lambda part: part["p_mfgr"].isin(p["mfgrs"]), _years_in(p))


def q4_3(tables: Mapping[str, Frame], p: Params) -> Frame:
    return _q4("4.3", tables, p, ["d_year", "s_city", "p_brand1"], ("s_nation", p["supplier_nation"]),
               lambda part: part["p_category"] == p["category"], _years_in(p))


PLANS: dict[str, Callable[[Mapping[str, Frame], Params], Frame]] = {
    "1.1": q1_1, "1.2": q1_2, "1.3": q1_3,
    "2.1": q2_1, "2.2": q2_2, "2.3": q2_3,
    "3.1": q3_1, "3.2": q3_2, "3.3": q3_3, "3.4": q3_4,
    "4.1": q4_1, "4.2": q4_2, "4.3": q4_3,
}


def run_plan(query_id: str, tables: Mapping[str, Frame], params: Mapping[str, Any] | None = None) -> Frame:
    """Run SSB query `query_id` on frames named like olap/schema.py (lineorder, part, supplier, customer, ddate).

    params are validated by olap.queries (QueryParamError names a bad parameter); the result has the SQL's columns,
    column order and row order, with a fresh index.
    """
    values = validate_params(query_id, params)
    return PLANS[query_id](tables, values)
