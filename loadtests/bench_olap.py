"""SSB benchmark: the 13 queries through Switchyard on each engine, against DuckDB in-process and PostgreSQL
heap tables queried directly, on the same data in one run.

    python loadtests/bench_olap.py --sf 1

Steps: a fresh `switchyard serve` (embedded PostgreSQL) generates the dataset as a job, which also loads it
into the engines (DuckDB in memory, PostgreSQL heap tables; cuDF when a GPU is present). Then, per query: one
warm-up and the median of --runs timed runs for each engine through HTTP, for DuckDB in-process on the same
Parquet files (tables loaded into memory, the same SQL text), and for PostgreSQL over asyncpg (the same SQL,
the service's tables). The answers of every system, and of the GPU plans run on pandas, are compared. Writes
JSON and a PNG bar chart under results_dir("olap") (loadtests/processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import orjson

from benchkit import MachineLoad, Service, results_dir, save_json, switchyard, versions, wait_for_quiet

RESULTS = results_dir("olap")


def timed(fn: Callable[[], Any], runs: int) -> tuple[dict[str, float], Any]:
    """One warm-up, then `runs` timed runs: median, min, max in ms, and the last answer."""
    answer = fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        answer = fn()
        times.append((time.perf_counter() - started) * 1000)
    return {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
            "max_ms": round(max(times), 2)}, answer


def normalise(rows: list[Any]) -> list[tuple]:
    return [tuple(int(v) if isinstance(v, float) and v.is_integer() else v for v in row) for row in rows]


def job_lines() -> Callable[[int, int, str], None]:
    """A job's progress as a line each time its message changes (switchyard_client's progress function)."""
    shown: list[str] = []

    def report(done: int, total: int, message: str) -> None:
        if shown[-1:] != [message]:
            shown.append(message)
            print(f"  {done}/{total or '?'} {message}", flush=True)

    return report


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    systems = report["systems"]
    queries = report["queries"]
    fig, (ax, ax_sum) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [5, 1]})
    width = 0.8 / len(systems)
    x = np.arange(len(queries))
    for i, system in enumerate(systems):
        ys = [report["timings"][system][q]["median_ms"] for q in queries]
        ax.bar(x + i * width, ys, width, label=system)
        ax_sum.bar(i, report["sums_ms"][system], label=system)
    ax.set_xticks(x + width * (len(systems) - 1) / 2, [f"Q{q}" for q in queries])
    ax.set_yscale("log")
    ax.set_ylabel("median ms (log)")
    ax.set_title(f"SSB SF {report['scale_factor']:g}: per query, median of {report['runs']}")
    ax.legend(fontsize=8)
    ax_sum.set_xticks(range(len(systems)), [s.replace(" ", "\n", 1) for s in systems], fontsize=7)
    ax_sum.set_title("13 queries summed (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    import duckdb

    from olap.plans import run_plan
    from olap.queries import QUERIES, render_sql
    from olap.schema import TABLES

    work = Path(tempfile.mkdtemp(prefix="bench-olap-"))
    (work / "data").mkdir()
    service = Service(work / "data")
    service.start()
    load = MachineLoad(service.pids)
    client = switchyard(service.url)
    report: dict[str, Any] = {"benchmark": "ssb", "scale_factor": args.sf, "runs": args.runs,
                              "versions": versions("switchyard", "duckdb", "pyarrow", "pandas", "asyncpg"),
                              "queries": list(QUERIES), "timings": {}, "machine": {}}
    try:
        print(f"generating SF {args.sf:g} through the service (a job that also loads the engines)...")
        started = time.perf_counter()
        generated = client.ssb_generate(args.sf, args.seed, progress=job_lines())
        report["generate_and_load_s"] = round(time.perf_counter() - started, 1)
        report["dataset"] = generated
        dataset = Path(generated["dataset"])
        engines = [e["name"] for e in client.engines("olap")["engines"] if e["ready"]]
        report["engines_ready"] = engines
        wait_for_quiet()

        answers: dict[str, dict[str, list[tuple]]] = {}
        for engine in [e for e in ("cudf", "duckdb", "postgres") if e in engines]:
            system = f"switchyard {engine} (HTTP)"
            report["timings"][system], answers[system] = {}, {}
            with load.measure(report["machine"].setdefault(system, {})):
                for q in QUERIES:
                    t, result = timed(lambda: client.ssb_query(q, engine=engine, output="json"), args.runs)
                    assert result["engine"] == engine, result
                    report["timings"][system][q], answers[system][q] = t, normalise(result["rows"])
            print(f"  {system}: {sum(v['median_ms'] for v in report['timings'][system].values()):.0f} ms")

        system = "duckdb in-process"
        con = duckdb.connect(":memory:")
        for table in TABLES:
            con.execute(f"CREATE TABLE {table} AS SELECT * FROM read_parquet(?)", [str(dataset / f"{table}.parquet")])
        report["timings"][system], answers[system] = {}, {}
        with load.measure(report["machine"].setdefault(system, {})):
            for q in QUERIES:
                sql = render_sql(q, {})
                t, rows = timed(lambda: con.execute(sql).fetchall(), args.runs)
                report["timings"][system][q], answers[system][q] = t, normalise(rows)
        print(f"  {system}: {sum(v['median_ms'] for v in report['timings'][system].values()):.0f} ms")

        system = "postgresql heap (direct)"
        report["timings"][system], answers[system] = {}, {}
        with load.measure(report["machine"].setdefault(system, {})):
            report["timings"][system], answers[system] = asyncio.run(_postgres(service.pg_dsn, args.runs, render_sql,
                                                                               list(QUERIES)))
        print(f"  {system}: {sum(v['median_ms'] for v in report['timings'][system].values()):.0f} ms")

        import pandas as pd

        frames = {t: pd.read_parquet(dataset / f"{t}.parquet") for t in TABLES}
        system = "gpu plans on pandas"
        report["timings"][system], answers[system] = {}, {}
        for q in QUERIES:
            t, frame = timed(lambda: run_plan(q, frames, {}), 1)
            report["timings"][system][q] = t
            answers[system][q] = normalise(frame.itertuples(index=False, name=None))
    finally:
        client.close()
        service.stop()

    reference = answers["duckdb in-process"]
    report["answers_agree"] = {system: {q: answers[system][q] == reference[q] for q in QUERIES} for system in answers}
    report["all_agree"] = all(all(v.values()) for v in report["answers_agree"].values())
    report["answer_rows"] = {q: len(reference[q]) for q in QUERIES}
    report["systems"] = [s for s in report["timings"] if s != "gpu plans on pandas"]
    report["sums_ms"] = {s: round(sum(v["median_ms"] for v in report["timings"][s].values()), 1)
                         for s in report["timings"]}
    sums = report["sums_ms"]
    cpu = sums.get("switchyard duckdb (HTTP)")
    report["ratios"] = {
        "cpu_http_over_duckdb_in_process": round(cpu / sums["duckdb in-process"], 3) if cpu else None,
        "postgres_direct_over_cpu_http": round(sums["postgresql heap (direct)"] / cpu, 2) if cpu else None,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"bench_olap-sf{args.sf:g}-{stamp}.json", report)
    plot(args.out / f"bench_olap-sf{args.sf:g}-{stamp}.png", report)
    print(orjson.dumps({"sums_ms": sums, "ratios": report["ratios"], "all_agree": report["all_agree"]},
                       option=orjson.OPT_INDENT_2).decode())
    print(f"wrote {args.out / f'bench_olap-sf{args.sf:g}-{stamp}.json'} and .png")


async def _postgres(dsn: str, runs: int, render_sql: Callable, queries: list[str]) -> tuple[dict, dict]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    await conn.execute("SET search_path = ssb")
    timings: dict[str, Any] = {}
    answers: dict[str, Any] = {}
    try:
        for q in queries:
            stmt = await conn.prepare(render_sql(q, {}))
            times = []
            rows = await stmt.fetch()
            for _ in range(runs):
                started = time.perf_counter()
                rows = await stmt.fetch()
                times.append((time.perf_counter() - started) * 1000)
            timings[q] = {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
                          "max_ms": round(max(times), 2)}
            answers[q] = normalise([[int(v) if hasattr(v, "to_integral_value") else v for v in r] for r in rows])
    finally:
        await conn.close()
    return timings, answers


if __name__ == "__main__":
    main()
