"""The .tbl importer: round trip of a generated data set through dbgen's text format, and every rejected input.

Fixtures are written the way ssb-dbgen prints them: '|' after every field, no header, dates either yyyymmdd
(eyalroz) or "YYYY-MM-DD" in quotes (vadimtk).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from olap.generate import generate
from olap.importer import SsbImportError, import_tbl
from olap.schema import TABLES, TBL_FILES

DATE_COLUMNS = {"lo_orderdate", "lo_commitdate", "d_datekey"}


def _date_text(keys: pa.Array, style: str) -> pa.Array:
    text = pc.cast(keys, pa.string())
    if style == "yyyymmdd":
        return text
    year, month, day = (pc.utf8_slice_codeunits(text, a, b) for a, b in ((0, 4), (4, 6), (6, 8)))
    dashed = pc.binary_join_element_wise(year, month, day, "-")
    return pc.binary_join_element_wise('"', dashed, '"', "")


def write_tbl(table: pa.Table, path: Path, date_style: str = "yyyymmdd", trailing: bool = True) -> None:
    """One line per row, every field followed by '|' (or without the last '|' when trailing is False)."""
    fields = [_date_text(table[name], date_style) if name in DATE_COLUMNS else pc.cast(table[name], pa.string())
              for name in table.column_names]
    if trailing:
        fields.append(pa.array([""] * table.num_rows))
    lines = pc.binary_join_element_wise(*fields, "|").to_pylist()
    path.write_text("".join(line + "\n" for line in lines))


def write_tbl_dir(source: Path, target: Path, date_style: str = "yyyymmdd", trailing: bool = True) -> Path:
    target.mkdir(parents=True)
    for table, file in TBL_FILES.items():
        write_tbl(pq.read_table(source / f"{table}.parquet"), target / file, date_style, trailing)
    return target


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "sf0.01"
    generate(0.01, out, seed=7)
    return out


@pytest.fixture(scope="module")
def tbl_dir(source, tmp_path_factory) -> Path:
    return write_tbl_dir(source, tmp_path_factory.mktemp("tbl") / "plain")


@pytest.fixture
def broken(tbl_dir, tmp_path) -> Path:
    """A private copy of the .tbl files for a test to damage."""
    return Path(shutil.copytree(tbl_dir, tmp_path / "broken"))


def rows_of(source: Path) -> dict[str, int]:
    return json.loads((source / "meta.json").read_text())["rows"]


def assert_same_dataset(imported: Path, source: Path) -> None:
    for table, schema in TABLES.items():
        got = pq.read_table(imported / f"{table}.parquet")
        assert got.schema.equals(schema, check_metadata=False), table
        assert got.equals(pq.read_table(source / f"{table}.parquet")), table


# --- successful imports ------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["yyyymmdd", "quoted-dashed"])
def test_round_trip(source, tmp_path, style):
    src = write_tbl_dir(source, tmp_path / "tbl", date_style=style)
    if style == "quoted-dashed":
        assert (src / "date.tbl").read_text().startswith('"1992-01-01"|January 1, 1992|Thursday|')
    calls = []
    meta = import_tbl(src, tmp_path / "out", expected_rows=rows_of(source),
                      progress=lambda *a: calls.append(a))
    assert_same_dataset(tmp_path / "out", source)
    assert meta == {"scale_factor": None, "source": "ssb-dbgen .tbl import", "rows": rows_of(source)}
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    assert calls[-1][0] == calls[-1][1] == sum(rows_of(source).values())


def test_without_trailing_separator_and_with_scale_factor(source, tmp_path):
    src = write_tbl_dir(source, tmp_path / "tbl", trailing=False)
    meta = import_tbl(src, tmp_path / "out", scale_factor=0.01)
    assert meta["scale_factor"] == 0.01 and meta["rows"] == rows_of(source)
    assert_same_dataset(tmp_path / "out", source)


def test_aggregates_agree_with_duckdb(source, tbl_dir, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    import_tbl(tbl_dir, tmp_path / "out")
    sql = ("select count(*), sum(lo_revenue), sum(lo_extendedprice * lo_discount), min(lo_orderdate), "
           "max(lo_commitdate) from '{}'")
    got = duckdb.sql(sql.format(tmp_path / "out" / "lineorder.parquet")).fetchall()
    want = duckdb.sql(sql.format(source / "lineorder.parquet")).fetchall()
    assert got == want
    lo = pq.read_table(tmp_path / "out" / "lineorder.parquet")
    assert got[0][:2] == (lo.num_rows, pc.sum(lo["lo_revenue"]).as_py())


# --- rejected inputs ---------------------------------------------------------------------------------------

def _damage(path: Path, line: int, edit) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[line - 1] = edit(lines[line - 1])
    path.write_text("".join(lines))


def _set_field(index: int, value: str):
    def edit(line: str) -> str:
        fields = line.rstrip("\n").split("|")
        fields[index] = value
        return "|".join(fields) + "\n"
    return edit


def _assert_rejected(src: Path, out: Path, *fragments: str, **kwargs) -> SsbImportError:
    with pytest.raises(SsbImportError) as info:
        import_tbl(src, out, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert not out.exists()
    assert [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == []
    return info.value


def test_missing_file(broken, tmp_path):
    (broken / "part.tbl").unlink()
    _assert_rejected(broken, tmp_path / "out", "part.tbl", "not found")


def test_wrong_column_count(broken, tmp_path):
    _damage(broken / "supplier.tbl", 5, lambda line: line.replace("|", "", 1))    # two fields merged
    err = _assert_rejected(broken, tmp_path / "out", "supplier.tbl line 5", "6 fields, expected 7")
    assert err.line == 5


def test_wrong_column_count_on_the_first_line(broken, tmp_path):
    _damage(broken / "customer.tbl", 1, lambda line: "extra|" + line)
    _assert_rejected(broken, tmp_path / "out", "customer.tbl line 1", "9 fields, expected 8")


def test_non_numeric_key(broken, tmp_path):
    _damage(broken / "customer.tbl", 3, _set_field(0, "3x"))
    _assert_rejected(broken, tmp_path / "out", "customer.tbl line 3", "c_custkey is not an integer", "'3x'")


def test_empty_key(broken, tmp_path):
    _damage(broken / "lineorder.tbl", 40_000, _set_field(3, ""))                  # lo_partkey, a late batch
    _assert_rejected(broken, tmp_path / "out", "lineorder.tbl line 40000", "lo_partkey is not an integer")


@pytest.mark.parametrize("value", ["19921340", "1992-02-30", "yesterday", ""])
def test_bad_date(broken, tmp_path, value):
    _damage(broken / "lineorder.tbl", 7, _set_field(15, value))                   # lo_commitdate
    _assert_rejected(broken, tmp_path / "out", "lineorder.tbl line 7", "lo_commitdate is not a date",
                     repr(value))


def test_bad_date_key_in_date_table(broken, tmp_path):
    _damage(broken / "date.tbl", 2557, _set_field(0, "19981232"))
    _assert_rejected(broken, tmp_path / "out", "date.tbl line 2557", "d_datekey")


def test_expected_row_count_mismatch(source, tbl_dir, tmp_path):
    expected = rows_of(source) | {"customer": 301}
    _assert_rejected(tbl_dir, tmp_path / "out", "customer.tbl", "300 rows, expected 301",
                     expected_rows=expected)


def test_empty_dimension_file(broken, tmp_path):
    (broken / "supplier.tbl").write_text("")
    _assert_rejected(broken, tmp_path / "out", "supplier.tbl", "no rows")


def test_failed_import_keeps_the_previous_dataset(source, tbl_dir, broken, tmp_path):
    out = tmp_path / "out"
    import_tbl(tbl_dir, out)
    _damage(broken / "lineorder.tbl", 11, _set_field(0, "eleven"))
    with pytest.raises(SsbImportError, match="lineorder.tbl line 11"):
        import_tbl(broken, out)
    assert_same_dataset(out, source)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
