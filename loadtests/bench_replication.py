"""Replication lag and the price of each consistency level, against a service with several Uvicorn workers.

    python loadtests/bench_replication.py                   # 4 workers, 20,000 x 128, HNSW
    python loadtests/bench_replication.py --workers 2 --write-rate 100

A fresh `switchyard serve` with SWITCHYARD_WORKERS=N and a replication trace, one bulk load, then: (1) the lag from
a commit (taken just before COMMIT) to the moment the last worker applied it, with writes alone and beside
searching clients, p50 / p99 / max; (2) search QPS and latency at each consistency level, read-only and beside the
write stream, as ratios to `eventually`. Clients and servers share the machine's cores. Writes JSON and a PNG under
results_dir("replication").
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench_vectors import bulk_load, make_data
from benchkit import MachineLoad, Service, results_dir, run_clients, save_json, versions, wait_for_quiet

RESULTS = results_dir("replication")
LEVELS = ("eventually", "bounded", "session", "strong")
COLLECTION = "replicated"


class Writer:
    """Upserts of `batch` new points at `rate` per second, on one keep-alive connection, until stopped."""

    next_id = 10_000_000  # every writer's ids are new, so no write replaces a point

    def __init__(self, port: int, dim: int, rate: float, batch: int = 10) -> None:
        self.port, self.dim, self.rate, self.batch = port, dim, rate, batch
        self.stop = threading.Event()
        self.seqs: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.rng = np.random.default_rng(1)

    def __enter__(self) -> "Writer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        period, due = 1.0 / self.rate, time.monotonic()
        while not self.stop.is_set():
            ids = list(range(Writer.next_id, Writer.next_id + self.batch))
            Writer.next_id += self.batch
            vectors = self.rng.standard_normal((self.batch, self.dim)).astype("<f4")
            body = orjson.dumps({"ids": ids, "vectors_b64": base64.b64encode(vectors.tobytes()).decode()})
            conn.request("PUT", f"/v1/collections/{COLLECTION}/points", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            payload = orjson.loads(r.read())
            if r.status != 200:
                raise RuntimeError(f"write failed: {payload}")
            self.seqs.append(payload["seq"])
            due += period
            self.stop.wait(max(0.0, due - time.monotonic()))
        conn.close()


def search_client(port: int, queries: np.ndarray, level: str, writer_seqs: list[int]):
    """A closed-loop client: single-vector searches at `level` (session passes the writer's latest seq)."""
    path = f"/v1/collections/{COLLECTION}/search"
    bodies = [{"vector": q.tolist(), "k": 10, "params": {"ef": 64}, "consistency": level} for q in queries]

    class Client:
        def __init__(self) -> None:
            self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def __call__(self, i: int) -> int:
            body = bodies[i % len(bodies)]
            if level == "session":
                body = {**body, "seq": writer_seqs[-1] if writer_seqs else 0}
            self.conn.request("POST", path, orjson.dumps(body), {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
            return 1

        def close(self) -> None:
            self.conn.close()

    return lambda _: Client()


def wait_for_replicas(conn: http.client.HTTPConnection, workers: int, timeout_s: float = 600) -> None:
    """Until every worker holds the loaded collection, caught up and not rebuilding (each builds its own index)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn.request("GET", f"/v1/collections/{COLLECTION}")
        replicas = orjson.loads(conn.getresponse().read())["replication"]["replicas"]
        if len(replicas) == workers and all(r.get("lag_rows") == 0 and not r.get("rebuilding") for r in replicas):
            return
        time.sleep(1)
    raise RuntimeError("the workers' replicas did not settle")


def qps_per_level(port: int, queries: np.ndarray, args: argparse.Namespace, load: MachineLoad,
                  seqs: list[int]) -> dict[str, Any]:
    """Rounds that each measure every level once, in turn (a warm-up round first), so that drift and the
    clients' spread over workers weigh on every level alike; the median round per level."""
    runs: dict[str, list[dict[str, Any]]] = {level: [] for level in LEVELS}
    for round_ in range(args.runs + 1):
        for level in LEVELS:
            m: dict[str, Any] = {}
            with load.measure(m):
                m.update(run_clients(args.clients, args.duration, search_client(port, queries, level, seqs)))
            if round_:
                runs[level].append(m)
    out = {}
    for level, results in runs.items():
        values = sorted(r["qps"] for r in results)
        median = sorted(results, key=lambda r: r["qps"])[len(results) // 2]
        out[level] = {**median, "qps_min": values[0], "qps_max": values[-1], "runs": len(results),
                      "busy_flag": any(r["busy_flag"] for r in results)}
    for level in LEVELS:
        out[level]["vs_eventually"] = round(out[level]["qps"] / out["eventually"]["qps"], 3)
    return out


async def commit_times(dsn: str) -> dict[int, float]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT seq, extract(epoch FROM committed_at)::float8 AS at FROM vector_commits c "
                                "JOIN vector_collections v ON v.id = c.collection_id WHERE v.name = $1", COLLECTION)
    finally:
        await conn.close()
    return {r["seq"]: r["at"] for r in rows}


def read_traces(trace_dir: Path) -> dict[str, dict[int, float]]:
    """process file -> {seq: applied at}."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(trace_dir.glob("replication-*.log")):
        applied: dict[int, float] = {}
        for line in path.read_text().splitlines():
            _, seq, at = line.split()
            applied[int(seq)] = float(at)
        out[path.stem] = applied
    return out


def lag_stats(seqs: list[int], commits: dict[int, float], traces: dict[str, dict[int, float]]) -> dict[str, Any]:
    """For each write: from its commit to the last worker applying it; plus each worker's own distribution."""
    every, per_worker, missing = [], {name: [] for name in traces}, 0
    for seq in seqs:
        at = commits.get(seq)
        applied = [t.get(seq) for t in traces.values()]
        if at is None or any(a is None for a in applied):
            missing += 1
            continue
        every.append(max(applied) - at)
        for name, a in zip(traces, applied):
            per_worker[name].append(a - at)

    def pct(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None}
        v = np.array(values) * 1000
        return {"p50_ms": round(float(np.percentile(v, 50)), 3), "p99_ms": round(float(np.percentile(v, 99)), 3),
                "max_ms": round(float(v.max()), 3)}

    return {"writes": len(seqs), "unmatched": missing, "to_every_worker": pct(every),
            "per_worker": {name: pct(v) for name, v in per_worker.items()}, "samples_ms": [x * 1000 for x in every]}


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for label, lag in report["lag"].items():
        samples = np.sort(lag["samples_ms"])
        if len(samples):
            left.plot(samples, np.arange(1, len(samples) + 1) / len(samples), label=label)
    left.set_xscale("log")
    left.set_xlabel("commit -> applied in every worker (ms)")
    left.set_ylabel("share of writes")
    left.set_title(f"Replication lag, {report['workers']} workers, {report['write_rate']} writes/s")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    width = 0.38
    x = np.arange(len(LEVELS))
    for offset, load in ((-width / 2, "read_only"), (width / 2, "with_writes")):
        qps = [report["qps"][load][level]["qps"] for level in LEVELS]
        bars = right.bar(x + offset, qps, width, label=load.replace("_", " "))
        for bar, level in zip(bars, LEVELS):
            ratio = report["qps"][load][level]["vs_eventually"]
            right.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                           va="bottom", fontsize=8)
    right.set_xticks(x, LEVELS)
    right.set_ylabel("searches per second")
    right.set_title(f"Search QPS per consistency level ({report['clients']} clients)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--write-rate", type=float, default=50.0, help="upserts per second (10 vectors each)")
    p.add_argument("--lag-seconds", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per QPS run")
    p.add_argument("--runs", type=int, default=5, help="rounds over the levels (after a warm-up round)")
    args = p.parse_args()

    base, queries = make_data(args.n, 1000, args.dim, seed=7)
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-replication-"))
    (tmp / "data").mkdir()
    trace_dir = tmp / "trace"
    service = Service(tmp / "data", env={"SWITCHYARD_WORKERS": str(args.workers),
                                         "SWITCHYARD_REPLICATION_TRACE_DIR": str(trace_dir)})
    print(f"quiet machine: {wait_for_quiet():.2f} other cores busy; starting {args.workers} workers in {tmp}")
    service.start()
    load = MachineLoad(service.pids)
    report: dict[str, Any] = {"workers": args.workers, "n": args.n, "dim": args.dim, "write_rate": args.write_rate,
                              "clients": args.clients,
                              "versions": versions("faiss-cpu", "fastapi", "uvicorn", "asyncpg")}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=600)
        conn.request("POST", "/v1/collections", orjson.dumps({"name": COLLECTION, "dim": args.dim, "index": {
            "type": "hnsw", "params": {"m": 16, "ef_construction": 64}}, "pgvector_index": {"type": "none"}}),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().read() and True
        print("bulk load:", bulk_load(service.port, COLLECTION, base))
        wait_for_replicas(conn, args.workers)

        seqs: dict[str, list[int]] = {}
        print(f"lag: {args.write_rate:g} writes/s for {args.lag_seconds:g} s, alone ...")
        with Writer(service.port, args.dim, args.write_rate) as w:
            time.sleep(args.lag_seconds)
        seqs["writes alone"] = w.seqs
        for clients in sorted({max(1, args.workers), args.clients}):
            print(f"lag: the same beside {clients} clients searching (bounded) ...")
            with Writer(service.port, args.dim, args.write_rate) as w:
                run_clients(clients, args.lag_seconds, search_client(service.port, queries, "bounded", []))
            seqs[f"beside {clients} searching clients"] = w.seqs
        time.sleep(1)
        commits = asyncio.run(commit_times(service.pg_dsn))

        qps: dict[str, dict[str, Any]] = {}
        for load_kind in ("read_only", "with_writes"):
            print(f"QPS per level, {load_kind.replace('_', ' ')}: {args.runs} rounds over the levels ...")
            if load_kind == "with_writes":
                with Writer(service.port, args.dim, args.write_rate) as w:
                    qps[load_kind] = qps_per_level(service.port, queries, args, load, w.seqs)
            else:
                qps[load_kind] = qps_per_level(service.port, queries, args, load, [0])
        report["qps"] = qps
    finally:
        service.stop()
    traces = read_traces(trace_dir)
    report["lag"] = {label: lag_stats(s, commits, traces) for label, s in seqs.items()}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    save_json(RESULTS / f"bench_replication-{stamp}.json", report)
    plot(RESULTS / f"bench_replication-{stamp}.png", report)
    for label, lag in report["lag"].items():
        e = lag["to_every_worker"]
        print(f"lag, {label}: {lag['writes']} writes; commit -> every worker p50 {e['p50_ms']} ms, "
              f"p99 {e['p99_ms']} ms, max {e['max_ms']} ms")
    for load_kind, levels in report["qps"].items():
        print(f"QPS {load_kind}: " + ", ".join(f"{lv} {v['qps']:.0f} ({v['vs_eventually']:.2f}x, p99 {v['p99_ms']} ms)"
                                               for lv, v in levels.items()))
    print(f"results: {RESULTS / f'bench_replication-{stamp}.json'} and .png")


if __name__ == "__main__":
    main()
