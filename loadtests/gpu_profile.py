"""Two device probes of `make gpu-check` (loadtests/gpu_check.py), each run in a fresh process of its own:

- first_request_profile: what the first point-in-polygon request still pays on the device once the engine has
  started. CudaSpatialEngine() and warm_up() (what the service's engine start does), then the first pip_counts on
  the benchmark's data under cProfile: the top 25 entries by cumulative time go into the report.
- warm_up_without_shim: whether the GPU engine warms up without the numpy.row_stack shim that
  loadtests/device/on-device.sh puts in on request (numpy 2.5 removed row_stack; numba-cuda 0.30.4 still calls it).
"""

from __future__ import annotations

import cProfile
import dataclasses
import pstats
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = ({"points": 2_000_000, "polygons": 3_000}, {"points": 100_000, "polygons": 300})  # normal, --quick
TOP = 25


def _where(filename: str) -> str:
    """A profile entry's file, short: relative to the checkout or to site-packages."""
    path = filename.replace("\\", "/")
    root = str(ROOT).replace("\\", "/") + "/"
    if path.startswith(root):
        return path[len(root):]
    for marker in ("/site-packages/", "/dist-packages/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def top_entries(profile: cProfile.Profile, n: int = TOP) -> list[dict[str, Any]]:
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative")
    rows = []
    for func in stats.fcn_list[:n]:  # type: ignore[attr-defined]  # set by sort_stats
        primitive, calls, tottime, cumtime, _ = stats.stats[func]  # type: ignore[attr-defined]
        filename, line, name = func
        rows.append({"function": f"{_where(filename)}:{line}({name})", "ncalls": calls,
                     "primitive_calls": primitive, "tottime_s": round(tottime, 6), "cumtime_s": round(cumtime, 6)})
    return rows


def first_request_profile(size: dict[str, int], runs: int = 1, budget_s: float | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    from loadtests.gpu_spatial import star_polygons, uniform_points
    from spatial.cuda_engine import CudaSpatialEngine, simulator_enabled

    out: dict[str, Any] = {"points": size["points"], "polygons": size["polygons"], "simulator": simulator_enabled()}
    engine = CudaSpatialEngine()
    out["import_and_construct_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    engine.warm_up()
    out["warm_up_s"] = round(time.perf_counter() - started, 3)
    points, polygons = uniform_points(size["points"], 0), star_polygons(size["polygons"], 1)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    engine.pip_counts(points, polygons)
    profile.disable()
    out["first_pip_counts_profiled_s"] = round(time.perf_counter() - started, 4)
    # the same call again on new layer objects (uploads, structures and join again), not profiled: what the first
    # call pays beyond any later fresh one, without the profiler's own overhead
    again = (dataclasses.replace(points), dataclasses.replace(polygons))
    started = time.perf_counter()
    engine.pip_counts(*again)
    out["second_fresh_pip_counts_s"] = round(time.perf_counter() - started, 4)
    out["top_cumulative"] = top_entries(profile)
    out["counters"] = {k: int(v) for k, v in getattr(engine, "counters", {}).items()}
    return out


def warm_up_without_shim(size: dict[str, Any] | None = None, runs: int = 1,
                         budget_s: float | None = None) -> dict[str, Any]:
    import numpy as np

    shimmed = getattr(np, "row_stack", None) is np.vstack
    if shimmed:
        del np.row_stack  # as numpy 2.5 ships
    out: dict[str, Any] = {"numpy": np.__version__, "shim_removed_here": shimmed,
                           "numpy_has_row_stack": hasattr(np, "row_stack")}
    from spatial.cuda_engine import CudaSpatialEngine

    started = time.perf_counter()
    try:
        CudaSpatialEngine().warm_up()
        out["warm_up"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is the finding
        out["warm_up"] = f"{type(exc).__name__}: {exc}"[:1000]
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import json

    print(json.dumps(first_request_profile(SIZES[1]), indent=1))
