"""The 13 Star Schema Benchmark queries (Q1.1..Q4.3) as data: SQL templates, typed parameters, validation.

One source of truth: `render_sql` gives the SQL that DuckDB and PostgreSQL run unchanged, and olap/plans.py runs the
same queries as dataframe plans. Semantics are the ORIGINAL SSB texts (O'Neil et al., Rev. 3), not the "flat"
rewrites. Sums are cast to BIGINT, Q3.x breaks ties by the remaining group keys and strings compare byte-wise, so
every engine answers the same rows in the same order; values are inlined only after validation against strict
domains. The conventions in full: docs/design/olap.md.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ClientError


class QueryParamError(ClientError):
    """A query parameter is unknown, of the wrong type or outside its domain. `.field` names the parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UnknownQueryError(LookupError):
    """No SSB query has this id."""


# ---------------------------------------------------------------------------------------------------------------------
# Domains (ssb-dbgen dists.dss and mk_part / gen_city)

REGIONS: tuple[str, ...] = ("AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST")
NATIONS_BY_REGION: dict[str, tuple[str, ...]] = {
    "AFRICA": ("ALGERIA", "ETHIOPIA", "KENYA", "MOROCCO", "MOZAMBIQUE"),
    "AMERICA": ("ARGENTINA", "BRAZIL", "CANADA", "PERU", "UNITED STATES"),
    "ASIA": ("CHINA", "INDIA", "INDONESIA", "JAPAN", "VIETNAM"),
    "EUROPE": ("FRANCE", "GERMANY", "ROMANIA", "RUSSIA", "UNITED KINGDOM"),
    "MIDDLE EAST": ("EGYPT", "IRAN", "IRAQ", "JORDAN", "SAUDI ARABIA"),
}
NATIONS: tuple[str, ...] = tuple(sorted(n for nations in NATIONS_BY_REGION.values() for n in nations))
MONTHS: tuple[str, ...] = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
FIRST_YEAR, LAST_YEAR = 1992, 1998


def city_prefix(nation: str) -> str:
    """gen_city: a city is the nation's first 9 characters, space-padded to 9, plus one digit ('UNITED KI1',
    'PERU     3')."""
    return nation[:9].ljust(9)


# ---------------------------------------------------------------------------------------------------------------------
# Parameter types


class _Int:
    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def check(self, value: Any) -> int:
        # 1997.0 is an integer to JSON Schema (and to the service's other integer fields): taken as 1997
        integral_float = isinstance(value, float) and value.is_integer()
        if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or integral_float):
            raise ValueError(f"expected an integer, got {value!r}" if isinstance(value, float)
                             else f"expected an integer, got {type(value).__name__}")
        value = int(value)
        if not self.low <= value <= self.high:
            raise ValueError(f"must be between {self.low} and {self.high}, got {value}")
        return value

    def schema(self) -> dict:
        return {"type": "integer", "minimum": self.low, "maximum": self.high}


class _YearMonthNum(_Int):
    """yyyymm, e.g. 199401."""

    def __init__(self) -> None:
        super().__init__(FIRST_YEAR * 100 + 1, LAST_YEAR * 100 + 12)

    def check(self, value: Any) -> int:
        value = super().check(value)
        if not 1 <= value % 100 <= 12:
            raise ValueError(f"must be yyyymm with a month 01..12, got {value}")
        return value

    def schema(self) -> dict:  # every valid yyyymm listed, so the schema refuses month 13 as check() does
        return {**super().schema(), "format": "yyyymm",
                "enum": [y * 100 + m for y in range(FIRST_YEAR, LAST_YEAR + 1) for m in range(1, 13)]}


class _Text:
    def __init__(self, pattern: str, description: str, choices: Sequence[str] | None = None):
        self.pattern = pattern
        self.regex = re.compile(pattern)
        self.description = description
        self.choices = tuple(choices) if choices is not None else None

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        if self.regex.fullmatch(value) is None or (self.choices is not None and value not in self.choices):
            raise ValueError(f"must be {self.description}, got {value!r}")
        return value

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "string", "pattern": self.pattern}
        if self.choices is not None:
            out["enum"] = list(self.choices)
        return out


