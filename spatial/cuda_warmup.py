"""The GPU spatial engine's warm-up: at engine start, every kernel compiled and launched and every array step run
at request sizes, on synthetic layers whose answers are known, and the answers checked.

numba-cuda compiles a kernel at its first launch for the argument types it gets, and CuPy compiles its elementwise,
scan and mask kernels at first use (some only for arrays past one block): a warm-up on two points left all of that
to the first request (4.7 s for a 2,000,000-point count on an H200). A device or a pair of library versions that
cannot run the kernels (numba-cuda 0.30.4 with numpy 2.5) or answers wrong raises WarmUpError, so the registry
reports the engine unavailable with the reason. Sizes and measurements: docs/design/spatial.md.
"""

from __future__ import annotations

import importlib.metadata
import math
import time
from typing import Any

import numpy as np

from . import device_distance
from .geoarrow import Points, Polygons, points_from_lonlat

WARM_UP_POINTS = 1 << 18  # half a million PIP candidates: array steps at a request's sizes
SIMULATOR_WARM_UP_POINTS = 320  # the simulator runs every thread in Python
RADIUS_M = 500.0
X0, Y0 = 10.0, 10.0  # the lower left corner of the boxes' grid
STEP = 2.0 ** -10  # degrees between a cluster's points: exact in binary, so every neighbour pair on one parallel
#                    has the same distance bit for bit (pairs exactly at a radius, for the band)


class WarmUpError(RuntimeError):
    """The engine cannot serve here: a kernel did not launch, or a known answer came back wrong."""


