"""A vectorized Star Schema Benchmark generator that follows eyalroz/ssb-dbgen's rules, written to Parquet.

Cardinalities, key layouts, value domains, the price arithmetic and the date table's columns are dbgen's (read in
its src/build.c, dss.h, shared.h, driver.c, bm_utils.c and the dists.dss value lists); its random streams are not,
so individual rows and the query answers differ from a dbgen data set. The date table keeps all 2,557 days at every
scale factor, so every order date joins. The rules one by one: docs/design/olap.md.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from olap.schema import TABLES

Progress = Callable[[int, int | None, str], None]

SOURCE = "switchyard generator (ssb-dbgen rules)"

# Orders per lineorder chunk: ~1M lines, one Parquet row group each. Part of the output's definition (each
# chunk has its own random stream), so changing it changes the data for a given seed.
ORDERS_PER_CHUNK = 250_000

# --- dbgen constants (src/dss.h, src/shared.h, src/driver.c) -------------------------------------------------
PART_BASE, SUPP_BASE, CUST_BASE = 200_000, 2_000, 30_000
ORDER_BASE = 150_000 * 10                # tdefs[LINE].base *= ORDERS_PER_CUST
TOTDATE = 2557                           # days in 1992-01-01..1998-12-31
ODATE_SPAN = TOTDATE - (121 + 30)        # O_ODATE_MAX - O_ODATE_MIN + 1: orders stop at 1998-08-02
COMMIT_MIN, COMMIT_MAX = 30, 90          # L_CDTE_MIN/MAX
LINES_MIN, LINES_MAX = 1, 7              # O_LCNT_MIN/MAX
CUST_MORTALITY = 3
ADDR_LEN = 15                            # C_ADDR_LEN == S_ADDR_LEN in SSB; a_rnd length U[0.4x, 1.6x]
ADDR_MIN, ADDR_MAX = int(ADDR_LEN * 0.4), int(ADDR_LEN * 1.6)
ALPHANUM = np.frombuffer(b"0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ,", np.uint8)

# --- dists.dss value lists, in file order ------------------------------------------------------------------
REGIONS = ["AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST"]
# (nation, weight): dbgen stores the running sum of these weights as the nation's region index.
_NATION_WEIGHTS = [
    ("ALGERIA", 0), ("ARGENTINA", 1), ("BRAZIL", 0), ("CANADA", 0), ("EGYPT", 3), ("ETHIOPIA", -4),
    ("FRANCE", 3), ("GERMANY", 0), ("INDIA", -1), ("INDONESIA", 0), ("IRAN", 2), ("IRAQ", 0), ("JAPAN", -2),
    ("JORDAN", 2), ("KENYA", -4), ("MOROCCO", 0), ("MOZAMBIQUE", 0), ("PERU", 1), ("CHINA", 1), ("ROMANIA", 1),
    ("SAUDI ARABIA", 1), ("VIETNAM", -2), ("RUSSIA", 1), ("UNITED KINGDOM", 0), ("UNITED STATES", -2),
]
NATIONS = [name for name, _ in _NATION_WEIGHTS]
NATION_REGION = np.cumsum([w for _, w in _NATION_WEIGHTS])    # index into REGIONS
ORDER_PRIORITIES = ["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW"]
SHIP_MODES = ["REG AIR", "AIR", "RAIL", "TRUCK", "MAIL", "FOB", "SHIP"]
MARKET_SEGMENTS = ["AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY"]
PART_TYPES = [f"{a} {b} {c}"
              for a in ("STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO")
              for b in ("ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED")
              for c in ("TIN", "NICKEL", "BRASS", "STEEL", "COPPER")]
CONTAINERS = [f"{a} {b}" for a in ("SM", "LG", "MED", "JUMBO", "WRAP")
              for b in ("CASE", "BOX", "BAG", "JAR", "PACK", "PKG", "CAN", "DRUM")]
COLORS = [
    "almond", "antique", "aquamarine", "azure", "beige", "bisque", "black", "blanched", "blue", "blush", "brown",
    "burlywood", "burnished", "chartreuse", "chiffon", "chocolate", "coral", "cornflower", "cornsilk", "cream",
    "cyan", "dark", "deep", "dim", "dodger", "drab", "firebrick", "floral", "forest", "frosted", "gainsboro",
    "ghost", "goldenrod", "green", "grey", "honeydew", "hot", "indian", "ivory", "khaki", "lace", "lavender",
    "lawn", "lemon", "light", "lime", "linen", "magenta", "maroon", "medium", "metallic", "midnight", "mint",
    "misty", "moccasin", "navajo", "navy", "olive", "orange", "orchid", "pale", "papaya", "peach", "peru", "pink",
    "plum", "powder", "puff", "purple", "red", "rose", "rosy", "royal", "saddle", "salmon", "sandy", "seashell",
    "sienna", "sky", "slate", "smoke", "snow", "spring", "steel", "tan", "thistle", "tomato", "turquoise", "violet",
    "wheat", "white", "yellow",
]

# --- build.c date tables -----------------------------------------------------------------------------------
MONTH_NAMES = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
               "November", "December"]
WEEKDAY_NAMES = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
# gen_season: the first (start_month..end_month, day range) that contains the date; together they cover the year.
SEASON_OF_MONTH = {1: "Winter", 2: "Winter", 3: "Winter", 4: "Spring", 5: "Summer", 6: "Summer", 7: "Summer",
                   8: "Summer", 9: "Fall", 10: "Fall", 11: "Christmas", 12: "Christmas"}
HOLIDAYS = {(12, 24), (1, 1), (2, 20), (4, 20), (5, 20), (7, 20), (8, 20), (9, 20), (10, 20), (11, 20)}

# Random stream ids (dbgen's table numbers, plus one for the per-order line counts).
_STREAM_PART, _STREAM_SUPP, _STREAM_CUST, _STREAM_LINE, _STREAM_LINE_COUNT = 0, 2, 3, 5, 50


@dataclass(frozen=True)
class Sizes:
    """Row counts and key ranges that dbgen derives from the scale factor."""
    part: int
    supplier: int
    customer: int
    orders: int
    max_partkey: int       # L_PKEY_MAX: lineorder's part key range, not always the part count


def sizes(scale_factor: float) -> Sizes:
    """driver.c's row counts: SF < 1 scales each base count (truncated, >= 1); SF >= 1 truncates SF to an int."""
    if not scale_factor > 0:
        raise ValueError(f"scale factor must be > 0, got {scale_factor!r}")
    if scale_factor < 1:
        part, supp, cust, orders = (max(1, int(base * scale_factor))
                                    for base in (PART_BASE, SUPP_BASE, CUST_BASE, ORDER_BASE))
        return Sizes(part, supp, cust, orders, max_partkey=part)
    scale = int(scale_factor)
    # Part rows use log2 (written as log/log(2) in driver.c); L_PKEY_MAX uses the natural log (dss.h).
    part = PART_BASE * math.floor(1 + math.log(scale) / math.log(2))
    max_partkey = PART_BASE * (math.floor(math.log(scale)) + 1)
    return Sizes(part, SUPP_BASE * scale, CUST_BASE * scale, ORDER_BASE * scale, max_partkey)