class _List:
    def __init__(self, item: _Int | _Text, min_items: int, max_items: int):
        self.item, self.min_items, self.max_items = item, min_items, max_items

    def check(self, value: Any) -> list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list, got {type(value).__name__}")
        if not self.min_items <= len(value) <= self.max_items:
            raise ValueError(f"must have {self.min_items} to {self.max_items} items, got {len(value)}")
        checked = []
        for i, item in enumerate(value):
            try:
                checked.append(self.item.check(item))
            except ValueError as e:
                raise ValueError(f"item {i}: {e}") from None
        return checked

    def schema(self) -> dict:
        return {"type": "array", "items": self.item.schema(), "minItems": self.min_items, "maxItems": self.max_items}


_YEAR = _Int(FIRST_YEAR, LAST_YEAR)
_DISCOUNT = _Int(0, 10)         # lo_discount is U[0,10] percent
_QUANTITY = _Int(1, 50)         # lo_quantity is U[1,50]
_QUANTITY_BOUND = _Int(1, 51)   # exclusive upper bound: 51 keeps every row
_WEEK = _Int(1, 53)             # d_weeknuminyear = daynuminyear/7 + 1
_YEARMONTHNUM = _YearMonthNum()
_YEARMONTH = _Text(r"^(" + "|".join(MONTHS) + r")(199[2-8])$", "a month like 'Dec1997' (1992..1998)")
_MFGR = _Text(r"^MFGR#[1-5]$", "a manufacturer 'MFGR#1'..'MFGR#5'")
_CATEGORY = _Text(r"^MFGR#[1-5][1-5]$", "a category 'MFGR#11'..'MFGR#55'")
_BRAND = _Text(r"^MFGR#[1-5][1-5]([1-9]|[1-3][0-9]|40)$", "a brand 'MFGR#<category><1..40>' like 'MFGR#2221'")
_REGION = _Text(r"^[A-Z ]{4,11}$", "one of the 5 regions " + ", ".join(REGIONS), REGIONS)
_NATION = _Text(r"^[A-Z ]{4,14}$", "one of the 25 nations", NATIONS)
_CITY = _Text(r"^(" + "|".join(sorted({city_prefix(n) for n in NATIONS})) + r")[0-9]$",
              "a 10-character city: a nation's first 9 letters space-padded, then a digit, like 'UNITED KI1'")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Param:
    name: str
    type: _Int | _Text | _List
    default: Any                                # list defaults are tuples, so nobody can change them in place
    description: str

    def describe(self) -> dict:
        return {"name": self.name, "default": _plain(self.default), "description": self.description,
                **self.type.schema()}


@dataclass(frozen=True)
class Query:
    id: str
    title: str
    sql: str                                    # template: {name} is replaced by the parameter's SQL literal
    params: tuple[Param, ...]
    columns: tuple[str, ...]                    # result columns, in order
    order_by: tuple[tuple[str, bool], ...]      # (column, ascending), tie-breakers included
    ordered: tuple[tuple[str, str], ...] = ()   # (low, high) parameter pairs that must satisfy low <= high
    param_names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_names", frozenset(p.name for p in self.params))

    @property
    def defaults(self) -> dict[str, Any]:
        return {p.name: _plain(p.default) for p in self.params}


def _p(name: str, type_: _Int | _Text | _List, default: Any, description: str) -> Param:
    return Param(name, type_, default, description)


def _years(name: str, default: int, what: str) -> Param:
    return _p(name, _YEAR, default, what)


_Q1_SELECT = "SELECT CAST(COALESCE(SUM(lo_extendedprice * lo_discount), 0) AS BIGINT) AS revenue\n"

_Q2_SQL = """\
SELECT d_year, p_brand1, CAST(SUM(lo_revenue) AS BIGINT) AS revenue
FROM lineorder
JOIN part ON lo_partkey = p_partkey
JOIN supplier ON lo_suppkey = s_suppkey
JOIN ddate ON lo_orderdate = d_datekey
WHERE {where}
GROUP BY d_year, p_brand1
ORDER BY d_year ASC, p_brand1 ASC"""

_Q3_SQL = """\
SELECT c_{g}, s_{g}, d_year, CAST(SUM(lo_revenue) AS BIGINT) AS revenue
FROM lineorder
JOIN customer ON lo_custkey = c_custkey
JOIN supplier ON lo_suppkey = s_suppkey
JOIN ddate ON lo_orderdate = d_datekey
WHERE {where}
GROUP BY c_{g}, s_{g}, d_year
ORDER BY d_year ASC, revenue DESC, c_{g} ASC, s_{g} ASC"""

_Q4_FROM = """\
FROM lineorder
JOIN customer ON lo_custkey = c_custkey
JOIN supplier ON lo_suppkey = s_suppkey
JOIN part ON lo_partkey = p_partkey
JOIN ddate ON lo_orderdate = d_datekey
"""


