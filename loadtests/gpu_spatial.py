"""The spatial part of `make gpu-check` (loadtests/gpu_check.py): the GPU engine (spatial.cuda_engine) against the
CPU engine (spatial.cpu_engine) on the same data, in one process, each call labelled by what it pays:

- fresh: a new Points / Polygons object each call, so uploads, structures (quadtree, part boxes, distance grid) and
  the join itself;
- resident: the layers and their structures kept, the join recomputed: the engine's cache of join results is dropped
  before each timed call (`drop_results()`), and where the engine counts its joins, each timed call is checked to
  have computed one;
- cached: the repeat that the engine's result cache serves. Labelled as such, and never used for a speed-up.

Speed-ups: resident against resident, fresh against fresh. Answers compared: point-in-polygon counts and a page of
(point, polygon) pairs exactly; distance pairs exactly and distances within RTOL / ATOL_M (the largest difference is
reported). Every measurement checks the time left first and is cut, and reported as cut, when it would not fit.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import numpy as np

RADIUS_M = 1000.0
MAX_PAIRS = 1_000_000  # a distance join is paged as the service pages it: whole points up to this many pairs
PAGE_POINTS = 100_000  # the page of point-in-polygon pairs compared: the first this many points
RTOL, ATOL_M = 1e-12, 1e-9  # distances: GPU against CPU (the device's trig and sqrt are not glibc's)
SLOW_CALL_S = 2.0  # an engine whose first fresh call takes longer is timed once per measurement (runs = 1)
SIZES = (  # normal, --quick
    {"pip": [[2_000_000, 3_000], [20_000_000, 3_000]], "distance": [200_000, 2_000_000], "radius_m": RADIUS_M},
    {"pip": [[100_000, 300]], "distance": [20_000], "radius_m": RADIUS_M},
)


# -- the data (seeded: the HTTP part and the first-request profile use the very same) -------------------------------
def star_polygons(n: int, seed: int = 1):
    """n valid star-shaped polygons (vertices at random radii, in angle order) over a lon/lat box, every third
    with a star-shaped hole: GeoArrow buffers built with numpy alone."""
    from spatial.geoarrow import Polygons

    rng = np.random.default_rng(seed)
    xs, ys, rings, parts = [], [], [0], [0]
    for g in range(n):
        cx, cy, r = rng.uniform(-170, 170), rng.uniform(-60, 60), rng.uniform(0.5, 3.0)
        for radius in ((r, r * 0.3) if g % 3 == 0 else (r,)):
            k = int(rng.integers(8, 40))
            # one vertex in each of k equal sectors: no angular gap reaches pi, so the hole stays off the shell
            # and every polygon is valid (the service checks what it is sent)
            angle = (np.arange(k) + 0.9 * rng.uniform(0, 1, k)) * (2 * np.pi / k)
            rad = radius * rng.uniform(0.6, 1.0, k)
            xs.append(cx + rad * np.cos(angle))
            ys.append(cy + rad * np.sin(angle))
            rings.append(rings[-1] + k)
        parts.append(len(rings) - 1)
    offsets = np.arange(n + 1, dtype=np.int64)
    return Polygons(np.concatenate(xs), np.concatenate(ys), np.asarray(rings, np.int64), np.asarray(parts, np.int64),
                    offsets)


def uniform_points(n: int, seed: int = 0):
    from spatial.geoarrow import points_from_lonlat

    rng = np.random.default_rng(seed)
    return points_from_lonlat(rng.uniform(-180, 180, n), rng.uniform(-63, 63, n))


def clustered_points(n: int, seed: int = 2):
    """Points around 400 centres (sd 0.05 degrees): at 1 km, 200,000 of them make about 560,000 pairs."""
    from spatial.geoarrow import points_from_lonlat

    rng = np.random.default_rng(seed)
    centres = np.column_stack([rng.uniform(-180, 180, 400), rng.uniform(-70, 70, 400)])
    pick = rng.integers(0, len(centres), n)
    return points_from_lonlat((centres[pick, 0] + rng.normal(0, 0.05, n) + 180) % 360 - 180,
                              np.clip(centres[pick, 1] + rng.normal(0, 0.05, n), -90, 90))


# -- what an engine keeps --------------------------------------------------------------------------------------------
def drop_results(engine: Any) -> str | None:
    """Drop the engine's cached join results, keeping layers and structures. Says how; None: it keeps none."""
    if hasattr(engine, "drop_results"):
        engine.drop_results()
        return "drop_results()"
    joins = getattr(engine, "_joins", None)  # until drop_results() lands in spatial/
    if joins is not None and hasattr(joins, "clear"):
        joins.clear()
        return "_joins.clear() (the engine has no drop_results() yet)"
    return None


