"""Scale-out on Ray: single-vector search (and upsert) throughput and latency against shards x replicas, beside
one process.

    python loadtests/bench_scaleout.py                      # 50,000 x 128, layouts single,1x1,2x1,2x2
    python loadtests/bench_scaleout.py --rows 200000 --layouts single,2x2,4x1 --clients 1,4,16

Every layout serves the same data (an HNSW index, the same parameters) from a fresh service: `single` is the
ordinary one-process service; `SxR` joins a local Ray cluster (two node processes on this machine) with S shards
of R replicas each. The fan-out overhead is the one-client latency of a layout minus the single process's: the
hop to the shard actors and the merge. On one machine the shards and replicas share its cores with the clients
and PostgreSQL, and each Ray actor call costs the ingress CPU of its own (Ray's core worker threads): this shows
what the hop costs, not what a cluster of machines would serve. Writes JSON and a PNG under results_dir("scaleout")
(loadtests/processes.py).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtests.bench_overhead import bodies, qps_vs_clients  # noqa: E402
from loadtests.bench_vectors import bulk_load  # noqa: E402
from loadtests.benchkit import Service, local_ray_cluster, save_json, versions, wait_for_quiet  # noqa: E402
from loadtests.datasets import exact_neighbors, mixture  # noqa: E402
from loadtests.processes import results_dir  # noqa: E402

RESULTS = results_dir("scaleout")
M, EF_CONSTRUCTION = 16, 64


def call(port: int, method: str, path: str, body: Any = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request(method, path, orjson.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    if response.status >= 300:
        raise RuntimeError(f"{method} {path}: {response.status} {payload[:300]!r}")
    return orjson.loads(payload) if payload else None


def recall(port: int, name: str, queries: np.ndarray, truth: np.ndarray, ef: int) -> float:
    got = call(port, "POST", f"/v1/collections/{name}/search", {
        "vectors": queries.tolist(), "k": 10, "engine": "cpu", "params": {"ef": ef}, "consistency": "strong"})["ids"]
    return float(np.mean([len(set(g) & set(t[:10].tolist())) / 10 for g, t in zip(got, truth)]))


def run_layout(layout: str, address: str | None, base: np.ndarray, queries: np.ndarray, truth: np.ndarray,
               args: argparse.Namespace) -> dict[str, Any]:
    env = {}
    if layout != "single":
        shards, replicas = map(int, layout.split("x"))
        env = {"SWITCHYARD_RAY_ADDRESS": address, "SWITCHYARD_SHARDS": str(shards),
               "SWITCHYARD_SHARD_REPLICAS": str(replicas), "SWITCHYARD_SHARD_CPUS": "0.5",
               "SWITCHYARD_RAY_NAMESPACE": f"bench-{layout}"}
    print(f"== {layout}", flush=True)
    with tempfile.TemporaryDirectory(prefix="switchyard-scaleout-") as tmp:
        service = Service(Path(tmp) / "data", env=env)
        service.start(timeout_s=300)
        try:
            name = "scaleout"
            call(service.port, "POST", "/v1/collections", {
                "name": name, "dim": base.shape[1], "pgvector_index": {"type": "none"},
                "index": {"type": "hnsw", "params": {"m": M, "ef_construction": EF_CONSTRUCTION}}})
            started = time.perf_counter()
            bulk_load(service.port, name, base)
            loaded_s = time.perf_counter() - started
            deadline = time.monotonic() + 300
            while True:  # every replica rebuilt and caught up: a strong search answers from the resident engine
                try:
                    row = {"recall": recall(service.port, name, queries[:200], truth[:200], args.ef)}
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            row.update(layout=layout, load_s=round(loaded_s, 2))
            path = f"/v1/collections/{name}/search?k=10&engine=cpu&ef={args.ef}"
            row["clients"] = qps_vs_clients(service, path, bodies(queries, "raw"), args.clients, args.duration)
            # Single-vector upserts with new ids: committed at the ingress, then taken in by the owning shards.
            fresh = np.random.default_rng(7).standard_normal((50_000, base.shape[1])).astype(np.float32)
            upserts = [(orjson.dumps({"ids": [10_000_000 + i], "vectors": [v.tolist()]}), "application/json")
                       for i, v in enumerate(fresh)]
            row["upsert_clients"] = qps_vs_clients(service, f"/v1/collections/{name}/points", upserts,
                                                   args.upsert_clients, args.duration, method="PUT")
            if layout != "single":
                row["shards"] = call(service.port, "GET", "/v1/engines")["shards"]
        finally:
            service.stop()
    return row


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in report["layouts"]:
        clients = [r["clients"] for r in row["clients"]]
        left.plot(clients, [r["qps"] for r in row["clients"]], marker="o", label=row["layout"])
        right.plot(clients, [r["p99_ms"] for r in row["clients"]], marker="o", label=row["layout"])
    left.set(xscale="log", xlabel="clients", ylabel="QPS", title="single-vector search QPS (shards x replicas)")
    right.set(xscale="log", yscale="log", xlabel="clients", ylabel="p99 ms", title="p99 latency")
    for axis in (left, right):
        axis.legend(fontsize=8)
    cores = report["versions"]["cores"]
    fig.suptitle(f"{report['rows']:,} x {report['dim']} on {cores} cores (shared by the clients, the ingress, the "
                 "actors and PostgreSQL)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--layouts", default="single,1x1,2x1,2x2", help="'single' and SHARDSxREPLICAS entries")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--upsert-clients", default="1,8", help="clients for the single-vector upsert runs")
    parser.add_argument("--duration", type=float, default=5)
    parser.add_argument("--ef", type=int, default=64)
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    args.upsert_clients = [int(c) for c in args.upsert_clients.split(",")]
    print(f"machine load before: {wait_for_quiet():.2f} cores busy", flush=True)
    base, queries = mixture(args.rows, args.queries, args.dim, seed=1)
    truth = exact_neighbors(base, queries[:200], "l2")
    layouts = args.layouts.split(",")
    rows = []
    with local_ray_cluster(nodes=2, cpus_per_node=8) as address:
        for layout in layouts:
            rows.append(run_layout(layout, address, base, queries, truth, args))
    single = next((r for r in rows if r["layout"] == "single"), None)
    if single is not None:
        base_p50 = single["clients"][0]["p50_ms"]
        for r in rows:
            r["fanout_overhead_ms_p50_1_client"] = round(r["clients"][0]["p50_ms"] - base_p50, 3)
            r["qps_ratio_to_single"] = [round(x["qps"] / s["qps"], 3) for x, s in zip(r["clients"], single["clients"])]
            r["upsert_ratio_to_single"] = [round(x["qps"] / s["qps"], 3)
                                           for x, s in zip(r["upsert_clients"], single["upsert_clients"])]
    report = {"what": "single-vector search over HTTP, one process vs Ray shards x replicas", "rows": args.rows,
              "dim": args.dim, "ef": args.ef, "m": M, "ef_construction": EF_CONSTRUCTION, "layouts": rows,
              "versions": versions("ray", "faiss-cpu", "fastapi"),
              "note": "one machine: the shard actors, the ingress, PostgreSQL and the clients share its cores"}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    save_json(RESULTS / f"bench_scaleout-{stamp}.json", report)
    plot(RESULTS / f"bench_scaleout-{stamp}.png", report)
    for r in rows:
        print(f"{r['layout']:>7}: recall {r['recall']:.3f}, QPS " + ", ".join(
            f"{c['clients']}c {c['qps']:,.0f} (p99 {c['p99_ms']} ms)" for c in r["clients"])
            + (f", fan-out +{r['fanout_overhead_ms_p50_1_client']} ms p50" if single else "")
            + "; upserts/s " + ", ".join(f"{c['clients']}c {c['qps']:,.0f}" for c in r["upsert_clients"]))
    print(f"wrote {RESULTS / f'bench_scaleout-{stamp}.json'}")


if __name__ == "__main__":
    main()
