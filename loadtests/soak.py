"""Soak and overload: a mixed workload at 1x, 2x and 4x the service's measured capacity, on loopback.

    python loadtests/soak.py --duration 20

Starts `switchyard serve` on a fresh data directory (embedded PostgreSQL), loads a vector collection and a
small SSB dataset, then:
1. unloaded: one client, back to back: the reference p50/p99;
2. capacity: closed-loop clients, the highest answered rate;
3. open-loop phases at 2x and 4x that rate: requests are sent on a fixed schedule whatever the answers, and
   latency counts from the scheduled send (no coordinated omission).
The mix: single-vector searches (70%), small upserts (20%), SSB queries on DuckDB (10%). Each phase reports
throughput, p50/p99 of admitted (2xx) requests, the share shed with 429/503 (and whether each carried
Retry-After), other errors by kind, and the service's memory (RSS of its processes, PostgreSQL's included) every
half second. JSON and a PNG go to loadtests/results/soak/.
"""

from __future__ import annotations

import argparse
import http.client
import queue
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtests.benchkit import Service, run_clients, save_json, versions  # noqa: E402
from loadtests.client import Api  # noqa: E402

DIM = 128
ROWS = 20_000


class Mix:
    """The requests of the mixed workload, as (method, path, body) picked by request number."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.queries = [orjson.dumps({"vector": v, "k": 10}, option=orjson.OPT_SERIALIZE_NUMPY)
                        for v in rng.random((512, DIM), dtype=np.float32)]
        self.upserts = [orjson.dumps({"ids": [int(i) for i in rng.integers(0, ROWS, 10)],
                                      "vectors": rng.random((10, DIM), dtype=np.float32)},
                                     option=orjson.OPT_SERIALIZE_NUMPY) for _ in range(128)]
        self.ssb = [orjson.dumps({"engine": "duckdb"})]
        self.queries_ids = ["1.1", "2.1", "3.2", "4.1"]

    def request(self, i: int) -> tuple[str, str, bytes, str]:
        kind = i % 10
        if kind < 7:
            return "POST", "/v1/collections/soak/search", self.queries[i % len(self.queries)], "search"
        if kind < 9:
            return "PUT", "/v1/collections/soak/points", self.upserts[i % len(self.upserts)], "upsert"
        return "POST", f"/v1/olap/ssb/queries/{self.queries_ids[i % 4]}", self.ssb[0], "ssb"


class Connection:
    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def send(self, method: str, path: str, body: bytes) -> tuple[int, bool]:
        """(status, had Retry-After); status 0 for a transport error."""
        try:
            self.conn.request(method, path, body, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            response.read()
            return response.status, response.getheader("Retry-After") is not None
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            return 0, False


def closed_loop(port: int, mix: Mix, clients: int, duration_s: float) -> dict[str, Any]:
    def make(c: int):
        conn = Connection(port)

        def call(i: int) -> int:
            status, _ = conn.send(*mix.request(i)[:3])
            return 1 if 200 <= status < 300 else 0

        return call

    return run_clients(clients, duration_s, make)


def open_loop(port: int, mix: Mix, rate: float, duration_s: float, senders: int = 96) -> dict[str, Any]:
    """Send at `rate` per second on a fixed schedule for duration_s; latency from each request's scheduled time."""
    schedule: queue.Queue = queue.Queue()
    results: list[tuple[str, int, bool, float]] = []
    lock = threading.Lock()

    def sender() -> None:
        conn = Connection(port)
        while True:
            item = schedule.get()
            if item is None:
                return
            i, due = item
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            method, path, body, kind = mix.request(i)
            status, retry = conn.send(method, path, body)
            with lock:
                results.append((kind, status, retry, time.perf_counter() - due))

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    for t in threads:
        t.start()
    start = time.perf_counter() + 0.2
    n = int(rate * duration_s)
    for i in range(n):
        schedule.put((i, start + i / rate))
    for _ in threads:
        schedule.put(None)
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return summarize(results, elapsed, rate)


def summarize(results: list[tuple[str, int, bool, float]], elapsed: float, rate: float | None) -> dict[str, Any]:
    ok = sorted(lat for _, status, _, lat in results if 200 <= status < 300)
    shed = [(status, retry) for _, status, retry, _ in results if status in (429, 503)]
    other = Counter(str(status) for _, status, _, _ in results if not (200 <= status < 300 or status in (429, 503)))
    by_kind = Counter(kind for kind, status, _, _ in results if 200 <= status < 300)
    pct = lambda q: round(1000 * ok[min(len(ok) - 1, int(q * len(ok)))], 2) if ok else None  # noqa: E731
    return {"offered_per_s": rate, "sent": len(results), "seconds": round(elapsed, 2),
            "admitted_per_s": round(len(ok) / elapsed, 1), "admitted_by_kind": dict(by_kind),
            "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "shed_share": round(len(shed) / max(1, len(results)), 4),
            "shed_by_status": dict(Counter(str(s) for s, _ in shed)),
            "shed_without_retry_after": sum(1 for _, retry in shed if not retry),
            "errors": dict(other)}


