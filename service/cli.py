"""The `switchyard` command: `serve` runs the HTTP service, `migrate` applies database migrations."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.process.links import EngineSockets, ProcessLinks
from service.settings import Settings

# uvicorn's httptools protocol with a synchronous search lane
SYNC_SEARCH = "service.http.express_protocol:ExpressProtocol"


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
    import uvicorn

    settings = _settings(args)
    if args.ray:
        from service.cluster.ray_layer import ray_module, serve_on_ray

        try:
            ray_module()
        except RuntimeError as exc:
            sys.exit(str(exc))
        serve_on_ray(settings, args.address or settings.cluster.ray_address)
        return 0
    common: dict[str, Any] = dict(log_level=settings.server.log_level, timeout_graceful_shutdown=20,
                                  proxy_headers=False,
                                  access_log=False)  # service/http/access_log.py logs off the event loop
    fronts = settings.front_processes
    if fronts == 0:  # one process serving HTTP itself, or full replicas
        _serve_here(settings, common)
        return 0
    engines = settings.engine_processes
    # Engine processes listen on unix sockets in a private directory with a short path (socket names are limited
    # to about 100 bytes); the fronts, a child process tree, listen on the port.
    sockets = Path(tempfile.mkdtemp(prefix="switchyard-"))
    links = ProcessLinks(tuple(EngineSockets(sockets / f"engine-{i}.sock", sockets / f"engine-{i}-http.sock")
                               for i in range(engines)))
    os.environ["SWITCHYARD_ENGINES"] = str(engines)  # each engine sizes its threads and memory by it
    try:
        if engines > 1:
            return _serve_engines(settings, fronts, sockets, links)
        # One engine: this process, with the fronts as its children.
        front = _start_fronts(settings, fronts, sockets, links)
        stopping = threading.Event()
        threading.Thread(target=_stop_when_fronts_exit, args=(front, stopping), daemon=True).start()
        try:
            from service.http.app import create_app

            uvicorn.run(functools.partial(create_app, settings, links.as_engine(0)), factory=True,
                        uds=str(links.engines[0].http), **common)
        finally:
            stopping.set()
            _stop([front])
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return 0


UVICORN_FLAGS = ("--no-access-log", "--no-proxy-headers", "--timeout-graceful-shutdown", "20")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _uvicorn_child(target: str, role: str, settings: Settings, folder: Path, *options: str) -> list[str]:
    """The command line of a child Uvicorn (fronts, engines) that logs as this process does, its role named."""
    from uvicorn.config import LOGGING_CONFIG

    config = json.loads(json.dumps(LOGGING_CONFIG))  # Uvicorn's own loggers, plus the root logger for ours
    config["formatters"]["switchyard"] = {"format": LOG_FORMAT.replace("%(name)s", f"%(name)s[{role}]")}
    config["handlers"]["switchyard"] = {"class": "logging.StreamHandler", "formatter": "switchyard",
                                        "stream": "ext://sys.stderr"}
    config["root"] = {"handlers": ["switchyard"], "level": settings.server.log_level.upper()}
    config["loggers"]["httpx"] = {"level": "WARNING"}  # a front's pass-through would log every request
    path = folder / f"logging-{role.replace(' ', '-')}.json"
    path.write_text(json.dumps(config))
    return [sys.executable, "-m", "uvicorn", target, "--factory", *options, "--log-config", str(path),
            "--log-level", settings.server.log_level, *UVICORN_FLAGS]


def _start_fronts(settings: Settings, fronts: int, folder: Path, links: ProcessLinks) -> subprocess.Popen:
    command = _uvicorn_child("service.process.front:create_front", "front", settings, folder,
                             "--host", settings.server.host,
                             "--port", str(settings.server.port), "--workers", str(fronts))
    return subprocess.Popen(command, env={**os.environ, **links.environment()}, preexec_fn=_exit_with_parent)


def _serve_engines(settings: Settings, fronts: int, folder: Path, links: ProcessLinks) -> int:
    """One engine process per device, as vLLM runs one engine core per device: each a child pinned to its device
    with CUDA_VISIBLE_DEVICES, holding every resident index and following PostgreSQL's change log as any replica
    does; the fronts spread requests among them. This process only watches: when one child exits, all stop."""
    from service.process.devices import device_pins, probe_cuda

    log = logging.getLogger("switchyard")
    pins = device_pins(probe_cuda(enabled=settings.gpu.mode != "off"), os.environ.get("CUDA_VISIBLE_DEVICES"))
    children = []
    for i, engine in enumerate(links.engines):
        env = {**os.environ, **links.as_engine(i).environment()}
        if pins:  # more engines than devices (SWITCHYARD_ENGINES) share them in turn
            env["CUDA_VISIBLE_DEVICES"] = pins[i % len(pins)]
        log.info("engine process %d on %s", i, f"CUDA device {env['CUDA_VISIBLE_DEVICES']}" if pins else "the CPU")
        command = _uvicorn_child("service.http.app:create_app", f"engine {i}", settings, folder,
                                 "--uds", str(engine.http))
        children.append(subprocess.Popen(command, env=env, preexec_fn=_exit_with_parent))
    children.append(_start_fronts(settings, fronts, folder, links))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    code = 0
    while not stop.wait(0.2):
        ended = next((child for child in children if child.poll() is not None), None)
        if ended is not None:
            log.error("%s exited (code %s); stopping the others",
                      "the front processes" if ended is children[-1] else "an engine process", ended.returncode)
            code = 1
            break
    _stop(children[-1:])  # the fronts first: no request reaches an engine that is stopping
    _stop(children[:-1])
    return code


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve_here(settings: Settings, common: dict) -> None:
    """This process (or its full replicas) serves HTTP on the port, and on the unix socket SWITCHYARD_UDS too when
    it is set: a client on the same host (an application, a load tester) then skips TCP, as PostgreSQL's local
    clients do."""
    import uvicorn

    options = dict(factory=True, host=settings.server.host, port=settings.server.port, workers=settings.server.workers,
                   http=SYNC_SEARCH if settings.vectors.express_protocol else "auto", **common)
    if settings.server.uds is None:
        uvicorn.run("service.http.app:create_app", **options)
        return
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config("service.http.app:create_app", **options)
    server = uvicorn.Server(config)
    path = str(settings.server.uds)
    if os.path.exists(path):
        os.remove(path)  # left by a process that did not stop cleanly
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    local.bind(path)
    os.chmod(path, 0o660)
    sockets = [config.bind_socket(), local]
    try:
        if config.workers > 1:
            Multiprocess(config, sockets=sockets).run()
        else:
            server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    finally:
        if os.path.exists(path):
            os.remove(path)
    if config.workers == 1 and not server.started:
        sys.exit(3)  # uvicorn's start-up failure code


def _exit_with_parent() -> None:
    """In the front processes' supervisor, before it starts: SIGTERM when the engine process dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _stop_when_fronts_exit(front: subprocess.Popen, stopping: threading.Event) -> None:
    """The engine is no use without its fronts (the port may be taken, or they crashed): stop it too."""
    code = front.wait()
    if not stopping.is_set():
        logging.getLogger("switchyard").error("the front processes exited (code %s); stopping the engine", code)
        os.kill(os.getpid(), signal.SIGTERM)


