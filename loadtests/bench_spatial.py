"""Geometry-join benchmark: Switchyard's spatial engines against GeoPandas sjoin (shapely STRtree) and PostGIS,
on real polygons shipped inside PyPI packages (no run-time download), in one run.

    python loadtests/bench_spatial.py [--points 1000000] [--postgis-url postgresql://...]

Polygon sets: 177 Natural Earth countries (pyogrio's bundled naturalearth_lowres) and 3,233 US counties
(bokeh-sampledata). For each, --points seeded uniform points over the world, or over the contiguous US box. Timed
(median of --runs after a warm-up): Switchyard's point-in-polygon counts through HTTP (layers uploaded as GeoParquet)
and the same engine in-process, GeoPandas sjoin(points, polygons, predicate="intersects") on prebuilt GeoDataFrames (its
index build included, as a user would pay it), and PostGIS (points with a GiST index, ST_Intersects) when
--postgis-url is given. Every system's per-polygon counts are compared. Then the distance join: --distance-points
clustered points at 1 km, checked against a brute-force haversine on a seeded sample of points.
Writes JSON and a PNG under results_dir("spatial") (loadtests/processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson

from benchkit import MachineLoad, Service, results_dir, save_json, switchyard, versions, wait_for_quiet
from switchyard_client import Client

RESULTS = results_dir("spatial")


# Where the points fall: the world for countries; the contiguous US for counties (the counties' own bounds
# span the Aleutians across the antimeridian, which would leave almost every point in the ocean).
EXTENTS = {"countries": None, "us_counties": (-125.0, 24.5, -66.9, 49.4)}


def polygon_sets() -> dict[str, Any]:
    """GeoDataFrames of real polygons from installed packages (EPSG:4326 lon/lat)."""
    import geopandas as gpd
    import pyogrio
    from bokeh_sampledata import us_counties

    countries_path = Path(pyogrio.__file__).parent / "tests/fixtures/naturalearth_lowres/naturalearth_lowres.shp"
    countries = gpd.read_file(countries_path)[["geometry"]]
    records = us_counties.records()
    counties = gpd.GeoDataFrame(geometry=[r["geometry"] for r in records], crs="EPSG:4326")
    return {"countries": countries.reset_index(drop=True), "us_counties": counties}


def timed(fn: Callable[[], Any], runs: int) -> tuple[dict[str, float], Any]:
    answer = fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        answer = fn()
        times.append(time.perf_counter() - started)
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4)}, answer


def geoparquet(geoms: Any) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import shapely

    sink = io.BytesIO()
    pq.write_table(pa.table({"geometry": shapely.to_wkb(np.asarray(geoms))}), sink)
    return sink.getvalue()


def haversine_m(lon1, lat1, lon2, lat2, r=6371008.8):
    p1, p2 = np.radians(lat1), np.radians(lat2)
    a = np.sin((p2 - p1) / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(np.radians(lon2 - lon1) / 2) ** 2
    return 2 * r * np.arcsin(np.sqrt(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--distance-points", type=int, default=200_000)
    ap.add_argument("--radius-m", type=float, default=1000.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--postgis-url", help="a PostgreSQL with PostGIS to measure side by side")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    import geopandas as gpd
    import shapely

    from spatial.cpu_engine import CpuSpatialEngine
    from spatial.geoarrow import points_from_lonlat, polygons_from_shapely

    sets = polygon_sets()
    work = Path(tempfile.mkdtemp(prefix="bench-spatial-"))
    (work / "data").mkdir()
    service = Service(work / "data", env={"SWITCHYARD_MAX_BODY_BYTES": str(512 * 1024 * 1024)})
    service.start()
    load = MachineLoad(service.pids)
    client = switchyard(service.url)
    engine = CpuSpatialEngine()
    report: dict[str, Any] = {"benchmark": "spatial", "points": args.points, "runs": args.runs,
                              "versions": versions("switchyard", "shapely", "geopandas", "numba", "numpy"),
                              "sets": {}, "machine": {}}
    try:
        for name, polys in sets.items():
            rng = np.random.default_rng(args.seed)
            minx, miny, maxx, maxy = EXTENTS[name] or polys.total_bounds
            lon, lat = rng.uniform(minx, maxx, args.points), rng.uniform(miny, maxy, args.points)
            point_geoms = shapely.points(lon, lat)
            pts_gdf = gpd.GeoDataFrame(geometry=point_geoms, crs="EPSG:4326")
            out: dict[str, Any] = {"polygons": len(polys),
                                   "vertices": int(shapely.get_num_coordinates(polys.geometry.values).sum())}
            print(f"{name}: {len(polys)} polygons, {args.points} points")

            client.upload_geoparquet(f"pts-{name}", "points", geoparquet(point_geoms))
            client.upload_geoparquet(f"poly-{name}", "polygons", geoparquet(polys.geometry.values))
            wait_for_quiet()
            counts: dict[str, list[int]] = {}
            with load.measure(report["machine"].setdefault(f"{name} switchyard http", {})):
                t, answer = timed(lambda: client.point_in_polygon_counts(f"pts-{name}", f"poly-{name}", engine="cpu"),
                                  args.runs)
            out["switchyard cpu (HTTP)"], counts["switchyard cpu (HTTP)"] = t, answer.counts.tolist()

            points = points_from_lonlat(lon, lat)
            polygons = polygons_from_shapely(polys.geometry.values)
            with load.measure(report["machine"].setdefault(f"{name} switchyard in-process", {})):
                t, c = timed(lambda: engine.pip_counts(points, polygons), args.runs)
            out["switchyard cpu (in-process)"], counts["switchyard cpu (in-process)"] = t, np.asarray(c).tolist()

            def sjoin() -> list[int]:
                fresh = gpd.GeoDataFrame(geometry=pts_gdf.geometry.values, crs="EPSG:4326")  # no cached index
                joined = gpd.sjoin(fresh, polys, predicate="intersects", how="inner")
                return np.bincount(joined["index_right"].to_numpy(), minlength=len(polys)).tolist()

            with load.measure(report["machine"].setdefault(f"{name} geopandas", {})):
                t, c = timed(sjoin, args.runs)
            out["geopandas sjoin"], counts["geopandas sjoin"] = t, c

            if args.postgis_url:
                with load.measure(report["machine"].setdefault(f"{name} postgis", {})):
                    t, c = asyncio.run(_postgis(args.postgis_url, lon, lat, polys, args.runs))
                out["postgis"], counts["postgis"] = t, c

            reference = counts["geopandas sjoin"]
            out["counts_agree"] = {system: c == reference for system, c in counts.items()}
            out["matched_points"] = int(sum(reference))
            ours = out["switchyard cpu (HTTP)"]["median_s"]
            out["ratios"] = {"geopandas_over_switchyard_http": round(out["geopandas sjoin"]["median_s"] / ours, 2)}
            if "postgis" in out:
                out["ratios"]["postgis_over_switchyard_http"] = round(out["postgis"]["median_s"] / ours, 2)
            report["sets"][name] = out
            timings = {k: v for k, v in out.items() if isinstance(v, dict) and "median_s" in v}
            print(f"  {orjson.dumps(timings).decode()}")
            print(f"  ratios {out['ratios']}, counts agree {out['counts_agree']}")

        report["distance"] = _distance(client, engine, args, load, report)
    finally:
        client.close()
        service.stop()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"bench_spatial-{stamp}.json", report)
    plot(args.out / f"bench_spatial-{stamp}.png", report)
    print(f"wrote {args.out / f'bench_spatial-{stamp}.json'} and .png")


def _distance(client: Client, engine: Any, args: argparse.Namespace, load: MachineLoad,
              report: dict) -> dict[str, Any]:
    """Clustered points (cities-like, some across the antimeridian), R metres, checked on a sample."""
    rng = np.random.default_rng(args.seed + 1)
    centers = np.column_stack([rng.uniform(-180, 180, 400), rng.uniform(-70, 70, 400)])
    centers[:20, 0] = rng.choice([-179.995, 179.995], 20)
    pick = rng.integers(0, len(centers), args.distance_points)
    lon = (centers[pick, 0] + rng.normal(0, 0.05, args.distance_points) + 180) % 360 - 180
    lat = np.clip(centers[pick, 1] + rng.normal(0, 0.05, args.distance_points), -90, 90)
    client.create_points("dist", lon, lat)
    started = time.perf_counter()
    with load.measure(report["machine"].setdefault("distance join http", {})):
        joined = client.within_distance("dist", "dist", args.radius_m, page_size=100_000)  # every page
    took = time.perf_counter() - started
    pairs = list(zip(joined.left.tolist(), joined.right.tolist()))
    sample = rng.choice(args.distance_points, 500, replace=False)
    by_point: dict[int, set[int]] = {int(i): set() for i in sample}
    for i, j in pairs:
        if i in by_point:
            by_point[i].add(j)
        if j in by_point:
            by_point[j].add(i)
    exact = True
    for i in sample:
        d = haversine_m(lon[i], lat[i], lon, lat)
        want = set(np.flatnonzero(d <= args.radius_m).tolist()) - {int(i)}
        exact &= want == by_point[int(i)]
    print(f"distance join: {args.distance_points} points, R={args.radius_m:g} m: {len(pairs)} pairs in {took:.2f} s; "
          f"sample of 500 equals brute force: {exact}")
    return {"points": args.distance_points, "radius_m": args.radius_m, "pairs": len(pairs),
            "seconds_http": round(took, 3),
            "sample_checked": 500, "sample_equals_brute_force": bool(exact)}


async def _postgis(url: str, lon: np.ndarray, lat: np.ndarray, polys: Any,
                   runs: int) -> tuple[dict[str, float], list[int]]:
    import asyncpg
    import shapely

    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS postgis")
        await conn.execute("DROP TABLE IF EXISTS bench_lonlat, bench_pts, bench_polys")
        await conn.execute("CREATE TABLE bench_lonlat (id bigint, lon float8, lat float8)")
        await conn.copy_records_to_table("bench_lonlat", records=list(zip(range(len(lon)), lon.tolist(), lat.tolist())))
        await conn.execute("CREATE TABLE bench_pts AS SELECT id, "
                           "ST_SetSRID(ST_MakePoint(lon, lat), 4326)::geometry(Point, 4326) AS geom FROM bench_lonlat")
        await conn.execute("CREATE TABLE bench_polys (id bigint, geom geometry(MultiPolygon, 4326))")
        multi = [shapely.MultiPolygon([g]) if g.geom_type == "Polygon" else g for g in polys.geometry.values]
        await conn.executemany("INSERT INTO bench_polys VALUES ($1, ST_GeomFromText($2, 4326))",
                               [(i, g.wkt) for i, g in enumerate(multi)])
        await conn.execute("CREATE INDEX ON bench_pts USING gist (geom)")
        await conn.execute("ANALYZE bench_pts")
        await conn.execute("ANALYZE bench_polys")
        sql = ("SELECT p.id, count(t.id) FROM bench_polys p LEFT JOIN bench_pts t ON ST_Intersects(p.geom, t.geom) "
               "GROUP BY p.id ORDER BY p.id")
        rows = await conn.fetch(sql)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            rows = await conn.fetch(sql)
            times.append(time.perf_counter() - started)
        return ({"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
                 "max_s": round(max(times), 4)}, [r["count"] for r in rows])
    finally:
        await conn.close()


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5))
    for ax, name in zip(np.atleast_1d(axes), sets):
        out = report["sets"][name]
        systems = [k for k, v in out.items() if isinstance(v, dict) and "median_s" in v]
        ax.bar(range(len(systems)), [out[s]["median_s"] for s in systems])
        ax.set_xticks(range(len(systems)), [s.replace(" (", "\n(") for s in systems], fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"{report['points']:,} points x {out['polygons']:,} {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
