"""Disk guards: work that writes (SSB datasets, bulk loads) checks its estimate against free space, keeping a
reserve for PostgreSQL, and against the SSB quota, before it starts; a full disk met anyway is a 507."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from service.errors import ProblemError

SSB_BYTES_PER_SF = 1.0e9  # Parquet plus the PostgreSQL heap copy of the tables
PARQUET_BYTES_PER_SF = 0.2e9  # measured: 7.9 MB at scale factor 0.05
BULK_BYTES_PER_BYTE = 3.0  # a vector's bytes in PostgreSQL: heap, WAL, pgvector's index, the snapshot


class InsufficientStorage(ProblemError):
    status, slug, title = 507, "insufficient-storage", "Insufficient storage"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def ensure_room(data_dir: Path, need_bytes: float, reserve_bytes: float, what: str, field: str | None = None) -> None:
    """Refuse work that would leave less than `reserve_bytes` free on the data directory's disk."""
    data_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(data_dir).free
    if free - need_bytes < reserve_bytes:
        raise InsufficientStorage(
            f"{what} needs about {_gb(need_bytes)} of disk; {_gb(free)} is free and {_gb(reserve_bytes)} is kept in "
            "reserve (SWITCHYARD_DISK_RESERVE_MB): delete datasets or collections, or free disk space", field=field)


def ensure_quota(used_bytes: float, need_bytes: float, quota_bytes: float | None, what: str,
                 field: str | None = None) -> None:
    if quota_bytes is not None and used_bytes + need_bytes > quota_bytes:
        raise InsufficientStorage(
            f"{what} needs about {_gb(need_bytes)}; SSB datasets already use {_gb(used_bytes)} of the "
            f"{_gb(quota_bytes)} quota (SWITCHYARD_SSB_QUOTA_GB): delete a dataset first", field=field)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is a full disk: PostgreSQL's disk_full, or ENOSPC from a file write."""
    import asyncpg

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, asyncpg.DiskFullError) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