def _q2(where: str) -> str:
    return _Q2_SQL.replace("{where}", where)


def _q3(group: str, where: str) -> str:
    return _Q3_SQL.replace("{g}", group).replace("{where}", where)


def _q4(keys: str, where: str) -> str:
    return (f"SELECT {keys}, CAST(SUM(lo_revenue - lo_supplycost) AS BIGINT) AS profit\n" + _Q4_FROM
            + f"WHERE {where}\nGROUP BY {keys}\nORDER BY " + ", ".join(f"{k} ASC" for k in keys.split(", ")))


_Q2_COLUMNS = ("d_year", "p_brand1", "revenue")
_Q2_ORDER = (("d_year", True), ("p_brand1", True))
_Q3_ORDER_NATION = (("d_year", True), ("revenue", False), ("c_nation", True), ("s_nation", True))
_Q3_ORDER_CITY = (("d_year", True), ("revenue", False), ("c_city", True), ("s_city", True))
_DISCOUNT_RANGE = (("discount_min", "discount_max"),)
_YEAR_RANGE = (("year_min", "year_max"),)


_QUERY_LIST: tuple[Query, ...] = (
    Query(
        "1.1", "Revenue from discounts in one year (discount range, quantity below a bound)",
        _Q1_SELECT + "FROM lineorder\nJOIN ddate ON lo_orderdate = d_datekey\n"
        "WHERE d_year = {year}\n  AND lo_discount BETWEEN {discount_min} AND {discount_max}\n"
        "  AND lo_quantity < {quantity_below}",
        (_years("year", 1993, "d_year"),
         _p("discount_min", _DISCOUNT, 1, "lowest lo_discount (percent), inclusive"),
         _p("discount_max", _DISCOUNT, 3, "highest lo_discount (percent), inclusive"),
         _p("quantity_below", _QUANTITY_BOUND, 25, "lo_quantity must be below this")),
        ("revenue",), (), _DISCOUNT_RANGE),
    Query(
        "1.2", "Revenue from discounts in one month (discount and quantity ranges)",
        _Q1_SELECT + "FROM lineorder\nJOIN ddate ON lo_orderdate = d_datekey\n"
        "WHERE d_yearmonthnum = {yearmonthnum}\n  AND lo_discount BETWEEN {discount_min} AND {discount_max}\n"
        "  AND lo_quantity BETWEEN {quantity_min} AND {quantity_max}",
        (_p("yearmonthnum", _YEARMONTHNUM, 199401, "d_yearmonthnum, yyyymm"),
         _p("discount_min", _DISCOUNT, 4, "lowest lo_discount (percent), inclusive"),
         _p("discount_max", _DISCOUNT, 6, "highest lo_discount (percent), inclusive"),
         _p("quantity_min", _QUANTITY, 26, "lowest lo_quantity, inclusive"),
         _p("quantity_max", _QUANTITY, 35, "highest lo_quantity, inclusive")),
        ("revenue",), (), _DISCOUNT_RANGE + (("quantity_min", "quantity_max"),)),
    Query(
        "1.3", "Revenue from discounts in one week of a year (discount and quantity ranges)",
        _Q1_SELECT + "FROM lineorder\nJOIN ddate ON lo_orderdate = d_datekey\n"
        "WHERE d_weeknuminyear = {week} AND d_year = {year}\n"
        "  AND lo_discount BETWEEN {discount_min} AND {discount_max}\n"
        "  AND lo_quantity BETWEEN {quantity_min} AND {quantity_max}",
        (_years("year", 1994, "d_year"),
         _p("week", _WEEK, 6, "d_weeknuminyear (dbgen's daynuminyear/7 + 1, not the ISO week)"),
         _p("discount_min", _DISCOUNT, 5, "lowest lo_discount (percent), inclusive"),
         _p("discount_max", _DISCOUNT, 7, "highest lo_discount (percent), inclusive"),
         _p("quantity_min", _QUANTITY, 26, "lowest lo_quantity, inclusive"),
         _p("quantity_max", _QUANTITY, 35, "highest lo_quantity, inclusive")),
        ("revenue",), (), _DISCOUNT_RANGE + (("quantity_min", "quantity_max"),)),
    Query(
        "2.1", "Revenue by year and brand for one part category and supplier region",
        _q2("p_category = {category} AND s_region = {region}"),
        (_p("category", _CATEGORY, "MFGR#12", "p_category"),
         _p("region", _REGION, "AMERICA", "s_region")),
        _Q2_COLUMNS, _Q2_ORDER),
    Query(
        "2.2", "Revenue by year and brand for a brand range and supplier region",
        _q2("p_brand1 BETWEEN {brand_min} AND {brand_max} AND s_region = {region}"),
        (_p("brand_min", _BRAND, "MFGR#2221", "lowest p_brand1, inclusive (string order: 'MFGR#2210' < 'MFGR#222')"),
         _p("brand_max", _BRAND, "MFGR#2228", "highest p_brand1, inclusive (string order)"),
         _p("region", _REGION, "ASIA", "s_region")),
        _Q2_COLUMNS, _Q2_ORDER, (("brand_min", "brand_max"),)),
    Query(
        "2.3", "Revenue by year for one brand and supplier region",
        _q2("p_brand1 = {brand} AND s_region = {region}"),
        (_p("brand", _BRAND, "MFGR#2221", "p_brand1"),
         _p("region", _REGION, "EUROPE", "s_region")),
        _Q2_COLUMNS, _Q2_ORDER),
    Query(
        "3.1", "Revenue by customer nation, supplier nation and year, for a customer and a supplier region",
        _q3("nation", "c_region = {customer_region} AND s_region = {supplier_region}\n"
                      "  AND d_year >= {year_min} AND d_year <= {year_max}"),
        (_p("customer_region", _REGION, "ASIA", "c_region"),
         _p("supplier_region", _REGION, "ASIA", "s_region"),
         _years("year_min", 1992, "first d_year, inclusive"),
         _years("year_max", 1997, "last d_year, inclusive")),
        ("c_nation", "s_nation", "d_year", "revenue"), _Q3_ORDER_NATION, _YEAR_RANGE),
    Query(
        "3.2", "Revenue by customer city, supplier city and year, for a customer and a supplier nation",
        _q3("city", "c_nation = {customer_nation} AND s_nation = {supplier_nation}\n"
                    "  AND d_year >= {year_min} AND d_year <= {year_max}"),
        (_p("customer_nation", _NATION, "UNITED STATES", "c_nation"),
         _p("supplier_nation", _NATION, "UNITED STATES", "s_nation"),
         _years("year_min", 1992, "first d_year, inclusive"),
         _years("year_max", 1997, "last d_year, inclusive")),
        ("c_city", "s_city", "d_year", "revenue"), _Q3_ORDER_CITY, _YEAR_RANGE),
    Query(
        "3.3", "Revenue by customer city, supplier city and year, for customers and suppliers in given cities",
        _q3("city", "c_city IN ({cities}) AND s_city IN ({cities})\n"
                    "  AND d_year >= {year_min} AND d_year <= {year_max}"),
        (_p("cities", _List(_CITY, 1, 10), ("UNITED KI1", "UNITED KI5"), "c_city and s_city, each in this list"),
         _years("year_min", 1992, "first d_year, inclusive"),
         _years("year_max", 1997, "last d_year, inclusive")),
        ("c_city", "s_city", "d_year", "revenue"), _Q3_ORDER_CITY, _YEAR_RANGE),
    Query(
        "3.4", "Revenue by customer city, supplier city and year, for given cities in one month",
        _q3("city", "c_city IN ({cities}) AND s_city IN ({cities})\n  AND d_yearmonth = {yearmonth}"),
        (_p("cities", _List(_CITY, 1, 10), ("UNITED KI1", "UNITED KI5"), "c_city and s_city, each in this list"),
         _p("yearmonth", _YEARMONTH, "Dec1997", "d_yearmonth, like 'Dec1997'")),
        ("c_city", "s_city", "d_year", "revenue"), _Q3_ORDER_CITY),
    Query(
        "4.1", "Profit by year and customer nation, for customer and supplier regions and manufacturers",
        _q4("d_year, c_nation", "c_region = {customer_region} AND s_region = {supplier_region}\n"
                                "  AND p_mfgr IN ({mfgrs})"),
        (_p("customer_region", _REGION, "AMERICA", "c_region"),
         _p("supplier_region", _REGION, "AMERICA", "s_region"),
         _p("mfgrs", _List(_MFGR, 1, 5), ("MFGR#1", "MFGR#2"), "p_mfgr, any of these")),
        ("d_year", "c_nation", "profit"), (("d_year", True), ("c_nation", True))),
    Query(
        "4.2", "Profit by year, supplier nation and category, for regions, years and manufacturers",
        _q4("d_year, s_nation, p_category",
            "c_region = {customer_region} AND s_region = {supplier_region}\n"
            "  AND d_year IN ({years}) AND p_mfgr IN ({mfgrs})"),
        (_p("customer_region", _REGION, "AMERICA", "c_region"),
         _p("supplier_region", _REGION, "AMERICA", "s_region"),
         _p("years", _List(_YEAR, 1, 7), (1997, 1998), "d_year, any of these"),
         _p("mfgrs", _List(_MFGR, 1, 5), ("MFGR#1", "MFGR#2"), "p_mfgr, any of these")),
        ("d_year", "s_nation", "p_category", "profit"),
        (("d_year", True), ("s_nation", True), ("p_category", True))),
    Query(
        "4.3", "Profit by year, supplier city and brand, for a customer region, supplier nation, years and category",
        _q4("d_year, s_city, p_brand1",
            "c_region = {customer_region} AND s_nation = {supplier_nation}\n"
            "  AND d_year IN ({years}) AND p_category = {category}"),
        (_p("customer_region", _REGION, "AMERICA", "c_region (the flat rewrites drop this predicate; SSB keeps it)"),
         _p("supplier_nation", _NATION, "UNITED STATES", "s_nation"),
         _p("years", _List(_YEAR, 1, 7), (1997, 1998), "d_year, any of these"),
         _p("category", _CATEGORY, "MFGR#14", "p_category")),
        ("d_year", "s_city", "p_brand1", "profit"),
        (("d_year", True), ("s_city", True), ("p_brand1", True))),
)

