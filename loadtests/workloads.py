"""`switchyard loadtest vectors-mixed | spatial | olap`: data prepared through the API, then one Locust run per
users level (every kind of request of the workload mixed in each run)."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import numpy as np

from loadtests import capacity, report
from loadtests.client import Api, ServiceError
from loadtests.sweep import Point, Sweep


def _run_users(args: argparse.Namespace, out: Path, url: str, locustfile: str, point_args: list[str],
               summarize: Callable[[dict[str, Any]], dict[str, Any]]) -> list[dict[str, Any]]:
    sweep = Sweep(out, args.duration, args.processes, args.locust_arg, args.api_key or "", total=len(args.users))
    rows = []
    for users in args.users:
        row = sweep.run(Point(f"{args.workload}-u{users}", locustfile, users, url, point_args))
        figures = {"users": users, "folder": row["folder"], "by_request": report.request_figures(row),
                   **summarize(row)}
        main = next(iter(figures["by_request"].values()), None)
        print(f" {sum(r['answers_per_s'] for r in figures['by_request'].values()):,.1f} answers/s, "
              f"{sum(r['failures'] for r in figures['by_request'].values())} failures"
              + (f", first request p99 {main['p99_ms']} ms" if main else ""), file=sys.stderr)
        rows.append(figures)
    return rows


def _finish(out: Path, summary: dict[str, Any]) -> int:
    report.write(out, summary)
    print(f"report: {out / 'summary.md'}", file=sys.stderr)
    print((out / "summary.md").read_text())
    return 0


# -- vectors-mixed ----------------------------------------------------------------------------------------------
LEVELS = ("strong", "session", "bounded", "eventually")


def promised_gone(level: str, acked_at: float, seq: int, sent_at: float, session_seq: int, bound_s: float) -> bool:
    """Did `level` promise that a delete acknowledged at `acked_at` (monotonic seconds) with `seq` is applied for a
    search sent at `sent_at` carrying `session_seq`? strong: once acknowledged; session: once the search carries
    its seq; bounded: `bound_s` after the acknowledgement; eventually: never. A deleted id returned where the level
    did not promise it gone is within the level's bound: no failure (mixed_vectors.py counts it apart)."""
    if level == "strong":
        return acked_at <= sent_at
    if level == "session":
        return seq <= session_seq
    if level == "bounded":
        return acked_at <= sent_at - bound_s
    return False


