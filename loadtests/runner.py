"""`switchyard loadtest vectors|vectors-mixed|spatial|olap`: prepare data through the API, run Locust headless
over a sweep, write one report folder (Locust's CSVs and HTML report per point, summary.json, summary.md, PNG
plots). Locust runs in child processes; this process never imports gevent nor runs the service (it reads the
service's settings models only, to size its default loads: loadtests/capacity.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from loadtests import capacity, report
from loadtests.client import Api
from loadtests.processes import ServiceError, local_service, results_dir
from loadtests.sweep import Point, Sweep

# Each engine's search parameter and the values swept by default, by the collection's index type.
ParamSweep = tuple[str | None, list[int | None]]
SEARCH_PARAMS: dict[str, ParamSweep] = {"hnsw": ("ef", [16, 32, 64, 128]), "ivf_flat": ("n_probes", [1, 4, 16, 64]),
                                        "ivf_pq": ("n_probes", [4, 16, 64]), "cagra": ("itopk_size", [32, 64, 128]),
                                        "brute_force": (None, [None])}
PGVECTOR_PARAMS: dict[str, ParamSweep] = {"hnsw": ("ef_search", [20, 40, 80, 160]),
                                          "ivfflat": ("probes", [1, 4, 16, 64]), "none": (None, [None])}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _sweep_overrides(items: list[str]) -> dict[str, list[int]]:
    """--sweep cpu=16,32,64 -> {"cpu": [16, 32, 64]}."""
    out = {}
    for item in items:
        target, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--sweep {item!r}: expected TARGET=V1,V2,... such as cpu=16,32,64")
        out[target.strip()] = _ints(values)
    return out


def _out_dir(args: argparse.Namespace, workload: str) -> Path:
    out = Path(args.out) if args.out else results_dir("loadtest") / f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for package in ("locust", "switchyard", "numpy", "psycopg", "faiss-cpu"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    arguments = sys.argv[2:] if sys.argv[1:2] == ["loadtest"] else sys.argv[1:]
    return {"command": "switchyard loadtest " + " ".join(arguments),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "versions": versions,
            "note": "Locust runs on the same machine as the service: client and server share its cores."}


def _service(args: argparse.Namespace, stack: ExitStack, out: Path, workers: int) -> str:
    if args.url:
        return args.url.rstrip("/")
    return stack.enter_context(local_service(workers, args.data_dir, out / "service.log",
                                             env=dict(e.split("=", 1) for e in args.serve_env)))


# -- vectors ----------------------------------------------------------------------------------------------------
def vectors(args: argparse.Namespace) -> int:
    from loadtests import baseline, datasets

    out = _out_dir(args, "vectors")
    data = datasets.load_vectors(args.vectors, args.queries, args.rows, args.dim, args.query_count, args.metric,
                                 args.seed)
    print(f"data: {data.source}; exact neighbours of {len(data.queries)} queries ...", file=sys.stderr)
    folder = datasets.save(out / "dataset", data, datasets.exact_neighbors(data.base, data.queries, data.metric),
                           args.collection)
    overrides = _sweep_overrides(args.sweep)
    summary: dict[str, Any] = {"workload": "vectors", "environment": _environment(args), "k": args.k,
                               "recall_target": args.recall_target, "batch": args.batch, "duration_s": args.duration,
                               "dataset": json.loads((folder / "meta.json").read_text())}
    with ExitStack() as stack:
        url = _service(args, stack, out, args.serve_workers)
        api = Api(url, args.api_key)
        summary["load"] = _prepare_collection(api, args, data)
        info = api.collection(args.collection)
        assert info is not None  # _prepare_collection made it
        summary["collection"] = {"index": info["index"], "pgvector_index": info["pgvector_index"],
                                 "count": info["count"]}
        targets = []
        for engine in args.engines:
            if engine == "pgvector":
                name, values = PGVECTOR_PARAMS[info["pgvector_index"].get("type", "hnsw")]
            else:
                name, values = SEARCH_PARAMS[_resident_type(info)]
            targets.append(_Target(engine, "search_vectors.py", name, overrides.get(engine, values), url,
                                   ["--collection", args.collection, "--engine", engine]))
        if args.baseline:
            kind, where = args.baseline
            if kind != "pgvector-direct":
                raise SystemExit(f"--baseline {kind}: the baseline offered is pgvector-direct")
            dsn = stack.enter_context(baseline.server(where))
            pg = info["pgvector_index"]
            summary["baseline"] = baseline.load(dsn, args.baseline_table, data.base, data.metric, pg.get("m") or 16,
                                                pg.get("ef_construction") or 64)
            _, values = PGVECTOR_PARAMS["hnsw"]
            targets.append(_Target("pgvector-direct", "pgvector_direct.py", "ef_search",
                                   overrides.get("pgvector-direct", values), url,
                                   ["--pg-dsn", dsn, "--pg-table", args.baseline_table]))
        _admitted_loads(args, api, targets, summary)
        sweep = Sweep(out, args.duration, args.processes, args.locust_arg, args.api_key or "", args.record_responses)
        common = ["--dataset", str(folder), "--k", str(args.k), "--batch", str(args.batch)]
        summary["points"] = _sweep_targets(sweep, targets, common, args)
    report.write(out, summary)
    print(f"report: {out / 'summary.md'}", file=sys.stderr)
    print(report.vectors_table(summary))
    return 0


class _Target:
    """One thing measured: a Switchyard engine, or the baseline, with its search parameter's values."""

    def __init__(self, name: str, locustfile: str, param: str | None, values: list, host: str, args: list[str]):
        self.name, self.locustfile, self.param, self.values, self.host, self.args = (
            name, locustfile, param, values, host, args)
        self.users: list[int] = []  # the users sweep's levels (_admitted_loads)

    def point(self, value: Any, users: int, common: list[str], stage: str) -> Point:
        args = [*self.args, *common]
        if self.param is not None:
            if self.locustfile == "pgvector_direct.py":
                args += ["--ef-search", str(value)]
            else:
                args += ["--params", json.dumps({self.param: value})]
        setting = f"{self.param}={value}" if self.param else "exact"
        return Point(f"{self.name}-{setting}-u{users}".replace("=", ""), self.locustfile, users, self.host, args,
                     {"target": self.name, "param": self.param, "value": value, "setting": setting, "stage": stage})