QUERIES: dict[str, Query] = {q.id: q for q in _QUERY_LIST}


# ---------------------------------------------------------------------------------------------------------------------
# Validation and rendering


def get_query(query_id: str) -> Query:
    try:
        return QUERIES[query_id]
    except (KeyError, TypeError):
        raise UnknownQueryError(f"unknown SSB query {query_id!r}; known: {', '.join(QUERIES)}") from None


def validate_params(query_id: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The query's parameters with defaults filled in, each checked against its type and domain.

    Raises QueryParamError (a ValueError) naming the offending parameter, UnknownQueryError for an unknown query id.
    """
    query = get_query(query_id)
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise QueryParamError("params", f"expected a mapping of parameter names to values, got {type(params).__name__}")
    for name in params:
        if name not in query.param_names:
            raise QueryParamError(str(name), f"unknown parameter for Q{query.id}; expected one of: "
                                             + ", ".join(p.name for p in query.params))
    values: dict[str, Any] = {}
    for p in query.params:
        try:
            values[p.name] = p.type.check(params.get(p.name, p.default))
        except QueryParamError:
            raise
        except ValueError as e:
            raise QueryParamError(p.name, str(e)) from None
    for low, high in query.ordered:
        if values[low] > values[high]:
            raise QueryParamError(high, f"must not be below {low} ({values[high]!r} < {values[low]!r})")
    return values


def sql_literal(value: Any) -> str:
    """A SQL literal: integers through int(), strings single-quoted with quotes doubled, lists comma-separated."""
    if isinstance(value, (list, tuple)):
        return ", ".join(sql_literal(v) for v in value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    raise TypeError(f"no SQL literal for {type(value).__name__}")


def render_sql(query_id: str, params: Mapping[str, Any] | None = None) -> str:
    """The query's SQL with validated parameter values inlined; runs unchanged on DuckDB and PostgreSQL."""
    query = get_query(query_id)
    values = validate_params(query_id, params)
    return query.sql.format(**{name: sql_literal(v) for name, v in values.items()})


def params_schema(query_id: str) -> dict[str, Any]:
    """JSON Schema of one query's `params` object: its own parameters only, each with its type and domain.
    What it cannot say: the (low, high) pairs that must be ordered (`Query.ordered`), checked by validate_params."""
    query = get_query(query_id)
    return {"type": "object", "additionalProperties": False, "properties": {
        p.name: {**p.type.schema(), "default": _plain(p.default), "description": p.description} for p in query.params}}


def describe() -> list[dict[str, Any]]:
    """Every query for the HTTP listing: id, title, SQL template and rendered SQL (defaults), columns, parameters."""
    return [
        {
            "id": q.id,
            "title": q.title,
            "sql_template": q.sql,
            "sql": render_sql(q.id),
            "columns": list(q.columns),
            "order_by": [{"column": c, "ascending": asc} for c, asc in q.order_by],
            "params": [p.describe() for p in q.params],
        }
        for q in _QUERY_LIST
    ]
