"""The `switchyard` command: `serve` runs the HTTP service, `migrate` applies database migrations, `ssb` generates
or imports SSB data into the data directory, `load-vectors` bulk-loads a .npy file into a running service, and
`loadtest` runs the Locust load tests."""

# Arguments only: each subcommand turns its parsed arguments into one call. How `serve` runs its processes is
# service/process/launcher.py; the one-shot subcommands' work is service/commands.py.

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from service import commands
from service.process.launcher import LOG_FORMAT, launch
from service.settings import Settings


def _settings(args: argparse.Namespace) -> Settings:
    # Command-line options override the environment; they go through the environment so that every
    # Uvicorn worker process builds the same Settings.
    for option, env in (("host", "HOST"), ("port", "PORT"), ("workers", "WORKERS"), ("fronts", "FRONTS"),
                        ("engines", "ENGINES"), ("uds", "UDS"),
                        ("data_dir", "DATA_DIR"),
                        ("database_url", "DATABASE_URL"), ("log_level", "LOG_LEVEL")):
        value = getattr(args, option, None)
        if value is not None:
            os.environ[f"SWITCHYARD_{env}"] = str(value)
    try:
        return Settings()
    except ValidationError as exc:
        lines = [f"  {Settings.variable(e['loc'])}: {e['msg']}" for e in exc.errors()]
        sys.exit("invalid configuration:\n" + "\n".join(lines))


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.ray:
        from service.cluster.placement import CannotPlace
        from service.cluster.ray_layer import ray_module, serve_on_ray

        try:
            ray_module()
        except RuntimeError as exc:
            sys.exit(str(exc))
        try:
            serve_on_ray(settings, args.address or settings.cluster.ray_address, args.num_cpus)
        except CannotPlace as exc:  # a deployment the cluster cannot hold: the numbers, no traceback
            sys.exit(f"switchyard serve --ray: {exc}")
        return 0
    return launch(settings)


def _migrate(args: argparse.Namespace) -> int:
    return commands.migrate(_settings(args))


def _ssb(args: argparse.Namespace) -> int:
    """Generate or import an SSB dataset into the data directory; the service loads it at its next start."""
    settings = _settings(args)
    if args.ssb_command == "generate":
        return commands.ssb_generate(settings.data_dir, args.sf, args.seed)
    return commands.ssb_import(settings.data_dir, Path(args.source), args.name)


def default_url() -> str:
    """Where a service started here with its defaults listens: SWITCHYARD_PORT if set, else 8000."""
    return f"http://127.0.0.1:{os.environ.get('SWITCHYARD_PORT') or 8000}"


def _load_vectors(args: argparse.Namespace) -> int:
    return commands.load_vectors(args.url, args.api_key, args.collection, args.vectors, args.ids, args.first_id)


def _loadtest(args: argparse.Namespace) -> int:
    """Delegates to the Locust harness, which runs Locust in child processes (it checks for the `loadtest` extra
    once a run starts, so `--help` works on any install)."""
    from loadtests.runner import main as loadtest_main

    return loadtest_main(args.loadtest_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service (Uvicorn)")
    serve.add_argument("--host", help="interface to listen on (SWITCHYARD_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (SWITCHYARD_PORT, default 8000)")
    serve.add_argument("--workers", type=int, help=(
        "full replicas, each with its own indexes and no fronts (SWITCHYARD_WORKERS, default 1)"))
    serve.add_argument("--fronts", type=int, help=(
        "HTTP front processes before the engine processes (SWITCHYARD_FRONTS; default: one per core on 4 or "
        "more cores, none on fewer)"))
    serve.add_argument("--engines", type=int, help=(
        "engine processes behind the fronts, each with every resident index, pinned to one CUDA device "
        "(SWITCHYARD_ENGINES; default: one per device when a GPU engine is installed, else one)"))
    serve.add_argument("--ray", action="store_true", help=(
        "run on a Ray cluster: the app as a Ray Serve ingress, vector shards as Ray actors (the 'ray' extra)"))
    serve.add_argument("--address", help=(
        "with --ray: the cluster to join (SWITCHYARD_RAY_ADDRESS; default: the one set there, or a local Ray)"))
    serve.add_argument("--num-cpus", dest="num_cpus", type=int, help=(
        "with --ray and no --address: logical CPUs of the local Ray (default: what every actor reserves, at least "
        "the cores; fewer than that is refused)"))
    serve.add_argument("--uds", help="also listen on this unix socket, for local clients (SWITCHYARD_UDS; no fronts)")
    serve.set_defaults(run=_serve)

    migrate = sub.add_parser("migrate", help="apply pending database migrations and exit")
    migrate.set_defaults(run=_migrate)

    load = sub.add_parser("load-vectors", help="bulk-load a .npy of vectors into a collection of a running service")
    load.add_argument("collection")
    load.add_argument("vectors", help=".npy file, float32 (n, dim)")
    load.add_argument("--ids", help=".npy file of n int64 ids (default: first-id, first-id+1, ...)")
    load.add_argument("--first-id", dest="first_id", type=int, default=0,
                      help="the first id when --ids is not given (default 0)")
    load.add_argument("--url", default=os.environ.get("SWITCHYARD_URL", default_url()),
                      help="the service (SWITCHYARD_URL; default http://127.0.0.1:$SWITCHYARD_PORT, port 8000)")
    load.add_argument("--api-key", dest="api_key", default=os.environ.get("SWITCHYARD_API_KEY"),
                      help="its API key (SWITCHYARD_API_KEY)")
    load.set_defaults(run=_load_vectors)

    loadtest = sub.add_parser(
        "loadtest", add_help=False,
        help="Locust load tests: vectors | vectors-mixed | spatial | olap (see --help of each)")
    loadtest.add_argument("loadtest_args", nargs=argparse.REMAINDER)
    loadtest.set_defaults(run=_loadtest)

    ssb = sub.add_parser("ssb", help="Star Schema Benchmark data: generate or import into the data directory")
    ssb_sub = ssb.add_subparsers(dest="ssb_command", required=True)
    gen = ssb_sub.add_parser("generate", help="generate an SSB dataset (Parquet) following ssb-dbgen's rules")
    gen.add_argument("--sf", type=float, required=True, help="scale factor (1 = 6 million lineorder rows)")
    gen.add_argument("--seed", type=int, default=0)
    imp = ssb_sub.add_parser("import", help="import the five .tbl files written by ssb-dbgen")
    imp.add_argument("source", help="directory with lineorder.tbl, part.tbl, supplier.tbl, customer.tbl, date.tbl")
    imp.add_argument("--name", default="imported", help="dataset name under <data_dir>/ssb")
    for p in (gen, imp):
        p.set_defaults(run=_ssb)

    for p in (serve, migrate, gen, imp):
        p.add_argument("--data-dir", dest="data_dir",
                       help="local state directory (SWITCHYARD_DATA_DIR, default ./data)")
        p.add_argument("--database-url", dest="database_url",
                       help="PostgreSQL URL (SWITCHYARD_DATABASE_URL); unset: embedded PostgreSQL in the data dir")
    for p in (serve, migrate, gen, imp, load):
        p.add_argument("--log-level", dest="log_level", choices=["critical", "error", "warning", "info", "debug"],
                       help="(SWITCHYARD_LOG_LEVEL, default info)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["loadtest"]:  # argparse's REMAINDER would not pass a leading --help on
        return _loadtest(argparse.Namespace(loadtest_args=argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=(getattr(args, "log_level", None) or os.environ.get("SWITCHYARD_LOG_LEVEL")
                               or "info").upper(),
                        format=LOG_FORMAT)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
