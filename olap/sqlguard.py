"""The guard in front of ad-hoc SQL: one read-only SELECT over the SSB tables, nothing else.

DuckDB's parser (a PostgreSQL dialect) gives the syntax tree, which must hold exactly one SELECT reading only
unqualified SSB tables or the query's own earlier CTEs (no WITH RECURSIVE), no table functions, functions from an
allowlist only, and casts to plain built-in types only. This is the first of two walls: the engines also run ad-hoc
SQL with file and network access off (DuckDB) or as an unprivileged role in a read-only transaction (PostgreSQL).
The rules in full: docs/design/olap.md#the-sql-guard.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

import duckdb

from .schema import TABLES

MAX_SQL_CHARS = 20_000

AGGREGATES = {
    "sum", "count", "count_star", "avg", "mean", "min", "max", "stddev", "stddev_samp", "stddev_pop", "variance",
    "var_samp", "var_pop", "median", "any_value", "first", "last", "bool_and", "bool_or", "arg_min", "arg_max",
    "approx_count_distinct", "quantile_cont", "quantile_disc", "mode", "string_agg", "group_concat", "corr",
    "covar_pop", "covar_samp",
}
WINDOWS = {"row_number", "rank", "dense_rank", "ntile", "lag", "lead", "percent_rank", "cume_dist", "first_value",
           "last_value", "nth_value"}
SCALARS = {
    "abs", "round", "floor", "ceil", "ceiling", "sqrt", "power", "pow", "ln", "log", "log10", "log2", "exp", "sign",
    "mod", "greatest", "least", "coalesce", "nullif", "ifnull", "lower", "upper", "length", "char_length",
    "substring", "substr", "trim", "ltrim", "rtrim", "concat", "concat_ws", "replace", "left", "right",
    "position", "strpos", "starts_with", "ends_with", "contains", "reverse",  # no repeat/lpad/rpad: gigabytes
    "date_part", "year", "month", "day", "trunc", "div", "split_part", "regexp_matches", "regexp_replace",
    "regexp_extract", "initcap", "md5", "hash", "least_common_multiple", "gcd", "lcm", "isnan", "isinf",
}
ALLOWED_FUNCTIONS = AGGREGATES | WINDOWS | SCALARS
OPERATOR = re.compile(r"^[-+*/%<>=!~|&^#@]+$")  # arithmetic, comparison, concatenation, LIKE (~~) ...
ALLOWED_TYPES = {
    "BOOLEAN", "BOOL", "TINYINT", "SMALLINT", "INTEGER", "INT", "INT4", "INT8", "INT2", "BIGINT", "HUGEINT",
    "REAL", "FLOAT", "FLOAT4", "FLOAT8", "DOUBLE", "DECIMAL", "NUMERIC", "VARCHAR", "TEXT", "STRING", "CHAR",
    "BPCHAR", "DATE", "UBIGINT", "UINTEGER",
}
TABLE_NAMES = set(TABLES)
_parser = threading.local()  # parse_tree's DuckDB connection, one per thread (a connection is not thread-safe)


class SqlRejected(ValueError):
    """Why an ad-hoc query is not allowed; `field` is always 'sql'."""

    field = "sql"


def check(sql: str) -> str:
    """Return the statement (stripped of a trailing semicolon) if it is allowed, else raise SqlRejected."""
    if len(sql) > MAX_SQL_CHARS:
        raise SqlRejected(f"the query is longer than {MAX_SQL_CHARS} characters")
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise SqlRejected(f"not valid SQL: {_first_line(exc)}") from None
    if len(statements) != 1:
        raise SqlRejected(f"exactly one statement is allowed, this has {len(statements)}")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise SqlRejected(f"only SELECT is allowed, not {statements[0].type.name}")
    text = statements[0].query.strip().rstrip(";")
    tree = parse_tree(text)
    _walk(tree["statements"][0]["node"], ctes=set())
    return text


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:300]


@functools.lru_cache(maxsize=256)
def parse_tree(sql: str) -> dict[str, Any]:
    """DuckDB's syntax tree of the statement (json_serialize_sql parses; it runs nothing). One parsing connection
    per thread: opening one took 14 ms, the parse itself 0.6 ms. Remembered by text, so the GPU engine's
    frame_sql does not parse again what check() just parsed; callers only read the tree."""
    con = getattr(_parser, "con", None)
    if con is None:
        con = _parser.con = duckdb.connect(":memory:", config={"enable_external_access": False})
    try:
        row = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
        assert row is not None  # a SELECT of one value: one row
        tree = json.loads(row[0])
    except duckdb.Error as exc:
        raise SqlRejected(f"not valid SQL: {_first_line(exc)}") from None
    if tree.get("error"):
        raise SqlRejected(f"not valid SQL: {tree.get('error_message', 'unparseable')}")
    if len(tree.get("statements", [])) != 1:
        raise SqlRejected("exactly one statement is allowed")
    return tree


def _walk(node: Any, ctes: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item, ctes)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "RECURSIVE_CTE_NODE":
        raise SqlRejected("recursive queries (WITH RECURSIVE) are not allowed")
    # CTE names are tables the query defines itself. A CTE's body sees only the CTEs before it: inside
    # `pg_roles AS (SELECT * FROM pg_roles)` the table read is the catalog's, so a CTE must not vouch for it.
    cte_map = node.get("cte_map")
    if isinstance(cte_map, dict):
        for entry in cte_map.get("map", []):
            if isinstance(entry, dict) and "key" in entry:
                _walk(entry.get("value"), ctes)
                ctes = ctes | {str(entry["key"]).lower()}
    kind = node.get("type")
    if kind == "BASE_TABLE":
        _check_table(node, ctes)
    elif kind == "TABLE_FUNCTION":
        raise SqlRejected("table functions (read_csv, read_parquet, glob, ...) are not allowed")
    if node.get("class") in ("FUNCTION", "WINDOW") and node.get("function_name") is not None:
        _check_function(node)
    if node.get("class") == "TYPE":
        _check_type(node)
    for key, value in node.items():
        if key not in ("qualified_name", "cte_map"):  # the CTE bodies were walked above, each in its own scope
            _walk(value, ctes)


def _check_table(node: dict[str, Any], ctes: set[str]) -> None:
    name = str(node.get("table_name", "")).lower()
    if node.get("schema_name") or node.get("catalog_name"):
        raise SqlRejected("qualified table names are not allowed "
                          f"({node.get('schema_name') or node.get('catalog_name')}.{name}); "
                          f"the SSB tables are {', '.join(sorted(TABLE_NAMES))}")
    if name not in TABLE_NAMES and name not in ctes:
        raise SqlRejected(f"unknown table {name!r}; the SSB tables are {', '.join(sorted(TABLE_NAMES))}")


def _check_function(node: dict[str, Any]) -> None:
    name = str(node["function_name"]).lower()
    if node.get("schema") or node.get("catalog"):
        raise SqlRejected(f"qualified function names are not allowed ({name})")
    if name in ALLOWED_FUNCTIONS or (node.get("is_operator") and OPERATOR.match(name)):
        return
    raise SqlRejected(f"function {name}() is not allowed in ad-hoc queries")


def _check_type(node: dict[str, Any]) -> None:
    name = str(node.get("type_name", "")).upper()
    if node.get("schema") or node.get("catalog") or name not in ALLOWED_TYPES:
        raise SqlRejected(f"casts to {name or 'this type'} are not allowed")
