"""What the service costs on top of its engine: server CPU per request beside in-process FAISS, and QPS vs clients.

    python loadtests/bench_overhead.py                  # 50,000 x 128 and 100,000 x 768, clustered
    python loadtests/bench_overhead.py --sets 20000x128 --workers 2

For each data set, a fresh `switchyard serve` with an HNSW collection (m=16, ef_construction=64) and the same FAISS
index in this process: CPU per search in-process; CPU of the service's processes per single-vector search (JSON,
base64, raw float32 bodies) and upsert, from /proc; then QPS and latency for 1-64 clients and upserts per second
for 1-16. `--env SWITCHYARD_FRONTS=2` for the front/engine layout (each process's RSS recorded with its role).
Writes JSON and a PNG under results_dir("overhead").
"""

from __future__ import annotations

import argparse
import base64
import http.client
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import psutil

from bench_vectors import bulk_load
from benchkit import MachineLoad, Service, results_dir, run_clients, save_json, versions, wait_for_quiet
from datasets import mixture

RESULTS = results_dir("overhead")
K, EF, M, EF_CONSTRUCTION = 10, 64, 16, 64
IDLE_GAP_S = 0.0003  # about one client round trip here


def faiss_cpu_per_search(base: np.ndarray, queries: np.ndarray) -> dict[str, Any]:
    import faiss

    faiss.omp_set_num_threads(1)
    index = faiss.IndexHNSWFlat(base.shape[1], M)
    index.hnsw.efConstruction = EF_CONSTRUCTION
    started = time.perf_counter()
    faiss.omp_set_num_threads(psutil.cpu_count())
    index.add(base)
    built = time.perf_counter() - started
    faiss.omp_set_num_threads(1)
    index.hnsw.efSearch = EF
    for q in queries[:200]:  # warm
        index.search(q[None, :], K)
    passes = []
    for _ in range(5):  # the median of five passes, as for the service
        cpu0 = time.process_time()
        for q in queries:
            index.search(q[None, :], K)
        passes.append((time.process_time() - cpu0) / len(queries))
    per = sorted(passes)[2]
    # The same searches with the core idle between them, as a server's is while one client's request travels:
    # on this VM an idle gap of a few hundred microseconds makes the next call cost about twice the CPU (cold
    # caches), which a back-to-back loop never sees.
    gapped = 0.0
    for q in queries:
        time.sleep(IDLE_GAP_S)
        started = time.thread_time()
        index.search(q[None, :], K)
        gapped += time.thread_time() - started
    return {"cpu_us_per_search": round(per * 1e6, 1),
            "cpu_us_per_search_idle_gaps": round(gapped / len(queries) * 1e6, 1),
            "idle_gap_us": IDLE_GAP_S * 1e6, "build_s": round(built, 1)}


def service_cpu(pids: Callable[[], set[int]]) -> float:
    total = 0.0
    for pid in pids():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _service_pids(service: Service) -> set[int]:
    root = psutil.Process(service.proc.pid)
    return {root.pid, *(c.pid for c in root.children(recursive=True) if "postgres" not in c.name())}


def process_memory(pids: set[int]) -> list[dict[str, Any]]:
    """RSS of each of the service's processes, with its role (the engine, a front, or the fronts' supervisor)."""
    out = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            command, rss = " ".join(process.cmdline()), process.memory_info().rss
        except psutil.Error:
            continue
        role = ("engine" if "service.cli" in command else "front" if "spawn_main" in command
                else "fronts' supervisor" if "service.process.front" in command else "resource tracker"
                if "resource_tracker" in command else command[:60])
        out.append({"pid": pid, "role": role, "rss_mb": round(rss / 2**20, 1)})
    return out


def _postgres_pids(service: Service) -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "postgres"}


def bodies(queries: np.ndarray, encoding: str) -> list[tuple[bytes, str]]:
    common = {"k": K, "engine": "cpu", "params": {"ef": EF}}
    out = []
    for q in queries:
        if encoding == "json":
            out.append((orjson.dumps({"vector": q.tolist(), **common}), "application/json"))
        elif encoding == "b64":
            out.append((orjson.dumps({"vectors_b64": base64.b64encode(q.astype("<f4").tobytes()).decode(), **common}),
                        "application/json"))
        else:
            out.append((q.astype("<f4").tobytes(), "application/octet-stream"))
    return out