def read_your_writes(tally: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per level: probes right after writes, and deleted ids returned by any search (probes and background): those
    that broke the level's promise (failures) and those within its bound (not failures), apart."""
    out = {}
    for level in LEVELS:
        up, down = (tally.get(f"ryw:upsert:{level}:probes", 0), tally.get(f"ryw:upsert:{level}:ok", 0))
        dp, gone = (tally.get(f"ryw:delete:{level}:probes", 0), tally.get(f"ryw:delete:{level}:ok", 0))
        returned = dp - gone + tally.get(f"deleted_returned:{level}", 0)
        broken = tally.get(f"deleted_returned_broken:{level}", 0)
        out[level] = {"upsert_probes": up, "upsert_found": down, "delete_probes": dp, "delete_gone": gone,
                      "deleted_returned": returned, "deleted_returned_broken": broken,
                      "deleted_returned_within_bound": returned - broken}
    return out


def vectors_mixed(args: argparse.Namespace) -> int:
    from loadtests import datasets
    from loadtests.runner import _environment, _out_dir, _prepare_collection

    out = _out_dir(args, "vectors-mixed")
    data = datasets.load_vectors(args.vectors, None, args.rows, args.dim, 200, "l2", args.seed)
    folder = datasets.save(out / "dataset", data, datasets.exact_neighbors(data.base, data.queries, "l2", 10),
                           args.collection)
    summary: dict[str, Any] = {"workload": "vectors-mixed", "environment": _environment(args),
                               "serve_workers": None if args.url else args.serve_workers,
                               "write_rate": args.write_rate, "write_batch": args.write_batch,
                               "consistency": args.consistency or "service default"}
    with ExitStack() as stack:
        url = _service(args, stack, out)
        api = Api(url, args.api_key)
        summary["load"] = _prepare_collection(api, args, data)
        args.users, summary["admitted_users"] = capacity.users_for(args, "vectors", args.engine, api)
        point_args = ["--collection", args.collection, "--dataset", str(folder), "--engine", args.engine,
                      "--write-rate", str(args.write_rate), "--write-batch", str(args.write_batch),
                      "--bound-ms", str(args.bound_ms)] + (["--consistency", args.consistency]
                                                           if args.consistency else [])
        summary["points"] = _run_users(args, out, url, "mixed_vectors.py", point_args,
                                       lambda row: {"read_your_writes": read_your_writes(row["tally"]),
                                                    "background_searches": row["tally"].get("background_searches", 0)})
    return _finish(out, summary)


def _service(args: argparse.Namespace, stack: ExitStack, out: Path) -> str:
    from loadtests.runner import _service as start

    return start(args, stack, out, args.serve_workers)


# -- spatial ----------------------------------------------------------------------------------------------------
def _seeded_points(n: int, seed: int, box: tuple[float, float, float, float]) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(seed)
    lon = rng.uniform(box[0], box[2], n)
    lat = rng.uniform(box[1], box[3], n)
    return lon.round(6).tolist(), lat.round(6).tolist()


def _seeded_polygons(n: int, seed: int) -> list[str]:
    """n star-shaped polygons (8-14 vertices) scattered over the land latitudes, some overlapping."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cx, cy, size = rng.uniform(-170, 170), rng.uniform(-55, 70), rng.uniform(1, 8)
        m = int(rng.integers(8, 15))
        angles = (np.arange(m) + rng.uniform(0, 0.8, m)) * (2 * np.pi / m)  # spaced apart: always a simple ring
        radii = size * rng.uniform(0.5, 1.0, m)
        ring = [(cx + r * np.cos(a), cy + r * np.sin(a)) for a, r in zip(angles, radii)]
        ring.append(ring[0])
        out.append("POLYGON((" + ", ".join(f"{x:.5f} {y:.5f}" for x, y in ring) + "))")
    return out


def _layer(api: Api, name: str, kind: str, body: dict[str, Any] | None, file: str | None) -> int:
    api.call("DELETE", f"/v1/spatial/layers/{name}", ok=(204, 404))
    if file:
        with open(file, "rb") as f:
            answer = api.call("PUT", f"/v1/spatial/layers/{name}", params={"kind": kind}, content=f.read(),
                              headers={"Content-Type": "application/vnd.apache.parquet"})
    else:
        answer = api.call("POST", "/v1/spatial/layers", json={"name": name, "kind": kind, **(body or {})})
    print(f"  layer {name}: {answer['count']:,} {kind}", file=sys.stderr)
    return answer["count"]


def _warm_spatial(api: Api, args: argparse.Namespace) -> None:
    """One join of each kind before measuring: the first call compiles the engine's kernels (seconds)."""
    print("warming up the joins (kernels compile on first use) ...", file=sys.stderr)
    pip = {"points": "lt_points", "polygons": "lt_polygons", "engine": args.engine}
    api.call("POST", "/v1/spatial/joins/point-in-polygon", json={**pip, "mode": "counts"})
    api.call("POST", "/v1/spatial/joins/point-in-polygon", json={**pip, "mode": "pairs", "page_size": args.page_size})
    api.call("POST", "/v1/spatial/joins/within-distance", json={"left": "lt_near", "right": "lt_near",
                                                                "radius_m": args.radius_m, "engine": args.engine,
                                                                "page_size": args.page_size})


def spatial(args: argparse.Namespace) -> int:
    from loadtests.runner import _environment, _out_dir

    out = _out_dir(args, "spatial")
    summary: dict[str, Any] = {"workload": "spatial", "environment": _environment(args), "radius_m": args.radius_m}
    with ExitStack() as stack:
        url = _service(args, stack, out)
        api = Api(url, args.api_key)
        print("preparing layers ...", file=sys.stderr)
        lon, lat = _seeded_points(args.points, args.seed, (-180, -60, 180, 75))
        near_lon, near_lat = _seeded_points(args.distance_points, args.seed + 1, (2.2, 48.8, 2.45, 48.92))  # Paris
        summary["layers"] = {
            "points": _layer(api, "lt_points", "points", {"lon": lon, "lat": lat}, args.points_file),
            "polygons": _layer(api, "lt_polygons", "polygons", {"wkt": _seeded_polygons(args.polygons, args.seed)},
                               args.polygons_file),
            "distance": _layer(api, "lt_near", "points", {"lon": near_lon, "lat": near_lat}, None)}
        _warm_spatial(api, args)
        args.users, summary["admitted_users"] = capacity.users_for(args, "spatial", args.engine, api)
        point_args = ["--radius-m", str(args.radius_m), "--engine", args.engine, "--page-size", str(args.page_size),
                      "--max-pages", str(args.max_pages), "--tasks", args.tasks]
        summary["points"] = _run_users(args, out, url, "spatial_joins.py", point_args,
                                       lambda row: {"engines": {k: v for k, v in row["tally"].items()
                                                                if k.startswith("engine:")}})
    return _finish(out, summary)


# -- olap -------------------------------------------------------------------------------------------------------
def _ssb_ready(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    active = [d for d in api.call("GET", "/v1/olap/ssb/datasets") if d.get("active")]
    if args.tbl:
        body = {"path": str(Path(args.tbl).resolve()), "name": Path(args.tbl).name}
        api.wait_job(api.call("POST", "/v1/olap/ssb/import", json=body), f"import {args.tbl}")
    elif not active or (args.sf is not None and float(active[0].get("scale_factor", -1)) != args.sf):
        sf = args.sf if args.sf is not None else 0.1
        api.wait_job(api.call("POST", "/v1/olap/ssb/generate", json={"scale_factor": sf, "seed": 0}),
                     f"generate SSB SF {sf}")
    active = [d for d in api.call("GET", "/v1/olap/ssb/datasets") if d.get("active")]
    if not active:
        raise ServiceError("no SSB dataset is loaded in the engines")
    return {k: active[0].get(k) for k in ("scale_factor", "rows", "source", "path")}


def olap(args: argparse.Namespace) -> int:
    from loadtests.runner import _environment, _out_dir

    out = _out_dir(args, "olap")
    summary: dict[str, Any] = {"workload": "olap", "environment": _environment(args), "engine": args.engine}
    if args.tbl and not args.url:  # the service started here must be allowed to read the .tbl files
        args.serve_env.append(f"SWITCHYARD_SSB_IMPORT_DIR={Path(args.tbl).resolve().parent}")
    with ExitStack() as stack:
        url = _service(args, stack, out)
        api = Api(url, args.api_key)
        summary["dataset"] = _ssb_ready(api, args)
        args.users, summary["admitted_users"] = capacity.users_for(args, "olap", args.engine, api)
        point_args = ["--engine", args.engine, "--sql-share", str(args.sql_share)] + (
            ["--queries", args.queries] if args.queries else [])
        summary["points"] = _run_users(args, out, url, "olap_queries.py", point_args,
                                       lambda row: {"engines": {k: v for k, v in row["tally"].items()
                                                                if k.startswith(("engine:", "fallback:"))}})
    return _finish(out, summary)


# -- the command line -------------------------------------------------------------------------------------------
def add_parsers(sub: Any, common: Callable[[argparse.ArgumentParser, str], None]) -> None:
    m = sub.add_parser("vectors-mixed", help="searches while writes stream in; read-your-writes per consistency level")
    common(m, "4,16")
    m.set_defaults(serve_workers=2, run=vectors_mixed)
    m.add_argument("--collection", default="loadtest_mixed")
    m.add_argument("--vectors", help=".npy (n, dim) float32 to start from (default: a seeded Gaussian mixture)")
    m.add_argument("--rows", type=int, default=20_000)
    m.add_argument("--dim", type=int, default=128)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--index", default="hnsw")
    m.add_argument("--index-params",
                   help="resident index build parameters as JSON (default for hnsw: m, ef_construction)")
    m.add_argument("--m", type=int, default=16)
    m.add_argument("--ef-construction", type=int, default=64)
    m.add_argument("--reuse", action="store_true")
    m.add_argument("--engine", default="auto")
    m.add_argument("--consistency", default="", help="level of the background searches (default: the service's)")
    m.add_argument("--write-rate", type=float, default=20, help="write requests per second (default 20)")
    m.add_argument("--write-batch", type=int, default=10, help="points per upsert (default 10)")
    m.add_argument("--bound-ms", type=float, default=1000, help="the service's SWITCHYARD_BOUNDED_STALENESS_MS")

    s = sub.add_parser("spatial", help="point-in-polygon (counts, paged pairs) and within-distance joins")
    common(s, "1,4,16")
    s.set_defaults(run=spatial)
    s.add_argument("--points", type=int, default=100_000, help="seeded points over the world (default 100,000)")
    s.add_argument("--polygons", type=int, default=200, help="seeded polygons (default 200)")
    s.add_argument("--points-file", help="GeoParquet of points instead of the seeded ones")
    s.add_argument("--polygons-file", help="GeoParquet of polygons instead of the seeded ones")
    s.add_argument("--distance-points", type=int, default=20_000, help="seeded points in a city for the distance join")
    s.add_argument("--radius-m", type=float, default=100)
    s.add_argument("--engine", default="auto")
    s.add_argument("--page-size", type=int, default=10_000)
    s.add_argument("--max-pages", type=int, default=3)
    s.add_argument("--tasks", default="pip-counts,pip-pairs,distance")
    s.add_argument("--seed", type=int, default=0)

    o = sub.add_parser("olap", help="the 13 SSB queries with random parameters, and ad-hoc SQL")
    common(o, "1,4,16")
    o.set_defaults(run=olap)
    o.add_argument("--sf", type=float, help="generate this SSB scale factor unless the engines hold it (default 0.1)")
    o.add_argument("--tbl", help="import ssb-dbgen .tbl files from this directory instead")
    o.add_argument("--engine", default="auto")
    o.add_argument("--queries", default="", help="query ids to mix (default all 13)")
    o.add_argument("--sql-share", type=float, default=0.2)
