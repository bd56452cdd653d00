"""The spatial joins through HTTP, for `make gpu-check` (loadtests/gpu_check.py): what a request costs a client.

Starts `switchyard serve` (loadtests/processes.local_service: embedded PostgreSQL in a temporary data directory, the
default process layout), uploads through the API with switchyard_client (the points as GeoParquet, PUT
/v1/spatial/layers/{name}; the polygons as WKB in JSON), then times, with an httpx client over TCP to 127.0.0.1,
for each engine asked for ("gpu" and "cpu" by default): the first point-in-polygon count after start (the cold
one) and its repeats, the first page of (point, polygon) pairs, and every page of a distance self-join followed by
repeats of its first page. Each row has the client's wall time and the answer's took_ms. The engines' answers are
compared: counts and pair pages exactly, distances within gpu_spatial.RTOL / ATOL_M. A repeat may be served from
an engine's cache of join results (through HTTP nothing drops it): rows say "repeat", never "compute".
"""

from __future__ import annotations

import importlib.util
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from loadtests.gpu_spatial import RADIUS_M, Clock, clustered_points, compare_pairs, star_polygons, uniform_points

SIZES = (  # normal, --quick
    {"points": 2_000_000, "polygons": 3_000, "distance_points": 200_000, "radius_m": RADIUS_M},
    {"points": 100_000, "polygons": 300, "distance_points": 20_000, "radius_m": RADIUS_M},
)
ENGINES = ("gpu", "cpu")
ENGINE_NAMES = {"gpu": "cuda-spatial", "cpu": "cpu-spatial"}
PIP_PAGE_POINTS = 10_000  # points per page of PIP pairs (the API's default)
DISTANCE_PAGE_PAIRS = 100_000  # pairs per distance page (the API's most)
MAX_BODY_BYTES = 256 << 20  # a 2,000,000-point GeoParquet upload is about 45 MB; the default limit is 64 MiB
PIP = "/v1/spatial/joins/point-in-polygon"
DISTANCE = "/v1/spatial/joins/within-distance"


class HttpFailure(RuntimeError):
    pass