def per_request_cpu(service: Service, path: str, requests: list[tuple[bytes, str]], method: str = "POST",
                    query: str = "", runs: int = 1, min_requests: int = 0) -> dict[str, Any]:
    """Requests one after another on one keep-alive connection; CPU the service (and PostgreSQL) spent per request,
    the median of `runs` passes over the requests (with min and max: background work such as a snapshot written
    after a build shows as one slow pass)."""
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)

    def send(body: bytes, content_type: str) -> None:
        conn.request(method, path + query, body, {"Content-Type": content_type})
        response = conn.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: {response.status} {payload[:300]!r}")

    for body, ctype in requests[:100]:  # warm
        send(body, ctype)
    ours, pg = (lambda: _service_pids(service)), (lambda: _postgres_pids(service))
    # CPU times come in 10 ms ticks: a pass of 10,000 requests reads to 1 us per request
    sequence = requests * max(1, -(-min_requests // len(requests)))
    n = len(sequence)
    passes = []
    for _ in range(runs):
        cpu0, pg0, t0 = service_cpu(ours), service_cpu(pg), time.perf_counter()
        for body, ctype in sequence:
            send(body, ctype)
        elapsed = time.perf_counter() - t0
        passes.append(((service_cpu(ours) - cpu0) / n * 1e6, (service_cpu(pg) - pg0) / n * 1e6, elapsed / n * 1e6))
    conn.close()
    cpu = sorted(p[0] for p in passes)
    middle = sorted(passes)[len(passes) // 2]
    return {"cpu_us_per_request": round(middle[0], 1), "cpu_us_min": round(cpu[0], 1), "cpu_us_max": round(cpu[-1], 1),
            "postgres_cpu_us_per_request": round(middle[1], 1), "wall_us_per_request": round(middle[2], 1),
            "requests": n, "passes": runs}


def qps_vs_clients(service: Service, path: str, requests: list[tuple[bytes, str]], clients: list[int],
                   duration_s: float, method: str = "POST") -> list[dict[str, Any]]:
    """Closed-loop clients; each row also gives the service's CPU per request under that load (no idle gaps)."""
    out = []
    ours = lambda: _service_pids(service)  # noqa: E731
    for n in clients:
        def make(c: int) -> Callable[[int], int]:
            conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)

            def call(i: int) -> int:
                body, ctype = requests[i % len(requests)]
                conn.request(method, path, body, {"Content-Type": ctype})
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise RuntimeError(f"{method} {path}: {response.status}")
                return 1

            call.close = conn.close  # type: ignore[attr-defined]
            return call

        cpu0 = service_cpu(ours)
        row = run_clients(n, duration_s, make)
        row["server_cpu_us_per_request"] = round((service_cpu(ours) - cpu0) / max(1, row["calls"]) * 1e6, 1)
        print(f"    {n:>3} clients: {row['qps']:,.0f} QPS, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
              f"server CPU {row['server_cpu_us_per_request']} us/request", flush=True)
        out.append(row)
    return out


def run_set(n: int, dim: int, args: argparse.Namespace) -> dict[str, Any]:
    print(f"== {n:,} x {dim}", flush=True)
    base, queries = mixture(n, args.queries, dim, seed=1)
    result: dict[str, Any] = {"rows": n, "dim": dim}
    print("  FAISS in-process (building HNSW) ...", flush=True)
    result["faiss_in_process"] = faiss_cpu_per_search(base, queries)
    print(f"    {result['faiss_in_process']['cpu_us_per_search']} us CPU per search", flush=True)
    with tempfile.TemporaryDirectory(prefix="switchyard-overhead-") as tmp:
        service = Service(Path(tmp) / "data", env={"SWITCHYARD_WORKERS": str(args.workers),
                                                   **dict(e.split("=", 1) for e in args.env)})
        service.start()
        try:
            name = f"overhead{dim}"
            conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=600)
            conn.request("POST", "/v1/collections", orjson.dumps({
                "name": name, "dim": dim,
                "index": {"type": "hnsw", "params": {"m": M, "ef_construction": EF_CONSTRUCTION}},
                "pgvector_index": {"type": "hnsw", "m": M, "ef_construction": EF_CONSTRUCTION}}),
                {"Content-Type": "application/json"})
            conn.getresponse().read()
            result["load"] = bulk_load(service.port, name, base)
            load = MachineLoad(service.pids)
            result["search"] = {}
            with load.measure(result):
                for encoding in args.encodings:
                    try:
                        row = per_request_cpu(service, f"/v1/collections/{name}/search", bodies(queries, encoding),
                                              query="?k=10&engine=cpu&ef=64" if encoding == "raw" else "",
                                              runs=args.passes, min_requests=10_000)
                    except RuntimeError as exc:  # e.g. a service without raw float32 bodies
                        row = {"error": str(exc)[:200]}
                    result["search"][encoding] = row
                    print(f"  search ({encoding}): {row}", flush=True)
                rng = np.random.default_rng(2)
                upserts = [(orjson.dumps({"ids": [10_000_000 + i], "vectors": [v.tolist()]}), "application/json")
                           for i, v in enumerate(rng.standard_normal((args.upserts, dim)).astype(np.float32))]
                result["upsert"] = per_request_cpu(service, f"/v1/collections/{name}/points", upserts, method="PUT")
                print(f"  upsert (json, 1 vector): {result['upsert']}", flush=True)
                print("  QPS vs clients (JSON single-vector searches):", flush=True)
                result["clients"] = qps_vs_clients(service, f"/v1/collections/{name}/search", bodies(queries, "json"),
                                                   args.clients, args.duration)
                # Concurrent single-vector upserts (new ids, so each is a real insert): what group commit is for.
                print("  upserts per second vs clients (JSON, 1 vector each):", flush=True)
                fresh = [(orjson.dumps({"ids": [20_000_000 + i], "vectors": [v.tolist()]}), "application/json")
                         for i, v in enumerate(rng.standard_normal((50_000, dim)).astype(np.float32))]
                result["upsert_clients"] = qps_vs_clients(service, f"/v1/collections/{name}/points", fresh,
                                                          args.upsert_clients, args.duration, method="PUT")
            result["rss_mb"] = process_memory(_service_pids(service))
        finally:
            service.stop()
    faiss_us = result["faiss_in_process"]["cpu_us_per_search"]
    result["overhead_us"] = {e: round(r["cpu_us_per_request"] - faiss_us, 1)
                             for e, r in result["search"].items() if "cpu_us_per_request" in r}
    return result


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = report["sets"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, width = [f"{s['rows']:,} x {s['dim']}" for s in sets], 0.8 / (1 + len(report["encodings"]))
    xs = np.arange(len(sets))
    left.bar(xs, [s["faiss_in_process"]["cpu_us_per_search"] for s in sets], width, label="FAISS in-process")
    for i, e in enumerate(report["encodings"], 1):
        left.bar(xs + i * width, [s["search"][e].get("cpu_us_per_request", 0) for s in sets], width,
                 label=f"service, {e} body")
    left.set_xticks(xs + width * len(report["encodings"]) / 2, labels)
    left.set(ylabel="CPU µs per single-vector search", title="Server CPU per search vs the engine alone")
    left.legend(fontsize=8)
    for s in sets:
        right.plot([r["clients"] for r in s["clients"]], [r["qps"] for r in s["clients"]], marker="o",
                   label=f"{s['rows']:,} x {s['dim']}")
    right.set(xscale="log", xlabel="clients (closed loop, same cores)", ylabel="QPS", title="QPS vs clients")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="50000x128,100000x768", help="comma-separated ROWSxDIM")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--upserts", type=int, default=500)
    parser.add_argument("--encodings", default="json,b64,raw", help="search body encodings to measure")
    parser.add_argument("--clients", default="1,2,4,8,16,32,64")
    parser.add_argument("--upsert-clients", default="1,4,16", help="clients for the upsert QPS runs")
    parser.add_argument("--duration", type=float, default=5)
    parser.add_argument("--passes", type=int, default=5, help="passes over the queries per search encoding (median)")
    parser.add_argument("--workers", type=int, default=1, help="SWITCHYARD_WORKERS of the service")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="more service settings")
    args = parser.parse_args()
    args.encodings = args.encodings.split(",")
    args.clients = [int(c) for c in args.clients.split(",")]
    args.upsert_clients = [int(c) for c in args.upsert_clients.split(",")]
    print(f"machine load before: {wait_for_quiet():.2f} cores busy", flush=True)
    sets = [run_set(*map(int, s.split("x")), args) for s in args.sets.split(",")]
    report = {"what": "server CPU per request vs in-process FAISS; QPS vs clients", "k": K, "ef": EF, "m": M,
              "service_env": args.env,
              "ef_construction": EF_CONSTRUCTION, "workers": args.workers, "encodings": args.encodings, "sets": sets,
              "versions": versions("faiss-cpu", "fastapi", "uvicorn", "numpy"),
              "note": "clients are threads of this process on the same cores as the service"}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    save_json(RESULTS / f"bench_overhead-{stamp}.json", report)
    plot(RESULTS / f"bench_overhead-{stamp}.png", report)
    print(f"wrote {RESULTS / f'bench_overhead-{stamp}.json'}")


if __name__ == "__main__":
    main()
