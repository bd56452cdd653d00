"""Every GPU check in one command, wherever a CUDA device is: `make gpu-check` (or `python loadtests/gpu_check.py`).

    python loadtests/gpu_check.py [--quick] [--no-tests] [--no-bench] [--runs N] [--device-budget-s S] [--out DIR]

Reports the device and GPU libraries, runs every GPU test set, checks the per-device process layout, then the GPU
parts, each in a process of its own and against the CPU engine on the same data with the answers compared:
spatial in-process (fresh / resident / cached, loadtests/gpu_spatial.py), the first spatial request's profile
(loadtests/gpu_profile.py), spatial through HTTP (loadtests/gpu_http.py), the CuPy exact vector engine
(loadtests/gpu_vectors.py: bench(size, runs), where it exists), cuVS and cuDF (loadtests/gpu_rapids.py). The whole
run keeps to --device-budget-s: a part that would not fit is cut and reported as "cut: out of time", and the report
is still written (gpu-check-<stamp>.json and .md under results_dir("gpu-check") or --out). Skips with reasons where
a device or library is missing, and never reports a figure it did not measure. Exits non-zero when a test fails or
a GPU answer differs from the CPU's. What each part covers, and how to run it on a GPU machine without network
access (loadtests/device/): docs/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from loadtests import gpu_http, gpu_profile, gpu_rapids, gpu_spatial  # noqa: E402
from loadtests.gpu_report import markdown  # noqa: E402
from loadtests.gpu_spatial import bench_spatial, star_polygons  # noqa: E402,F401  (tests import them from here)
from loadtests.processes import results_dir  # noqa: E402

RESULTS = results_dir("gpu-check")
DEVICE_BUDGET_S = 450.0  # the whole run, tests included (a lent GPU machine gives a check about 8 minutes)
TESTS_CAP_S = 180.0  # all the test sets together, at most
TEST_SET_CAP_S = 120.0  # one test set, at most, within a budget (the next sets get the rest)
GRACE_S = 15.0  # a part's own clock stops this long before it is killed

LIBRARIES = {  # module -> the distributions that may provide it
    "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy"),
    "numba": ("numba",),
    "numba.cuda": ("numba-cuda",),
    "cuvs": ("cuvs-cu12", "cuvs-cu13", "cuvs"),
    "cudf": ("cudf-cu12", "cudf-cu13", "cudf"),
    "cudf_polars": ("cudf-polars-cu12", "cudf-polars-cu13", "cudf-polars"),
    "rmm": ("rmm-cu12", "rmm-cu13", "rmm"),
}
TEST_SETS = [  # (name, pytest arguments, extra environment); a test file not there is skipped with the reason
    ("spatial kernels on the device", ["tests/test_spatial_cuda_sim.py"], {"SWITCHYARD_GPU_KERNELS": "device"}),
    ("CuPy exact vector engine", ["tests/test_exact_gpu_index.py"], {}),
    ("cuVS adapter", ["tests/test_cuvs_adapter.py"], {}),
    ("vector conformance, GPU rows", ["tests/test_vectors_conformance.py", "-k", "gpu"], {}),
    ("SSB on cuDF", ["tests/test_ssb_service.py", "-k", "cudf"], {}),
    ("ad-hoc SQL on resident cuDF tables", ["tests/test_frame_sql.py", "-k", "cudf"], {}),
]
# The CuPy exact vector engine's benchmark is loadtests/gpu_vectors.py's bench(size, runs) (its SIZES, if it has
# them, else these): it returns a dict; "failures" (a list), "exact": False or any False "*_equal" value fails it,
# "cut" lists what it left out. It may take budget_s (seconds it may use) and progress (a callable given partial
# results).
CUPY_VECTOR_SIZES = ({"vectors": 1_000_000, "dims": [128, 768], "batches": [1, 16, 256, 2048], "k": 10},
                     {"vectors": 100_000, "dims": [128], "batches": [1, 16, 256], "k": 10})


@dataclass(frozen=True)
class Part:
    name: str
    target: str  # module:function, called in a child process as function(size, runs[, budget_s][, progress])
    needs: tuple[str, ...]  # modules from LIBRARIES
    sizes: tuple[Any, Any] | None  # normal, --quick; None: the target module's SIZES
    cap_s: float  # the most it may take
    reserve_s: float  # kept for it while earlier parts run


PARTS = [
    Part("spatial", "loadtests.gpu_spatial:bench_spatial", ("cupy", "numba.cuda"), gpu_spatial.SIZES, 150, 60),
    Part("spatial-first-request", "loadtests.gpu_profile:first_request_profile", ("cupy", "numba.cuda"),
         gpu_profile.SIZES, 60, 25),
    Part("spatial-http", "loadtests.gpu_http:bench_http", ("cupy", "numba.cuda"), gpu_http.SIZES, 130, 60),
    # the CuPy exact vector engine (indexes/): its bench lives in loadtests/gpu_vectors.py, skipped until it exists
    Part("cupy-vectors", "loadtests.gpu_vectors:bench", ("cupy",), None, 150, 45),
    Part("vectors", "loadtests.gpu_rapids:bench_vectors", ("cupy", "cuvs"), gpu_rapids.SIZES["vectors"], 90, 40),
    Part("olap", "loadtests.gpu_rapids:bench_olap", ("cudf",), gpu_rapids.SIZES["olap"], 90, 40),
    Part("numpy-shim", "loadtests.gpu_profile:warm_up_without_shim", ("numba.cuda",), ({}, {}), 45, 20),
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


def row_stack_status() -> str:
    """numpy 2.5 removed numpy.row_stack, which numba-cuda 0.30.4 still calls (issue 38)."""
    row_stack = getattr(np, "row_stack", None)
    if row_stack is None:
        return "absent (numpy removed it)"
    if row_stack is np.vstack:
        return "added by a shim (numpy.row_stack = numpy.vstack; loadtests/device/on-device.sh --shim)"
    return "numpy's own"


def probe() -> dict[str, Any]:
    from service.process.devices import probe_cuda

    cuda = probe_cuda()
    return {"device": [{"index": d.index, "name": d.name, "memory_bytes": d.total_memory_bytes} for d in cuda.devices],
            "device_reason": None if cuda.present else cuda.reason,
            "libraries": {module: _installed(module) for module in LIBRARIES},
            "numpy": np.__version__, "numpy_row_stack": row_stack_status(),
            "python": platform.python_version(), "cores": os.cpu_count()}


class Budget:
    """The run's wall-clock allowance (None: unlimited)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.started)

    def allow(self, cap: float, reserved: float, own: float = 0.0) -> float:
        """Up to `cap`, leaving `reserved` for what comes after, but at least `own` while there is that much."""
        left = self.left()
        return max(0.0, min(cap, max(left - reserved, min(own, left))))


