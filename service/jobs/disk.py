"""Disk accounting for work that writes (SSB datasets, bulk loads): one ledger per process.

A job is admitted only if its estimate fits in what is free on the data directory's disk, less what jobs
already admitted (queued or running) claimed and have not released, less the reserve kept for PostgreSQL
(SWITCHYARD_DISK_RESERVE_MB); an SSB dataset must also fit in the SSB quota together with what SSB datasets
use now (their Parquet files and the PostgreSQL copy of the active one) and what queued SSB jobs claimed. A
job's claim is held until it ends, however it ends: by then its bytes are on disk or freed. Refusals are 507
with the numbers in the detail and as members of the problem; a full disk met anyway is a 507 too.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import ProblemError

# What an SSB dataset writes per scale factor, measured at SF 0.05 and 0.2: Parquet 0.16-0.17 GB, the PostgreSQL
# heap copy (ssb.*, pg_total_relation_size) 0.84 GB. DuckDB and cuDF hold their copy in memory: nothing on disk.
PARQUET_BYTES_PER_SF = 0.2e9
POSTGRES_BYTES_PER_SF = 0.85e9
SSB_BYTES_PER_SF = PARQUET_BYTES_PER_SF + POSTGRES_BYTES_PER_SF
TBL_BYTES_PER_SF = 0.57e9  # ssb-dbgen's five .tbl files
BULK_BYTES_PER_BYTE = 3.0  # a vector's bytes in PostgreSQL: heap, WAL, pgvector's index, the snapshot
DEFAULT_SSB_QUOTA_SHARE = 0.5  # of what was free at start (plus what SSB used then), with no SWITCHYARD_SSB_QUOTA_GB

_SSB_TABLE_BYTES = ("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'ssb' AND c.relkind = 'r'")


class InsufficientStorage(ProblemError):
    status, slug, title = 507, "insufficient-storage", "Insufficient storage"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 or n == 0 else f"{n / 1e6:.1f} MB"


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


@dataclass(frozen=True)
class SsbUsage:
    """What SSB datasets use on disk now: every dataset's Parquet files, and the active one's PostgreSQL tables."""
    parquet: int
    postgres: int

    @property
    def total(self) -> int:
        return self.parquet + self.postgres


async def ssb_usage(pool: Any, root: Path) -> SsbUsage:
    parquet = await asyncio.to_thread(tree_bytes, root)
    return SsbUsage(parquet, int(await pool.fetchval(_SSB_TABLE_BYTES)))


@dataclass
class DiskNeed:
    """What a job asks of the disk when it is admitted: its estimate, and for an SSB dataset what SSB uses now."""
    nbytes: float
    what: str
    field: str | None = None
    ssb: SsbUsage | None = None


@dataclass(eq=False)
class Claim:
    """An admitted job's estimate, held from admission until the job ends."""
    nbytes: float
    ssb: bool


class DiskLedger:
    def __init__(self, data_dir: Path, reserve_bytes: float, ssb_quota_bytes: float | None) -> None:
        self.data_dir = data_dir
        self.reserve = reserve_bytes
        self.ssb_quota = ssb_quota_bytes
        self.claims: set[Claim] = set()
        self.released = 0  # count of releases: a measurement of SSB usage that spans one is taken again

    def free(self) -> int:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(self.data_dir).free

    def claimed(self, ssb_only: bool = False) -> float:
        return sum(c.nbytes for c in self.claims if c.ssb or not ssb_only)

    def check_room(self, need: float, what: str, field: str | None = None, ssb: SsbUsage | None = None) -> None:
        """Refuse (507) work that would leave less than the reserve free once every admitted job has written its
        share, or, for an SSB dataset (`ssb`: what SSB uses now), that would pass the SSB quota."""
        free, claimed = self.free(), self.claimed()
        numbers: dict[str, Any] = {"need_bytes": int(need), "free_bytes": free, "claimed_bytes": int(claimed),
                                   "reserve_bytes": int(self.reserve)}
        fits = free - claimed - need >= self.reserve
        said = (f"{what} needs about {_gb(need)} of disk; {_gb(free)} is free, of which {_gb(claimed)} is claimed by "
                f"{len(self.claims)} queued or running job(s) and {_gb(self.reserve)} is kept in reserve "
                "(SWITCHYARD_DISK_RESERVE_MB)")
        if ssb is not None and self.ssb_quota is not None:
            ssb_claimed = self.claimed(ssb_only=True)
            numbers.update(ssb_used_bytes=ssb.total, ssb_claimed_bytes=int(ssb_claimed),
                           quota_bytes=int(self.ssb_quota))
            fits = fits and ssb.total + ssb_claimed + need <= self.ssb_quota
            said += (f"; SSB datasets use {_gb(ssb.total)} (Parquet {_gb(ssb.parquet)}, PostgreSQL "
                     f"{_gb(ssb.postgres)}) and queued or running SSB jobs claim {_gb(ssb_claimed)} of the "
                     f"{_gb(self.ssb_quota)} quota (SWITCHYARD_SSB_QUOTA_GB)")
        if not fits:
            wait = "wait for those jobs, " if self.claims else ""
            raise InsufficientStorage(f"{said}: {wait}delete datasets or collections, or free disk space", field=field,
                                      **numbers)

    def claim(self, need: DiskNeed) -> Claim:
        """Admit a job (507 if it does not fit) and hold its estimate. Synchronous, so nothing is admitted between
        the check and the claim."""
        self.check_room(need.nbytes, need.what, need.field, need.ssb)
        claim = Claim(need.nbytes, need.ssb is not None)
        self.claims.add(claim)
        return claim

    def release(self, claim: Claim) -> None:
        if claim in self.claims:
            self.claims.discard(claim)
            self.released += 1

    async def ssb_usage(self, pool: Any, root: Path) -> SsbUsage:
        """SSB's usage, measured again if a job ended meanwhile (its bytes could be missed by the measurement
        after its claim was dropped)."""
        for _ in range(3):
            before = self.released
            usage = await ssb_usage(pool, root)
            if self.released == before:
                break
        return usage


async def open_ledger(data_dir: Path, reserve_bytes: float, quota_gb: float | None, pool: Any) -> DiskLedger:
    """The process's ledger. With no quota set, SSB may use DEFAULT_SSB_QUOTA_SHARE of what is free now plus what
    it already uses, so a fresh install cannot fill its disk with SSB data by accident."""
    ledger = DiskLedger(data_dir, reserve_bytes, None if quota_gb is None else quota_gb * 1e9)
    if quota_gb is None:
        used = await ssb_usage(pool, data_dir / "ssb")
        ledger.ssb_quota = DEFAULT_SSB_QUOTA_SHARE * (ledger.free() + used.total)
    return ledger


def ssb_import_bytes(tbl_bytes: float) -> float:
    """What importing .tbl files of this size writes: the same per scale factor as a generated dataset."""
    return SSB_BYTES_PER_SF * tbl_bytes / TBL_BYTES_PER_SF


def disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is a full disk: PostgreSQL's disk_full, or ENOSPC from a file write."""
    import asyncpg

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, asyncpg.DiskFullError) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
