"""The servers a load test starts for its run: `switchyard serve` with its embedded PostgreSQL, and a plain
embedded PostgreSQL + pgvector for the baselines. Standard library only (plus the project's EmbeddedPostgres), so
that VectorDBBench's environment can use it as well as the runner's."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Benchmarks drive the service with closed-loop clients at a fixed concurrency, which is no overload: they run it
# with a fixed in-flight limit, as peers (pgvector, PostGIS, DuckDB) run with none. loadtests/soak.py measures the
# adaptive limit, the default (docs/operations.md: Overload).
BENCHMARK_ENV = {"SWITCHYARD_INFLIGHT_LATENCY_TOLERANCE": "0"}

# Where benchmarks and load tests write by default (git-ignored in a checkout; never inside site-packages).
RESULTS_ENV = "SWITCHYARD_RESULTS_DIR"
_CHECKOUT = Path(__file__).resolve().parent.parent


def results_dir(name: str) -> Path:
    """The default folder for one benchmark's results (a script's --out, where it has one, still wins):
    $SWITCHYARD_RESULTS_DIR/<name> when that is set; else loadtests/results/<name> in a source checkout (one with
    pyproject.toml beside loadtests/); else results/<name> under the current directory, so that an installed
    package never writes into site-packages. .gitignore covers loadtests/results/ and results/."""
    base = os.environ.get(RESULTS_ENV)
    if base:
        return Path(base).expanduser() / name
    if (_CHECKOUT / "pyproject.toml").is_file():
        return _CHECKOUT / "loadtests" / "results" / name
    return Path.cwd() / "results" / name


class ServiceError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_service(workers: int, data_dir: str | Path | None, log_path: Path, env: dict[str, str] | None = None,
                  command: list[str] | None = None, ready_s: float = 180) -> Iterator[str]:
    """`switchyard serve` (this interpreter's, or `command`) with embedded PostgreSQL in its own data directory;
    yields its URL once /readyz answers 200, stops it with Ctrl-C (so PostgreSQL stops cleanly) on exit."""
    port = free_port()
    folder = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="switchyard-loadtest-"))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    child_env.update({"SWITCHYARD_LOG_LEVEL": "warning", **BENCHMARK_ENV, **(env or {})})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*(command or [sys.executable, "-m", "service.cli"]), "serve", "--port", str(port),
                                 "--data-dir", str(folder), "--workers", str(workers)],
                                env=child_env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        print(f"starting switchyard serve --workers {workers} (data in {folder}) ...", file=sys.stderr)
        while not _ready(url):
            if proc.poll() is not None:
                raise ServiceError(f"the service exited with {proc.returncode}: see {log_path}")
            if time.monotonic() > deadline:
                raise ServiceError(f"the service was not ready in {ready_s:.0f} s: see {log_path}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def embedded_postgres(folder: Path | None = None) -> Iterator[str]:
    """A PostgreSQL + pgvector of its own (the project's EmbeddedPostgres) for the run; yields its libpq URL. Without
    `folder` its data goes into a temporary directory, removed once the server has stopped."""
    from service.database.postgres import EmbeddedPostgres

    temporary = folder is None
    folder = folder or Path(tempfile.mkdtemp(prefix="pgvector-direct-"))
    print(f"starting an embedded PostgreSQL in {folder} ...", file=sys.stderr)
    server = EmbeddedPostgres(folder / "pgdata")
    try:
        yield server.start()
    finally:
        try:
            server.stop()
        finally:
            if temporary:
                shutil.rmtree(folder, ignore_errors=True)