# -- the tests ---------------------------------------------------------------------------------------------------
def run_tests(name: str, args: list[str], env: dict[str, str], timeout_s: float,
              cut_by_budget: bool = False) -> dict[str, Any]:
    """One test set in a pytest of its own. `cut_by_budget`: timeout_s is what the run's budget left it, so a set
    still running then is reported cut, not failed."""
    if importlib.util.find_spec("pytest") is None:
        return {"set": name, "status": "skipped", "reason": "pytest is not installed here"}
    missing = [a for a in args if a.startswith("tests/") and not (ROOT / a.split("::")[0]).exists()]
    if missing:
        return {"set": name, "status": "skipped", "reason": f"{', '.join(missing)} is not there"}
    if timeout_s < 10:
        return {"set": name, "status": "cut", "reason": "cut: out of time (the run's --device-budget-s)"}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={junit}", *args],
                                  cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            if cut_by_budget:
                return {"set": name, "status": "cut", "reason": f"cut: out of time after {timeout_s:.0f} s "
                        "(the run's --device-budget-s)", "seconds": round(timeout_s, 1)}
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


# -- the parts, each in a child process --------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _write(path: Path, result: Any, done: bool) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"done": done, "result": result}, default=_plain))
    tmp.replace(path)


def child_main(args: argparse.Namespace) -> int:
    """One part, in this (child) process: writes its result, and its partial results as they come, as JSON."""
    module_name, function_name = args.child.split(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, function_name)
    size = json.loads(args.child_size)
    if size is None:  # the module's own sizes: (normal, quick), or {"full": ..., "quick": ...}
        sizes = getattr(module, "SIZES", CUPY_VECTOR_SIZES)
        size = sizes["quick" if args.quick else "full"] if isinstance(sizes, dict) else sizes[1 if args.quick else 0]
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    if "budget_s" in params:
        kwargs["budget_s"] = args.child_budget_s
    if "progress" in params:
        kwargs["progress"] = lambda partial: _write(args.child_out, partial, False)
    _write(args.child_out, fn(size, args.runs, **kwargs), True)
    return 0


