"""One result shape for every OLAP engine: column names and rows of plain Python values."""

from __future__ import annotations

import decimal
from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa

from .errors import QueryFailed, UnrepresentableResult

__all__ = ["QueryFailed", "Result", "from_arrow", "from_arrow_batches", "from_records", "plain"]


@dataclass
class Result:
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = False  # more rows existed than the row limit allowed

    def as_tuples(self) -> list[tuple]:
        return [tuple(r) for r in self.rows]


def plain(value: Any) -> Any:
    """JSON-ready values: a sum over BIGINT is HUGEINT (DuckDB) or NUMERIC (PostgreSQL); answer integers."""
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value


def from_arrow(table: pa.Table, max_rows: int | None = None, engine: str = "the engine") -> Result:
    """Plain rows from an Arrow table; a value Python cannot hold (a date past 9999) is the query's fault."""
    try:
        return _from_arrow(table, max_rows)
    except (OverflowError, ValueError) as exc:
        raise UnrepresentableResult(engine, exc) from None


def _from_arrow(table: pa.Table, max_rows: int | None) -> Result:
    truncated = max_rows is not None and table.num_rows > max_rows
    if truncated:
        table = table.slice(0, max_rows)
    columns = table.column_names
    data = []
    for i in range(table.num_columns):
        values = table.column(i).to_pylist()
        data.append([plain(v) for v in values] if pa.types.is_decimal(table.schema.field(i).type) else values)
    return Result(columns, [list(r) for r in zip(*data)] if data else [], truncated)


def from_arrow_batches(reader: pa.RecordBatchReader, max_rows: int | None, engine: str = "the engine") -> Result:
    """Read batches only until the row limit is passed: a huge result is never fully materialised."""
    batches = []
    seen = 0
    for batch in reader:
        batches.append(batch)
        seen += batch.num_rows
        if max_rows is not None and seen > max_rows:
            break
    table = pa.Table.from_batches(batches, schema=reader.schema)
    return from_arrow(table, max_rows, engine)


def from_records(columns: list[str], records: Iterable[Iterable[Any]], max_rows: int | None = None) -> Result:
    rows = [[plain(v) for v in r] for r in records]
    truncated = max_rows is not None and len(rows) > max_rows
    return Result(columns, rows[:max_rows] if truncated else rows, truncated)
