"""What a Python caller pays per search, by client: switchyard_client's transports beside the obvious plain clients.

    python loadtests/bench_client.py                    # 50,000 x 128 clustered, HNSW m=16 ef_construction=64, ef 64
    python loadtests/bench_client.py --set 100000x768 --searches 3000

One fresh `switchyard serve` (TCP loopback); the collection is loaded through switchyard_client. Then, one client
at a time on one thread, the same single-vector searches (k 10, ef 64) through each client: client CPU per search
(this process's CPU time), service CPU per search (its processes, PostgreSQL excluded, from /proc), and latency
p50 / p99. The median of 3 passes per client, the clients alternated between passes. Writes JSON under
results_dir("client").
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench_overhead import _service_pids, service_cpu
from benchkit import JsonClient, Service, results_dir, save_json, versions, wait_for_quiet
from datasets import mixture
from switchyard_client import AsyncClient, Client

RESULTS = results_dir("client")
K, EF = 10, 64


def plain_json(port: int, name: str) -> tuple[Callable[[np.ndarray], Any], Callable[[], None]]:
    """What a user writes first: http.client with keep-alive, a JSON body with a float list, orjson to parse."""
    client = JsonClient(port)
    path = f"/v1/collections/{name}/search"
    return (lambda q: client.call("POST", path, {"vector": q.tolist(), "k": K, "params": {"ef": EF}})["ids"]), \
        client.conn.close


def requests_json(port: int, name: str) -> tuple[Callable[[np.ndarray], Any], Callable[[], None]]:
    import requests

    session = requests.Session()
    url = f"http://127.0.0.1:{port}/v1/collections/{name}/search"

    def search(q: np.ndarray) -> Any:
        return session.post(url, json={"vector": q.tolist(), "k": K, "params": {"ef": EF}}).json()["ids"]

    return search, session.close


def switchyard(transport: str) -> Callable[[int, str], tuple[Callable[[np.ndarray], Any], Callable[[], None]]]:
    def make(port: int, name: str) -> tuple[Callable[[np.ndarray], Any], Callable[[], None]]:
        client = Client(f"http://127.0.0.1:{port}", transport=transport)
        return (lambda q: client.search(name, q, K, params={"ef": EF}).ids), client.close
    return make


def async_client(port: int, name: str) -> tuple[Callable[[np.ndarray], Any], Callable[[], None]]:
    """AsyncClient, one search awaited at a time on one event loop (the loop's cost included)."""
    loop = asyncio.new_event_loop()
    client = AsyncClient(f"http://127.0.0.1:{port}")

    def search(q: np.ndarray) -> Any:
        return loop.run_until_complete(client.search(name, q, K, params={"ef": EF})).ids

    def close() -> None:
        loop.run_until_complete(client.close())
        loop.close()

    return search, close


CLIENTS: dict[str, Callable[[int, str], tuple[Callable[[np.ndarray], Any], Callable[[], None]]]] = {
    "switchyard_client (pycurl, raw float32)": switchyard("pycurl"),
    "switchyard_client (http.client, raw float32)": switchyard("http"),
    "switchyard_client AsyncClient (httpx, raw float32)": async_client,
    "http.client + JSON (plain)": plain_json,
    "requests + JSON (plain)": requests_json,
}


def one_pass(service: Service, name: str, make: Callable, queries: np.ndarray) -> dict[str, float]:
    search, close = make(service.port, name)
    try:
        for q in queries[:100]:  # warm: connection, caches
            search(q)
        pids = _service_pids(service)
        latencies = np.empty(len(queries))
        server0, client0 = service_cpu(lambda: pids), time.process_time()
        for i, q in enumerate(queries):
            started = time.perf_counter()
            search(q)
            latencies[i] = time.perf_counter() - started
        client_s, server_s = time.process_time() - client0, service_cpu(lambda: pids) - server0
    finally:
        close()
    n = len(queries)
    return {"client_cpu_us": 1e6 * client_s / n, "service_cpu_us": 1e6 * server_s / n,
            "p50_ms": 1e3 * float(np.percentile(latencies, 50)), "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
            "qps_one_client": n / float(latencies.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="50000x128", help="N x DIM of the clustered data")
    parser.add_argument("--searches", type=int, default=5000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    n, dim = (int(x) for x in args.set.split("x"))
    base, queries = mixture(n, args.searches, dim, seed=0)
    available = {}
    for label, make in CLIENTS.items():
        module = "pycurl" if "pycurl" in label else "requests" if "requests" in label else None
        try:
            if module:
                __import__(module)
            available[label] = make
        except ImportError:
            print(f"skipping {label}: {module} is not installed")
    folder = Path(tempfile.mkdtemp(prefix="bench-client-"))
    service = Service(folder / "data")
    service.start()
    try:
        with Client(service.url, transport="http") as sy:
            sy.create_collection("bench", dim, index={"type": "hnsw", "params": {"m": 16, "ef_construction": 64}})
            sy.load("bench", np.arange(n), base, progress=True)
            sy.build("bench", pgvector="wait")
        passes: dict[str, list[dict[str, float]]] = {label: [] for label in available}
        for _ in range(args.passes):
            for label, make in available.items():
                wait_for_quiet()
                passes[label].append(one_pass(service, "bench", make, queries))
                print(f"{label}: {passes[label][-1]}")
    finally:
        service.stop()
    report: dict[str, Any] = {"set": args.set, "k": K, "ef": EF, "searches": args.searches, "transport": "TCP loopback",
                              "versions": versions("numpy", "pycurl", "httpx", "requests", "faiss-cpu"), "clients": {}}
    print(f"\n| client ({args.set}, one thread) | client CPU µs / search | service CPU µs / search | p50 ms | "
          "p99 ms | QPS |")
    print("|---|---|---|---|---|---|")
    for label, runs in passes.items():
        median = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
        report["clients"][label] = {"median": median, "passes": runs}
        print(f"| {label} | {median['client_cpu_us']:.0f} | {median['service_cpu_us']:.0f} | "
              f"{median['p50_ms']:.2f} | {median['p99_ms']:.2f} | {median['qps_one_client']:,.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"client-{args.set}-{time.strftime('%Y%m%d-%H%M%S')}.json", report)


if __name__ == "__main__":
    main()
