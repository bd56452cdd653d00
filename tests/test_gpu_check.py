"""`make gpu-check` (loadtests/gpu_check.py) on a machine without a GPU: every GPU part is skipped with its reason
and the report is written. Its spatial benchmark code runs in the CUDA simulator (tests/test_spatial_cuda_sim.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    assert [b["bench"] for b in report["benches"]] == ["spatial", "vectors", "olap"]
    assert all(b["status"] == "skipped" and b["reason"] for b in report["benches"])
    assert report["layout"]["status"] == "skipped" and report["layout"]["reason"].startswith("no CUDA device")
    markdown = report_path.with_suffix(".md").read_text()
    assert "Device: none (no CUDA device" in markdown and "**spatial**: skipped" in markdown
