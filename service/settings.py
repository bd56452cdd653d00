"""One settings object, read from SWITCHYARD_* environment variables (or given directly in tests)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_", extra="ignore")

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL (postgresql://user:pass@host:port/db). Unset: an embedded PostgreSQL "
        "with pgvector is started in <data_dir>/postgres and stopped on shutdown.",
    )
    data_dir: Path = Field(default=Path("data"),
                           description="Local state: embedded database, index snapshots, SSB data.")
    api_key: SecretStr | None = Field(default=None,
                                      description="If set, every /v1 route needs 'Authorization: Bearer <key>'.")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    workers: int = Field(default=1, ge=1, description=(
        "Full replicas: Uvicorn workers that each hold their own resident indexes (no front processes then)."))
    fronts: int | None = Field(default=None, ge=0, le=256, description=(
        "HTTP front processes before the engine processes (README: Process layout). Default: one per core on "
        "machines with 4 or more, none (the engine process serves HTTP itself) on fewer, where the hop between "
        "processes costs more than it frees; one per core whenever there are several engine processes."))
    engines: int | None = Field(default=None, ge=1, le=64, description=(
        "Engine processes behind the fronts, each holding every resident index and pinned to one CUDA device "
        "(README: Process layout). Default: one per visible device when a GPU engine is installed, else one."))
    uds: Path | None = Field(default=None, description=(
        "Also listen on this unix socket (besides host:port): local clients skip TCP. Not with front processes."))
    engine_socket: Path | None = Field(default=None, description=(
        "Set by `switchyard serve`: the engine process's unix socket for parsed searches and upserts."))
    engine_links: list[tuple[Path, Path]] = Field(default_factory=list, description=(
        "Set by `switchyard serve` for its front processes: each engine process's socket for parsed searches and "
        "upserts, and its HTTP socket, where every other request is passed through."))
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = Field(default=True, description=(
        "Log every request (logger switchyard.access, written by a background thread) except the hot routes."))
    access_log_sample: float = Field(default=0.0, ge=0.0, le=1.0, description=(
        "Share of hot-route requests (search, JSON upsert) that are access-logged too: 0 none, 1 all."))
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
                                description="Larger request bodies get 413 unparsed.")
    max_bulk_bytes: int = Field(default=4 * 1024**3, ge=1024,
                                description="Limit for bulk loads sent as an Arrow IPC stream (read into memory, "
                                            "loaded as a job).")
    cpu_threads: int | None = Field(default=None, ge=1, le=1024, description=(
        "Threads one CPU engine call may use (FAISS's OpenMP). Default: the cores divided among the workers or "
        "engine processes."))
    huge_pages: bool = Field(default=True, description=(
        "Back resident FAISS indexes' vectors and graph with transparent huge pages (Linux, THP mode 'madvise' or "
        "'always'): fewer TLB misses per graph search (indexes/hugepages.py)."))
    batch_max: int = Field(default=64, ge=1, le=4096,
                           description="Most single-vector searches merged into one engine call.")
    inline_search_us: float = Field(default=500, ge=0, le=100_000, description=(
        "A lone single-vector search on the CPU whose engine time has averaged under this runs on the event loop "
        "instead of a worker thread (the hop costs more than a small search); 0: always a thread."))
    inline_turn_us: float = Field(default=3000, ge=0, le=100_000, description=(
        "Engine time the event loop spends answering searches in one of its turns (by each search's learnt cost; "
        "the first always runs); more arriving together go to a worker thread as a batch, so the loop keeps "
        "reading while the engine runs."))
    sync_search: bool = Field(default=True, description=(
        "Answer plain single-vector searches from the HTTP protocol itself when the resident CPU engine can at once "
        "(service/hot_protocol.py); false: every request goes through the ASGI app."))
    batch_window_ms: float = Field(default=0.0, ge=0, le=100,
                                   description="How long an idle collection waits for company before searching; 0 = "
                                   "never wait, batch only what queues while the engine is busy.")
    consistency: Literal["strong", "session", "bounded", "eventually"] = Field(
        default="bounded", description="Consistency level of searches that do not name one (README: Consistency).")
    bounded_staleness_ms: float = Field(default=1000.0, gt=0, le=3_600_000, description=(
        "'bounded' searches see every write committed this long before they arrived."))
    consistency_timeout_ms: float = Field(default=2000.0, gt=0, le=600_000, description=(
        "How long a search waits for its replica to reach its level before pgvector answers (auto) or 503."))
    replication_poll_ms: float = Field(default=200.0, ge=10, le=60_000, description=(
        "How often each process polls every collection's head: the backstop of LISTEN/NOTIFY, and what keeps "
        "'bounded' searches from waiting. Keep it well under bounded_staleness_ms."))
    replication_trace_dir: Path | None = Field(default=None, description=(
        "If set, each process appends '<collection id> <seq> <applied at, epoch s>' for every commit it applies "
        "to a file here (replication-lag measurements: loadtests/bench_replication.py)."))
    rebuild_dead_fraction: float = Field(default=0.2, gt=0, le=10, description=(
        "A resident index is rebuilt in the background when its dead rows exceed this share of its live rows."))
    rebuild_delta_rows: int = Field(default=10_000, ge=1, description=(
        "... or when more rows than this (and than 10% of the live rows) wait outside the ANN index."))
    db_pool_min: int = Field(default=1, ge=0)
    db_pool_max: int = Field(default=10, ge=1)
    db_connect_timeout_s: float = Field(default=30.0, gt=0)
    db_command_timeout_s: float = Field(default=300.0, gt=0)
    duckdb_memory_mb: int | None = Field(default=None, ge=64, description=(
        "DuckDB's memory_limit for SSB queries (default: a quarter of RAM divided among the workers or engines); a "
        "query that needs more fails with a clear error instead of taking the machine."))
    db_check_interval_s: float = Field(default=1.0, gt=0, le=60, description=(
        "How often the service checks that PostgreSQL answers (at once when a request saw it gone)."))
    db_max_restarts: int = Field(default=10, ge=0, le=1000, description=(
        "Restarts in a row of a dead embedded PostgreSQL before the service stops trying (0: never restart it)."))
    readiness_timeout_s: float = Field(default=2.0, gt=0, description="How long /readyz waits for the database.")
    db_acquire_timeout_s: float = Field(default=10.0, gt=0, le=600, description=(
        "How long a request waits for a free PostgreSQL connection before a 503 with Retry-After."))
    sql_pool_max: int = Field(default=4, ge=1, le=100, description=(
        "Connections of the separate pool that runs ad-hoc SQL on PostgreSQL (POST /v1/olap/sql with engine "
        "postgres), so slow queries never hold the connections of writes and readiness."))
    admission: bool = Field(default=True, description=(
        "Admission control (README: Overload): per-engine concurrency limits and short queues, 503 past them."))
    max_inflight: int = Field(default_factory=lambda: 64 * (os.cpu_count() or 1), ge=0, le=1_000_000, description=(
        "Most /v1 requests a process serves at once (default 64 per core; the limit in force adapts below it, see "
        "SWITCHYARD_INFLIGHT_LATENCY_TOLERANCE); past it a request is answered 503 at once, before its body is read, "
        "so admitted requests keep their latency when the event loop itself is the bottleneck (0: no limit)."))
    inflight_latency_tolerance: float = Field(default=1.5, ge=0, le=1000, description=(
        "The in-flight limit adapts (README: Overload): it is cut while admitted requests take more than this many "
        "times their least recent mean latency, and raised while they do not; 0: a fixed SWITCHYARD_MAX_INFLIGHT."))
    min_inflight: int = Field(default_factory=lambda: max(2, os.cpu_count() or 1), ge=1, le=1_000_000, description=(
        "The least the adaptive in-flight limit goes down to (default: the cores, at least 2)."))
    queue_wait_ms: float = Field(default=250.0, ge=0, le=60_000, description=(
        "The most a request waits in an engine's queue before it is refused with 503 (its deadline may cut it "
        "shorter)."))
    queue_depth: int | None = Field(default=None, ge=0, le=100_000, description=(
        "Requests that may wait per engine (default: twice the engine's concurrency limit)."))
    request_timeout_s: float | None = Field(default=None, gt=0, le=3600, description=(
        "Deadline of requests that send no X-Request-Timeout header (default: none)."))
    quota_requests_per_s: float = Field(default=0.0, ge=0, description=(
        "Requests per second per API key (or client address without one) on /v1 routes; 0: no quota."))
    quota_burst: float = Field(default=0.0, ge=0, description="Burst of the request quota (default: 2 seconds' worth).")
    quota_engine_seconds_per_s: float = Field(default=0.0, ge=0, description=(
        "Engine-seconds per second per API key or client; 0: no quota."))
    quota_engine_seconds_burst: float | None = Field(default=None, gt=0, description=(
        "Burst of the engine-seconds quota (default: 10 seconds' worth)."))
    breaker_failures: int = Field(default=5, ge=1, le=1000, description=(
        "Failures in a row after which `auto` routes around a resident engine for the cool-down."))
    breaker_cooldown_s: float = Field(default=30.0, gt=0, le=3600, description=(
        "How long a failing resident engine is skipped before one request probes it again."))
    max_jobs: int = Field(default=2, ge=1, le=64, description=(
        "Jobs (bulk loads, index builds, SSB generation and import) running at once; more wait queued."))
    max_queued_jobs: int = Field(default=16, ge=0, le=10_000, description=(
        "Jobs that may wait for a slot; past them new jobs get 503 with Retry-After."))
    disk_reserve_mb: int = Field(default=1024, ge=0, description=(
        "Free disk kept in reserve on the data directory's disk: SSB generation, imports and bulk loads whose "
        "estimate would eat into it are refused with 507."))
    ssb_quota_gb: float | None = Field(default=None, gt=0, description=(
        "Most disk the SSB datasets under <data_dir>/ssb may use (default: no quota, only the reserve)."))
    ops_auth: Literal["open", "key"] = Field(default="open", description=(
        "'key': /metrics, /readyz and /healthz need the API key too (when one is set)."))
    ssb_import_dir: Path | None = Field(default=None, description=(
        "POST /v1/olap/ssb/import reads .tbl files only from inside this directory (default <data_dir>/import)."))
    gpu: Literal["auto", "off"] = Field(default="auto", description="'off' hides any CUDA device from the engines.")
    gpu_memory_pool_mb: int = Field(default=0, ge=-1, description=(
        "RMM pool set up when the GPU engines start and shared by CuPy, cuDF, cudf-polars and cuVS: its initial "
        "size in MiB (it may grow to 90% of the device); 0: half the device's memory; -1: no pool."))
    gpu_build_process: bool = Field(default=True, description=(
        "Build large cuVS indexes (4,000,000+ floats) in a child process with its own CUDA context, so a CAGRA "
        "build never holds the one GPU worker thread that every GPU search goes through (indexes/build_process.py); "
        "false: builds run on that thread."))
    ray_address: str | None = Field(default=None, description=(
        "Scale out on Ray: the cluster to join ('auto': the one this machine is part of, or ray://host:10001). "
        "Vector collections are then split into shards held by Ray actors (see README, Running on a cluster)."))
    ray_namespace: str = Field(default="switchyard", min_length=1, max_length=64, description=(
        "On Ray: the namespace of this deployment's actors; two Switchyards sharing a cluster need two."))
    shards: int = Field(default=2, ge=1, le=1024, description="On Ray: shards per vector collection, by id hash.")
    shard_replicas: int = Field(default=2, ge=1, le=64, description=(
        "On Ray: replicas of each shard; a search goes to one of them, the next one if it is down."))
    olap_partitions: int = Field(default=2, ge=0, le=1024, description=(
        "On Ray: partitions of the SSB lineorder table, each held by OLAP actors (0: SSB stays in the ingress)."))
    olap_replicas: int = Field(default=1, ge=1, le=64, description="On Ray: replicas of each SSB partition.")
    spatial_partitions: int = Field(default=2, ge=0, le=1024, description=(
        "On Ray: partitions of every point layer for point-in-polygon joins, polygon layers with each "
        "(0: spatial joins stay in the ingress)."))
    spatial_replicas: int = Field(default=1, ge=1, le=64, description="On Ray: replicas of each spatial partition.")
    shard_cpus: float = Field(default=1.0, ge=0, le=1024, description="On Ray: CPUs reserved for each shard replica.")
    shard_gpus: float = Field(default=0.0, ge=0, le=64, description=(
        "On Ray: GPUs reserved for each shard replica (1 on GPU clusters: one replica per device)."))
    shard_call_timeout_s: float = Field(default=30.0, gt=0, le=3600, description=(
        "On Ray: the longest an ingress waits for one shard replica's answer before asking another."))
    ray_ingress_replicas: int = Field(default=1, ge=1, le=1024, description=(
        "`switchyard serve --ray`: Ray Serve replicas of the HTTP ingress (the FastAPI app)."))

    @field_validator("database_url")
    @classmethod
    def _postgres_scheme(cls, url: str | None) -> str | None:
        if url is None or url.strip() == "":
            return None
        if not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql:// or postgres://")
        return url

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, key: object) -> object:
        # compose passes SWITCHYARD_API_KEY="" when the variable is unset: that means "no key", not "the empty key".
        return None if isinstance(key, str) and key.strip() == "" else key

    @model_validator(mode="after")
    def _one_layout(self) -> "Settings":
        several_engines = (self.engines or 1) > 1
        if self.uds is not None and (self.fronts or several_engines):
            raise ValueError("SWITCHYARD_UDS needs the engine process to serve HTTP itself: set SWITCHYARD_FRONTS=0")
        if several_engines and self.workers > 1:
            raise ValueError("SWITCHYARD_ENGINES and SWITCHYARD_WORKERS are two layouts: set one of them")
        if several_engines and self.fronts == 0:
            raise ValueError("several engine processes share the port through front processes: SWITCHYARD_FRONTS "
                             "must be 1 or more")
        return self

    @field_validator("data_dir", "ssb_import_dir", "replication_trace_dir", "uds")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        return path.expanduser().resolve() if path is not None else None

    @property
    def engine_processes(self) -> int:
        """How many engine processes `serve` starts: one per visible CUDA device when a GPU engine is installed (as
        vLLM runs one engine core per device), else one."""
        if self.engines is not None:
            return self.engines
        if self.workers > 1 or self.uds is not None or self.fronts == 0 or self.gpu == "off":
            return 1
        from .devices import probe_cuda
        from .engines import gpu_engine_installed

        devices = len(probe_cuda(enabled=True).devices)
        return devices if devices > 1 and gpu_engine_installed() else 1

    @property
    def front_processes(self) -> int:
        """How many front processes `serve` starts: none for full replicas (workers > 1)."""
        if self.workers > 1 or self.uds is not None:
            return 0
        if self.fronts is not None:
            return self.fronts
        cores = os.cpu_count() or 1
        return cores if cores >= 4 or self.engine_processes > 1 else 0

    @property
    def replicas(self) -> int:
        """Processes on this machine that each hold the resident data (and share its cores and memory)."""
        return max(self.workers, self.engines or 1)

    @property
    def duckdb_memory(self) -> str:
        import psutil

        mb = self.duckdb_memory_mb or max(64, psutil.virtual_memory().total // 2**20 // 4 // self.replicas)
        return f"{mb}MB"

    @property
    def engine_threads(self) -> int:
        return self.cpu_threads or max(1, (os.cpu_count() or 1) // self.replicas)

    @property
    def ssb_imports(self) -> Path:
        return self.ssb_import_dir or self.data_dir / "import"

    @property
    def embedded_pgdata(self) -> Path:
        return self.data_dir / "postgres"