# --- string building ---------------------------------------------------------------------------------------
# Columns are assembled as (rows, width) matrices of ASCII codes and handed to Arrow as one buffer, which keeps
# millions of names, phones and addresses out of Python loops.

def _ascii(chars: np.ndarray, lengths: np.ndarray | None = None) -> pa.Array:
    """String array from an (n, width) uint8 matrix; row i keeps its first lengths[i] characters (all if None)."""
    n, width = chars.shape
    if lengths is None:
        data = chars.reshape(-1)
        offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    else:
        data = chars[np.arange(width) < lengths[:, None]]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """Zero-padded decimal digits of each value as an (n, width) ASCII matrix."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return (np.asarray(values, dtype=np.int64)[:, None] // powers % 10 + ord("0")).astype(np.uint8)


def _text(text: str, n: int) -> np.ndarray:
    """The same text on every row, as an (n, len) ASCII matrix."""
    return np.broadcast_to(np.frombuffer(text.encode(), np.uint8), (n, len(text)))


def _pick(values: list[str], index: np.ndarray) -> pa.Array:
    """values[index[i]] for every row."""
    return pc.take(pa.array(values, pa.string()), pa.array(index))


def _numbered_names(tag: str, keys: np.ndarray) -> pa.Array:
    """sprintf('%s%09ld', tag, key), e.g. 'Customer#000000001'."""
    return _ascii(np.hstack([_text(tag, len(keys)), _digits(keys, 9)]))


def _addresses(rng: np.random.Generator, n: int) -> pa.Array:
    """a_rnd: U[6,24] characters drawn from dbgen's 64-character alphabet (letters, digits, space, comma)."""
    lengths = rng.integers(ADDR_MIN, ADDR_MAX + 1, n)
    chars = ALPHANUM[rng.integers(0, len(ALPHANUM), (n, ADDR_MAX))]
    return _ascii(chars, lengths)


