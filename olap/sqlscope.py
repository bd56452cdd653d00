"""Which columns each FROM item of an ad-hoc query has, so that `t.c` can be told from a function call.

PostgreSQL reads `t.c` as relation t's column c, and when t has no column c as the call c(t) (attribute notation:
`SELECT d.to_json FROM ddate d` runs to_json). The guard therefore lets `t.c` through only where every relation
the query names t surely has a column c, or where c is an SSB column name (no PostgreSQL function bears one, so the
worst is an error). What a relation surely has is worked out from the tree, never guessed: the SSB schema for its
tables; for a CTE or subquery the names of its select list as PostgreSQL names them (aliases, column references,
`*` expanded) as far as they are certain, with `AS t(a, b)` renames applied by position. Anything uncertain
counts as absent, which can only refuse more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

UNNAMED = "?column?"


@dataclass(frozen=True)
class Cols:
    """A relation's output names in order: `names` is a certain prefix, complete when nothing follows it."""

    names: tuple[str, ...] = ()
    complete: bool = False

    def renamed(self, aliases: list[str]) -> "Cols":
        """`AS t(a, b)`: the first len(aliases) columns take those names."""
        if not aliases:
            return self
        return Cols(tuple(aliases) + self.names[len(aliases):], self.complete)

    def __add__(self, other: "Cols") -> "Cols":
        if not self.complete:
            return self
        return Cols(self.names + other.names, other.complete)


class Scope:
    """The relations a query names (name -> columns every relation of that name has) and its qualified columns."""

    def __init__(self, tables: dict[str, pa.Schema]) -> None:
        self.tables = {name: Cols(tuple(schema.names), True) for name, schema in tables.items()}
        self.table_columns = {c for cols in self.tables.values() for c in cols.names}
        self.relations: dict[str, set[str]] = {}
        self.refs: list[tuple[str, str]] = []

    # -- what the walk reports --------------------------------------------------------------------------
    def enter_select(self, node: dict[str, Any], ctes: dict[str, Cols]) -> None:
        for name, cols in self._from(node.get("from_table"), ctes):
            names = set(cols.names) - {UNNAMED}
            self.relations[name] = self.relations[name] & names if name in self.relations else names

    def qualified(self, relation: str, column: str) -> None:
        self.refs.append((relation, column))

    def cte_columns(self, value: Any, ctes: dict[str, Cols]) -> Cols:
        if not isinstance(value, dict):
            return Cols()
        return self.outputs(value.get("query_node"), ctes).renamed([str(a) for a in value.get("aliases") or []])

    def unresolved(self) -> str | None:
        """Why a qualified column is refused, or None when each names a column its relation surely has."""
        for relation, column in self.refs:
            if relation not in self.relations:
                return f"{relation}.{column}: {relation!r} is not a table or alias in this query"
            if column not in self.table_columns and column not in self.relations[relation]:
                return (f"{relation}.{column}: {column!r} is not a column of {relation!r} (PostgreSQL would call a "
                        f"function {column}({relation}) instead); name a column the table or subquery has")
        return None

    # -- output names -----------------------------------------------------------------------------------
    def outputs(self, node: Any, ctes: dict[str, Cols]) -> Cols:
        """The output names of a query node as PostgreSQL gives them, as far as they are certain."""
        if not isinstance(node, dict):
            return Cols()
        cte_map = node.get("cte_map")
        if isinstance(cte_map, dict):
            for entry in cte_map.get("map", []):
                if isinstance(entry, dict) and "key" in entry:
                    ctes = {**ctes, str(entry["key"]): self.cte_columns(entry.get("value"), ctes)}
        if node.get("type") == "SET_OPERATION_NODE":  # the first branch names the columns
            children = node.get("children") or [node.get("left")]
            return self.outputs(children[0], ctes)
        if node.get("type") != "SELECT_NODE":
            return Cols()
        relations = self._from(node.get("from_table"), ctes)
        out = Cols((), True)
        for item in node.get("select_list", []):
            out = out + self._item(item, relations)
        return out

    def _item(self, item: dict[str, Any], relations: list[tuple[str, Cols]]) -> Cols:
        if item.get("alias"):
            return Cols((str(item["alias"]),), True)
        cls = item.get("class")
        if cls == "STAR":
            if item.get("exclude_list") or item.get("replace_list") or item.get("columns") or item.get("expr") \
                    or item.get("rename_list") or item.get("qualified_exclude_list"):
                return Cols()
            chosen = [cols for name, cols in relations if not item.get("relation_name")
                      or name == item["relation_name"]]
            out = Cols((), True)
            for cols in chosen:
                out = out + cols
            return out if chosen else Cols()
        if cls == "COLUMN_REF":
            return Cols((str(item["column_names"][-1]),), True)
        if cls == "CAST" and isinstance(item.get("child"), dict) and item["child"].get("class") == "COLUMN_REF":
            return Cols((str(item["child"]["column_names"][-1]),), True)
        # Unnamed or named by PostgreSQL after a function or type: a name nothing can rely on.
        return Cols((UNNAMED,), True)

    def _from(self, ref: Any, ctes: dict[str, Cols]) -> list[tuple[str, Cols]]:
        """The FROM item's relations as (the name it is referred to by, its columns)."""
        if not isinstance(ref, dict):
            return []
        kind = ref.get("type")
        aliases = [str(a) for a in ref.get("column_name_alias") or []]
        if kind == "JOIN":
            return self._from(ref.get("left"), ctes) + self._from(ref.get("right"), ctes)
        if kind == "BASE_TABLE":
            table = str(ref.get("table_name", ""))
            cols = ctes.get(table) or self.tables.get(table) or Cols()
            return [(str(ref.get("alias") or table), cols.renamed(aliases))]
        if kind == "SUBQUERY":
            subquery = ref.get("subquery")
            cols = self.outputs(subquery.get("node") if isinstance(subquery, dict) else None, ctes)
            return [(str(ref.get("alias") or ""), cols.renamed(aliases))]
        if kind == "EXPRESSION_LIST":
            return [(str(ref.get("alias") or ""), Cols().renamed(aliases))]
        return []
