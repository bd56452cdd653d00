"""Every GPU check in one command, wherever a CUDA device is: `make gpu-check` (or `python loadtests/gpu_check.py`).

    python loadtests/gpu_check.py [--quick] [--no-tests] [--no-bench] [--out DIR]

Reports the device and GPU libraries, runs every GPU test set, checks the per-device process layout, and runs the
GPU side of the spatial, vector and SSB benchmarks against the CPU engines with the answers compared. Writes
gpu-check-<stamp>.json and .md under results_dir("gpu-check"); skips with reasons where a device or library is
missing, and never reports a figure it did not measure. What each part covers: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from loadtests.processes import results_dir  # noqa: E402

RESULTS = results_dir("gpu-check")

LIBRARIES = {  # module -> the distributions that may provide it
    "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy"),
    "numba.cuda": ("numba-cuda",),
    "cuvs": ("cuvs-cu12", "cuvs-cu13", "cuvs"),
    "cudf": ("cudf-cu12", "cudf-cu13", "cudf"),
    "cudf_polars": ("cudf-polars-cu12", "cudf-polars-cu13", "cudf-polars"),
    "rmm": ("rmm-cu12", "rmm-cu13", "rmm"),
}
TEST_SETS = [  # (name, pytest arguments, extra environment)
    ("spatial kernels on the device", ["tests/test_spatial_cuda_sim.py"], {"SWITCHYARD_GPU_KERNELS": "device"}),
    ("cuVS adapter", ["tests/test_cuvs_adapter.py"], {}),
    ("vector conformance, GPU rows", ["tests/test_vectors_conformance.py", "-k", "gpu"], {}),
    ("SSB on cuDF", ["tests/test_ssb_service.py", "-k", "cudf"], {}),
    ("ad-hoc SQL on resident cuDF tables", ["tests/test_frame_sql.py", "-k", "cudf"], {}),
]


# -- what is here ------------------------------------------------------------------------------------------------
def _installed(module: str) -> dict[str, Any]:
    top = module.split(".")[0]
    found = importlib.util.find_spec(top) is not None
    if found and module == "numba.cuda":
        found = importlib.util.find_spec("numba.cuda") is not None
    version = None
    for dist in LIBRARIES[module]:
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"installed": found, "version": version}


def probe() -> dict[str, Any]:
    from service.process.devices import probe_cuda

    cuda = probe_cuda()
    return {"device": [{"index": d.index, "name": d.name, "memory_bytes": d.total_memory_bytes} for d in cuda.devices],
            "device_reason": None if cuda.present else cuda.reason,
            "libraries": {module: _installed(module) for module in LIBRARIES},
            "python": platform.python_version(), "cores": os.cpu_count()}


# -- the tests ---------------------------------------------------------------------------------------------------
def run_tests(name: str, args: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    if importlib.util.find_spec("pytest") is None:
        return {"set": name, "status": "skipped", "reason": "pytest is not installed here"}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={junit}", *args],
                                  cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"set": name, "status": "failed", "reason": f"timed out after {timeout_s:.0f} s"}
        took = round(time.perf_counter() - started, 1)
        if not junit.exists():
            return {"set": name, "status": "failed", "reason": (proc.stdout + proc.stderr)[-2000:], "seconds": took}
        cases = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, reason = "passed", None
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = "skipped" if tag == "skipped" else "failed"
                    reason = (found.text or "").strip().splitlines()[-1:] if tag == "skipped" else []
                    reason = (reason[0] if reason else found.get("message") or found.text or "")[:500]
                    break
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "reason": reason})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    # "partial": some passed and some were skipped (a CPU-only test of a GPU module passes anywhere)
    status = "failed" if counts["failed"] or proc.returncode not in (0, 5) else (
        "skipped" if not counts["passed"] else "partial" if counts["skipped"] else "passed")
    return {"set": name, "status": status, **counts, "seconds": took, "cases": cases}


# -- the process layout ------------------------------------------------------------------------------------------
SEEN_DEVICES = """
import ctypes, json
cuda, count, seen = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(0), []
if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0:
    for i in range(count.value):
        device, bus = ctypes.c_int(0), ctypes.create_string_buffer(64)
        cuda.cuDeviceGet(ctypes.byref(device), i)
        cuda.cuDeviceGetPCIBusId(bus, 64, device)
        seen.append(bus.value.decode())
