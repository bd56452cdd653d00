"""What the systems under test need beyond loadtests/processes.py (which starts them): the `switchyard` command
to run, and the vector extension VectorDBBench's pgvector client expects."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def switchyard_command() -> list[str]:
    """The project's own environment's `switchyard` (.venv, as `make run` uses), else this interpreter's."""
    local = REPO / ".venv" / "bin" / "switchyard"
    if local.exists():
        return [str(local)]
    if shutil.which("switchyard"):
        return ["switchyard"]
    return [sys.executable, "-m", "service.cli"]


def ensure_vector_extension(dsn: str) -> None:
    """VectorDBBench's pgvector client registers the vector type on connecting, before its own CREATE EXTENSION,
    so a database without the extension fails there: create it first."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
