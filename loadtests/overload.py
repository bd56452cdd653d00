"""Overload: admitted p99 and throughput at 4x capacity, per workload, from an open-loop generator in its own
processes (loadtests/openloop.py).

    python loadtests/overload.py --duration 20 [--workloads k10,k100,mix] [--factor 4]
        [--pin | --service-cores N --generator-processes P]

A fresh `switchyard serve` (its own defaults) with a 20,000 x 128 HNSW collection, a 50,000 x 64 one and SSB at
scale factor 0.1. Per workload: the unloaded reference (one closed-loop client), the capacity (open-loop steps at
doubling rates until answers per second stop growing by 5%), then open loop at `factor` x capacity. Reported: the
admitted p99 over the unloaded p99 (the issue's bound: 3x), the answers per second while refusing (from the
schedule's start until the last answer came) over capacity
(bound: 0.9), the share refused and whether each refusal had Retry-After, and the generator's lateness and CPU.
Workloads: k10 (k=10 searches), k100 (k=100, ef=800 searches), mix (90% k=10 searches, 10% SSB queries on DuckDB).
Client and transport: pre-encoded JSON over keep-alive HTTP/1.1 on TCP loopback. Results: results_dir("overload").
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtests import openloop  # noqa: E402
from loadtests.benchkit import Service, save_json, versions, wait_for_quiet  # noqa: E402
from loadtests.client import Api  # noqa: E402
from loadtests.processes import results_dir  # noqa: E402

SSB_QUERIES = ("1.1", "2.1", "3.2", "4.1")


def searches(collection: str, dim: int, k: int, params: dict[str, Any] | None, n: int = 256,
             seed: int = 0) -> list[openloop.Request]:
    rng = np.random.default_rng(seed)
    out = []
    for vector in rng.random((n, dim), dtype=np.float32):
        body: dict[str, Any] = {"vector": vector, "k": k}
        if params:
            body["params"] = params
        out.append(openloop.http_request("POST", f"/v1/collections/{collection}/search",
                                         orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), "search"))
    return out


def workloads() -> dict[str, list[openloop.Request]]:
    k10 = searches("c128", 128, 10, None)
    ssb = [openloop.http_request("POST", f"/v1/olap/ssb/queries/{q}", b'{"engine": "duckdb"}', "ssb")
           for q in SSB_QUERIES]
    mix = [ssb[(i // 10) % len(ssb)] if i % 10 == 9 else k10[i] for i in range(len(k10))]  # 90/10
    return {"k10": k10, "k100": searches("c64", 64, 100, {"ef": 800}), "mix": mix}


def prepare(url: str) -> None:
    api = Api(url)
    rng = np.random.default_rng(1)
    for name, rows, dim in (("c128", 20_000, 128), ("c64", 50_000, 64)):
        api.http.post("/v1/collections", json={"name": name, "dim": dim, "index": {"type": "hnsw"}}).raise_for_status()
        centres = rng.random((64, dim), dtype=np.float32)
        vectors = centres[rng.integers(0, 64, rows)] + 0.05 * rng.standard_normal((rows, dim), dtype=np.float32)
        for start in range(0, rows, 5000):
            api.http.put(f"/v1/collections/{name}/points", content=orjson.dumps(
                {"ids": list(range(start, start + 5000)), "vectors": vectors[start:start + 5000]},
                option=orjson.OPT_SERIALIZE_NUMPY), headers={"Content-Type": "application/json"}).raise_for_status()
        wait_job(api, api.http.post(f"/v1/collections/{name}/build").json().get("job"))
    wait_job(api, api.http.post("/v1/olap/ssb/generate", json={"scale_factor": 0.1}).json()["job"])


def wait_job(api: Api, job: str | None) -> None:
    while job and api.http.get(f"/v1/jobs/{job}").json()["state"] in ("queued", "running"):
        time.sleep(0.5)


def capacity(port: int, requests: list[openloop.Request], start: float, step_s: float, cpus: set[int] | None,
             processes: int) -> dict[str, Any]:
    """Open-loop steps at doubling rates until the answers per second stop growing (by 5%): the best step."""
    steps = [openloop.run(port, requests, step_s, rate=start, cpus=cpus, processes=processes)]
    rate = 2 * start
    while rate <= 256 * start:
        steps.append(openloop.run(port, requests, step_s, rate=rate, cpus=cpus, processes=processes))
        if steps[-1]["admitted_per_s"] < 1.05 * max(step["admitted_per_s"] for step in steps[:-1]):
            break
        rate *= 2
    best = max(steps, key=lambda step: step["admitted_per_s"])
    return {**best, "steps": [{k: s[k] for k in ("offered_per_s", "admitted_per_s", "p99_ms", "shed_share")}
                              for s in steps]}


def measure(port: int, requests: list[openloop.Request], duration_s: float, factor: float,
            cpus: set[int] | None, processes: int) -> dict[str, Any]:
    unloaded = openloop.run(port, requests, duration_s, clients=1, processes=1, cpus=cpus)
    wait_for_quiet(10)
    cap = capacity(port, requests, max(20.0, unloaded["admitted_per_s"] / 2), max(3.0, duration_s / 4), cpus,
                   processes)
    wait_for_quiet(10)
    before = refusals(port)
    over = openloop.run(port, requests, duration_s, rate=factor * cap["admitted_per_s"], cpus=cpus,
                        processes=processes)
    after = refusals(port)
    over["refused_by"] = {key: after[key] - before.get(key, 0) for key in after if after[key] > before.get(key, 0)}
    return {"unloaded": unloaded, "capacity": cap, "overload": over,
            "p99_vs_unloaded": round(over["p99_ms"] / unloaded["p99_ms"], 2) if over["p99_ms"] else None,
            "p99_vs_unloaded_by_label": {
                label: round(over["by_label"][label]["p99_ms"] / unloaded["by_label"][label]["p99_ms"], 2)
                for label in over["by_label"] if label in unloaded["by_label"]},
            "throughput_vs_capacity": round(over["admitted_per_s"] / cap["admitted_per_s"], 3)}


def refusals(port: int) -> dict[str, float]:
    """The service's refusals so far, by engine and reason (`switchyard_shed_total`, from /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {f"{engine}/{reason}": float(count) for engine, reason, count in
            re.findall(r'^switchyard_shed_total\{engine="([^"]*)",reason="([^"]*)"\} (\S+)$', text, re.M)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20, help="seconds of the unloaded and overload phases")
    parser.add_argument("--factor", type=float, default=4.0, help="overload: this many times capacity")
    parser.add_argument("--workloads", default="k10,k100,mix")
    parser.add_argument("--env", action="append", default=[], help="SWITCHYARD_X=Y for the service (repeatable)")
    parser.add_argument("--pin", action="store_true", help=(
        "service and PostgreSQL on the first half of the cores, the generator on the rest (a small machine: "
        "otherwise the generator competes with the service it measures)"))
    parser.add_argument("--service-cores", type=int, default=0, help=(
        "start the service and PostgreSQL on the first N cores (they size themselves to them), the generator on "
        "the rest: a machine with cores to spare, where the generator need not share the service's"))
    parser.add_argument("--fronts-apart", action="store_true", help=(
        "with --service-cores: the front processes moved onto the generator's cores once started, the engine and "
        "PostgreSQL left on the service's (a small machine's stand-in for fronts with cores of their own; pass "
        "--env SWITCHYARD_FRONTS=N, as a service on few cores starts none)"))
    parser.add_argument("--generator-processes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir("overload"))
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    service_cpus = set(cores[:args.service_cores]) if args.service_cores else None

    env = dict(item.split("=", 1) for item in args.env)
    chosen = {name: reqs for name, reqs in workloads().items() if name in args.workloads.split(",")}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        service = Service(Path(tmp) / "data", env={"SWITCHYARD_ACCESS_LOG": "false", **env}, benchmark_env=False,
                          cpus=service_cpus)
        service.data_dir.mkdir(parents=True)
        service.start()
        cpus = set(cores[args.service_cores:]) if service_cpus else None
        try:
            prepare(service.url)
            if args.fronts_apart and cpus:
                print("fronts moved onto cores", sorted(cpus), ":", move_fronts(service, cpus), flush=True)
            if args.pin and not service_cpus:
                half = max(1, len(cores) // 2)
                pin(service, set(cores[:half]))
                cpus = set(cores[half:])
            for name, requests in chosen.items():
                wait_for_quiet(20)
                results[name] = measure(service.port, requests, args.duration, args.factor, cpus,
                                        args.generator_processes)
                print(name, table_row(name, results[name]), "refused by", results[name]["overload"]["refused_by"],
                      flush=True)
        finally:
            service.stop()
    report = {"what": __doc__.split("\n\n")[0], "factor": args.factor, "env": env, "pinned": args.pin,
              "fronts_apart": args.fronts_apart,
              "service_cpus": sorted(service_cpus) if service_cpus else None, "cores": len(cores),
              "generator_cpus": sorted(cpus) if cpus else None, "workloads": results,
              "versions": versions("fastapi", "uvicorn", "faiss-cpu", "duckdb")}
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"overload-{time.strftime('%Y%m%d-%H%M%S')}.json", report)
    print("| workload | unloaded p99 ms | capacity /s | offered /s | admitted /s (x capacity) | admitted p99 ms "
          "(x unloaded) | refused | generator late p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        print(table_row(name, result))


def pin(service: Service, cpus: set[int]) -> None:
    """Every thread of the service and of PostgreSQL onto `cpus` (new backends inherit the postmaster's)."""
    set_affinity(service.pids(), cpus)


def set_affinity(pids: Iterable[int], cpus: set[int]) -> None:
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:
                pass


def move_fronts(service: Service, cpus: set[int]) -> list[int]:
    """The front processes (the supervisor named by its command line, and its workers) onto `cpus`: their pids."""
    import psutil

    moved = [proc.pid for p in psutil.process_iter(["cmdline"])
             if "service.process.front:create_front" in " ".join(p.info["cmdline"] or [])
             for proc in (p, *p.children(recursive=True))]
    set_affinity(moved, cpus)
    if not moved:
        raise SystemExit("--fronts-apart: the service runs no front processes (pass --env SWITCHYARD_FRONTS=N)")
    return moved


def table_row(name: str, r: dict[str, Any]) -> str:
    over = r["overload"]
    return (f"| {name} | {r['unloaded']['p99_ms']} | {r['capacity']['admitted_per_s']} | {over['offered_per_s']:.0f} "
            f"| {over['admitted_per_s']} ({r['throughput_vs_capacity']}) | {over['p99_ms']} ({r['p99_vs_unloaded']}) "
            f"| {100 * over['shed_share']:.0f}% (no Retry-After: {over['shed_without_retry_after']}; other: "
            f"{over['errors'] or 0}) | {over['generator']['late_p99_ms']} |")


if __name__ == "__main__":
    main()