class MemorySampler(threading.Thread):
    def __init__(self, pids) -> None:
        super().__init__(daemon=True)
        self.pids, self.samples, self.stop, self.phase = pids, [], threading.Event(), "start"
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            rss = 0
            for pid in self.pids():
                try:
                    rss += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            self.samples.append((round(time.monotonic() - self.t0, 2), rss // 2**20, self.phase))


def plot(path: Path, phases: dict[str, Any], memory: list[tuple[float, int, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(phases)
    a.bar(names, [phases[n]["p99_ms"] or 0 for n in names], color="tab:blue", label="p99 of admitted (ms)")
    a.bar(names, [phases[n]["p50_ms"] or 0 for n in names], color="tab:cyan", label="p50 of admitted (ms)")
    for x, n in enumerate(names):
        a.annotate(f"shed {100 * phases[n].get('shed_share', 0):.0f}%", (x, phases[n]["p99_ms"] or 0), ha="center",
                   va="bottom", fontsize=8)
    a.set_ylabel("ms")
    a.set_title("latency of admitted requests")
    a.legend()
    b.plot([t for t, _, _ in memory], [m for _, m, _ in memory], color="tab:red")
    b.set_xlabel("seconds")
    b.set_ylabel("RSS of the service and PostgreSQL (MiB)")
    b.set_title("memory over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prepare(url: str) -> None:
    api = Api(url)
    rng = np.random.default_rng(1)
    api.http.post("/v1/collections", json={"name": "soak", "dim": DIM, "index": {"type": "hnsw"}}).raise_for_status()
    vectors = rng.random((ROWS, DIM), dtype=np.float32)
    for start in range(0, ROWS, 2000):
        api.http.put("/v1/collections/soak/points", content=orjson.dumps(
            {"ids": list(range(start, start + 2000)), "vectors": vectors[start:start + 2000]},
            option=orjson.OPT_SERIALIZE_NUMPY), headers={"Content-Type": "application/json"}).raise_for_status()
    api.http.post("/v1/collections/soak/build").raise_for_status()
    job = api.http.post("/v1/olap/ssb/generate", json={"scale_factor": 0.1}).json()["job"]
    while api.http.get(f"/v1/jobs/{job}").json()["state"] in ("queued", "running"):
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20, help="seconds per phase")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients of the capacity phase")
    parser.add_argument("--factors", default="2,4", help="overload factors of the open-loop phases")
    parser.add_argument("--env", action="append", default=[], help="SWITCHYARD_X=Y for the service (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "loadtests" / "results" / "soak")
    args = parser.parse_args()

    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        service = Service(Path(tmp) / "data", env={"SWITCHYARD_ACCESS_LOG": "false", **env})
        service.data_dir.mkdir(parents=True)
        service.start()
        memory = MemorySampler(service.pids)
        try:
            prepare(service.url)
            mix = Mix()
            memory.start()
            phases: dict[str, Any] = {}
            memory.phase = "unloaded"
            phases["unloaded"] = closed_loop(service.port, mix, 1, args.duration)
            memory.phase = "capacity"
            phases["capacity"] = closed_loop(service.port, mix, args.clients, args.duration)
            capacity = phases["capacity"]["qps"]
            for factor in (float(f) for f in args.factors.split(",")):
                name = f"{factor:g}x"
                memory.phase = name
                phases[name] = open_loop(service.port, mix, factor * capacity, args.duration)
                print(name, phases[name], flush=True)
            memory.stop.set()
        finally:
            service.stop()
    unloaded_p99 = phases["unloaded"]["p99_ms"]
    for name, phase in phases.items():
        if phase.get("p99_ms") and unloaded_p99:
            phase["p99_vs_unloaded"] = round(phase["p99_ms"] / unloaded_p99, 2)
    by_phase: dict[str, list[int]] = {}
    for _, mib, phase in memory.samples:
        by_phase.setdefault(phase, []).append(mib)
    result = {"what": "mixed workload (70% search, 20% upsert of 10 points, 10% SSB on DuckDB) at 1x, 2x, 4x capacity",
              "rows": ROWS, "dim": DIM, "env": env, "phases": phases,
              "memory_mib": {p: {"min": min(v), "max": max(v)} for p, v in by_phase.items()},
              "memory_samples": memory.samples, "versions": versions("fastapi", "uvicorn", "faiss-cpu", "duckdb")}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"soak-{stamp}.json", result)
    plot(args.out / f"soak-{stamp}.png", phases, memory.samples)
    print(orjson.dumps({k: v for k, v in result.items() if k != "memory_samples"}, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