def keeps_results(engine: Any) -> bool:
    """Whether the engine keeps join results at all (the GPU engine does, per pair of layers; the CPU engine keeps
    structures only, so every call of it computes)."""
    return hasattr(engine, "_joins") or bool(getattr(engine, "keeps_join_results", False))


def join_count(engine: Any) -> int | None:
    """The joins the engine has computed, by its own counters (None: it counts none)."""
    counters = getattr(engine, "counters", None)
    if counters is None:
        return None
    return sum(int(v) for k, v in counters.items() if "join" in k)


def distance_join(engine: Any, a: Any, b: Any, radius_m: float, self_join: bool = True) -> list[np.ndarray]:
    """Every (i, j, metres) pair, a page of at most MAX_PAIRS after another (whole points), concatenated."""
    pages, start = [], 0
    while start < len(a):
        i, j, d, start = engine.within_distance_page(a, b, radius_m, start, len(a), self_join, MAX_PAIRS)
        pages.append((i, j, d))
    if not pages:
        return [np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64)]
    return [np.concatenate([p[k] for p in pages]) for k in range(3)]


def compare_pairs(got: list[np.ndarray], want: list[np.ndarray]) -> dict[str, Any]:
    """Pairs exactly; distances (a third array, if any) within RTOL / ATOL_M, with the largest difference."""
    out: dict[str, Any] = {"pairs_equal": all(np.array_equal(got[k], want[k]) for k in range(2))}
    if len(got) > 2 and out["pairs_equal"]:
        diff = np.abs(np.asarray(got[2], np.float64) - np.asarray(want[2], np.float64))
        out["distances_equal"] = bool(np.all(diff <= ATOL_M + RTOL * np.abs(want[2])))
        out["max_abs_diff_m"] = float(diff.max()) if len(diff) else 0.0
        out["distances_not_bit_identical"] = int(np.count_nonzero(diff))
    elif len(got) > 2:
        out["distances_equal"] = False
    return out


class Clock:
    """The bench's time allowance: a measurement starts only if its estimate fits what is left."""

    def __init__(self, budget_s: float | None) -> None:
        self.deadline = None if budget_s is None else time.monotonic() + budget_s

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()


def _stats(times: list[float]) -> dict[str, Any]:
    return {"median_s": round(statistics.median(times), 6), "runs": len(times),
            "all_s": [round(t, 6) for t in times]}