def boxes(side: int) -> Polygons:
    """side x side unit squares from (X0, Y0), geometry g = row * side + column, each one closed ring."""
    g = np.arange(side * side)
    x0, y0 = X0 + (g % side), Y0 + (g // side)
    x = np.column_stack([x0, x0 + 1, x0 + 1, x0, x0]).ravel().astype(np.float64)
    y = np.column_stack([y0, y0, y0 + 1, y0 + 1, y0]).ravel().astype(np.float64)
    offsets = np.arange(len(g) + 1, dtype=np.int64)
    return Polygons(x, y, offsets * 5, offsets.copy(), offsets.copy())


def box_points(n: int, side: int) -> tuple[Points, np.ndarray, np.ndarray]:
    """n points for `boxes(side)`, shuffled: inside one box (clear of every edge), on the edge two boxes share (in
    both), outside all; with their known (point, geometry) pairs, sorted."""
    rng = np.random.default_rng(0)
    rows, cols = np.meshgrid(np.arange(side), np.arange(1, side), indexing="ij")
    ex, ey = X0 + cols.ravel(), Y0 + rows.ravel() + 0.5
    edge_geoms = np.column_stack([rows.ravel() * side + cols.ravel() - 1, rows.ravel() * side + cols.ravel()])
    outside = np.array([[X0 - 1.5, Y0 + 0.5], [X0 + side + 3.0, Y0 - 2.0]])
    n_in = max(n - len(ex) - len(outside), side * side)
    cell = np.arange(n_in) % (side * side)
    ix = X0 + cell % side + rng.uniform(0.125, 0.875, n_in)
    iy = Y0 + cell // side + rng.uniform(0.125, 0.875, n_in)
    x = np.concatenate([ix, ex, outside[:, 0]])
    y = np.concatenate([iy, ey, outside[:, 1]])
    edges = n_in + np.arange(len(ex))
    point = np.concatenate([np.arange(n_in), edges, edges])  # in the order before the shuffle
    geom = np.concatenate([cell, edge_geoms[:, 0], edge_geoms[:, 1]]).astype(np.int64)
    order = rng.permutation(len(x))  # position p holds point order[p]
    position = np.argsort(order)[point]
    sort = np.lexsort([geom, position])
    return points_from_lonlat(x[order], y[order]), position[sort].astype(np.int64), geom[sort]


def clusters(n_clusters: int) -> tuple[Points, np.ndarray, np.ndarray]:
    """Clusters of 4 points STEP apart along a parallel (at most 326 m across), 55 km or more from one another,
    and one across the antimeridian and one at the pole; with the self-join's known pairs (within a cluster,
    i < j, sorted)."""
    c = np.arange(min(n_clusters, 256 * 240))
    lon0, lat0 = -160.0 + (c % 256), -60.0 + 0.5 * (c // 256)
    k = np.arange(4)
    lon = np.concatenate([(lon0[:, None] + k * STEP).ravel(),
                          [180.0 - 1.5 * STEP, 180.0 - 0.5 * STEP, -180.0 + 0.5 * STEP, -180.0 + 1.5 * STEP],
                          [0.0, 90.0, 180.0, -90.0]])
    lat = np.concatenate([np.repeat(lat0, 4), np.zeros(4), np.full(4, 89.999)])
    first, second = np.triu_indices(4, 1)
    base = 4 * np.arange(len(lon) // 4)[:, None]
    return points_from_lonlat(lon, lat), (base + first).ravel(), (base + second).ravel()


def _haversine_np(lon1, lat1, lon2, lat2) -> np.ndarray:
    """The formula of kernels.haversine_m in numpy: an oracle independent of numba and of the device."""
    rad = math.pi / 180.0
    s1 = np.sin((lat2 - lat1) * rad * 0.5)
    s2 = np.sin((lon2 - lon1) * rad * 0.5)
    h = np.minimum(s1 * s1 + np.cos(lat1 * rad) * np.cos(lat2 * rad) * (s2 * s2), 1.0)
    return 2.0 * device_distance.EARTH_RADIUS_M * np.arcsin(np.sqrt(h))


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise WarmUpError(f"the device answered a warm-up {what} wrong")


def _versions() -> str:
    found = []
    for name in ("numba-cuda", "numpy", "cupy-cuda12x", "cupy-cuda13x"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def _point_in_polygon(engine: Any, n: int) -> None:
    side = min(max(math.isqrt(n // 256), 2), 32)
    polygons = boxes(side)
    points, want_point, want_geom = box_points(n, side)
    try:
        counts = engine.pip_counts(points, polygons)
        _expect(np.array_equal(counts, np.bincount(want_geom, minlength=len(polygons))), "point-in-polygon count")
        lo, hi = len(points) // 3, 2 * len(points) // 3  # a page: the pairs of a range of points
        point, geom = engine.pip_pairs(points, polygons, lo, hi)
        page = (want_point >= lo) & (want_point < hi)
        _expect(np.array_equal(point, want_point[page]) and np.array_equal(geom, want_geom[page]),
                "point-in-polygon page")
    finally:
        engine.forget(points)
        engine.forget(polygons)


def _distance(engine: Any, n_clusters: int) -> int:
    near, want_i, want_j = clusters(n_clusters)
    try:
        pages, start, budget = [], 0, max(7, len(want_i) // 3)
        while start < len(near):  # paged as the manager pages: whole points, at most `budget` pairs
            i, j, d, after = engine.within_distance_page(near, near, RADIUS_M, start, len(near), True, budget)
            _expect(after > start and (len(i) <= budget or len(np.unique(i)) == 1), "distance page")
            pages.append((i, j, d))
            start = after
        i, j, d = (np.concatenate([p[k] for p in pages]) for k in range(3))
        truth = _haversine_np(near.x[want_i], near.y[want_i], near.x[want_j], near.y[want_j])
        _expect(np.array_equal(i, want_i) and np.array_equal(j, want_j)
                and np.allclose(d, truth, rtol=1e-9, atol=1e-6), "distance join")
        # A radius equal to the host's distance of the first cluster's neighbours, which every cluster of its
        # row shares bit for bit: pairs at the radius itself, decided on the host (device_distance).
        exact = device_distance.host_haversine(near.x[want_i], near.y[want_i], near.x[want_j], near.y[want_j])
        radius = float(exact[0])
        banded = engine.counters["band_pairs"]
        i, j, d = engine.within_distance(near, near, radius, 0, len(near), self_join=True)
        keep = exact <= radius
        _expect(np.array_equal(i, want_i[keep]) and np.array_equal(j, want_j[keep])
                and np.array_equal(d, exact[keep]) and engine.counters["band_pairs"] > banded,
                "distance join at the radius")
        return len(near)
    finally:
        engine.forget(near)


def warm_up(engine: Any, points: int | None = None) -> dict[str, Any]:
    """Run the engine's joins on synthetic layers of about `points` points (default: WARM_UP_POINTS on a
    device, SIMULATOR_WARM_UP_POINTS in the simulator) and check every answer and that every kernel launched.
    Leaves nothing resident. Returns what it ran and how long it took."""
    from .cuda_engine import _KERNELS, simulator_enabled

    n = int(points or (SIMULATOR_WARM_UP_POINTS if simulator_enabled() else WARM_UP_POINTS))
    engine.launched = set()
    started = time.perf_counter()
    try:
        _point_in_polygon(engine, n)
        distance_points = _distance(engine, max(4, n // 16))
    except WarmUpError:
        raise
    except Exception as exc:  # a kernel that cannot compile or launch here: the engine is unavailable
        where = f"launching {engine.launching}; " if engine.launching else ""
        raise WarmUpError(f"{type(exc).__name__}: {exc} ({where}{_versions()})") from exc
    finally:
        engine.drop_results()
    missing = [name for name in _KERNELS if name not in engine.launched]
    if missing:
        raise WarmUpError(f"the warm-up never launched {', '.join(missing)}")
    return {"points": n, "distance_points": distance_points, "seconds": round(time.perf_counter() - started, 3)}
