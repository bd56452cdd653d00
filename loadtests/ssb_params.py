"""Random valid parameters for the 13 SSB query templates, drawn the way the SSB paper varies them (O'Neil et al.,
"Star Schema Benchmark", rev. 3: a year, a discount band of width 2, a quantity band, a category, a brand range
of 8, regions, nations, two cities of one nation, a month), so a load test spreads over the data instead of
hitting one cached answer. Values stay inside the domains that GET /v1/olap/ssb/queries describes."""

from __future__ import annotations

import random
from typing import Any, Callable

REGIONS = ("AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST")
NATIONS = {
    "AFRICA": ("ALGERIA", "ETHIOPIA", "KENYA", "MOROCCO", "MOZAMBIQUE"),
    "AMERICA": ("ARGENTINA", "BRAZIL", "CANADA", "PERU", "UNITED STATES"),
    "ASIA": ("CHINA", "INDIA", "INDONESIA", "JAPAN", "VIETNAM"),
    "EUROPE": ("FRANCE", "GERMANY", "ROMANIA", "RUSSIA", "UNITED KINGDOM"),
    "MIDDLE EAST": ("EGYPT", "IRAN", "IRAQ", "JORDAN", "SAUDI ARABIA"),
}
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _discount_band(r: random.Random) -> dict[str, int]:
    d = r.randint(1, 9)
    return {"discount_min": d - 1, "discount_max": d + 1}


def _quantity_band(r: random.Random) -> dict[str, int]:
    low = r.randint(1, 41)
    return {"quantity_min": low, "quantity_max": low + 9}


def _category(r: random.Random) -> str:
    return f"MFGR#{r.randint(1, 5)}{r.randint(1, 5)}"


def _city(r: random.Random, nation: str) -> str:
    return nation[:9].ljust(9) + str(r.randint(0, 9))


def _two_cities(r: random.Random) -> list[str]:
    nation = r.choice([n for ns in NATIONS.values() for n in ns])
    first, second = r.sample(range(10), 2)
    return [nation[:9].ljust(9) + str(first), nation[:9].ljust(9) + str(second)]


def _years(r: random.Random) -> dict[str, int]:
    first = r.randint(1992, 1997)
    return {"year_min": first, "year_max": r.randint(first, 1998)}


def _region_pair(r: random.Random) -> dict[str, str]:
    return {"customer_region": r.choice(REGIONS), "supplier_region": r.choice(REGIONS)}


def _nation_pair(r: random.Random) -> dict[str, str]:
    nations = NATIONS[r.choice(REGIONS)]  # Q3.2 compares nations of one region
    return {"customer_nation": r.choice(nations), "supplier_nation": r.choice(nations)}


def _two_years(r: random.Random) -> list[int]:
    first = r.randint(1992, 1997)
    return [first, first + 1]


def _two_mfgrs(r: random.Random) -> list[str]:
    return sorted(r.sample([f"MFGR#{i}" for i in range(1, 6)], 2))


def _brand_range(r: random.Random) -> dict[str, str]:
    # same digit count at both ends: brands compare as strings ('MFGR#2210' < 'MFGR#222')
    category, low = _category(r), r.choice((1, 2, *range(10, 34)))
    return {"brand_min": f"{category}{low}", "brand_max": f"{category}{low + 7}"}


GENERATORS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "1.1": lambda r: {"year": r.randint(1993, 1997), **_discount_band(r), "quantity_below": r.choice((24, 25, 26))},
    "1.2": lambda r: {"yearmonthnum": r.randint(1992, 1998) * 100 + r.randint(1, 12), **_discount_band(r),
                      **_quantity_band(r)},
    "1.3": lambda r: {"year": r.randint(1992, 1998), "week": r.randint(1, 52), **_discount_band(r),
                      **_quantity_band(r)},
    "2.1": lambda r: {"category": _category(r), "region": r.choice(REGIONS)},
    "2.2": lambda r: {**_brand_range(r), "region": r.choice(REGIONS)},
    "2.3": lambda r: {"brand": f"{_category(r)}{r.randint(1, 40)}", "region": r.choice(REGIONS)},
    "3.1": lambda r: {**_region_pair(r), **_years(r)},
    "3.2": lambda r: {**_nation_pair(r), **_years(r)},
    "3.3": lambda r: {"cities": _two_cities(r), **_years(r)},
    "3.4": lambda r: {"cities": _two_cities(r), "yearmonth": f"{r.choice(MONTHS)}{r.randint(1992, 1998)}"},
    "4.1": lambda r: {**_region_pair(r), "mfgrs": _two_mfgrs(r)},
    "4.2": lambda r: {**_region_pair(r), "years": _two_years(r), "mfgrs": _two_mfgrs(r)},
    "4.3": lambda r: {"customer_region": r.choice(REGIONS), "supplier_nation": _nation_pair(r)["supplier_nation"],
                      "years": _two_years(r), "category": _category(r)},
}

# Ad-hoc SQL a user might send beside the templates: (name, SQL with {year} / {region} holes).
AD_HOC = (
    ("revenue by year",
     "SELECT d_year, SUM(lo_revenue) AS revenue FROM lineorder JOIN ddate ON lo_orderdate = d_datekey "
     "GROUP BY d_year ORDER BY d_year"),
    ("top suppliers of a region", "SELECT s_name, SUM(lo_revenue) AS revenue FROM lineorder JOIN supplier ON "
                                  "lo_suppkey = s_suppkey WHERE s_region = '{region}' GROUP BY s_name "
                                  "ORDER BY revenue DESC LIMIT 10"),
    ("orders in a year", "SELECT COUNT(*) AS orders, AVG(lo_quantity) AS quantity FROM lineorder JOIN ddate ON "
                         "lo_orderdate = d_datekey WHERE d_year = {year}"),
)


def random_params(query_id: str, r: random.Random) -> dict[str, Any]:
    """Parameters for one query; an id this module does not know runs with its defaults ({})."""
    generator = GENERATORS.get(query_id)
    return generator(r) if generator else {}


def random_sql(r: random.Random) -> tuple[str, str]:
    name, template = r.choice(AD_HOC)
    return name, template.format(year=r.randint(1992, 1998), region=r.choice(REGIONS))
