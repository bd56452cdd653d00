"""The guard in front of ad-hoc SQL: an allowlist over the syntax tree of one read-only SELECT on the SSB tables.

DuckDB's parser (a PostgreSQL dialect), set to fold unquoted identifiers to lower case and keep quoted ones exact
as PostgreSQL does, gives the tree. Everything in it must be on a list: statement and table-reference kinds,
expression kinds, functions and operators, cast types. Tables are the SSB tables or the query's own earlier CTEs,
by exact name (`WITH "PG_ROLES" ... FROM pg_roles` reads the catalog in PostgreSQL, so it is refused). A
qualified column `t.c` must name a column `t` is known to have (or an SSB column, which no PostgreSQL function is
named after): PostgreSQL reads `t.f` on a table without a column f as the call f(t). Functions that make strings
larger than their input (repeat, lpad, replace, concat, ||, string_agg...) are not on the list: nested, they build
gigabytes from one character. The query's own parameters ($1, ?) are refused: no values are sent. So is
sampling (TABLESAMPLE, USING SAMPLE), which the engines read differently.

This is the first of two walls: the engines also run ad-hoc SQL with file and network access off (DuckDB) or as
an unprivileged role in a read-only transaction (PostgreSQL). The rules in full: docs/design/olap.md#the-sql-guard.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import duckdb
import orjson

from .errors import ClientError
from .schema import TABLES
from .sqlscope import Scope

MAX_SQL_CHARS = 20_000
CACHED_SQL_CHARS = 4_096  # longer texts are parsed each time (parse_tree)
MAX_STRING_TYPE_LENGTH = 1_000  # CHAR(n) pads every value to n characters (DuckDB's tree shows it as VARCHAR(n))

AGGREGATES = {
    "sum", "count", "count_star", "avg", "mean", "min", "max", "stddev", "stddev_samp", "stddev_pop", "variance",
    "var_samp", "var_pop", "median", "any_value", "first", "last", "bool_and", "bool_or", "arg_min", "arg_max",
    "approx_count_distinct", "quantile_cont", "quantile_disc", "mode", "corr", "covar_pop", "covar_samp",
}
WINDOWS = {"row_number", "rank", "dense_rank", "ntile", "lag", "lead", "percent_rank", "cume_dist", "first_value",
           "last_value", "nth_value"}
# No function here answers a string longer than a constant times its input (upper/lower keep the characters).
SCALARS = {
    "abs", "round", "floor", "ceil", "ceiling", "sqrt", "power", "pow", "ln", "log", "log10", "log2", "exp", "sign",
    "mod", "greatest", "least", "coalesce", "nullif", "ifnull", "lower", "upper", "length", "char_length",
    "substring", "substr", "trim", "ltrim", "rtrim", "left", "right", "position", "strpos", "starts_with",
    "ends_with", "contains", "reverse", "split_part", "regexp_matches", "regexp_full_match", "regexp_extract",
    "initcap", "md5", "hash", "date_part", "date_trunc", "year", "month", "day", "trunc", "div", "gcd", "lcm",
    "least_common_multiple", "isnan", "isinf", "to_days", "to_months", "to_years", "to_weeks",
}
ALLOWED_FUNCTIONS = AGGREGATES | WINDOWS | SCALARS
# Named in the refusal: each grows strings (or lists) without a bound a query could be held to.
GROWING = {"repeat", "lpad", "rpad", "replace", "regexp_replace", "concat", "concat_ws", "||", "string_agg",
           "group_concat", "listagg", "array_agg", "list", "json_agg", "jsonb_agg", "format", "translate", "overlay",
           "array_to_string", "list_aggr", "string_split", "unnest", "generate_series", "range"}
OPERATORS = {"+", "-", "*", "/", "%", "//", "^", "**", "~~", "!~~", "~~*", "!~~*", "~~~", "<", ">", "<=", ">=", "=",
             "==", "<>", "!=", "&", "|", "#", "<<", ">>", "~", "@"}
ALLOWED_TYPES = {
    "BOOLEAN", "BOOL", "TINYINT", "SMALLINT", "INTEGER", "INT", "INT4", "INT8", "INT2", "BIGINT", "HUGEINT",
    "REAL", "FLOAT", "FLOAT4", "FLOAT8", "DOUBLE", "DECIMAL", "NUMERIC", "VARCHAR", "TEXT", "STRING", "CHAR",
    "BPCHAR", "DATE", "UBIGINT", "UINTEGER", "INTERVAL", "TIMESTAMP",
}
STRING_TYPES = {"VARCHAR", "TEXT", "STRING", "CHAR", "BPCHAR"}
# Expression kinds of DuckDB's tree that may appear (FUNCTION, WINDOW and TYPE are checked further).
EXPRESSIONS = {"COLUMN_REF", "CONSTANT", "FUNCTION", "WINDOW", "CAST", "OPERATOR", "COMPARISON", "CONJUNCTION",
               "CASE", "BETWEEN", "SUBQUERY", "STAR", "TYPE"}
OPERATOR_KINDS = {"OPERATOR_NOT", "OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL", "COMPARE_IN", "COMPARE_NOT_IN",
                  "OPERATOR_COALESCE"}
QUERY_NODES = {"SELECT_NODE", "SET_OPERATION_NODE"}
TABLE_REFS = {"BASE_TABLE", "JOIN", "SUBQUERY", "EMPTY", "EXPRESSION_LIST"}
# Keywords PostgreSQL evaluates as functions of the session although they read like column names.
SESSION_NAMES = {"current_user", "session_user", "user", "current_role", "current_catalog", "current_schema",
                 "system_user"}
TABLE_NAMES = set(TABLES)
# A sample (on a FROM item or the whole SELECT) means different things per engine, so no rule could hold for all.
SAMPLING_REFUSED = ("sampling (TABLESAMPLE, USING SAMPLE) is not allowed: the engines read it differently "
                    "(TABLESAMPLE SYSTEM (10) is 10 rows in DuckDB, 10 percent in PostgreSQL; USING SAMPLE is "
                    "DuckDB's alone)")
_parser = threading.local()  # parse_tree's DuckDB connections, one per thread (a connection is not thread-safe)


class SqlRejected(ClientError):
    """Why an ad-hoc query is not allowed; `field` is always 'sql'."""


def check(sql: str) -> str:
    """Return the statement (stripped of a trailing semicolon) if it is allowed, else raise SqlRejected.

    Seconds of CPU for nobody else's benefit when run on the event loop (38 ms for a 20,000-character query):
    olap/manager.py runs it on a thread of its own. There DuckDB's parse (json_serialize_sql, 13 ms of the 38)
    lets go of the GIL; duckdb.extract_statements does not (9 ms in one piece), so it runs only for a text the
    parse refused, to say why (a second statement, or not a SELECT: json_serialize_sql takes one or more SELECTs
    and nothing else, and a text of one statement is that statement's text)."""
    if len(sql) > MAX_SQL_CHARS:
        raise SqlRejected(f"the query is longer than {MAX_SQL_CHARS} characters")
    text = sql.strip().rstrip(";")
    try:
        tree = parse_tree(text, fold=True)
    except SqlRejected:
        _refuse_statements(sql)
        raise
    scope = Scope(TABLES)
    _Walk(scope).node(tree["statements"][0]["node"], ctes={})
    if refused := scope.unresolved():
        raise SqlRejected(refused)
    return text


def _refuse_statements(sql: str) -> None:
    """Raise SqlRejected saying what is wrong with the statements of `sql` other than one SELECT, if anything."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise SqlRejected(f"not valid SQL: {_first_line(exc)}") from None
    if len(statements) != 1:
        raise SqlRejected(f"exactly one statement is allowed, this has {len(statements)}")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise SqlRejected(f"only SELECT is allowed, not {statements[0].type.name}")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:300]


def parse_tree(sql: str, fold: bool = False) -> dict[str, Any]:
    """DuckDB's syntax tree of the statement (json_serialize_sql parses; it runs nothing). `fold`: identifiers as
    PostgreSQL reads them (unquoted ones in lower case), for the guard; without, DuckDB's own (case kept), for
    frame_sql. Remembered by text up to CACHED_SQL_CHARS (a tree holds about 50 bytes per character of its text:
    distinct long queries would fill the cache with megabytes each); callers only read the tree."""
    return _cached_tree(sql, fold) if len(sql) <= CACHED_SQL_CHARS else _parse_tree(sql, fold)


def _parse_tree(sql: str, fold: bool) -> dict[str, Any]:
    """One parsing connection per thread and kind: opening one took 14 ms, the parse itself 0.6 ms."""
    key = "folding" if fold else "keeping"
    con = getattr(_parser, key, None)
    if con is None:
        con = duckdb.connect(":memory:", config={"enable_external_access": False})
        if fold:
            con.execute("SET preserve_identifier_case = false")
        setattr(_parser, key, con)
    try:
        row = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
        assert row is not None  # a SELECT of one value: one row
        tree = orjson.loads(row[0])  # half json's time, in one piece that holds the GIL (7 ms at 20,000 characters)
    except duckdb.Error as exc:
        raise SqlRejected(f"not valid SQL: {_first_line(exc)}") from None
    if tree.get("error"):
        raise SqlRejected(f"not valid SQL: {tree.get('error_message', 'unparseable')}")
    if len(tree.get("statements", [])) != 1:
        raise SqlRejected("exactly one statement is allowed")
    return tree


_cached_tree = functools.lru_cache(maxsize=256)(_parse_tree)


class _Walk:
    """One pass over the tree: each node checked against the lists, CTE names scoped as PostgreSQL scopes them,
    and the FROM items and qualified columns handed to the Scope."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    def node(self, node: Any, ctes: dict[str, Any]) -> None:
        if isinstance(node, list):
            for item in node:
                self.node(item, ctes)
            return
        if not isinstance(node, dict):
            return
        kind = _name(node, "type")
        if node.get("sample"):
            raise SqlRejected(SAMPLING_REFUSED)
        if kind == "RECURSIVE_CTE_NODE":
            raise SqlRejected("recursive queries (WITH RECURSIVE) are not allowed")
        if kind == "TABLE_FUNCTION":
            raise SqlRejected("table functions (read_csv, read_parquet, glob, ...) are not allowed")
        if kind is not None and kind.endswith("_NODE") and kind not in QUERY_NODES:
            raise SqlRejected(f"{kind.removesuffix('_NODE').lower().replace('_', ' ')} queries are not allowed")
        # CTE names are tables the query defines itself. A CTE's body sees only the CTEs before it: inside
        # `pg_roles AS (SELECT * FROM pg_roles)` the table read is the catalog's, so a CTE must not vouch for it.
        cte_map = node.get("cte_map")
        if isinstance(cte_map, dict):
            for entry in cte_map.get("map", []):
                if isinstance(entry, dict) and "key" in entry:
                    self.node(entry.get("value"), ctes)
                    ctes = {**ctes, str(entry["key"]): self.scope.cte_columns(entry.get("value"), ctes)}
        if kind == "SELECT_NODE":
            self._table_ref(node.get("from_table"), ctes)
            self.scope.enter_select(node, ctes)
        if "class" in node:
            self._expression(node)
        for key, value in node.items():
            if key not in ("qualified_name", "cte_map"):  # the CTE bodies were walked above, each in its own scope
                self.node(value, ctes)

    def _table_ref(self, node: Any, ctes: dict[str, Any]) -> None:
        """A FROM item (the walk goes on into subqueries and join conditions by itself)."""
        if not isinstance(node, dict):
            return
        kind = _name(node, "type")
        if kind == "TABLE_FUNCTION":
            raise SqlRejected("table functions (read_csv, read_parquet, glob, ...) are not allowed")
        if kind not in TABLE_REFS:
            raise SqlRejected(f"{str(kind).lower().replace('_', ' ')} in FROM is not allowed")
        if kind == "JOIN":
            self._table_ref(node.get("left"), ctes)
            self._table_ref(node.get("right"), ctes)
        if kind != "BASE_TABLE":
            return
        name = str(node.get("table_name", ""))
        if node.get("schema_name") or node.get("catalog_name"):
            raise SqlRejected("qualified table names are not allowed "
                              f"({node.get('schema_name') or node.get('catalog_name')}.{name}); "
                              f"the SSB tables are {', '.join(sorted(TABLE_NAMES))}")
        if name not in TABLE_NAMES and name not in ctes:
            raise SqlRejected(f"unknown table {name!r} (quoted names are exact, unquoted ones fold to lower case); "
                              f"the SSB tables are {', '.join(sorted(TABLE_NAMES))}")

    def _expression(self, node: dict[str, Any]) -> None:
        cls = _name(node, "class")
        if cls == "PARAMETER":
            raise SqlRejected("parameters ($1, ?) are not allowed: write the values into the SQL")
        if cls not in EXPRESSIONS:
            raise SqlRejected(f"{str(cls).lower().replace('_', ' ')} expressions are not allowed")
        if cls == "OPERATOR" and _name(node, "type") not in OPERATOR_KINDS:
            raise SqlRejected(f"the {str(_name(node, 'type')).lower().replace('_', ' ')} operator is not allowed")
        if cls in ("FUNCTION", "WINDOW") and node.get("function_name") is not None:
            _check_function(node)
        elif cls == "TYPE":
            _check_type(node)
        elif cls == "COLUMN_REF":
            self._column(node)
        if node.get("export_state"):
            raise SqlRejected("EXPORT_STATE is not allowed")

    def _column(self, node: dict[str, Any]) -> None:
        parts = [str(p) for p in node.get("column_names", [])]
        if any(p in SESSION_NAMES for p in parts):
            raise SqlRejected(f"{'.'.join(parts)}: session information ({', '.join(sorted(SESSION_NAMES))}) is not "
                              "available to ad-hoc queries (quoted or not)")
        if len(parts) > 2:
            raise SqlRejected(f"{'.'.join(parts)}: a column is named as column or table.column, no more parts")
        if len(parts) == 2:
            self.scope.qualified(parts[0], parts[1])


def _name(node: dict[str, Any], key: str) -> str | None:
    """A node's kind under `key`, or None where that holds no string: "type" is also a value's type, as a dict
    ({"id": "BIGINT", ...} in a sample's size), which the walk goes into as a child but never reads as a kind
    (None is on no list, so a kind it cannot read is refused, not a crash)."""
    value = node.get(key)
    return value if isinstance(value, str) else None


def _check_function(node: dict[str, Any]) -> None:
    name = str(node["function_name"]).lower()
    if node.get("schema") or node.get("catalog"):
        raise SqlRejected(f"qualified function names and method calls are not allowed "
                          f"({node.get('schema') or node.get('catalog')}.{name})")
    if node.get("is_operator") and name in OPERATORS:
        return
    if name in ALLOWED_FUNCTIONS and not node.get("is_operator"):
        return
    if name in GROWING:
        raise SqlRejected(f"{name if node.get('is_operator') else name + '()'} is not allowed in ad-hoc queries: it "
                          "makes strings larger than its input, and nested it exhausts memory")
    what = f"the operator {name}" if node.get("is_operator") else f"function {name}()"
    raise SqlRejected(f"{what} is not allowed in ad-hoc queries")


def _check_type(node: dict[str, Any]) -> None:
    name = str(node.get("type_name", "")).upper()
    if node.get("schema") or node.get("catalog") or name not in ALLOWED_TYPES:
        raise SqlRejected(f"casts to {name or 'this type'} are not allowed")
    if name in STRING_TYPES:
        for child in node.get("children") or []:
            literal = child.get("literal") if isinstance(child, dict) else None
            text = str(literal.get("text", "")) if isinstance(literal, dict) else ""
            if not text.isdigit() or int(text) > MAX_STRING_TYPE_LENGTH:
                raise SqlRejected(f"casts to {name}({text or '...'}) are not allowed: string types take a length of "
                                  f"at most {MAX_STRING_TYPE_LENGTH}")
