"""Soak and overload: a mixed workload at 1x, 2x and 4x the service's measured capacity, on loopback.

    python loadtests/soak.py --duration 20

A fresh `switchyard serve` with a vector collection and a small SSB dataset; one client back to back (the unloaded
reference), open-loop steps at doubling rates (capacity), then open-loop phases at 2x and 4x that rate, latency
counted from the scheduled send. The mix: searches 70%, upserts 20%, SSB queries 10%. Per phase: throughput,
p50/p99 of admitted requests, the share shed and whether each refusal had Retry-After, other errors, memory and
the in-flight limit over time. JSON and a PNG go to results_dir("soak") (loadtests/processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import re
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

from loadtests.benchkit import Service, results_dir, save_json, versions  # noqa: E402
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


class Pool:
    """Keep-alive HTTP/1.1 connections for the open-loop phases: one per request in flight, as many as needed.

    A few lines of asyncio instead of threads, so that the generator keeps its schedule at thousands of requests
    per second on a small machine and never caps the requests in flight (a capped sender pool turns an open loop
    into a closed one: the backlog then waits in the generator, where the service cannot shed it)."""

    IDLE_S = 2.0  # connections idle longer are closed, not reused: the service closes them after 5 s

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def send(self, method: str, path: str, body: bytes) -> tuple[int | str, bool]:
        """(status, had Retry-After); for a transport error, its name instead of a status."""
        writer = None
        try:
            while self.idle:
                reader, writer, since = self.idle.pop()
                if time.perf_counter() - since < self.IDLE_S and not reader.at_eof():
                    break
                writer.close()
                writer = None
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(f"{method} {path} HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            status = int(head.split(" ", 2)[1])
            headers = dict(line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)
            await reader.readexactly(int(headers.get("content-length", "0")))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as exc:
            if writer is not None:
                writer.close()
            return type(exc).__name__, False
        if headers.get("connection", "").strip() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer, time.perf_counter()))
        return status, "retry-after" in headers

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()


def closed_loop(port: int, mix: Mix, clients: int, duration_s: float) -> dict[str, Any]:
    """`clients` clients, each sending its next request when the last is answered, for duration_s."""
    results: list[tuple[str, int | str, bool, float]] = []

    async def client(pool: Pool, c: int, stop_at: float) -> None:
        i = c
        while time.perf_counter() < stop_at:
            method, path, body, kind = mix.request(i)
            sent = time.perf_counter()
            status, retry = await pool.send(method, path, body)
            results.append((kind, status, retry, time.perf_counter() - sent))
            i += clients

    async def run() -> float:
        pool = Pool(port)
        start = time.perf_counter()
        await asyncio.gather(*(client(pool, c, start + duration_s) for c in range(clients)))
        pool.close()
        return time.perf_counter() - start

    summary = summarize(results, asyncio.run(run()), None)
    summary["clients"] = clients
    return summary


def ramp(port: int, mix: Mix, start: float = 50.0, step_s: float = 4.0) -> dict[str, Any]:
    """The capacity: open-loop steps at doubling rates until the answers per second stop growing (by 5%); the
    step with the most. (Closed-loop clients would measure the cost of refusals instead: a refused client asks
    again at once, so a few of them keep the service busy refusing.)"""
    steps, rate = [open_loop(port, mix, start, step_s)], start * 2
    while rate <= 64 * start:
        steps.append(open_loop(port, mix, rate, step_s))
        if steps[-1]["admitted_per_s"] < 1.05 * max(step["admitted_per_s"] for step in steps[:-1]):
            break
        rate *= 2
    best = max(steps, key=lambda step: step["admitted_per_s"])
    return {**best, "steps": [{k: step[k] for k in ("offered_per_s", "admitted_per_s", "p99_ms")} for step in steps]}


def open_loop(port: int, mix: Mix, rate: float, duration_s: float) -> dict[str, Any]:
    """Send at `rate` per second on a fixed schedule for duration_s, whatever the answers; latency counts from
    each request's scheduled time. Also reports the generator's own share of a core and how late it sent (the
    service shares this machine: a late generator would inflate the latencies it reports)."""
    results: list[tuple[str, int | str, bool, float]] = []
    late: list[float] = []

    async def one(pool: Pool, i: int, due: float) -> None:
        method, path, body, kind = mix.request(i)
        late.append(time.perf_counter() - due)
        status, retry = await pool.send(method, path, body)
        results.append((kind, status, retry, time.perf_counter() - due))

    async def run() -> float:
        pool, tasks = Pool(port), []
        start = time.perf_counter() + 0.2
        for i in range(int(rate * duration_s)):
            due = start + i / rate
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(pool, i, due)))
        await asyncio.gather(*tasks)
        pool.close()
        return time.perf_counter() - start

    cpu = time.process_time()
    elapsed = asyncio.run(run())
    summary = summarize(results, elapsed, rate)
    summary["generator"] = {"cpu_share": round((time.process_time() - cpu) / elapsed, 2),
                            "send_late_p99_ms": percentile(sorted(late), 0.99)}
    return summary


def percentile(ordered: list[float], q: float) -> float | None:
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None


def summarize(results: list[tuple[str, int | str, bool, float]], elapsed: float, rate: float | None) -> dict[str, Any]:
    answered = [(kind, lat) for kind, status, _, lat in results if isinstance(status, int) and 200 <= status < 300]
    ok = sorted(lat for _, lat in answered)
    shed = [(status, retry) for _, status, retry, _ in results if status in (429, 503)]
    other = Counter(str(status) for _, status, _, _ in results
                    if not (isinstance(status, int) and (200 <= status < 300 or status in (429, 503))))
    by_kind = {kind: sorted(lat for k, lat in answered if k == kind) for kind in sorted({k for k, _ in answered})}
    return {"offered_per_s": rate, "sent": len(results), "seconds": round(elapsed, 2),
            "admitted_per_s": round(len(ok) / elapsed, 1), "admitted_by_kind": {k: len(v) for k, v in by_kind.items()},
            "p50_ms": percentile(ok, 0.5), "p99_ms": percentile(ok, 0.99),
            "p50_p99_ms_by_kind": {k: [percentile(v, 0.5), percentile(v, 0.99)] for k, v in by_kind.items()},
            "shed_share": round(len(shed) / max(1, len(results)), 4),
            "shed_by_status": dict(Counter(str(s) for s, _ in shed)),
            "shed_without_retry_after": sum(1 for _, retry in shed if not retry),
            "errors": dict(other)}


class Sampler(threading.Thread):
    """Every half second: the RSS of the service's processes (PostgreSQL's included) and its in-flight limit."""

    def __init__(self, pids, url: str) -> None:
        super().__init__(daemon=True)
        self.pids, self.samples, self.stop, self.phase = pids, [], threading.Event(), "start"
        self.api = Api(url)
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            rss = postgres = 0
            for pid in self.pids():
                try:
                    process = psutil.Process(pid)
                    used = process.memory_info().rss
                    rss += used
                    postgres += used if process.name().startswith("postgres") else 0
                except psutil.Error:
                    pass
            self.samples.append((round(time.monotonic() - self.t0, 2), rss // 2**20, self.phase, self.limit(),
                                 postgres // 2**20))

    def limit(self) -> float | None:
        try:
            text = self.api.http.get("/metrics").text
            found = re.search(r'^switchyard_inflight_limit\{work="light"\} (\S+)$', text, re.M)
        except Exception:  # noqa: BLE001 - a sample missed under overload is no reason to stop sampling
            return None
        return float(found.group(1)) if found else None


def plot(path: Path, phases: dict[str, Any], memory: list[tuple[float, int, str, float | None, int]]) -> None:
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
    b.plot([t for t, *_ in memory], [m for _, m, *_ in memory], color="tab:red", label="all")
    b.plot([t for t, *_ in memory], [m - pg for _, m, _, _, pg in memory], color="tab:orange", label="service only")
    b.legend(loc="lower right")
    b.set_xlabel("seconds")
    b.set_ylabel("RSS of the service and PostgreSQL (MiB)", color="tab:red")
    b.set_title("memory and in-flight limit over the run")
    limits = [(t, lim) for t, _, _, lim, _ in memory if lim is not None]
    if limits:
        c = b.twinx()
        c.step([t for t, _ in limits], [lim for _, lim in limits], color="tab:green", where="post")
        c.set_ylabel("in-flight limit", color="tab:green")
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
    parser.add_argument("--factors", default="2,4", help="overload factors of the open-loop phases")
    parser.add_argument("--env", action="append", default=[], help="SWITCHYARD_X=Y for the service (repeatable)")
    parser.add_argument("--out", type=Path, default=results_dir("soak"))
    args = parser.parse_args()

    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        service = Service(Path(tmp) / "data", env={"SWITCHYARD_ACCESS_LOG": "false", **env}, benchmark_env=False)
        service.data_dir.mkdir(parents=True)
        service.start()
        memory = Sampler(service.pids, service.url)
        try:
            prepare(service.url)
            mix = Mix()
            memory.start()
            phases: dict[str, Any] = {}
            memory.phase = "unloaded"
            phases["unloaded"] = closed_loop(service.port, mix, 1, args.duration)
            memory.phase = "capacity"
            phases["capacity"] = ramp(service.port, mix)
            capacity = phases["capacity"]["admitted_per_s"]
            for factor in (float(f) for f in args.factors.split(",")):
                name = f"{factor:g}x"
                memory.phase = name
                phases[name] = open_loop(service.port, mix, factor * capacity, args.duration)
                print(name, phases[name], flush=True)
            memory.stop.set()
        finally:
            service.stop()
    unloaded_p99 = phases["unloaded"]["p99_ms"]
    for _name, phase in phases.items():
        if phase.get("p99_ms") and unloaded_p99:
            phase["p99_vs_unloaded"] = round(phase["p99_ms"] / unloaded_p99, 2)
    by_phase: dict[str, list[int]] = {}
    for _, mib, phase, _, postgres in memory.samples:
        by_phase.setdefault(phase, []).append((mib, mib - postgres))
    result = {"what": "mixed workload (70% search, 20% upsert of 10 points, 10% SSB on DuckDB) at 1x, 2x, 4x capacity",
              "rows": ROWS, "dim": DIM, "env": env, "phases": phases,
              "memory_mib": {p: {"min": min(m for m, _ in v), "max": max(m for m, _ in v),
                                 "service_min": min(m for _, m in v), "service_max": max(m for _, m in v)}
                             for p, v in by_phase.items()},
              "memory_samples": memory.samples, "versions": versions("fastapi", "uvicorn", "faiss-cpu", "duckdb")}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"soak-{stamp}.json", result)
    plot(args.out / f"soak-{stamp}.png", phases, memory.samples)
    print(orjson.dumps({k: v for k, v in result.items() if k != "memory_samples"}, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
