"""`python -m loadtests.vectordbbench run ...`: VectorDBBench's custom-dataset performance case (and its label-filter
cases) against Switchyard and against VectorDBBench's own pgvector client, in one offline run; then a summary.

This process prepares the data set and the systems under test and never imports VectorDBBench: it runs bench.py
as a child process with VectorDBBench's environment (its log and result folders inside --out, no dataset source),
captures everything it prints, and summarises its result files and logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

from loadtests.processes import embedded_postgres, local_service, results_dir

from . import dataset as ds
from . import offline, summary
from .services import REPO, ensure_vector_extension, switchyard_command


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.vectordbbench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run VectorDBBench against Switchyard and pgvector, write a summary")
    data = run.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="train.npy,test.npy[,neighbors.npy], a folder holding those, or a folder in "
                                     "VectorDBBench's custom-dataset Parquet layout")
    data.add_argument("--synthetic", metavar="N,DIM", help="a seeded clustered Gaussian mixture of N vectors (L2)")
    run.add_argument("--queries", type=int, default=1000, help="test queries of --synthetic (default 1000)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--metric", choices=ds.METRICS, default="l2", help="metric of --data (default l2)")
    run.add_argument("--label-percentages", type=_floats, default=[], metavar="P,P",
                     help="also run the label-filter case for these label shares, e.g. 0.01,0.5 (labels and their "
                          "ground truth are generated for .npy and synthetic data)")
    run.add_argument("--url", help="a running Switchyard, e.g. http://127.0.0.1:8000 or unix:/path/to.sock")
    run.add_argument("--switchyard-transport", choices=["unix", "tcp"], default="unix", help=(
        "with --start-service: how the client reaches the service (default unix: its unix socket, SWITCHYARD_UDS, "
        "as VectorDBBench's pgvector client reaches the embedded PostgreSQL through its unix socket)"))
    run.add_argument("--switchyard-client", choices=["switchyard_client", "plain-json"], default="switchyard_client",
                     help="how VectorDBBench's Switchyard client calls it: through switchyard_client (default), or "
                          "as the obvious plain client would (requests, keep-alive, JSON float lists)")
    run.add_argument("--start-service", action="store_true",
                     help="start `switchyard serve` with an embedded PostgreSQL in a temporary data dir")
    run.add_argument("--api-key", default=os.environ.get("SWITCHYARD_API_KEY"))
    run.add_argument("--pgvector-dsn", help="PostgreSQL with pgvector for VectorDBBench's pgvector client; default: "
                                            "an embedded PostgreSQL of its own in a temporary data dir")
    run.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8], metavar="C,C")
    run.add_argument("--duration", type=int, default=30, help="seconds per concurrency (default 30)")
    run.add_argument("--k", type=int, default=10)
    run.add_argument("--m", type=int, default=16)
    run.add_argument("--ef-construction", type=int, default=64)
    run.add_argument("--ef-search", type=int, default=64)
    run.add_argument("--switchyard-ef-search", type=int, help=(
        "Switchyard's search ef when it should differ from pgvector's (default --ef-search): the two HNSW "
        "implementations reach different recall at the same ef, so a like-for-like run can match recall instead"))
    run.add_argument("--switchyard-workers", type=int, default=1, help=(
        "with --start-service: `serve --workers N`, full replicas that each answer searches (default 1)"))
    run.add_argument("--switchyard-env", action="append", default=[], metavar="NAME=VALUE",
                     help="a setting of the started service, e.g. SWITCHYARD_FRONTS=2 (with --start-service)")
    run.add_argument("--engine", choices=["auto", "cpu", "pgvector"], default="auto", help="Switchyard's search engine")
    run.add_argument("--switchyard-pgvector-index", choices=["hnsw", "none"], default="hnsw",
                     help="the pgvector index Switchyard keeps for fallback (built in its load time; default hnsw)")
    run.add_argument("--pgvector-maintenance-work-mem", default="1GB",
                     help="for the pgvector client's index build (VectorDBBench's option; default 1GB)")
    run.add_argument("--insert-batch-size", type=int, default=5000, help="rows per insert call, both systems")
    run.add_argument("--out", type=Path, default=results_dir("vectordbbench"),
                     help="report folder (default: $SWITCHYARD_RESULTS_DIR/vectordbbench; without it "
                          "loadtests/results/vectordbbench/ in a source checkout, else ./results/vectordbbench/)")
    run.add_argument("--keep-data", action="store_true", help="keep the temporary folder (data set, data dirs)")
    args = parser.parse_args(argv)
    if not args.url and not args.start_service:
        parser.error("give --url of a running Switchyard, or --start-service")
    return args


def redact(dsn: str) -> str:
    """The DSN without its password, for the summary."""
    parts = urlsplit(dsn)
    if not parts.password:
        return dsn
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def prepare_dataset(args: argparse.Namespace, folder: Path) -> ds.CustomDataset:
    if args.synthetic:
        n, dim = _ints(args.synthetic)
        train, test = ds.synthetic(n, dim, args.queries, args.seed)
        return ds.write_custom_dataset(folder, train, test, "l2", args.k, None, args.label_percentages, args.seed)
    given = [Path(p) for p in args.data.split(",")]
    if len(given) == 1 and given[0].is_dir():
        if (given[0] / "train.npy").exists():
            given = [given[0] / name for name in ("train.npy", "test.npy", "neighbors.npy")
                     if (given[0] / name).exists()]
        else:
            return ds.describe_parquet_dir(given[0], args.metric, args.label_percentages)
    train, test, neighbors = ds.load_npy(given)
    return ds.write_custom_dataset(folder, train, test, args.metric, args.k, neighbors, args.label_percentages,
                                   args.seed)


def run_vectordbbench(plan_file: Path, plan: dict, out: Path, scratch: Path) -> int:
    """bench.py in a child process, its output (and every process it spawns) copied to a log file and here."""
    logs = out / "logs"
    env = {**os.environ, **offline.OFFLINE_ENV,
           "LOG_FILE": str(logs / "vectordb_bench.log"), "LOG_LEVEL": "INFO",
           "RESULTS_LOCAL_DIR": str(out / "vectordbbench-results"),
           "DATASET_LOCAL_DIR": str(scratch / "vectordbbench-datasets"),
           offline.ENV: urlsplit(plan["switchyard"]["url"]).hostname or "localhost",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(logs / "vectordbbench-console.log", "w") as console:
        proc = subprocess.Popen([sys.executable, "-m", "loadtests.vectordbbench.bench", str(plan_file)], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            console.write(line)
            sys.stdout.write(line)
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="switchyard-vdbb-"))
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    task_label = "switchyard-" + time.strftime("%Y%m%d-%H%M%S")
    try:
        with ExitStack() as stack:
            print(f"data set -> {scratch / 'dataset'}", flush=True)
            data = prepare_dataset(args, scratch / "dataset")
            url = args.url
            if args.start_service:
                env = dict(item.split("=", 1) for item in args.switchyard_env)
                if args.switchyard_transport == "unix":
                    env["SWITCHYARD_UDS"] = str(scratch / "switchyard.sock")
                url = stack.enter_context(local_service(args.switchyard_workers, scratch / "switchyard",
                                                        out / "logs" / "switchyard-serve.log",
                                                        env=env, command=switchyard_command()))
                if args.switchyard_transport == "unix":
                    url = "unix:" + env["SWITCHYARD_UDS"]
                print(f"switchyard serve at {url}", flush=True)
            dsn = args.pgvector_dsn
            if dsn is None:
                dsn = stack.enter_context(embedded_postgres(scratch / "pgvector"))
                print(f"embedded PostgreSQL for pgvector at {dsn}", flush=True)
            ensure_vector_extension(dsn)
            plan = {
                "task_label": task_label, "dataset": data.to_dict(), "k": args.k, "concurrencies": args.concurrency,
                "duration": args.duration, "insert_batch_size": args.insert_batch_size,
                "hnsw": {"m": args.m, "ef_construction": args.ef_construction, "ef_search": args.ef_search},
                "switchyard": {"url": url, "collection_name": "vdbbench", "engine": args.engine,
                               "ef_search": args.switchyard_ef_search or args.ef_search, "env": args.switchyard_env,
                               "workers": args.switchyard_workers,
                               "pgvector_index": args.switchyard_pgvector_index, "api_key": args.api_key,
                               "client": args.switchyard_client},
                "pgvector": {"dsn": dsn, "maintenance_work_mem": args.pgvector_maintenance_work_mem},
            }
            plan_file = scratch / "plan.json"
            plan_file.write_text(json.dumps(plan, indent=2))
            exit_code = run_vectordbbench(plan_file, plan, out, scratch)
    finally:
        if not args.keep_data:
            shutil.rmtree(scratch, ignore_errors=True)

    public_plan = {**plan, "switchyard": {**plan["switchyard"], "api_key": None},
                   "pgvector": {**plan["pgvector"], "dsn": redact(plan["pgvector"]["dsn"])}}
    report = summary.build(
        results=summary.read_results(out / "vectordbbench-results", task_label),
        log_scan=summary.scan_logs([out / "logs" / "vectordb_bench.log", out / "logs" / "vectordbbench-console.log"]),
        meta={"command": "python -m loadtests.vectordbbench " + shlex.join(sys.argv[1:] if argv is None else argv),
              "started": started, "task_label": task_label, "plan": public_plan,
              "vectordbbench_exit_code": exit_code, "machine": summary.machine()},
    )
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    text = summary.markdown(report)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
