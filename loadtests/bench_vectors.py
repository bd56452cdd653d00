"""Vector search benchmark: Switchyard's engines over HTTP against pgvector HNSW queried directly, one run.

    python loadtests/bench_vectors.py                      # 100,000 x 384 seeded data, 1,000 queries
    python loadtests/bench_vectors.py --data base.npy --queries-file q.npy

Seeded clustered data (hard enough that IVF at a few probes is far from recall 0.98) and exact ground truth; a
fresh `switchyard serve` with embedded PostgreSQL and one bulk load that builds the resident index and pgvector's
HNSW (m=16, ef_construction=64); then per engine and search parameter value: recall@10 and QPS for one client, 32
clients and batches of 100 (pgvector through asyncpg, prepared statements). Clients share the cores with the
servers. Writes JSON and a PNG (recall against QPS) under results_dir("vectors").
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson

from benchkit import (
    MachineLoad,
    Service,
    client_label,
    repeat,
    results_dir,
    run_clients,
    save_json,
    switchyard,
    versions,
    wait_for_quiet,
)
from datasets import mixture  # sibling module: these scripts run as files

RESULTS = results_dir("vectors")


# -- data ---------------------------------------------------------------------------------------------
make_data = mixture  # the load tests' seeded mixture (loadtests/datasets.py)


def ground_truth(base: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    import faiss

    flat = faiss.IndexFlatL2(base.shape[1])
    flat.add(base)
    return flat.search(queries, k)[1]


def recall_at(found: list[list[int]], truth: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(f[:k]) & set(t[:k].tolist())) / k for f, t in zip(found, truth)]))


# -- Switchyard over HTTP, through switchyard_client ---------------------------------------------------
def http_search_all(url: str, collection: str, queries: np.ndarray, k: int, engine: str,
                    params: dict[str, Any]) -> list[list[int]]:
    with switchyard(url) as api:
        return [row for start in range(0, len(queries), 100)
                for row in api.search(collection, queries[start:start + 100], k, params=params,
                                      engine=engine).ids.tolist()]


def http_modes(url: str, collection: str, queries: np.ndarray, k: int, engine: str, params: dict[str, Any],
               clients: int, batch: int, duration: float, runs: int, load: MachineLoad) -> dict[str, Any]:
    """One switchyard_client Client per thread (its keep-alive connection), raw float32 queries: single vectors
    and batches of `batch`."""
    singles = list(queries)
    batches = [queries[s:s + batch] for s in range(0, len(queries), batch)]

    class SyClient:
        def __init__(self, vectors: list[np.ndarray], per_call: int) -> None:
            self.vectors, self.per_call = vectors, per_call
            self.api = switchyard(url)

        def __call__(self, i: int) -> int:
            self.api.search(collection, self.vectors[i % len(self.vectors)], k, params=params, engine=engine)
            return self.per_call

        def close(self) -> None:
            self.api.close()

    def client_for(vectors: list[np.ndarray], per_call: int) -> ClientFactory:
        return lambda _: SyClient(vectors, per_call)

    return measure_modes(client_for(singles, 1), client_for(batches, batch), clients, batch, duration, runs, load)


ClientFactory = Callable[[int], Callable[[int], int]]


def measure_modes(single: ClientFactory, batched: ClientFactory, clients: int, batch: int, duration: float,
                  runs: int, load: MachineLoad) -> dict[str, Any]:
    """QPS for one client sending single queries, `clients` concurrent clients, and one client sending batches."""
    out: dict[str, Any] = {}
    for mode, n, factory in (("single_1_client", 1, single), (f"single_{clients}_clients", clients, single),
                             (f"batch_{batch}", 1, batched)):
        m: dict[str, Any] = {}
        with load.measure(m):
            m.update(repeat(runs, lambda: run_clients(n, duration, factory)))
        out[mode] = m
    return out


# -- pgvector directly --------------------------------------------------------------------------------
class PgClient:
    """A thread's own asyncpg connection and event loop, with prepared statements."""

    def __init__(self, dsn: str, table: str, k: int, ef_search: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(self._connect(dsn, ef_search))
        self.single = self.loop.run_until_complete(self.conn.prepare(
            f"SELECT id FROM {table} ORDER BY embedding <-> $1 LIMIT {k}"))
        self.batch = self.loop.run_until_complete(self.conn.prepare(
            f"SELECT q.i, n.id FROM unnest($1::vector[]) WITH ORDINALITY AS q(v, i) "
            f"CROSS JOIN LATERAL (SELECT id FROM {table} ORDER BY embedding <-> q.v LIMIT {k}) n"))

    @staticmethod
    async def _connect(dsn: str, ef_search: int):
        import asyncpg
        from pgvector.asyncpg import register_vector

        conn = await asyncpg.connect(dsn)
        await register_vector(conn)
        await conn.execute(f"SET hnsw.ef_search = {int(ef_search)}")
        return conn

    def search(self, q: np.ndarray) -> list[int]:
        return [r[0] for r in self.loop.run_until_complete(self.single.fetch(q))]

    def search_batch(self, qs: np.ndarray) -> int:
        from pgvector import Vector

        rows = self.loop.run_until_complete(self.batch.fetch([Vector(q) for q in qs]))
        return len({r[0] for r in rows})  # queries answered

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


def pg_modes(dsn: str, table: str, queries: np.ndarray, k: int, ef: int, clients: int, batch: int,
             duration: float, runs: int, load: MachineLoad) -> dict[str, Any]:
    class Client:
        def __init__(self, batched: bool) -> None:
            self.pg, self.batched = PgClient(dsn, table, k, ef), batched

        def __call__(self, i: int) -> int:
            if self.batched:
                return self.pg.search_batch(np.take(queries, range(i * batch, (i + 1) * batch), axis=0, mode="wrap"))
            self.pg.search(queries[i % len(queries)])
            return 1

        def close(self) -> None:
            self.pg.close()

    return measure_modes(lambda _: Client(False), lambda _: Client(True), clients, batch, duration, runs, load)


# -- the run ------------------------------------------------------------------------------------------
def parse_params(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, value = part.split("=")
        out[key] = float(value) if "." in value else int(value)
    return out


def bulk_load(port: int, collection: str, base: np.ndarray, payloads: list[str] | None = None) -> dict[str, Any]:
    """One Arrow bulk load (ids 0..n-1, optional JSON payloads) through switchyard_client, followed to its end with
    its progress report; the job's result and total_s (the Arrow stream's writing included)."""
    started = time.perf_counter()
    with switchyard(f"http://127.0.0.1:{port}") as api:
        # pgvector="wait": the job ends when pgvector's index is built too, so both build times are measured
        result = api.load(collection, np.arange(len(base), dtype=np.int64), base,
                          None if payloads is None else [orjson.loads(p) for p in payloads], pgvector="wait")
    return {**result, "total_s": round(time.perf_counter() - started, 2)}


def best_at(results: list[dict[str, Any]], mode: str, target: float) -> dict[str, Any] | None:
    ok = [r for r in results if r["recall"] >= target]
    return max(ok, key=lambda r: r["modes"][mode]["qps"]) if ok else None


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5))
    for ax, mode in zip(axes, modes):
        for engine, rows in report["engines"].items():
            xs = [r["recall"] for r in rows["sweep"]]
            ys = [r["modes"][mode]["qps"] for r in rows["sweep"]]
            ax.plot(xs, ys, marker="o", label=f"{engine} ({rows['label']})")
            for r, x, y in zip(rows["sweep"], xs, ys):
                ax.annotate(str(r["param"]), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axvline(report["recall_target"], color="grey", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("recall@10")
        ax.set_ylabel("queries per second")
        ax.set_title(mode.replace("_", " "))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['data']['n']} x {report['data']['dim']} vectors, {report['data']['queries']} queries, "
                 f"k={report['k']}, {report['versions']['cores']} cores shared by clients and servers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--data", type=Path, help=".npy of base vectors (float32, n x dim) instead of generated data")
    ap.add_argument("--queries-file", type=Path, help=".npy of query vectors to go with --data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--cpu-index", default="hnsw", choices=["hnsw", "ivf_flat", "ivf_pq", "brute_force", "cagra"])
    ap.add_argument("--cpu-build", default="m=32,ef_construction=40", help="build parameters, name=value,...")
    ap.add_argument("--cpu-param", default="ef", help="the search parameter swept for the CPU engine")
    ap.add_argument("--cpu-sweep", default="32,40,48,64,96")
    ap.add_argument("--pg-sweep", default="40,50,60,70,80,100")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per QPS measurement")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per point (after one warm-up)")
    ap.add_argument("--recall-target", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    if args.data is not None:
        base = np.load(args.data).astype(np.float32)
        queries = np.load(args.queries_file).astype(np.float32) if args.queries_file else base[
            np.random.default_rng(args.seed).choice(len(base), args.queries, replace=False)]
        source = str(args.data)
    else:
        base, queries = make_data(args.n, args.queries, args.dim, args.seed)
        source = f"generated: seed {args.seed}, 1,000-cluster mixture in 32 latent dimensions, noise 0.35"
    n, dim = base.shape
    print(f"data: {n} x {dim}, {len(queries)} queries ({source})")
    truth = ground_truth(base, queries, args.k)

    work = Path(tempfile.mkdtemp(prefix="bench-vectors-"))
    service = Service(work / "data")
    (work / "data").mkdir()
    service.start()
    load = MachineLoad(service.pids)
    api = switchyard(service.url)
    report: dict[str, Any] = {
        "benchmark": "vectors", "k": args.k, "recall_target": args.recall_target,
        "data": {"n": n, "dim": dim, "queries": len(queries), "source": source, "metric": "l2"},
        "client": f"Switchyard: {client_label(api)}, raw float32 queries; pgvector: asyncpg, prepared statements; "
                  f"Python threads, one keep-alive connection each, on the same {versions()['cores']} cores as the "
                  f"servers",
        "versions": versions("switchyard", "faiss-cpu", "fastapi", "uvicorn", "asyncpg", "pgvector", "numpy"),
        "modes": ["single_1_client", f"single_{args.clients}_clients", f"batch_{args.batch}"],
        "engines": {},
    }
    try:
        with api:
            api.create_collection("bench", dim, "l2", index={"type": args.cpu_index,
                                                             "params": parse_params(args.cpu_build)},
                                  pgvector_index={"type": "hnsw", "m": 16, "ef_construction": 64})
        print("bulk load (stores, builds the resident index and pgvector's HNSW index)...")
        loaded = bulk_load(service.port, "bench", base)
        report["build"] = loaded
        print(f"  resident {args.cpu_index} build {loaded['resident_build_s']} s; "
              f"pgvector HNSW build {loaded['pgvector_build_s']} s")
        import asyncpg  # noqa: F401 - fail early if missing

        pg_version = asyncio.run(_pg_version(service.pg_dsn))
        report["versions"]["postgresql / pgvector"] = pg_version
        wait_for_quiet()

        cpu_rows = []
        for value in [int(v) if "." not in v else float(v) for v in args.cpu_sweep.split(",")]:
            params = {args.cpu_param: value}
            found = http_search_all(service.url, "bench", queries, args.k, "cpu", params)
            row = {"param": f"{args.cpu_param}={value}", "params": params,
                   "recall": round(recall_at(found, truth, args.k), 4)}
            row["modes"] = http_modes(service.url, "bench", queries, args.k, "cpu", params, args.clients, args.batch,
                                      args.duration, args.runs, load)
            cpu_rows.append(row)
            print(f"  cpu {row['param']}: recall {row['recall']}; " + ", ".join(
                f"{m} {v['qps']:.0f} QPS" for m, v in row["modes"].items()))
        report["engines"]["switchyard cpu (faiss) over HTTP"] = {
            "label": f"{args.cpu_index} {args.cpu_build}", "build_s": loaded["resident_build_s"], "sweep": cpu_rows}

        pg_rows = []
        table = asyncio.run(_table_of(service.pg_dsn, "bench"))
        for ef in [int(v) for v in args.pg_sweep.split(",")]:
            client = PgClient(service.pg_dsn, table, args.k, ef)
            found = [client.search(q) for q in queries]
            client.close()
            row = {"param": f"ef_search={ef}", "params": {"ef_search": ef},
                   "recall": round(recall_at(found, truth, args.k), 4)}
            row["modes"] = pg_modes(service.pg_dsn, table, queries, args.k, ef, args.clients, args.batch,
                                    args.duration, args.runs, load)
            pg_rows.append(row)
            print(f"  pgvector {row['param']}: recall {row['recall']}; " + ", ".join(
                f"{m} {v['qps']:.0f} QPS" for m, v in row["modes"].items()))
        report["engines"]["pgvector hnsw (direct SQL)"] = {
            "label": "m=16, ef_construction=64", "build_s": loaded["pgvector_build_s"], "sweep": pg_rows}
    finally:
        service.stop()

    ratios: dict[str, Any] = {}
    for mode in report["modes"]:
        ours, theirs = best_at(cpu_rows, mode, args.recall_target), best_at(pg_rows, mode, args.recall_target)
        ratios[mode] = None if not (ours and theirs) else {
            "switchyard": {"param": ours["param"], "recall": ours["recall"], "qps": ours["modes"][mode]["qps"]},
            "pgvector": {"param": theirs["param"], "recall": theirs["recall"], "qps": theirs["modes"][mode]["qps"]},
            "ratio": round(ours["modes"][mode]["qps"] / theirs["modes"][mode]["qps"], 2)}
    ratios["build"] = {"switchyard_s": loaded["resident_build_s"], "pgvector_s": loaded["pgvector_build_s"],
                       "ratio": round(loaded["pgvector_build_s"] / max(loaded["resident_build_s"], 1e-9), 2)}
    report["ratios_at_recall_target"] = ratios
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"bench_vectors-{stamp}.json", report)
    plot(args.out / f"bench_vectors-{stamp}.png", report)
    print(orjson.dumps(ratios, option=orjson.OPT_INDENT_2).decode())
    print(f"wrote {args.out / f'bench_vectors-{stamp}.json'} and .png")


async def _table_of(dsn: str, collection: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return f"vectors_{await conn.fetchval('SELECT id FROM vector_collections WHERE name = $1', collection)}"
    finally:
        await conn.close()


async def _pg_version(dsn: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return (f"{await conn.fetchval('SHOW server_version')} / "
                f"{await conn.fetchval('SELECT extversion FROM pg_extension WHERE extname = $$vector$$')}")
    finally:
        await conn.close()


if __name__ == "__main__":
    main()