def _admitted_loads(args: argparse.Namespace, api: Api, targets: list[_Target], summary: dict[str, Any]) -> None:
    """The loads each target is swept at, unless --users / --param-users say: within what its engine admits
    (loadtests/capacity.py; the pgvector-direct baseline has no admission control)."""
    env, processes = capacity.service_env(args)
    available = capacity.available_engines(api)
    caps = {t.name: None if t.locustfile == "pgvector_direct.py" else capacity.admitted_users(
        capacity.engine_gates("vectors", t.name, available), env, processes) for t in targets}
    if args.param_users is None:
        args.param_users = capacity.param_users(caps.values())
    for t in targets:
        t.users = args.users if args.users is not None else capacity.within(args.default_users, caps[t.name])
    summary.update(param_users=args.param_users, admitted_users=caps, users={t.name: t.users for t in targets})


def _sweep_targets(sweep: Sweep, targets: list[_Target], common: list[str], args: argparse.Namespace) -> list[dict]:
    """VectorDBBench's method: every search setting at --param-users (recall and QPS: the recall/QPS curve), then
    the users sweep at the cheapest setting that reaches --recall-target with at most 1% of its requests failed
    (the highest-recall such one if none reaches it; any setting if every one failed more)."""
    sweep.total = sum(len(t.values) + len([u for u in t.users if u != args.param_users]) for t in targets)
    rows = []

    def measure(point: Point) -> dict[str, Any]:
        row = report.point_figures(sweep.run(point), args.k, args.batch)
        recall = "n/a" if row["recall"] is None else f"{row['recall']:.3f}"
        print(f" {row['qps']:,.0f} QPS (answers), recall {recall}, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
              f"{row['failures']} failures ({row['refused']} refused)", file=sys.stderr)
        return row

    for target in targets:
        ran = [measure(target.point(v, args.param_users, common, "params")) for v in target.values]
        clean = [r for r in ran if report.headline_eligible(r)] or ran
        good = [r for r in clean if r["recall"] is not None and r["recall"] >= args.recall_target]
        chosen = good[0] if good else max(clean, key=lambda r: r["recall"] or 0)
        chosen["chosen"] = True
        rows += ran
        for users in target.users:
            if users != args.param_users:
                rows.append(measure(target.point(chosen["value"], users, common, "users")))
    return rows


def _resident_type(info: dict[str, Any]) -> str:
    state = info.get("index_state") or {}
    kind = state.get("index_type") or state.get("type") or info["index"]["type"]
    return kind if kind in SEARCH_PARAMS else ("hnsw" if info["count"] >= 20_000 else "brute_force")


def _prepare_collection(api: Api, args: argparse.Namespace, data: Any) -> dict[str, Any]:
    existing = api.collection(args.collection)
    if (existing is not None and args.reuse and existing["count"] == len(data.base)
            and existing["dim"] == data.base.shape[1]):
        print(f"reusing collection {args.collection} ({existing['count']:,} points)", file=sys.stderr)
        return {"reused": True}
    if existing is not None:
        api.call("DELETE", f"/v1/collections/{args.collection}")
    params = json.loads(args.index_params) if args.index_params else (
        {"m": args.m, "ef_construction": args.ef_construction} if args.index == "hnsw" else {})
    index = {"type": args.index, "params": params}
    api.call("POST", "/v1/collections", json={
        "name": args.collection, "dim": data.base.shape[1], "metric": data.metric, "index": index,
        "pgvector_index": {"type": "hnsw", "m": args.m, "ef_construction": args.ef_construction}})
    seconds = api.bulk_load(args.collection, data.base)
    return {"reused": False, "rows": len(data.base), "load_and_build_s": round(seconds, 1)}