# -- one engine on one case ------------------------------------------------------------------------------------------
def measure(engine: Any, work: str, layers: tuple, call: Callable[[Any, tuple], Any], runs: int, clock: Clock,
            estimate_s: float, same: Callable[[Any, Any], bool], cut: list[str],
            slow_s: float = SLOW_CALL_S) -> tuple[dict[str, Any], Any]:
    """fresh, resident and cached timings of `call` on `engine`; the fresh answer (later answers checked `same`).
    A first fresh call over `slow_s` makes every measurement one call."""
    label = f"{engine.name} {work}"
    out: dict[str, Any] = {"engine": engine.name}
    problems: list[str] = []
    fresh_times: list[float] = []
    answer, current = None, None
    counted_work = False  # whether the engine's join counter counts this work (a fresh call raised it)
    n = runs
    while len(fresh_times) < n:
        estimate = fresh_times[-1] if fresh_times else estimate_s
        if not clock.fits(estimate):
            cut.append(f"{label}: fresh call {len(fresh_times) + 1} of {n} cut: out of time "
                       f"(estimated {estimate:.1f} s, {max(clock.left(), 0):.1f} s left)")
            break
        for old in current or ():
            engine.forget(old)
        current = tuple(dataclasses.replace(g) for g in layers)  # new objects, the same buffers: nothing reused
        before = join_count(engine)
        started = time.perf_counter()
        got = call(engine, current)
        fresh_times.append(time.perf_counter() - started)
        counted_work = counted_work or (before is not None and (join_count(engine) or 0) > before)
        if answer is None:
            answer = got
        elif not same(got, answer):
            problems.append("a fresh answer differs from the first")
        if len(fresh_times) == 1 and fresh_times[0] > slow_s:
            n = 1
    if not fresh_times:
        return out, None
    out["fresh"] = {**_stats(fresh_times), "first_s": round(fresh_times[0], 6)}

    keeps = keeps_results(engine)
    resident_times: list[float] = []
    recomputed: list[bool] = []
    how = None
    for k in range(n):  # the last fresh call's layers: uploaded, with their structures built
        estimate = resident_times[-1] if resident_times else statistics.median(fresh_times)
        if not clock.fits(estimate):
            cut.append(f"{label}: resident call {k + 1} of {n} cut: out of time")
            break
        how = drop_results(engine) if keeps else None
        before = join_count(engine)
        started = time.perf_counter()
        got = call(engine, current)
        resident_times.append(time.perf_counter() - started)
        recomputed.append(before is not None and (join_count(engine) or 0) > before)
        if not same(got, answer):
            problems.append("a resident answer differs from the fresh one")
    if resident_times:
        out["resident"] = {**_stats(resident_times), "result_cache_dropped_by": how,
                           "joins_recomputed": sum(recomputed) if counted_work else None}
        if not keeps:
            out["resident"]["note"] = "the engine keeps no join results: every call computes"
        elif not counted_work:
            out["resident"]["note"] = "the engine counts no joins of this kind: recomputation not verified"
        elif not all(recomputed):
            problems.append("a resident call was served from the result cache: no compute was timed")
            out["resident"]["valid"] = False

    if not keeps:
        out["cached"] = {"status": "none", "note": "the engine keeps no join results: a repeat computes again"}
    elif resident_times:
        cached_times, hits = [], []
        for _ in range(n if statistics.median(resident_times) < slow_s / 4 else 1):
            if not clock.fits(min(resident_times)):
                cut.append(f"{label}: cached repeat cut: out of time")
                break
            before = join_count(engine)
            started = time.perf_counter()
            got = call(engine, current)
            cached_times.append(time.perf_counter() - started)
            hits.append(before is not None and join_count(engine) == before)
            if not same(got, answer):
                problems.append("a cached answer differs from the fresh one")
        if cached_times:
            hit = all(hits) if counted_work else None
            out["cached"] = {**_stats(cached_times), "cache_hit": hit,
                             "note": ("served from the engine's result cache: no join computed, not a speed-up"
                                      if hit else "a repeat without drop_results(): not a speed-up")}
    out["problems"] = problems
    for old in current or ():
        engine.forget(old)
    return out, answer


def _speedups(case: dict[str, Any]) -> None:
    gpu, cpu = case.get("gpu", {}), case.get("cpu", {})
    for what in ("resident", "fresh"):
        g, c = gpu.get(what), cpu.get(what)
        if g and c and g.get("valid", True) and c.get("valid", True) and g["median_s"] > 0:
            case[f"speedup_{what}"] = float(f"{c['median_s'] / g['median_s']:.3g}")


def _estimate(previous: dict[str, float], key: str, scale: float, default: float) -> float:
    return previous[key] * scale if key in previous else default


