"""The OpenAPI document as a contract: schemathesis `run --checks all` (examples, coverage, fuzzing and stateful
phases) against a running service, with the settings in loadtests/schemathesis.toml.

    python loadtests/contract.py --max-examples 120             # the long pass (over 10,000 cases)
    python loadtests/contract.py --max-examples 5               # the short pass CI runs (tests/test_contract.py)
    python loadtests/contract.py --url http://127.0.0.1:8000    # a service already running

Without --url it starts `switchyard serve` on a fresh data directory (embedded PostgreSQL) and seeds it so the
generated requests reach real resources: a collection, a point layer and a polygon layer, and with --ssb a small
SSB dataset; generated spatial joins may name the seeded layers (loadtests/contract_hooks.py). Generating and
importing SSB data are left out of the run: each generated case would start a job writing up to gigabytes
(tests/test_ssb_service.py covers both routes). The report (case and failure counts,
schemathesis's own output and JSON report) goes to results_dir("contract") (loadtests/processes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from loadtests.processes import local_service, results_dir  # noqa: E402

CONFIG = HERE / "schemathesis.toml"
RESULTS = results_dir("contract")
SKIPPED = r"^/v1/olap/ssb/(generate|import)$"


def seed(url: str, ssb: bool) -> None:
    """Resources for the generated requests to find: a collection with points, two layers, an SSB dataset."""
    with httpx.Client(base_url=url, timeout=300) as http:
        http.post("/v1/collections", json={"name": "c", "dim": 4}).raise_for_status()
        http.put("/v1/collections/c/points", json={
            "ids": [1, 2, 3], "vectors": [[0, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0]],
            "payloads": [{"tag": "a"}, {"tag": "b"}, None]}).raise_for_status()
        http.post("/v1/spatial/layers", json={"name": "pts", "kind": "points", "lon": [0.5, 2.0], "lat": [0.5, 2.0]}
                  ).raise_for_status()
        http.post("/v1/spatial/layers", json={"name": "polys", "kind": "polygons",
                                              "wkt": ["POLYGON((0 0, 1 0, 1 1, 0 1, 0 0))"]}).raise_for_status()
        if ssb:
            job = http.post("/v1/olap/ssb/generate", json={"scale_factor": 0.01}).json()["job"]
            while (state := http.get(f"/v1/jobs/{job}").json()["state"]) in ("queued", "running"):
                time.sleep(0.5)
            if state != "succeeded":
                raise RuntimeError(f"SSB generation ended {state}")


def run(url: str, max_examples: int, workers: int, seed_value: int | None, out: Path) -> dict:
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{url}/openapi.json",
               "--checks", "all", "--max-examples", str(max_examples), "--workers", str(workers), "--no-color",
               "--exclude-path-regex", SKIPPED, "--report", "json", "--report-dir", str(out)]
    if seed_value is not None:
        command += ["--seed", str(seed_value)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "loadtests.contract_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE.parent), os.environ.get("PYTHONPATH"))))}
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    (out / "schemathesis.txt").write_text(done.stdout + done.stderr)
    report = json.loads(max(out.glob("json-*.json")).read_text())  # schemathesis's own counts
    summary = {"exit_code": done.returncode, "max_examples": max_examples,
               "seconds": round(time.monotonic() - started, 1), **report["test_cases"],
               "errors": len(report["errors"]), "phases": {k: v["status"] for k, v in report["phases"].items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running service (default: start one with embedded PostgreSQL)")
    parser.add_argument("--max-examples", type=int, default=120, help="cases per operation and phase")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ssb", action="store_true", help="load an SSB dataset (scale 0.01) so queries answer 200")
    parser.add_argument("--out", type=Path,
                        help="report folder (default: results_dir('contract')/contract-<time>, loadtests/processes.py)")
    args = parser.parse_args(argv)

    out = args.out or RESULTS / time.strftime("contract-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    env = {"SWITCHYARD_ACCESS_LOG": "false"}  # otherwise its defaults
    service = nullcontext(args.url) if args.url else local_service(
        1, tempfile.mkdtemp(prefix="switchyard-contract-"), out / "service.log", env=env)
    with service as url:
        if not args.url:
            seed(url, args.ssb)
        summary = run(url, args.max_examples, args.workers, args.seed, out)
    print(json.dumps(summary, indent=2))
    print(f"report: {out}", file=sys.stderr)
    return summary["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