def _phones(rng: np.random.Generator, nation: np.ndarray) -> pa.Array:
    """gen_phone: 'CC-AAA-EEE-NNNN' with the country code 10 + nation index."""
    n, dash = len(nation), _text("-", len(nation))
    parts = [_digits(nation + 10, 2), dash, _digits(rng.integers(100, 1000, n), 3), dash,
             _digits(rng.integers(100, 1000, n), 3), dash, _digits(rng.integers(1000, 10000, n), 4)]
    return _ascii(np.hstack(parts))


_CITY_PREFIX = np.array([list(name[:9].ljust(9).encode()) for name in NATIONS], dtype=np.uint8)


def _cities(rng: np.random.Generator, nation: np.ndarray) -> pa.Array:
    """gen_city: the nation's first 9 characters, space-padded to 9, then a digit: 'UNITED KI1', 'PERU     0'."""
    return _ascii(np.hstack([_CITY_PREFIX[nation], _digits(rng.integers(0, 10, len(nation)), 1)]))


def _table(name: str, columns: dict[str, Any]) -> pa.Table:
    """Arrange columns in the schema's order and types (a missing or extra column is a bug here)."""
    schema = TABLES[name]
    assert set(columns) == set(schema.names), set(columns) ^ set(schema.names)
    arrays = [pa.array(columns[f.name], f.type) if not isinstance(columns[f.name], pa.Array)
              else columns[f.name].cast(f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


# --- dimension tables --------------------------------------------------------------------------------------

def _geography(rng: np.random.Generator, n: int) -> dict[str, object]:
    """Nation, region, city and phone shared by customer and supplier (mk_cust / mk_supp)."""
    nation = rng.integers(0, len(NATIONS), n)
    return {"nation": _pick(NATIONS, nation), "region": _pick(REGIONS, NATION_REGION[nation]),
            "city": _cities(rng, nation), "phone": _phones(rng, nation)}


def make_customer(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, _STREAM_CUST])
    keys = np.arange(1, n + 1)
    address = _addresses(rng, n)
    geo = _geography(rng, n)
    return _table("customer", {
        "c_custkey": keys, "c_name": _numbered_names("Customer#", keys), "c_address": address,
        "c_city": geo["city"], "c_nation": geo["nation"], "c_region": geo["region"], "c_phone": geo["phone"],
        "c_mktsegment": _pick(MARKET_SEGMENTS, rng.integers(0, len(MARKET_SEGMENTS), n)),
    })


def make_supplier(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, _STREAM_SUPP])
    keys = np.arange(1, n + 1)
    address = _addresses(rng, n)
    geo = _geography(rng, n)
    return _table("supplier", {
        "s_suppkey": keys, "s_name": _numbered_names("Supplier#", keys), "s_address": address,
        "s_city": geo["city"], "s_nation": geo["nation"], "s_region": geo["region"], "s_phone": geo["phone"],
    })