def verdict(result: dict[str, Any]) -> str | None:
    """Why a part's answers count as failed (None: they do not)."""
    if "failures" in result:
        return "; ".join(result["failures"])[:2000] or None
    bad: list[str] = ["exact"] if result.get("exact") is False else []

    def scan(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if (k.endswith("_equal") or k == "sql_resident") and v is False:
                    bad.append(f"{where}{k}")
                scan(v, f"{where}{k}.")

    scan(result, "")
    return f"answers differ: {', '.join(bad)}"[:2000] if bad else None


def run_part(part: Part, size: Any, runs: int, allowed_s: float, quick: bool) -> dict[str, Any]:
    """The part in a child process of its own session, killed (with what it started) past allowed_s."""
    entry: dict[str, Any] = {"bench": part.name, "allowed_s": round(allowed_s, 1)}
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{part.name}-") as tmp:
        result_path, log_path = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", part.target, "--child-out",
                   str(result_path), "--child-size", json.dumps(size), "--runs", str(runs),
                   "--child-budget-s", f"{max(allowed_s - GRACE_S, 5.0):.1f}", *(["--quick"] if quick else [])]
        started = time.perf_counter()
        killed = False
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=allowed_s)
            except subprocess.TimeoutExpired:
                killed = True
                for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 30)):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(timeout=wait_s)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        entry["seconds"] = round(time.perf_counter() - started, 1)
        saved = json.loads(result_path.read_text()) if result_path.exists() else {"done": False, "result": None}
        log_tail = log_path.read_text(errors="replace")[-3000:]
    result = saved["result"] or {}
    entry.update(result if isinstance(result, dict) else {"result": result})
    failed = verdict(result) if isinstance(result, dict) else None
    if failed:
        entry.update(status="failed", reason=failed)
    elif killed:
        entry.update(status="cut", reason=f"cut: out of time after {allowed_s:.0f} s (partial results kept)")
    elif proc.returncode != 0 or not saved["done"]:
        last = [line for line in log_tail.splitlines() if line.strip()][-3:]
        entry.update(status="failed", reason=f"exited with {proc.returncode}: {' / '.join(last)}"[:1500])
    elif entry.get("cut"):
        entry.update(status="cut", reason=f"cut: out of time: {len(entry['cut'])} measurement(s) left out")
    else:
        entry["status"] = "passed"
    if entry["status"] != "passed":
        entry["log_tail"] = log_tail
    return entry


def skip_reason(part: Part, here: dict[str, Any]) -> str | None:
    if here["device_reason"]:
        return here["device_reason"]
    if part.sizes is None and importlib.util.find_spec(part.target.split(":")[0]) is None:
        return f"{part.target.split(':')[0].replace('.', '/')}.py is not there yet"
    missing = [m for m in part.needs if not here["libraries"][m]["installed"]]
    if missing:
        return f"not installed: {', '.join(missing)}"
    if part.name == "numpy-shim" and "shim" not in here["numpy_row_stack"]:
        return f"no numpy shim to take away: numpy.row_stack is {here['numpy_row_stack']}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small benchmark sizes")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--runs", type=int, default=3, help="timed calls per measurement (median); slow ones get 1")
    ap.add_argument("--test-timeout", type=float, default=1200.0, help="seconds per test set, at most")
    ap.add_argument("--device-budget-s", type=float, default=DEVICE_BUDGET_S,
                    help=f"wall-clock seconds for the whole run (default {DEVICE_BUDGET_S:.0f}; 0: no limit)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-size", default="null", help=argparse.SUPPRESS)
    ap.add_argument("--child-budget-s", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    budget = Budget(args.device_budget_s or None)
    here = probe()
    report: dict[str, Any] = {"stamp": stamp, "here": here, "budget_s": budget.seconds, "tests": [], "benches": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-check-{stamp}"

    def save() -> None:  # after every step: a run stopped from outside still leaves its report so far
        report["seconds"] = round(time.monotonic() - budget.started, 1)
        path.with_suffix(".json").write_text(json.dumps(report, indent=2, default=_plain))
        path.with_suffix(".md").write_text(markdown(report))

    skips = {part.name: skip_reason(part, here) for part in PARTS}
    runnable = [] if args.no_bench else [part for part in PARTS if not skips[part.name]]
    reserved = sum(part.reserve_s for part in runnable)
    if not args.no_tests:
        tests_until = time.monotonic() + budget.allow(TESTS_CAP_S, reserved)
        for name, pytest_args, env in TEST_SETS:
            print(f"tests: {name} ...", flush=True)
            left = tests_until - time.monotonic()
            if budget.seconds is not None:
                left = min(left, TEST_SET_CAP_S)
            report["tests"].append(run_tests(name, pytest_args, env, min(args.test_timeout, left),
                                             cut_by_budget=left < args.test_timeout))
            t = report["tests"][-1]
            print(f"  {t['status']} ({t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                  f"{t.get('skipped', 0)} skipped) in {t.get('seconds', 0)} s", flush=True)
            save()
    report["layout"] = check_layout(here)
    if not args.no_bench:
        for part in PARTS:
            if skips[part.name]:
                report["benches"].append({"bench": part.name, "status": "skipped", "reason": skips[part.name]})
                continue
            reserved -= part.reserve_s
            allowed = budget.allow(part.cap_s, reserved, own=part.reserve_s)
            if allowed < min(part.reserve_s, 20):
                report["benches"].append({"bench": part.name, "status": "cut", "reason": (
                    f"cut: out of time ({max(budget.left(), 0):.0f} s of the run's budget left)")})
                continue
            size = part.sizes[1 if args.quick else 0] if part.sizes else None
            print(f"benchmark: {part.name} (up to {allowed:.0f} s) ...", flush=True)
            report["benches"].append(run_part(part, size, args.runs, allowed, args.quick))
            b = report["benches"][-1]
            print(f"  {b['status']} in {b.get('seconds')} s" + (f": {b['reason'][:300]}" if b.get("reason") else ""),
                  flush=True)
            save()
    save()
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