def _migrate(args: argparse.Namespace) -> int:
    from service.database.migrate import apply_migrations
    from service.database.postgres import EmbeddedPostgres, connect

    settings = _settings(args)

    async def run() -> int:
        embedded = None
        dsn = settings.database.url
        if dsn is None:
            embedded = EmbeddedPostgres(settings.embedded_pgdata)
            dsn = await asyncio.to_thread(embedded.start)
        try:
            conn = await connect(dsn, settings.database.connect_timeout_s)
            try:
                applied = await apply_migrations(conn)
            finally:
                await conn.close()
        finally:
            if embedded is not None:
                await asyncio.to_thread(embedded.stop)
        for m in applied:
            print(f"applied {m.version:04d}_{m.name}")
        if not applied:
            print("database is up to date")
        return 0

    return asyncio.run(run())


def _progress(done: int, total: int | None, message: str) -> None:
    """A one-line progress bar on stderr, redrawn in place."""
    filled = int(30 * done / total) if total else 0
    count = f"{done}/{total}" if total else ""
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {count} {message:<50}", end="", file=sys.stderr, flush=True)


def _ssb(args: argparse.Namespace) -> int:
    """Generate or import an SSB dataset into the data directory; the service loads it at its next start."""

    from olap.schema import dataset_dir

    settings = _settings(args)
    root = settings.data_dir / "ssb"
    try:
        if args.ssb_command == "generate":
            from olap.generate import generate

            target = dataset_dir(settings.data_dir, args.sf)
            if args.seed:
                target = target.with_name(f"{target.name}-seed{args.seed}")
            meta = generate(args.sf, target, args.seed, _progress)
        else:
            from olap.importer import SsbImportError, import_tbl

            target = root / args.name
            try:
                meta = import_tbl(Path(args.source), target, None, _progress)
            except SsbImportError as exc:
                print(file=sys.stderr)
                sys.exit(f"import failed, nothing was written: {exc}")
    finally:
        print(file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    (root / "active.json").write_text(json.dumps({"dataset": str(target)}))
    print(json.dumps({"dataset": str(target), "rows": meta["rows"]}))
    return 0


def _load_vectors(args: argparse.Namespace) -> int:
    """Bulk-load a .npy file into a collection of a running service, with a progress bar."""
    import io
    import time
    import urllib.error
    import urllib.request

    import numpy as np
    import pyarrow as pa

    vectors = np.load(args.vectors).astype(np.float32)
    ids = np.load(args.ids).astype(np.int64) if args.ids else np.arange(args.first_id, args.first_id + len(vectors))
    if vectors.ndim != 2 or len(ids) != len(vectors):
        sys.exit(f"need an (n, dim) array of vectors and n ids; got {vectors.shape} and {len(ids)} ids")
    table = pa.table({"id": pa.array(ids), "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)),
                                                                                      vectors.shape[1])})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/")

    def call(method: str, path: str, body: bytes | None = None, content_type: str | None = None) -> dict:
        request = urllib.request.Request(base + path, data=body, method=method,
                                         headers={**headers,
                                                  **({"Content-Type": content_type} if content_type else {})})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            problem = json.loads(exc.read() or b"{}")
            sys.exit(f"{method} {path}: {exc.code} {problem.get('detail', exc.reason)}")
        except urllib.error.URLError as exc:
            sys.exit(f"cannot reach {base}: {exc.reason}")

    job = call("PUT", f"/v1/collections/{args.collection}/points", sink.getvalue(),
               "application/vnd.apache.arrow.stream")
    while True:
        state = call("GET", job["location"])
        _progress(state["done"], state["total"] or len(ids), state["message"] or state["state"])
        if state["state"] in ("succeeded", "failed"):
            print(file=sys.stderr)
            break
        time.sleep(0.5)
    if state["state"] == "failed":
        print(f"load failed: {state['message']}", file=sys.stderr)
        return 1
    print(json.dumps(state["result"]))
    return 0


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
    serve.add_argument("--uds", help="also listen on this unix socket, for local clients (SWITCHYARD_UDS; no fronts)")
    serve.set_defaults(run=_serve)

    migrate = sub.add_parser("migrate", help="apply pending database migrations and exit")
    migrate.set_defaults(run=_migrate)

    load = sub.add_parser("load-vectors", help="bulk-load a .npy of vectors into a collection of a running service")
    load.add_argument("collection")
    load.add_argument("vectors", help=".npy file, float32 (n, dim)")
    load.add_argument("--ids", help=".npy file of n int64 ids (default: first-id, first-id+1, ...)")
    load.add_argument("--first-id", dest="first_id", type=int, default=0)
    load.add_argument("--url", default=os.environ.get("SWITCHYARD_URL", "http://127.0.0.1:8000"))
    load.add_argument("--api-key", dest="api_key", default=os.environ.get("SWITCHYARD_API_KEY"))
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
        p.add_argument("--log-level", dest="log_level", choices=["critical", "error", "warning", "info", "debug"])
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