def points_geoparquet(x: np.ndarray, y: np.ndarray) -> bytes:
    """A GeoParquet file of points (WKB `geometry`, ids by position), built with numpy and pyarrow alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(x)
    wkb = np.empty(n, dtype=np.dtype([("order", "u1"), ("type", "<u4"), ("x", "<f8"), ("y", "<f8")]))  # 21 bytes
    wkb["order"], wkb["type"], wkb["x"], wkb["y"] = 1, 1, x, y  # little-endian Point
    offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int64) * wkb.dtype.itemsize).tobytes())
    column = pa.Array.from_buffers(pa.large_binary(), n, [None, offsets, pa.py_buffer(wkb.tobytes())])
    sink = io.BytesIO()
    pq.write_table(pa.table({"geometry": column}), sink, compression="zstd")
    return sink.getvalue()


def _client_versions() -> dict[str, str]:
    import httpx

    import switchyard_client

    transport = "pycurl (libcurl)" if importlib.util.find_spec("pycurl") else "http.client"
    return {"uploads": f"switchyard_client {switchyard_client.__version__}, Client(transport='auto'): {transport}",
            "timed_requests": f"httpx {httpx.__version__} Client: HTTP/1.1 keep-alive, JSON bodies",
            "transport": "TCP to 127.0.0.1 (loopback)"}


def _layout() -> dict[str, Any]:
    try:
        from service.settings import Settings

        settings = Settings()
        return {"fronts": settings.front_processes, "engine_processes": settings.engine_processes}
    except Exception as exc:  # noqa: BLE001 - informative only
        return {"unknown": f"{type(exc).__name__}: {exc}"[:300]}


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (request, engine): the first call's wall and took_ms, and the medians of the later ones."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        entry = out.setdefault((row["request"], row["engine"]), {"request": row["request"], "engine": row["engine"],
                                                                 "answered_by": row["answered_by"], "later": []})
        if row["call"] == "first":
            entry.update(first_wall_ms=row["wall_ms"], first_took_ms=row["took_ms"])
        else:
            entry["later"].append(row)
    for entry in out.values():
        later = entry.pop("later")
        if later:
            entry["later_calls"] = len(later)
            entry["later_wall_ms_median"] = round(statistics.median(r["wall_ms"] for r in later), 3)
            took = [r["took_ms"] for r in later if r["took_ms"] is not None]
            entry["later_took_ms_median"] = round(statistics.median(took), 3) if took else None
    return list(out.values())


def bench_http(size: dict[str, Any], runs: int, budget_s: float | None = None,
               progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    import httpx

    from loadtests.processes import local_service
    from spatial.geoarrow import polygons_to_shapely
    from switchyard_client import Client

    clock = Clock(budget_s)
    engines = list(size.get("engines", ENGINES))
    radius = float(size.get("radius_m", RADIUS_M))
    out: dict[str, Any] = {"engines_asked": engines, "points": size["points"], "polygons": size["polygons"],
                           "distance_points": size["distance_points"], "radius_m": radius, "runs": runs,
                           "client": _client_versions(), "layout": _layout(), "uploads": {}, "requests": [],
                           "answers": {}, "cut": [], "failures": []}
    points, polygons = uniform_points(size["points"], 0), star_polygons(size["polygons"], 1)
    near = clustered_points(size["distance_points"], 2)
    started = time.perf_counter()
    bodies = {"points": points_geoparquet(points.x, points.y), "near": points_geoparquet(near.x, near.y)}
    shapes = polygons_to_shapely(polygons)
    out["client_encode_s"] = round(time.perf_counter() - started, 3)
    del points, near
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-http-"))
    log = folder / "serve.log"

    def report() -> None:
        if progress is not None:
            progress(out)

    def post(http: httpx.Client, path: str, body: dict[str, Any], request: str, call: str) -> dict[str, Any]:
        started = time.perf_counter()
        r = http.post(path, json=body, timeout=max(10.0, min(clock.left(), 600.0)))
        wall_ms = (time.perf_counter() - started) * 1000
        if r.status_code != 200:
            raise HttpFailure(f"{request} ({body.get('engine')}): HTTP {r.status_code}: {r.text[:500]}")
        answer = r.json()
        out["requests"].append({"request": request, "engine": body["engine"], "call": call,
                                "wall_ms": round(wall_ms, 3), "took_ms": answer.get("took_ms"),
                                "answered_by": answer.get("engine"), "fallback": answer.get("fallback")})
        return answer

    def requests(http: httpx.Client, engine: str) -> dict[str, Any]:
        """One engine's requests: the first PIP count (the cold one) and its repeats, the first page of pairs,
        every distance page and repeats of the first; what it answered, for the comparison."""
        mine: dict[str, Any] = {}
        body: dict[str, Any] = {"points": "gc-points", "polygons": "gc-zones", "mode": "counts", "engine": engine}
        answer = post(http, PIP, body, "pip counts", "first")
        mine["counts"] = (answer["polygon_ids"], answer["counts"])
        for _ in range(runs):
            if clock.left() < 5:
                out["cut"].append(f"{engine}: pip counts repeats cut: out of time")
                break
            post(http, PIP, body, "pip counts", "repeat")
        body = {**body, "mode": "pairs", "page_size": PIP_PAGE_POINTS}
        mine["pip_page"] = post(http, PIP, body, "pip pairs, first page", "first")["pairs"]
        post(http, PIP, body, "pip pairs, first page", "repeat")
        body = {"left": "gc-near", "right": "gc-near", "radius_m": radius, "engine": engine,
                "page_size": DISTANCE_PAGE_PAIRS}
        pairs: list[Any] = []
        distances: list[float] = []
        cursor, page = None, 0
        while True:
            if clock.left() < 5:
                out["cut"].append(f"{engine}: distance pages after page {page} cut: out of time")
                return mine
            answer = post(http, DISTANCE, {**body, "cursor": cursor},
                          "distance, first page" if page == 0 else "distance, later pages",
                          "first" if page == 0 else "page")
            pairs.extend(answer["pairs"])
            distances.extend(answer["distances_m"])
            cursor, page = answer.get("next_cursor"), page + 1
            if cursor is None:
                break
        out.setdefault("distance_pages", {})[engine] = page
        for _ in range(runs):
            if clock.left() < 5:
                break
            post(http, DISTANCE, {**body, "cursor": None}, "distance, first page", "repeat")
        matrix = np.asarray(pairs, np.int64).reshape(-1, 2)
        mine["distance"] = [matrix[:, 0], matrix[:, 1], np.asarray(distances, np.float64)]
        return mine

    got: dict[str, dict[str, Any]] = {}
    try:
        ready_s = max(30.0, min(240.0, clock.left() - 20))
        started = time.perf_counter()
        with local_service(1, folder / "data", log, env={"SWITCHYARD_MAX_BODY_BYTES": str(MAX_BODY_BYTES)},
                           ready_s=ready_s) as url:
            out["ready_s"] = round(time.perf_counter() - started, 2)
            out["url"] = url
            with httpx.Client(base_url=url) as http:
                listed = http.get("/v1/engines", params={"domain": "spatial"}).json()
                listed = listed.get("engines", listed) if isinstance(listed, dict) else listed
                out["engines"] = {e["name"]: {"available": e.get("available"), "ready": e.get("ready"),
                                              "reason": e.get("reason")} for e in listed}
                for engine in list(engines):
                    name = ENGINE_NAMES.get(engine)
                    if name and not out["engines"].get(name, {}).get("available"):
                        why = out["engines"].get(name, {}).get("reason") or "not listed"
                        out["failures"].append(f"{name} is not available in the service: {why}")
                        engines.remove(engine)
                with Client(url, timeout=max(60.0, clock.left())) as sy:
                    for layer, kind, body in (("gc-points", "points", bodies["points"]), ("gc-zones", "polygons", None),
                                              ("gc-near", "points", bodies["near"])):
                        started = time.perf_counter()
                        if body is None:  # WKB in JSON
                            answer = sy.create_polygons(layer, shapes)
                        else:  # GeoParquet, PUT
                            answer = sy.upload_geoparquet(layer, kind, body)
                        out["uploads"][layer] = {"rows": answer.get("count"), "bytes": len(body) if body else None,
                                                 "seconds": round(time.perf_counter() - started, 3),
                                                 "as": "WKB in JSON" if body is None else "GeoParquet"}
                report()
                for engine in engines:
                    if clock.left() < 5:
                        out["cut"].append(f"the {engine} engine's requests cut: out of time")
                        continue
                    try:
                        got[engine] = requests(http, engine)
                    except (HttpFailure, httpx.HTTPError, KeyError, ValueError) as exc:
                        out["failures"].append(f"{engine}: {type(exc).__name__}: {exc}"[:2000])
                    report()
    except Exception as exc:  # noqa: BLE001 - reported with the service's log; the parts measured stay
        out["failures"].append(f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        out["serve_log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else None
        shutil.rmtree(folder, ignore_errors=True)
    out["summary"] = _summary(out["requests"])
    if len(got) >= 2:
        (a, first), (b, second) = list(got.items())[:2]
        answers: dict[str, Any] = {"compared": [a, b]}
        answers["counts_equal"] = first["counts"] == second["counts"]
        answers["matched"] = int(np.sum(first["counts"][1]))
        answers["pip_page_equal"] = first["pip_page"] == second["pip_page"]
        answers["pip_page_pairs"] = len(first["pip_page"])
        if "distance" in first and "distance" in second:
            answers["distance_pairs"] = int(len(second["distance"][0]))
            answers.update({f"distance_{k}": v for k, v in compare_pairs(first["distance"],
                                                                        second["distance"]).items()})
        out["answers"] = answers
        if not (answers["counts_equal"] and answers["pip_page_equal"] and answers.get("distance_pairs_equal", True)
                and answers.get("distance_distances_equal", True)):
            out["failures"].append(f"the answers of {a} and {b} through HTTP differ")
    elif not out["failures"] and not out["cut"]:
        out["failures"].append("fewer than two engines answered: nothing compared")
    return out