def _three_colors(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three distinct colour indices per row, uniformly (agg_str takes the head of a random permutation)."""
    k = len(COLORS)
    a = rng.integers(0, k, n)
    b = rng.integers(0, k - 1, n)
    b += b >= a                                   # skip a
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    c = rng.integers(0, k - 2, n)
    c += c >= lo                                  # skip lo, then hi (order matters)
    c += c >= hi
    return a, b, c


def _brands(mfgr: np.ndarray, cat: np.ndarray, brand: np.ndarray) -> pa.Array:
    """'MFGR#' + mfgr + cat + brand, brand 1..40 printed with %ld (no padding): 'MFGR#121', 'MFGR#1240'."""
    n = len(brand)
    two = brand >= 10
    first = np.where(two, brand // 10, brand % 10)     # the only digit, or the tens
    chars = np.hstack([_text("MFGR#", n), _digits(mfgr, 1), _digits(cat, 1), _digits(first, 1),
                       _digits(brand % 10, 1)])
    return _ascii(chars, np.where(two, 9, 8))


def make_part(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, _STREAM_PART])
    color, name1, name2 = _three_colors(rng, n)
    mfgr, cat, brand = rng.integers(1, 6, n), rng.integers(1, 6, n), rng.integers(1, 41, n)
    return _table("part", {
        "p_partkey": np.arange(1, n + 1),
        "p_name": pc.binary_join_element_wise(_pick(COLORS, name1), _pick(COLORS, name2), " "),
        "p_mfgr": _ascii(np.hstack([_text("MFGR#", n), _digits(mfgr, 1)])),
        "p_category": _ascii(np.hstack([_text("MFGR#", n), _digits(mfgr, 1), _digits(cat, 1)])),
        "p_brand1": _brands(mfgr, cat, brand),
        "p_color": _pick(COLORS, color),
        "p_type": _pick(PART_TYPES, rng.integers(0, len(PART_TYPES), n)),
        "p_size": rng.integers(1, 51, n),
        "p_container": _pick(CONTAINERS, rng.integers(0, len(CONTAINERS), n)),
    })


def _calendar() -> dict[str, np.ndarray]:
    """Year, month, day, day of year and C tm_wday of 1992-01-01 + i for i in 0..TOTDATE-1."""
    day = np.datetime64("1992-01-01") + np.arange(TOTDATE)
    month_start, year_start = day.astype("datetime64[M]"), day.astype("datetime64[Y]")
    return {
        "year": year_start.astype(np.int64) + 1970,
        "month": month_start.astype(np.int64) % 12 + 1,
        "day": (day - month_start).astype(np.int64) + 1,
        "yday": (day - year_start).astype(np.int64) + 1,
        "wday": (day.astype(np.int64) + 4) % 7,         # 1970-01-01 was a Thursday; Sunday = 0 as in struct tm
        "last_in_month": (day + 1).astype("datetime64[M]") != month_start,
    }


def date_keys() -> np.ndarray:
    """yyyymmdd of every day in the date table; index = days since 1992-01-01 (dbgen's asc_date)."""
    cal = _calendar()
    return (cal["year"] * 10000 + cal["month"] * 100 + cal["day"]).astype(np.int32)


def make_ddate() -> pa.Table:
    """mk_date for index 1..2557 in UTC, quirks included (docs/design/olap.md)."""
    cal = _calendar()
    year, month, day = cal["year"], cal["month"], cal["day"]
    daynuminweek = (cal["wday"] + 1) % 7 + 1         # dbgen's formula: Wednesday -> 5 -> "Thursday"
    month_name = [MONTH_NAMES[m - 1] for m in month]
    return _table("ddate", {
        "d_datekey": date_keys(),
        "d_date": [f"{name} {d}, {y}" for name, d, y in zip(month_name, day, year)],
        "d_dayofweek": [WEEKDAY_NAMES[w - 1] for w in daynuminweek],
        "d_month": month_name,
        "d_year": year,
        "d_yearmonthnum": year * 100 + month,
        "d_yearmonth": [f"{name[:3]}{y}" for name, y in zip(month_name, year)],
        "d_daynuminweek": daynuminweek,
        "d_daynuminmonth": day,
        "d_daynuminyear": cal["yday"],
        "d_monthnuminyear": month,
        "d_weeknuminyear": cal["yday"] // 7 + 1,
        "d_sellingseason": [SEASON_OF_MONTH[m] for m in month],
        "d_lastdayinweekfl": (daynuminweek == 7).astype(np.int32),
        "d_lastdayinmonthfl": cal["last_in_month"].astype(np.int32),
        "d_holidayfl": np.array([(m, d) in HOLIDAYS for m, d in zip(month, day)], dtype=np.int32),
        "d_weekdayfl": ((daynuminweek != 1) & (daynuminweek != 7)).astype(np.int32),
    })


# --- lineorder ---------------------------------------------------------------------------------------------

def _chunks(n_orders: int) -> Iterator[tuple[int, int, int]]:
    """(chunk index, first order number (1-based), orders in chunk)."""
    for index, first in enumerate(range(1, n_orders + 1, ORDERS_PER_CHUNK)):
        yield index, first, min(ORDERS_PER_CHUNK, n_orders - first + 1)


def _line_counts(seed: int, chunk: int, n: int) -> np.ndarray:
    """Lines per order, from a stream of its own so the total row count is known before generating."""
    return np.random.default_rng([seed, _STREAM_LINE_COUNT, chunk]).integers(LINES_MIN, LINES_MAX + 1, n)


def sparse_order_keys(order_numbers: np.ndarray) -> np.ndarray:
    """mk_sparse(i, seq=0): keep the 3 low bits, insert 2 zero bits above them."""
    i = np.asarray(order_numbers, dtype=np.int64)
    return ((i >> 3) << 5) | (i & 7)


def retail_price(partkey: np.ndarray) -> np.ndarray:
    """rpb_routine, in cents."""
    p = np.asarray(partkey, dtype=np.int64)
    return 90000 + (p // 10) % 20001 + 100 * (p % 1000)


def _customer_keys(rng: np.random.Generator, n: int, max_key: int) -> np.ndarray:
    """U[1, max] then mk_order's fix-up: a multiple of 3 moves to k+1, or to k-1 when k+1 is past the top."""
    key = rng.integers(1, max_key + 1, n)
    dead = key % CUST_MORTALITY == 0
    return np.where(dead, np.where(key < max_key, key + 1, key - 1), key)


def make_lineorder_chunk(size: Sizes, seed: int, chunk: int, first_order: int, n: int,
                         dates: np.ndarray) -> pa.Table:
    """mk_order for orders first_order..first_order+n-1, all lines of each."""
    rng = np.random.default_rng([seed, _STREAM_LINE, chunk])
    lines = _line_counts(seed, chunk, n)
    # Per order.
    order_day = rng.integers(0, ODATE_SPAN, n)
    customer = _customer_keys(rng, n, size.customer)
    priority = rng.integers(0, len(ORDER_PRIORITIES), n)
    # Per line: `of` maps each line to its order within the chunk.
    starts = np.concatenate([[0], np.cumsum(lines)[:-1]])
    of = np.repeat(np.arange(n), lines)
    m = len(of)
    partkey = rng.integers(1, size.max_partkey + 1, m)
    quantity = rng.integers(1, 51, m)
    discount = rng.integers(0, 11, m)
    tax = rng.integers(0, 9, m)
    commit_day = order_day[of] + rng.integers(COMMIT_MIN, COMMIT_MAX + 1, m)
    rprice = retail_price(partkey)
    extended = rprice * quantity
    revenue = extended * (100 - discount) // 100
    order_total = np.add.reduceat(revenue * (100 + tax) // 100, starts)
    return _table("lineorder", {
        "lo_orderkey": sparse_order_keys(first_order + of),
        "lo_linenumber": np.arange(m) - starts[of] + 1,
        "lo_custkey": customer[of],
        "lo_partkey": partkey,
        "lo_suppkey": rng.integers(1, size.supplier + 1, m),
        "lo_orderdate": dates[order_day][of],
        "lo_orderpriority": _pick(ORDER_PRIORITIES, priority[of]),
        "lo_shippriority": _pick(["0"], np.zeros(m, dtype=np.int8)),
        "lo_quantity": quantity,
        "lo_extendedprice": extended,
        "lo_ordtotalprice": order_total[of],
        "lo_discount": discount,
        "lo_revenue": revenue,
        "lo_supplycost": 6 * rprice // 10,
        "lo_tax": tax,
        "lo_commitdate": dates[commit_day],
        "lo_shipmode": _pick(SHIP_MODES, rng.integers(0, len(SHIP_MODES), m)),
    })


def lineorder_rows(scale_factor: float, seed: int = 0) -> int:
    """The lineorder row count generate() will produce (cheap: draws only the line counts)."""
    size = sizes(scale_factor)
    return sum(int(_line_counts(seed, c, n).sum()) for c, _, n in _chunks(size.orders))


# --- output ------------------------------------------------------------------------------------------------

def row_reporter(progress: Progress | None,
                 total: int | None) -> Callable[[int, str], None]:
    """report(rows, message): adds rows written to a running count and passes it on to `progress`."""
    done = 0

    def report(rows: int, message: str) -> None:
        nonlocal done
        done += rows
        if progress is not None:
            progress(done, total, message)

    return report


@contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield an empty directory beside out_dir; on success it replaces out_dir, on any failure it is deleted.

    Readers therefore see the old data set or the complete new one, never a half-written one. A process killed
    outright leaves only a hidden '.<name>.*.tmp' directory next to out_dir.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp, which makes it 0700) so the data set gets the usual umask-derived permissions.
    tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_into_place(tmp, out_dir)


def _swap_into_place(new: Path, target: Path) -> None:
    """rename() cannot replace a non-empty directory: move the old one aside first, delete it last."""
    if not target.exists():
        os.rename(new, target)
        return
    old = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.old"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        shutil.rmtree(new, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_meta(directory: Path, meta: dict) -> None:
    (Path(directory) / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def generate(scale_factor: float, out_dir: Path, seed: int = 0, progress: Progress | None = None) -> dict:
    """Write <out_dir>/{lineorder,part,supplier,customer,ddate}.parquet and meta.json; return the meta dict.

    Deterministic for a given (scale_factor, seed). progress(done_rows, total_rows, message) is called after each
    table and each lineorder chunk, counting rows over all five tables.
    """
    if not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    seed = int(seed)
    size = sizes(scale_factor)
    n_lines = lineorder_rows(scale_factor, seed)
    report = row_reporter(progress, size.part + size.supplier + size.customer + TOTDATE + n_lines)

    rows: dict[str, int] = {}
    with atomic_dir(out_dir) as tmp:
        for name, make in (("ddate", make_ddate), ("supplier", lambda: make_supplier(size.supplier, seed)),
                           ("customer", lambda: make_customer(size.customer, seed)),
                           ("part", lambda: make_part(size.part, seed))):
            table = make()
            pq.write_table(table, tmp / f"{name}.parquet")
            rows[name] = table.num_rows
            report(table.num_rows, f"{name}: {table.num_rows:,} rows")
        rows["lineorder"] = _write_lineorder(tmp / "lineorder.parquet", size, seed, report)
        meta = {"scale_factor": scale_factor, "seed": seed, "source": SOURCE,
                "rows": {name: rows[name] for name in TABLES}}
        write_meta(tmp, meta)
    return meta


def _write_lineorder(path: Path, size: Sizes, seed: int, report: Callable[[int, str], None]) -> int:
    """One row group per chunk, written as produced, so memory stays at one chunk."""
    dates = date_keys()
    written = 0
    with pq.ParquetWriter(path, TABLES["lineorder"]) as writer:
        for chunk, first, n in _chunks(size.orders):
            table = make_lineorder_chunk(size, seed, chunk, first, n, dates)
            writer.write_table(table, row_group_size=table.num_rows)
            written += table.num_rows
            report(table.num_rows, f"lineorder: {first + n - 1:,} of {size.orders:,} orders")
    return written
