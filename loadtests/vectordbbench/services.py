"""The systems under test, started for one run when asked: `switchyard serve` with its embedded PostgreSQL in a
temporary data dir, and a separate embedded PostgreSQL + pgvector for VectorDBBench's own pgvector client."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def switchyard_command() -> list[str]:
    """The project's own environment's `switchyard` (.venv, as `make run` uses), else this interpreter's."""
    local = REPO / ".venv" / "bin" / "switchyard"
    if local.exists():
        return [str(local)]
    if shutil.which("switchyard"):
        return ["switchyard"]
    return [sys.executable, "-m", "service.cli"]


class SwitchyardServer:
    def __init__(self, data_dir: Path, log_file: Path, port: int | None = None) -> None:
        self.data_dir, self.log_file, self.port = data_dir, log_file, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
        env["SWITCHYARD_LOG_LEVEL"] = "warning"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [*switchyard_command(), "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"switchyard serve exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as response:
                    if response.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"switchyard serve not ready within {timeout_s:.0f} s; see {self.log_file}")

    def stop(self) -> None:
        # SIGINT: the service stops its embedded PostgreSQL cleanly.
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class PgvectorServer:
    """The project's EmbeddedPostgres (service/database.py) on its own data dir; runs while this process does."""

    def __init__(self, data_dir: Path) -> None:
        from service.database import EmbeddedPostgres

        self.server = EmbeddedPostgres(data_dir / "pgdata")

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()


def ensure_vector_extension(dsn: str) -> None:
    """VectorDBBench's pgvector client registers the vector type on connecting, before its own CREATE EXTENSION,
    so a database without the extension fails there: create it first."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
