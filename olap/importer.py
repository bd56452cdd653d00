"""Import the five ssb-dbgen .tbl files into the Parquet layout of olap/schema.py.

The files are '|'-separated with no header and (as dbgen prints them) a '|' after the last field. Date fields
(lo_orderdate, lo_commitdate, d_datekey) may be yyyymmdd, YYYY-MM-DD or "YYYY-MM-DD" (vadimtk's fork quotes
them); they become int32 yyyymmdd. Everything else is cast to the schema's types, so a non-numeric key fails.

The output is written to a temporary directory beside out_dir and renamed into place at the end: on any error
out_dir is left as it was (absent, or the previous data set). Every problem with the input raises
SsbImportError, whose message names the file, the line when it is known, and the reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from olap.generate import atomic_dir, row_reporter, write_meta
from olap.schema import TABLES, TBL_FILES

Progress = Callable[[int, int | None, str], None]

SOURCE = "ssb-dbgen .tbl import"
DATE_COLUMNS = {"lineorder": ("lo_orderdate", "lo_commitdate"), "ddate": ("d_datekey",)}
ROWS_PER_GROUP = 1 << 20           # Parquet row group size for the output
BLOCK_BYTES = 16 << 20             # CSV read block: ~150k lineorder rows per batch
_TRAILING = "__trailing"           # the empty field after dbgen's final '|'
_DATE_SHAPE = r"^\d{8}$|^\d{4}-\d{2}-\d{2}$"
_INTEGER = re.compile(r"^[+-]?\d+$")


class SsbImportError(ValueError):
    """A .tbl file is missing or malformed, or its row count is not the expected one."""

    def __init__(self, file: str, reason: str, line: int | None = None):
        self.file, self.reason, self.line = file, reason, line
        where = f"{file} line {line}" if line is not None else file
        super().__init__(f"{where}: {reason}")


def import_tbl(src_dir: Path, out_dir: Path, expected_rows: dict[str, int] | None = None,
               progress: Progress | None = None, *, scale_factor: float | None = None) -> dict:
    """Convert <src_dir>/*.tbl into <out_dir>/<table>.parquet + meta.json; return the meta dict.

    expected_rows ({table: rows}, any subset of the tables) is checked exactly. progress(done_rows, total, message)
    is called per written batch; total is the sum of expected_rows when it covers all tables, else None.
    """
    src_dir = Path(src_dir)
    for _table, file in TBL_FILES.items():       # fail before any work if a file is missing
        if not (src_dir / file).is_file():
            raise SsbImportError(file, f"file not found in {src_dir}")
    expected = dict(expected_rows or {})
    unknown = set(expected) - set(TABLES)
    if unknown:
        raise ValueError(f"expected_rows names unknown tables: {sorted(unknown)}")
    report = row_reporter(progress, sum(expected.values()) if set(expected) == set(TABLES) else None)

    rows: dict[str, int] = {}
    with atomic_dir(out_dir) as tmp:
        # Small tables first: a bad dimension file fails before the long lineorder pass.
        for table in ("ddate", "supplier", "customer", "part", "lineorder"):
            path = src_dir / TBL_FILES[table]
            rows[table] = _write_parquet(_read_tbl(path, table), tmp / f"{table}.parquet", table, report)
            _check_count(path.name, table, rows[table], expected.get(table))
        meta = {"scale_factor": scale_factor, "source": SOURCE, "rows": {name: rows[name] for name in TABLES}}
        write_meta(tmp, meta)
    return meta


def _check_count(file: str, table: str, rows: int, expected: int | None) -> None:
    if rows == 0:
        raise SsbImportError(file, f"no rows: {table} must not be empty")
    if expected is not None and rows != expected:
        raise SsbImportError(file, f"{rows:,} rows, expected {expected:,}")


def _write_parquet(batches: Iterator[pa.RecordBatch], path: Path, table: str,
                   report: Callable[[int, str], None]) -> int:
    """Write batches in row groups of ~ROWS_PER_GROUP (CSV batches are far smaller); return the row count."""
    pending: list[pa.RecordBatch]
    written, pending, pending_rows = 0, [], 0
    with pq.ParquetWriter(path, TABLES[table]) as writer:
        def flush() -> None:
            nonlocal written, pending, pending_rows
            if pending_rows:
                writer.write_table(pa.Table.from_batches(pending, TABLES[table]), row_group_size=pending_rows)
                written += pending_rows
                report(pending_rows, f"{table}: {written:,} rows")
            pending, pending_rows = [], 0

        for batch in batches:
            pending.append(batch)
            pending_rows += batch.num_rows
            if pending_rows >= ROWS_PER_GROUP:
                flush()
        flush()
    return written


# --- reading -----------------------------------------------------------------------------------------------

def _read_tbl(path: Path, table: str) -> Iterator[pa.RecordBatch]:
    """Stream the file as record batches in the schema's types, dates converted."""
    if path.stat().st_size == 0:
        return                                     # reported as 'no rows' by the caller (Arrow would raise)
    schema = TABLES[table]
    trailing = _has_trailing_separator(path, table)
    names = schema.names + ([_TRAILING] if trailing else [])
    dates = DATE_COLUMNS.get(table, ())
    types = {f.name: (pa.string() if f.name in dates else f.type) for f in schema}
    reader_options = (
        pacsv.ReadOptions(column_names=names, block_size=BLOCK_BYTES),
        pacsv.ParseOptions(delimiter="|", quote_char='"'),
        # No null markers: an empty key must fail the integer conversion, not load as NULL.
        pacsv.ConvertOptions(column_types=types, include_columns=schema.names, null_values=[],
                             strings_can_be_null=False, quoted_strings_can_be_null=False),
    )
    line = 0                                       # lines before the current batch (no header)
    try:
        reader = pacsv.open_csv(path, *reader_options)
        for batch in reader:
            yield _convert_dates(batch, dates, path.name, first_line=line + 1)
            line += batch.num_rows
    except pa.ArrowInvalid as exc:
        # Arrow's messages carry no line numbers; find the offending line with a plain scan (error path only).
        located = _locate_bad_line(path, table, trailing)
        if located is not None:
            raise SsbImportError(path.name, located[1], located[0]) from exc
        raise SsbImportError(path.name, _arrow_reason(exc)) from exc


def _has_trailing_separator(path: Path, table: str) -> bool:
    """dbgen ends each line with '|'; accept files without it too. Decided from the first line."""
    with open(path, "rb") as f:
        first = f.readline().rstrip(b"\r\n").decode("utf-8", errors="replace")
    fields = first.split("|")
    n = len(TABLES[table])
    if len(fields) == n + 1 and fields[-1] == "":
        return True
    if len(fields) == n:
        return False
    raise SsbImportError(path.name, f"{_count(fields)} fields, expected {n} for {table} "
                         f"(each followed by '|')", line=1)


def _count(fields: list[str]) -> int:
    """Fields on a line, not counting the empty one after a trailing '|'."""
    return len(fields) - 1 if fields and fields[-1] == "" else len(fields)


def _arrow_reason(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _locate_bad_line(path: Path, table: str, trailing: bool) -> tuple[int, str] | None:
    """The first line with a wrong field count or a non-integer in an integer column, as (line, reason)."""
    schema = TABLES[table]
    dates = set(DATE_COLUMNS.get(table, ()))
    integer_columns = [(i, f.name) for i, f in enumerate(schema) if pa.types.is_integer(f.type)
                       and f.name not in dates]
    n = len(schema) + (1 if trailing else 0)
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for number, text in enumerate(f, start=1):
            text = text.rstrip("\r\n")
            if not text:
                continue
            fields = text.split("|")
            if len(fields) != n or (trailing and fields[-1] != ""):
                return number, f"{_count(fields)} fields, expected {len(schema)} for {table}"
            for i, name in integer_columns:
                if not _INTEGER.match(fields[i].strip('"')):
                    return number, f"{name} is not an integer: {fields[i]!r}"
    return None


def _convert_dates(batch: pa.RecordBatch, columns: tuple[str, ...], file: str, first_line: int) -> pa.RecordBatch:
    """Replace each date column (yyyymmdd or YYYY-MM-DD text) by int32 yyyymmdd; reject anything else."""
    for name in columns:
        i = batch.schema.get_field_index(name)
        batch = batch.set_column(i, name, _parse_dates(batch.column(i), name, file, first_line))
    return batch


def _parse_dates(text: pa.Array, name: str, file: str, first_line: int) -> pa.Array:
    values = _compact_dates(text)
    if values is not None:
        well_formed = np.ones(len(values), dtype=bool)
    else:
        # Check the shape first: dropping the dashes alone would also accept e.g. '1992-1-011'.
        well_formed = pc.fill_null(pc.match_substring_regex(text, _DATE_SHAPE), False)
        compact = pc.if_else(well_formed, pc.replace_substring(text, "-", ""), "0")
        values = pc.cast(compact, pa.int32()).to_numpy()
        well_formed = well_formed.to_numpy(zero_copy_only=False)
    valid = well_formed & _real_dates(values)
    if not valid.all():
        bad = int(np.flatnonzero(~valid)[0])
        raise SsbImportError(file, f"{name} is not a date (yyyymmdd or YYYY-MM-DD): {text[bad].as_py()!r}",
                             line=first_line + bad)
    return pa.array(values, pa.int32())


def _compact_dates(text: pa.Array) -> np.ndarray | None:
    """Fast path for dbgen's usual yyyymmdd: the integers if every value is 8 characters that cast, else None."""
    if not pc.all(pc.equal(pc.binary_length(text), 8)).as_py():
        return None
    try:
        return pc.cast(text, pa.int32()).to_numpy()
    except pa.ArrowInvalid:
        return None


_DAYS_IN_MONTH = np.array([31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])


def _real_dates(yyyymmdd: np.ndarray) -> np.ndarray:
    """True where yyyymmdd is a calendar date (Gregorian leap years; strptime would accept 19920230)."""
    year, month, day = yyyymmdd // 10000, yyyymmdd // 100 % 100, yyyymmdd % 100
    leap = (year % 4 == 0) & ((year % 100 != 0) | (year % 400 == 0))
    month_ok = (month >= 1) & (month <= 12)
    days = _DAYS_IN_MONTH[np.clip(month, 1, 12) - 1] + (leap & (month == 2))
    return (year >= 1) & month_ok & (day >= 1) & (day <= days)
