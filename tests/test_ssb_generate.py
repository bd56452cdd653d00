"""The SSB generator: schema, determinism, dbgen's cardinalities and domains, atomic output.

Expected values are written out here from the ssb-dbgen sources (not imported from the generator), so a wrong
constant in olap/generate.py fails a test instead of agreeing with itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from olap import generate as gen
from olap.schema import TABLES

SF_SMALL, SF_LARGER = 0.01, 0.05

# dists.dss nation order, and each nation's region (cumulative weights); phone country code = index + 10.
NATIONS = ["ALGERIA", "ARGENTINA", "BRAZIL", "CANADA", "EGYPT", "ETHIOPIA", "FRANCE", "GERMANY", "INDIA",
           "INDONESIA", "IRAN", "IRAQ", "JAPAN", "JORDAN", "KENYA", "MOROCCO", "MOZAMBIQUE", "PERU", "CHINA",
           "ROMANIA", "SAUDI ARABIA", "VIETNAM", "RUSSIA", "UNITED KINGDOM", "UNITED STATES"]
REGION_OF = {
    **dict.fromkeys(["ALGERIA", "ETHIOPIA", "KENYA", "MOROCCO", "MOZAMBIQUE"], "AFRICA"),
    **dict.fromkeys(["ARGENTINA", "BRAZIL", "CANADA", "PERU", "UNITED STATES"], "AMERICA"),
    **dict.fromkeys(["CHINA", "INDIA", "INDONESIA", "JAPAN", "VIETNAM"], "ASIA"),
    **dict.fromkeys(["FRANCE", "GERMANY", "ROMANIA", "RUSSIA", "UNITED KINGDOM"], "EUROPE"),
    **dict.fromkeys(["EGYPT", "IRAN", "IRAQ", "JORDAN", "SAUDI ARABIA"], "MIDDLE EAST"),
}
ALPHANUM = set("0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ,")


def _generate(root: Path, sf: float, seed: int) -> Path:
    out = root / f"sf{sf}-seed{seed}"
    gen.generate(sf, out, seed=seed)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ssb")


@pytest.fixture(scope="module")
def small(root) -> Path:
    return _generate(root, SF_SMALL, 0)


@pytest.fixture(scope="module")
def larger(root) -> Path:
    return _generate(root, SF_LARGER, 0)


@pytest.fixture(scope="module", params=["small", "larger"])
def dataset(request) -> tuple[float, Path]:
    sf = SF_SMALL if request.param == "small" else SF_LARGER
    return sf, request.getfixturevalue(request.param)


def read(directory: Path, table: str) -> pa.Table:
    return pq.read_table(directory / f"{table}.parquet")


def col(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy()


def yyyymmdd_to_days(keys: np.ndarray) -> np.ndarray:
    text = [f"{k // 10000:04d}-{k // 100 % 100:02d}-{k % 100:02d}" for k in keys.tolist()]
    return np.array(text, dtype="datetime64[D]").astype(np.int64)


# --- layout, schema, determinism ---------------------------------------------------------------------------

def test_layout_schema_and_meta(small):
    assert sorted(p.name for p in small.iterdir()) == sorted([f"{t}.parquet" for t in TABLES] + ["meta.json"])
    meta = json.loads((small / "meta.json").read_text())
    assert meta["scale_factor"] == SF_SMALL and meta["seed"] == 0
    assert meta["source"] == "switchyard generator (ssb-dbgen rules)"
    for table, schema in TABLES.items():
        stored = pq.read_schema(small / f"{table}.parquet")
        assert stored.names == schema.names
        assert stored.equals(schema, check_metadata=False), table
        assert meta["rows"][table] == pq.ParquetFile(small / f"{table}.parquet").metadata.num_rows


def test_returns_meta_and_reports_progress(tmp_path):
    calls = []
    meta = gen.generate(SF_SMALL, tmp_path / "d", seed=3, progress=lambda *a: calls.append(a))
    assert meta == json.loads((tmp_path / "d" / "meta.json").read_text())
    done = [c[0] for c in calls]
    assert done == sorted(done) and done[-1] == sum(meta["rows"].values())
    assert all(c[1] == done[-1] for c in calls)                 # the total is known from the start
    assert any(c[2].startswith("lineorder") for c in calls)


def test_same_seed_same_data_other_seed_other_data(root, small):
    again = _generate(root, SF_SMALL, 0)
    other = _generate(root, SF_SMALL, 1)
    for table in TABLES:
        assert read(small, table).equals(read(again, table)), table
    for table in ("lineorder", "part", "supplier", "customer"):
        assert not read(small, table).equals(read(other, table)), table
    assert read(small, "ddate").equals(read(other, "ddate"))     # the calendar has no randomness


# --- cardinalities -----------------------------------------------------------------------------------------

def test_cardinalities(dataset):
    sf, d = dataset
    assert read(d, "customer").num_rows == int(30000 * sf)
    assert read(d, "supplier").num_rows == int(2000 * sf)
    assert read(d, "part").num_rows == int(200000 * sf)           # SF < 1: no log2 factor
    assert read(d, "ddate").num_rows == 2557
    lo = read(d, "lineorder")
    orders = int(1_500_000 * sf)
    assert pc.count_distinct(lo.column("lo_orderkey")).as_py() == orders
    # U[1,7] lines per order: mean 4, variance 4; allow 6 standard deviations.
    assert abs(lo.num_rows - 4 * orders) <= 6 * 2 * orders ** 0.5
    assert lo.num_rows == gen.lineorder_rows(sf, 0)


@pytest.mark.parametrize("sf, part, max_partkey, customer, orders", [
    (0.01, 2_000, 2_000, 300, 15_000),
    (0.0001, 20, 20, 3, 150),
    (0.00001, 2, 2, 1, 15),                                        # at least one row per table
    (1, 200_000, 200_000, 30_000, 1_500_000),
    (1.5, 200_000, 200_000, 30_000, 1_500_000),                    # dbgen truncates SF >= 1 to an integer
    (10, 800_000, 600_000, 300_000, 15_000_000),                   # part: log2; lo_partkey: natural log
    (100, 1_400_000, 1_000_000, 3_000_000, 150_000_000),
])
def test_sizes_follow_driver_c(sf, part, max_partkey, customer, orders):
    s = gen.sizes(sf)
    assert (s.part, s.max_partkey, s.customer, s.orders) == (part, max_partkey, customer, orders)
    assert s.supplier == (max(1, int(2000 * sf)) if sf < 1 else 2000 * int(sf))


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_rejects_bad_scale_factor(tmp_path, bad):
    with pytest.raises(ValueError):
        gen.generate(bad, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --- lineorder domains -------------------------------------------------------------------------------------

def test_lineorder_keys(dataset):
    sf, d = dataset
    lo = read(d, "lineorder")
    okey, line = col(lo, "lo_orderkey"), col(lo, "lo_linenumber")
    i = np.arange(1, int(1_500_000 * sf) + 1)
    assert np.array_equal(np.unique(okey), ((i >> 3) << 5) | (i & 7))   # mk_sparse(i, 0)
    # Rows come in order; each order's lines are numbered 1..n with n in 1..7.
    assert np.all(np.diff(okey) >= 0)
    first = np.flatnonzero(np.r_[True, okey[1:] != okey[:-1]])
    lines = np.diff(np.r_[first, len(okey)])
    assert lines.min() == 1 and lines.max() == 7
    assert np.array_equal(line, np.arange(len(okey)) - np.repeat(first, lines) + 1)
    # Order-level columns are constant within an order.
    for name in ("lo_custkey", "lo_orderdate", "lo_orderpriority", "lo_ordtotalprice"):
        values = lo.column(name).to_numpy(zero_copy_only=False)
        assert np.array_equal(values, np.repeat(values[first], lines)), name

    cust = col(lo, "lo_custkey")
    assert cust.min() >= 1 and cust.max() <= int(30000 * sf)
    assert not np.any(cust % 3 == 0)                               # CUST_MORTALITY
    part = col(lo, "lo_partkey")
    assert part.min() >= 1 and part.max() <= int(200000 * sf)
    supp = col(lo, "lo_suppkey")
    assert supp.min() >= 1 and supp.max() <= int(2000 * sf)


def test_lineorder_measures(dataset):
    _, d = dataset
    lo = read(d, "lineorder")
    qty, disc, tax = col(lo, "lo_quantity"), col(lo, "lo_discount"), col(lo, "lo_tax")
    assert (qty.min(), qty.max()) == (1, 50)
    assert (disc.min(), disc.max()) == (0, 10)
    assert (tax.min(), tax.max()) == (0, 8)
    p = col(lo, "lo_partkey").astype(np.int64)
    rprice = 90000 + (p // 10) % 20001 + 100 * (p % 1000)
    ext = col(lo, "lo_extendedprice")
    assert np.array_equal(ext, rprice * qty)
    assert np.array_equal(col(lo, "lo_revenue"), ext * (100 - disc) // 100)
    assert np.array_equal(col(lo, "lo_supplycost"), 6 * rprice // 10)
    # ordtotalprice: the order's sum of (ext*(100-disc)/100)*(100+tax)/100.
    per_line = pa.table({"k": lo.column("lo_orderkey"),
                         "v": pa.array((ext * (100 - disc) // 100) * (100 + tax) // 100)})
    want = dict(zip(*per_line.group_by("k").aggregate([("v", "sum")]).to_pydict().values()))
    got = dict(zip(col(lo, "lo_orderkey").tolist(), col(lo, "lo_ordtotalprice").tolist()))
    assert got == want
    assert set(lo.column("lo_shippriority").to_pylist()) == {"0"}
    assert set(lo.column("lo_orderpriority").to_pylist()) == {"1-URGENT", "2-HIGH", "3-MEDIUM",
                                                              "4-NOT SPECIFIED", "5-LOW"}
    assert set(lo.column("lo_shipmode").to_pylist()) == {"AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK"}


def test_lineorder_dates(dataset):
    _, d = dataset
    lo = read(d, "lineorder")
    order, commit = col(lo, "lo_orderdate"), col(lo, "lo_commitdate")
    assert order.min() >= 19920101 and order.max() <= 19980802      # O_ODATE_MAX
    lag = yyyymmdd_to_days(commit) - yyyymmdd_to_days(order)
    assert lag.min() >= 30 and lag.max() <= 90
    keys = set(col(read(d, "ddate"), "d_datekey").tolist())
    assert set(order.tolist()) <= keys and set(commit.tolist()) <= keys


def test_order_dates_cover_the_range_at_sf_005(larger):
    order = col(read(larger, "lineorder"), "lo_orderdate")
    assert (order.min(), order.max()) == (19920101, 19980802)
    assert len(np.unique(order)) == 2406


# --- dimensions --------------------------------------------------------------------------------------------

def test_part(dataset):
    _, d = dataset
    part = read(d, "part").to_pydict()
    assert part["p_partkey"] == list(range(1, len(part["p_partkey"]) + 1))
    brand_re = re.compile(r"^MFGR#[1-5][1-5]([1-9]|[1-3][0-9]|40)$")
    for mfgr, cat, brand in zip(part["p_mfgr"], part["p_category"], part["p_brand1"]):
        assert re.fullmatch(r"MFGR#[1-5]", mfgr) and cat[:6] == mfgr and len(cat) == 7
        assert brand_re.match(brand) and brand.startswith(cat), brand
    for name, color in zip(part["p_name"], part["p_color"]):
        words = name.split(" ")
        assert len(words) == 2 and len({*words, color}) == 3           # three distinct colours
        assert set(words) | {color} <= set(gen.COLORS)
    assert len(gen.COLORS) == 92 and len(set(gen.COLORS)) == 92
    assert set(part["p_type"]) <= set(gen.PART_TYPES) and len(set(gen.PART_TYPES)) == 150
    assert set(part["p_container"]) <= set(gen.CONTAINERS) and len(set(gen.CONTAINERS)) == 40
    assert min(part["p_size"]) >= 1 and max(part["p_size"]) <= 50


def test_all_thousand_brands_occur(larger):
    brands = set(read(larger, "part").column("p_brand1").to_pylist())      # 10,000 parts
    assert len(brands) == 1000
    assert {"MFGR#111", "MFGR#1110", "MFGR#5540", "MFGR#2221", "MFGR#2239"} <= brands


@pytest.mark.parametrize("table, p, key, tag", [("customer", "c", "c_custkey", "Customer#"),
                                                ("supplier", "s", "s_suppkey", "Supplier#")])
def test_customer_and_supplier(dataset, table, p, key, tag):
    _, d = dataset
    t = read(d, table).to_pydict()
    keys = t[key]
    assert keys == list(range(1, len(keys) + 1))
    assert t[f"{p}_name"] == [f"{tag}{k:09d}" for k in keys]
    for nation, region, city, phone, address in zip(t[f"{p}_nation"], t[f"{p}_region"], t[f"{p}_city"],
                                                    t[f"{p}_phone"], t[f"{p}_address"]):
        assert REGION_OF[nation] == region
        assert len(city) == 10 and city[:9] == nation[:9].ljust(9) and city[9].isdigit()
        assert re.fullmatch(r"\d\d-\d{3}-\d{3}-\d{4}", phone)
        assert int(phone[:2]) == NATIONS.index(nation) + 10
        assert 100 <= int(phone[3:6]) <= 999 and 100 <= int(phone[7:10]) <= 999 and int(phone[11:]) >= 1000
        assert 6 <= len(address) <= 24 and set(address) <= ALPHANUM
    if p == "c":
        assert set(t["c_mktsegment"]) <= {"AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY"}


def test_nation_region_mapping_and_cities(larger):
    c = read(larger, "customer").to_pydict()                         # 1,500 customers
    assert set(c["c_nation"]) == set(NATIONS)
    assert {(n, r) for n, r in zip(c["c_nation"], c["c_region"])} == set(REGION_OF.items())
    assert "UNITED KI1" in c["c_city"] or "UNITED KI5" in c["c_city"]
    assert any(city.startswith("MOROCCO  ") for city in c["c_city"])   # two pad spaces
    assert len(set(c["c_city"])) > 200                                # of 250 possible


def test_date_table():
    d = gen.make_ddate().to_pydict()
    keys = d["d_datekey"]
    assert len(keys) == 2557 and keys[0] == 19920101 and keys[-1] == 19981231
    days = yyyymmdd_to_days(np.array(keys))
    assert np.all(np.diff(days) == 1)
    first = {name: values[0] for name, values in d.items()}
    assert first == {
        "d_datekey": 19920101, "d_date": "January 1, 1992", "d_dayofweek": "Thursday", "d_month": "January",
        "d_year": 1992, "d_yearmonthnum": 199201, "d_yearmonth": "Jan1992", "d_daynuminweek": 5,
        "d_daynuminmonth": 1, "d_daynuminyear": 1, "d_monthnuminyear": 1, "d_weeknuminyear": 1,
        "d_sellingseason": "Winter", "d_lastdayinweekfl": 0, "d_lastdayinmonthfl": 0, "d_holidayfl": 1,
        "d_weekdayfl": 1,
    }
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December"]
    for i, key in enumerate(keys):
        y, m, day = key // 10000, key // 100 % 100, key % 100
        assert d["d_year"][i] == y and d["d_monthnuminyear"][i] == m and d["d_daynuminmonth"][i] == day
        assert d["d_date"][i] == f"{months[m - 1]} {day}, {y}" and d["d_month"][i] == months[m - 1]
        assert d["d_yearmonth"][i] == f"{months[m - 1][:3]}{y}" and d["d_yearmonthnum"][i] == y * 100 + m
        assert d["d_weeknuminyear"][i] == d["d_daynuminyear"][i] // 7 + 1       # integer division, not ISO
    # dbgen's off-by-one weekday: the label is the real weekday's successor (1970-01-01 was a Thursday).
    real = (days + 4) % 7                                            # 0 = Sunday
    weekdays = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
    assert d["d_dayofweek"] == [weekdays[(w + 1) % 7] for w in real]
    assert d["d_daynuminweek"] == ((real + 1) % 7 + 1).tolist()
    assert max(d["d_weeknuminyear"]) == 53
    assert sum(d["d_lastdayinmonthfl"]) == 84 and sum(d["d_holidayfl"]) == 70
    q13 = [k for k, w, y in zip(keys, d["d_weeknuminyear"], d["d_year"]) if w == 6 and y == 1994]
    assert q13 == list(range(19940204, 19940211))                    # Q1.3's week: Feb 4..10
    assert {(m, s) for m, s in zip(d["d_monthnuminyear"], d["d_sellingseason"])} == {
        (1, "Winter"), (2, "Winter"), (3, "Winter"), (4, "Spring"), (5, "Summer"), (6, "Summer"), (7, "Summer"),
        (8, "Summer"), (9, "Fall"), (10, "Fall"), (11, "Christmas"), (12, "Christmas")}


# --- atomic output -----------------------------------------------------------------------------------------

def _fail_in_lineorder(done, total, message):
    if message.startswith("lineorder"):
        raise RuntimeError("simulated failure")


def test_failure_leaves_no_half_dataset(tmp_path):
    out = tmp_path / "ssb" / "sf0.01"
    with pytest.raises(RuntimeError, match="simulated failure"):
        gen.generate(SF_SMALL, out, progress=_fail_in_lineorder)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []                          # no temporary directory left behind


def test_failure_keeps_previous_dataset_and_success_replaces_it(tmp_path):
    out = tmp_path / "d"
    gen.generate(SF_SMALL, out, seed=0)
    before = read(out, "lineorder")
    with pytest.raises(RuntimeError):
        gen.generate(SF_SMALL, out, seed=1, progress=_fail_in_lineorder)
    assert read(out, "lineorder").equals(before)
    gen.generate(SF_SMALL, out, seed=1)
    assert json.loads((out / "meta.json").read_text())["seed"] == 1
    assert not read(out, "lineorder").equals(before)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