def bench_spatial(size: dict[str, Any], runs: int, budget_s: float | None = None,
                  progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every case of `size` on both engines. `size`: {"pip": [[points, polygons], ...], "distance": [points, ...],
    "radius_m"}, or the older {"points", "polygons", "distance_points"}."""
    from spatial.cpu_engine import CpuSpatialEngine
    from spatial.cuda_engine import CudaSpatialEngine, simulator_enabled

    if "points" in size:
        size = {"pip": [[size["points"], size["polygons"]]], "distance": [size["distance_points"]]}
    radius = float(size.get("radius_m", RADIUS_M))
    clock = Clock(budget_s)
    gpu, cpu = CudaSpatialEngine(), CpuSpatialEngine()
    out: dict[str, Any] = {"runs": runs, "radius_m": radius, "max_pairs_per_page": MAX_PAIRS,
                           "tolerance": {"rtol": RTOL, "atol_m": ATOL_M}, "simulator": simulator_enabled(),
                           "compile_s": {}, "cases": [], "cut": [], "failures": []}
    started = time.perf_counter()
    try:
        gpu.warm_up()
    except Exception as exc:  # noqa: BLE001 - an engine that cannot start is the finding
        out["failures"].append(f"the GPU engine's warm_up(): {type(exc).__name__}: {exc}"[:1500])
        return out
    out["compile_s"]["gpu_warm_up"] = round(time.perf_counter() - started, 3)
    tiny, square = uniform_points(64, 5), star_polygons(2, 5)
    started = time.perf_counter()
    cpu.pip_counts(tiny, square)
    distance_join(cpu, tiny, tiny, radius)
    cpu.forget(tiny)
    cpu.forget(square)
    out["compile_s"]["cpu_first_tiny_joins"] = round(time.perf_counter() - started, 3)
    seen: dict[str, float] = {}  # the last case's median fresh seconds per engine and work, for estimates

    def report() -> None:
        if progress is not None:
            progress(out)

    pip_cases = [("pip", int(p), int(g)) for p, g in size.get("pip", [])]
    distance_cases = [("distance", int(p), 0) for p in size.get("distance", [])]
    last_n: dict[str, int] = {}
    for work, n, m in pip_cases + distance_cases:
        if work == "pip":
            case: dict[str, Any] = {"work": "pip", "label": f"PIP {n:,} points x {m:,} polygons", "points": n,
                                    "polygons": m}
            layers: tuple = (uniform_points(n, 0), star_polygons(m, 1))

            def call(engine, ls):
                return engine.pip_counts(ls[0], ls[1])

            def same(a, b):
                return np.array_equal(a, b)
        else:
            case = {"work": "distance", "label": f"distance self-join {n:,} points, {radius / 1000:g} km",
                    "points": n}
            layers = (clustered_points(n, 2),)

            def call(engine, ls):
                return distance_join(engine, ls[0], ls[0], radius)

            def same(a, b):
                cmp = compare_pairs(a, b)
                return cmp["pairs_equal"] and cmp["distances_equal"]
        out["cases"].append(case)
        scale = (n / last_n.get(work, n)) ** (2 if work == "distance" else 1)  # clustered: pairs grow as n^2
        answers = {}
        for side, engine in (("gpu", gpu), ("cpu", cpu)):
            key = f"{side}-{work}"
            estimate = _estimate(seen, key, scale, 0.0)
            if not clock.fits(estimate):
                out["cut"].append(f"{case['label']} on {engine.name} cut: out of time")
                continue
            try:
                result, answers[side] = measure(engine, work, layers, call, runs, clock, estimate, same, out["cut"],
                                                slow_s=float("inf") if out["simulator"] else SLOW_CALL_S)
            except Exception as exc:  # noqa: BLE001 - reported; the other engine and cases still run
                error = f"{type(exc).__name__}: {exc}"[:1500]
                result, answers[side] = {"engine": engine.name, "error": error, "problems": [error]}, None
            case[side] = result
            out["failures"] += [f"{case['label']} on {engine.name}: {p}" for p in result.pop("problems", [])]
            if "fresh" in result:
                seen[key] = result["fresh"]["median_s"]
            report()
        last_n[work] = n
        _speedups(case)
        if answers.get("gpu") is not None and answers.get("cpu") is not None:
            if work == "pip":
                pts, polys = layers
                page = min(n, PAGE_POINTS)
                got_page = gpu.pip_pairs(pts, polys, 0, page)
                want_page = cpu.pip_pairs(pts, polys, 0, page)
                case["answers"] = {"counts_equal": bool(np.array_equal(answers["gpu"], answers["cpu"])),
                                   "page_points": page, "page_pairs": int(len(want_page[0])),
                                   "page_equal": compare_pairs(list(got_page), list(want_page))["pairs_equal"],
                                   "matched": int(np.asarray(answers["cpu"]).sum())}
                ok = case["answers"]["counts_equal"] and case["answers"]["page_equal"]
            else:
                case["answers"] = {"pairs": int(len(answers["cpu"][0])), **compare_pairs(answers["gpu"],
                                                                                         answers["cpu"])}
                ok = case["answers"]["pairs_equal"] and case["answers"]["distances_equal"]
            if not ok:
                out["failures"].append(f"{case['label']}: the GPU engine's answer differs from the CPU engine's")
        for g in layers:
            gpu.forget(g)
            cpu.forget(g)
        del layers, answers
        report()
    out["counters"] = {k: int(v) for k, v in getattr(gpu, "counters", {}).items()}
    # the keys the simulator test (tests/test_spatial_cuda_sim.py) reads
    compared = [c for c in out["cases"] if "answers" in c]
    pip = [c for c in compared if c["work"] == "pip"]
    dist = [c for c in compared if c["work"] == "distance"]
    out["pip_equal"] = bool(pip) and all(c["answers"]["counts_equal"] and c["answers"]["page_equal"] for c in pip)
    out["distance_equal"] = bool(dist) and all(c["answers"]["pairs_equal"] and c["answers"]["distances_equal"]
                                               for c in dist)
    out["pip_matched"] = pip[0]["answers"]["matched"] if pip else 0
    out["distance_pairs"] = dist[0]["answers"]["pairs"] if dist else 0
    return out