print(json.dumps(seen))
"""


def _seen_devices(env: dict[str, str]) -> list[str]:
    """The PCI bus ids of the devices a fresh process sees under `env`, in CUDA's order (asked of the driver)."""
    out = subprocess.run([sys.executable, "-c", SEEN_DEVICES], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def check_layout(here: dict[str, Any]) -> dict[str, Any]:
    """What `switchyard serve` starts here: one engine process per device, each pinned by CUDA_VISIBLE_DEVICES
    (service/devices.device_pins) to the device this process calls by its index, and seeing no other."""
    if here["device_reason"]:
        return {"status": "skipped", "reason": here["device_reason"]}
    from service.engines import gpu_engine_installed
    from service.process.devices import device_pins, probe_cuda

    pins = device_pins(probe_cuda(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        everything = _seen_devices({})
        pinned = [_seen_devices({"CUDA_VISIBLE_DEVICES": pin}) for pin in pins]
    except (subprocess.SubprocessError, ValueError) as exc:
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    expected = len(pins) if len(pins) > 1 and gpu_engine_installed() else 1
    try:  # the service's own plan (pydantic-settings may be missing where only CuPy and numba-cuda are)
        from service.settings import Settings

        engines = Settings().engine_processes
    except ImportError:
        engines = None  # not read, so not compared
    ok = pinned == [[bus] for bus in everything] and engines in (None, expected)
    return {"status": "passed" if ok else "failed", "engine_processes": engines, "expected": expected,
            "devices": everything, "pins": pins, "seen_by_each_engine": pinned}


# -- the benchmarks ----------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """Median seconds of `runs` calls after the first, and the last answer."""
    answer, times = fn(), []
    for _ in range(runs):
        started = time.perf_counter()
        answer = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), answer


def star_polygons(n: int, seed: int):
    """n simple star-shaped polygons (vertices at random radii, in angle order) over a lon/lat box, every third
    with a star-shaped hole: GeoArrow buffers built with numpy alone."""
    from spatial.geoarrow import Polygons

    rng = np.random.default_rng(seed)
    xs, ys, rings, parts = [], [], [0], [0]
    for g in range(n):
        cx, cy, r = rng.uniform(-170, 170), rng.uniform(-60, 60), rng.uniform(0.5, 3.0)
        for radius in ((r, r * 0.3) if g % 3 == 0 else (r,)):
            k = int(rng.integers(8, 40))
            angle = np.sort(rng.uniform(0, 2 * np.pi, k))
            rad = radius * rng.uniform(0.6, 1.0, k)
            xs.append(cx + rad * np.cos(angle))
            ys.append(cy + rad * np.sin(angle))
            rings.append(rings[-1] + k)
        parts.append(len(rings) - 1)
    offsets = np.arange(n + 1, dtype=np.int64)
    return Polygons(np.concatenate(xs), np.concatenate(ys), np.asarray(rings, np.int64), np.asarray(parts, np.int64),
                    offsets)


def bench_spatial(size: dict[str, int], runs: int) -> dict[str, Any]:
    from spatial.cpu_engine import CpuSpatialEngine
    from spatial.cuda_engine import CudaSpatialEngine
    from spatial.geoarrow import points_from_lonlat

    rng = np.random.default_rng(0)
    polygons = star_polygons(size["polygons"], 1)
    points = points_from_lonlat(rng.uniform(-180, 180, size["points"]), rng.uniform(-63, 63, size["points"]))
    cpu, gpu = CpuSpatialEngine(), CudaSpatialEngine()
    started = time.perf_counter()
    gpu.warm_up()
    out: dict[str, Any] = {"points": len(points), "polygons": len(polygons), "compile_s": time.perf_counter() - started}
    started = time.perf_counter()
    first = gpu.pip_counts(points, polygons)
    out["pip_first_call_s"] = time.perf_counter() - started  # uploads, quadtree, join
    out["pip_resident_s"], counts = timed(lambda: gpu.pip_counts(points, polygons), runs)
    out["pip_cpu_s"], want = timed(lambda: cpu.pip_counts(points, polygons), runs)
    page = gpu.pip_pairs(points, polygons, 0, min(len(points), 100_000))
    want_page = cpu.pip_pairs(points, polygons, 0, min(len(points), 100_000))
    out["pip_equal"] = bool(np.array_equal(first, want) and np.array_equal(counts, want)
                            and all(np.array_equal(a, b) for a, b in zip(page, want_page)))
    out["pip_matched"] = int(want.sum())
    out["pip_speedup_resident"] = out["pip_cpu_s"] / out["pip_resident_s"]

    centres = np.column_stack([rng.uniform(-180, 180, 400), rng.uniform(-70, 70, 400)])
    pick = rng.integers(0, len(centres), size["distance_points"])
    near = points_from_lonlat((centres[pick, 0] + rng.normal(0, 0.05, len(pick)) + 180) % 360 - 180,
                              np.clip(centres[pick, 1] + rng.normal(0, 0.05, len(pick)), -90, 90))
    page_of = {"max_pairs": 1_000_000}

    def join(engine):
        pages, start = [], 0
        while start < len(near):
            i, j, d, start = engine.within_distance_page(near, near, 1000.0, start, len(near), True,
                                                         page_of["max_pairs"])
            pages.append((i, j, d))
        return [np.concatenate([p[k] for p in pages]) for k in range(3)]

    started = time.perf_counter()
    got = join(gpu)
    out.update(distance_points=len(near), distance_first_call_s=time.perf_counter() - started)
    out["distance_resident_s"], got = timed(lambda: join(gpu), runs)
    out["distance_cpu_s"], want = timed(lambda: join(cpu), runs)
    out["distance_pairs"] = len(want[0])
    out["distance_equal"] = bool(np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
                                 and np.allclose(got[2], want[2], rtol=1e-12, atol=1e-6))
    out["distance_speedup_resident"] = out["distance_cpu_s"] / out["distance_resident_s"]
    out["counters"] = dict(gpu.counters)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def bench_vectors(size: dict[str, int], runs: int) -> dict[str, Any]:
    from indexes.ann import IndexConfig, check_params
    from indexes.cuvs_index import CuvsBackend
    from indexes.distance import exact_search

    rng = np.random.default_rng(0)
    n, dim, nq, k = size["vectors"], size["dim"], size["queries"], 10
    centres = rng.normal(size=(200, dim)).astype(np.float32)
    data = (centres[rng.integers(0, 200, n)] + 0.3 * rng.normal(size=(n, dim))).astype(np.float32)
    queries = (centres[rng.integers(0, 200, nq)] + 0.3 * rng.normal(size=(nq, dim))).astype(np.float32)
    _, truth = exact_search(np, data, queries, k, "l2")
    out: dict[str, Any] = {"vectors": n, "dim": dim, "queries": nq, "k": k, "indexes": {}}
    backend = CuvsBackend()
    for index_type, search in (("brute_force", {}), ("ivf_pq", {"n_probes": 32, "refine_ratio": 2.0}),
                               ("cagra", {"itopk_size": 64})):
        config = IndexConfig(index_type, "l2", dim, check_params("build", index_type, None, "index.params"))
        started = time.perf_counter()
        index = backend.build(config, data)
        build_s = time.perf_counter() - started
        seconds, (_, rows) = timed(lambda: index.search(queries, k, search, None), runs)
        recall = float(np.mean([len(set(r) & set(t)) / k for r, t in zip(rows.tolist(), truth.tolist())]))
        out["indexes"][index_type] = {"build_s": round(build_s, 3), "recall_at_10": round(recall, 4),
                                      "batch_qps": round(nq / seconds, 1), "params": search}
    return out


def bench_olap(size: dict[str, float], runs: int) -> dict[str, Any]:
    from olap.cudf_engine import CudfEngine
    from olap.duckdb_engine import DuckDBEngine
    from olap.generate import generate
    from olap.queries import QUERIES, render_sql

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ssb"
        generate(size["sf"], directory)
        gpu, cpu = CudfEngine(), DuckDBEngine()
        out: dict[str, Any] = {"sf": size["sf"], "load_s": gpu.load(directory)["load_s"], "queries": {}}
        cpu.load(directory)
        for query_id in QUERIES:
            gpu_s, got = timed(lambda: gpu.run_query(query_id, None), runs)
            cpu_s, want = timed(lambda: cpu.run_query(query_id, None), runs)
            # the same query as ad-hoc SQL: olap/frame_sql.py on the resident tables (resident_sql counts it)
            sql = render_sql(query_id, None)
            before = gpu.resident_sql
            sql_s, from_sql = timed(lambda: gpu.run_sql(sql, max_rows=None, timeout_s=None), runs)
            out["queries"][query_id] = {"cudf_s": round(gpu_s, 5), "duckdb_s": round(cpu_s, 5),
                                        "speedup": round(cpu_s / gpu_s, 2),
                                        "equal": got.as_tuples() == want.as_tuples(),
                                        "cudf_sql_s": round(sql_s, 5), "sql_resident": gpu.resident_sql > before,
                                        "sql_equal": from_sql.as_tuples() == want.as_tuples()}
    return out


BENCHES = [  # (name, function, what it needs, sizes: normal and --quick)
    ("spatial", bench_spatial, ("cupy", "numba.cuda"),
     ({"points": 2_000_000, "polygons": 3_000, "distance_points": 200_000},
      {"points": 100_000, "polygons": 300, "distance_points": 20_000})),
    ("vectors", bench_vectors, ("cupy", "cuvs"),
     ({"vectors": 200_000, "dim": 128, "queries": 10_000}, {"vectors": 20_000, "dim": 64, "queries": 1_000})),
    ("olap", bench_olap, ("cudf",), ({"sf": 1.0}, {"sf": 0.1})),
]


def run_bench(name: str, fn: Callable, needs: tuple[str, ...], size: dict, runs: int, here: dict) -> dict[str, Any]:
    if here["device_reason"]:
        return {"bench": name, "status": "skipped", "reason": here["device_reason"]}
    missing = [m for m in needs if not here["libraries"][m]["installed"]]
    if missing:
        return {"bench": name, "status": "skipped", "reason": f"not installed: {', '.join(missing)}"}
    try:
        result = fn(size, runs)
    except Exception as exc:  # noqa: BLE001 - a failed part is reported, the others still run
        return {"bench": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    equal = all(v for k, v in result.items() if k.endswith("_equal")) and all(
        q["equal"] and q.get("sql_equal", True) and q.get("sql_resident", True)
        for q in result.get("queries", {}).values())
    return {"bench": name, "status": "passed" if equal else "failed", **result}


# -- the report --------------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    here = report["here"]
    lines = [f"# GPU check, {report['stamp']}", ""]
    if here["device"]:
        lines += [f"Device: {d['name']} ({d['memory_bytes'] / 2**30:.0f} GiB)" for d in here["device"]]
    else:
        lines.append(f"Device: none ({here['device_reason']})")
    lines += ["", "| library | installed | version |", "|---|---|---|"]
    lines += [f"| {m} | {'yes' if v['installed'] else 'no'} | {v['version'] or ''} |"
              for m, v in here["libraries"].items()]
    lines += ["", "## Tests", "", "| set | status | passed | failed | skipped | why skipped or failed |",
              "|---|---|---|---|---|---|"]
    for t in report["tests"]:
        reasons = sorted({c["reason"] for c in t.get("cases", []) if c["outcome"] != "passed" and c["reason"]})
        why = "; ".join(reasons)[:300] or (t.get("reason") or "")[:300]
        lines.append(f"| {t['set']} | {t['status']} | {t.get('passed', 0)} | {t.get('failed', 0)} | "
                     f"{t.get('skipped', 0)} | {why.replace('|', '/')} |")
    layout = report.get("layout", {})
    lines += ["", "## Process layout (one engine process per device)", "",
              f"{layout.get('status', 'not run')}: " + (layout.get("reason") or json.dumps(
                  {k: v for k, v in layout.items() if k != "status"}))]
    lines += ["", "## Benchmarks (GPU engine against the CPU engine, same data, answers compared)", ""]
    for b in report["benches"]:
        detail = {k: v for k, v in b.items() if k not in ("bench", "status", "reason")}
        lines.append(f"- **{b['bench']}**: {b['status']}" + (f" ({b['reason']})" if b.get("reason") else ""))
        if detail:
            lines.append(f"  `{json.dumps(detail)}`")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small benchmark sizes")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--test-timeout", type=float, default=1200.0, help="seconds per test set")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    stamp = time.strftime("%Y%m%d-%H%M%S")
    here = probe()
    report: dict[str, Any] = {"stamp": stamp, "here": here, "tests": [], "benches": []}
    if not args.no_tests:
        for name, pytest_args, env in TEST_SETS:
            print(f"tests: {name} ...", flush=True)
            report["tests"].append(run_tests(name, pytest_args, env, args.test_timeout))
    report["layout"] = check_layout(here)
    if not args.no_bench:
        for name, fn, needs, sizes in BENCHES:
            print(f"benchmark: {name} ...", flush=True)
            report["benches"].append(run_bench(name, fn, needs, sizes[1 if args.quick else 0], args.runs, here))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-check-{stamp}"
    path.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    path.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {path}.json and .md")
    failed = [t["set"] for t in report["tests"] if t["status"] == "failed"]
    failed += [b["bench"] for b in report["benches"] if b["status"] == "failed"]
    failed += ["process layout"] if report["layout"]["status"] == "failed" else []
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