# -- the command line -------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser, users: str) -> None:
    p.add_argument("--url", default=os.environ.get("SWITCHYARD_URL"),
                   help="a running service; unset: start `switchyard serve` with embedded PostgreSQL for the run")
    p.add_argument("--api-key", default=os.environ.get("SWITCHYARD_API_KEY"))
    p.add_argument("--serve-workers", type=int, default=1, help="Uvicorn workers of the service started here")
    p.add_argument("--serve-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the service started here (repeatable), e.g. SWITCHYARD_CONSISTENCY=strong")
    p.add_argument("--data-dir", help="data directory of the service started here (default: a temporary one)")
    p.add_argument("--users", type=_ints, default=None,
                   help=f"users per point, closed loop (default {users}, kept to what the engine under test admits "
                        "without refusing: its concurrency limit and queue)")
    p.set_defaults(default_users=_ints(users))
    p.add_argument("--duration", type=float, default=15, help="seconds per point (default 15)")
    p.add_argument("--processes", type=int, default=0, help="Locust --processes (load generator processes; 0: one)")
    p.add_argument("--locust-arg", action="append", default=[], help="passed to every Locust run (repeatable)")
    p.add_argument("--out", help="report folder (default: $SWITCHYARD_RESULTS_DIR/loadtest/<workload>-<time>; "
                                 "without it loadtests/results/loadtest/ in a source checkout, else "
                                 "./results/loadtest/)")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="switchyard loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="workload", required=True)

    v = sub.add_parser("vectors", help="search QPS, latency and recall per engine and search setting, and users")
    _common(v, "1,4,16,64")
    v.add_argument("--collection", default="loadtest")
    v.add_argument("--vectors", help=".npy (n, dim) float32 to load (default: a seeded Gaussian mixture)")
    v.add_argument("--queries", help=".npy queries (default: the last --query-count rows of --vectors, held out)")
    v.add_argument("--rows", type=int, default=100_000, help="seeded data: vectors (default 100,000)")
    v.add_argument("--dim", type=int, default=384, help="seeded data: dimensions (default 384)")
    v.add_argument("--query-count", type=int, default=1000)
    v.add_argument("--metric", choices=["l2", "cosine", "inner_product"], default="l2")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--index", default="hnsw", help="resident index type (auto, brute_force, hnsw, ivf_flat, ...)")
    v.add_argument("--index-params", help="its build parameters as JSON (default for hnsw: --m, --ef-construction)")
    v.add_argument("--m", type=int, default=16, help="HNSW m of every index: resident, Switchyard's pgvector, baseline")
    v.add_argument("--ef-construction", type=int, default=64)
    v.add_argument("--reuse", action="store_true", help="keep the collection if it already holds as many rows")
    v.add_argument("--engines", type=lambda s: s.split(","), default=["cpu", "pgvector"],
                   help="Switchyard engines to sweep (default cpu,pgvector)")
    v.add_argument("--sweep", action="append", default=[], metavar="TARGET=V1,V2",
                   help="search parameter values for one target, e.g. cpu=16,64 or pgvector-direct=40,80")
    v.add_argument("--param-users", type=int, default=None,
                   help="users while sweeping search settings (default 16, or the largest power of two every "
                        "engine under test admits where that is less: 8 with pgvector at its defaults)")
    v.add_argument("--recall-target", type=float, default=0.95,
                   help="the users sweep runs at the cheapest setting reaching this recall (default 0.95)")
    v.add_argument("--k", type=int, default=10)
    v.add_argument("--batch", type=int, default=1, help="queries per search request (default 1)")
    v.add_argument("--baseline", nargs=2, metavar=("pgvector-direct", "URL"),
                   help="also run the queries as SQL on a plain PostgreSQL + pgvector server: its libpq URL, or "
                        "'embedded' to start one for the run")
    v.add_argument("--baseline-table", default="loadtest_baseline")
    v.add_argument("--record-responses", action="store_true",
                   help="keep every answer's ids (points/<point>/responses.jsonl) to check recall offline")
    v.set_defaults(run=vectors)

    from loadtests import workloads  # the other three workloads

    workloads.add_parsers(sub, _common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = [name for name in ("locust", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:  # find_spec, not import: importing locust monkey-patches the process with gevent
        sys.exit(f"switchyard loadtest needs the loadtest extra ({', '.join(missing)} missing): "
                 "pip install 'switchyard[loadtest]'")
    try:
        return args.run(args)
    except ServiceError as exc:
        print(f"\nloadtest stopped: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

