"""One result shape for every OLAP engine: column names and rows of plain Python values.

An answer holds at most `max_rows` rows (the request's) and ANSWER_MAX_BYTES of values: a few hundred wide text
columns of 100,000 rows once took 7.5 GB of the service's memory as Python objects and JSON, outside the engines'
own memory limits. Past either, the answer is cut at a row and says `truncated`.
"""

from __future__ import annotations

import decimal
from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa

from .errors import QueryFailed, UnrepresentableResult

__all__ = ["ANSWER_MAX_BYTES", "QueryFailed", "Result", "from_arrow", "from_arrow_batches", "from_records", "plain",
           "record_bytes"]

ANSWER_MAX_BYTES = 32 << 20  # of values: Arrow buffers, or text and 8 bytes a value from PostgreSQL


@dataclass
class Result:
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = False  # more rows existed than the answer holds (max_rows, ANSWER_MAX_BYTES)

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
    if table.num_rows and table.nbytes > ANSWER_MAX_BYTES:  # rows of the average width that fit
        table, truncated = table.slice(0, max(1, table.num_rows * ANSWER_MAX_BYTES // table.nbytes)), True
    columns = table.column_names
    data = []
    for i in range(table.num_columns):
        values = table.column(i).to_pylist()
        data.append([plain(v) for v in values] if pa.types.is_decimal(table.schema.field(i).type) else values)
    return Result(columns, [list(r) for r in zip(*data)] if data else [], truncated)


def from_arrow_batches(reader: pa.RecordBatchReader, max_rows: int | None, engine: str = "the engine") -> Result:
    """Read batches only until the row or byte limit is passed: a huge result is never fully materialised."""
    batches = []
    seen = size = 0
    for batch in reader:
        batches.append(batch)
        seen += batch.num_rows
        size += batch.nbytes
        if (max_rows is not None and seen > max_rows) or size > ANSWER_MAX_BYTES:
            break
    table = pa.Table.from_batches(batches, schema=reader.schema)
    return from_arrow(table, max_rows, engine)


def record_bytes(record: Iterable[Any]) -> int:
    """A row's share of ANSWER_MAX_BYTES: its text and bytes as long as they are, any other value 8."""
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in record)


def from_records(columns: list[str], records: Iterable[Iterable[Any]], max_rows: int | None = None,
                 sizes: Iterable[int] | None = None) -> Result:
    """`sizes`: each record's record_bytes, when the caller measured them already."""
    rows: list[list[Any]] = []
    size, truncated = 0, False
    measured = iter(sizes) if sizes is not None else None
    for record in records:
        size += next(measured) if measured is not None else record_bytes(record)
        if (max_rows is not None and len(rows) == max_rows) or (size > ANSWER_MAX_BYTES and rows):
            truncated = True
            break
        rows.append([plain(v) for v in record])
    return Result(columns, rows, truncated)
