"""One settings object, grouped by concern, read from SWITCHYARD_* environment variables (or given directly).

Each setting keeps its flat name (`SWITCHYARD_DB_POOL_MAX`, `Settings(db_pool_max=4)`); inside the program it is
reached through its group (`settings.database.pool_max`). docs/configuration.md is generated from these models.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from indexes.cores import usable_cores

ENV_PREFIX = "SWITCHYARD_"
# SWITCHYARD_INLINE_SEARCH_US's defaults (docs/design/vectors.md): the hop to a worker thread pays where the event
# loop has another core to go on reading on, and costs 0.3-0.6 ms of CPU a search where it has none.
INLINE_SEARCH_US = 500
INLINE_SEARCH_NO_SPARE_CORE_US = 5000


def setting(default: Any = ..., *, env: str | None = None, **kwargs: Any) -> Any:
    """A field whose environment variable is SWITCHYARD_<env> (default: the field's own name)."""
    if env is not None:
        kwargs["validation_alias"] = env
        kwargs["serialization_alias"] = env
    return Field(default, **kwargs)


# A path given relative to the working directory (or with ~), stored absolute: child processes may run elsewhere.
AbsolutePath = Annotated[Path, AfterValidator(lambda path: path.expanduser().resolve())]


class Group(BaseModel):
    """A group of settings: fields given by their flat name (alias) or their name in the group."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, extra="forbid")

    @classmethod
    def flat_names(cls) -> dict[str, str]:
        """{flat name (the variable without SWITCHYARD_, lower case): field name in this group}."""
        return {(info.serialization_alias or name): name for name, info in cls.model_fields.items()}


class ServerSettings(Group):
    """Where and how the service listens, its processes, authentication, logging and request size limits."""

    data_dir: AbsolutePath = setting(Path("data"), description=(
        "Local state: embedded database, index snapshots, SSB data."))
    host: str = setting("127.0.0.1", description="Interface to listen on.")
    port: int = setting(8000, ge=1, le=65535, description="TCP port to listen on.")
    workers: int = setting(1, ge=1, description=(
        "Full replicas: Uvicorn workers that each hold their own resident indexes, kept in step with PostgreSQL's "
        "change log, and answer searches on their own event loop; they build each index once between them (no "
        "front processes then)."))
    fronts: int | None = setting(None, ge=0, le=256, description=(
        "HTTP front processes before the engine processes (docs/process-layout.md). Default: one per core on "
        "machines with 4 or more, none (the engine process serves HTTP itself) on fewer; one per core whenever "
        "there are several engine processes."))
    engines: int | None = setting(None, ge=1, le=64, description=(
        "Engine processes behind the fronts, each holding every resident index and pinned to one CUDA device "
        "(docs/process-layout.md). Default: one per visible device when a GPU engine is installed, else one."))
    uds: AbsolutePath | None = setting(None, description=(
        "Also listen on this unix socket (besides host:port): local clients skip TCP. Not with front processes."))
    api_key: SecretStr | None = setting(None, description=(
        "If set, every /v1 route needs 'Authorization: Bearer <key>' (401 otherwise)."))
    ops_auth: Literal["open", "key"] = setting("open", description=(
        "'key': /metrics, /readyz and /healthz need the API key too (when one is set)."))
    log_level: Literal["critical", "error", "warning", "info", "debug"] = setting("info", description="Log level.")
    access_log: bool = setting(True, description=(
        "Log every request (logger switchyard.access, written by a background thread) except the hot routes."))
    access_log_sample: float = setting(0.0, ge=0.0, le=1.0, description=(
        "Share of hot-route requests (search, JSON upsert) that are access-logged too: 0 none, 1 all."))
    max_body_bytes: int = setting(64 * 1024 * 1024, ge=1024, description=(
        "Larger request bodies get 413 before they are parsed."))
    max_bulk_bytes: int = setting(4 * 1024**3, ge=1024, description=(
        "Limit for bulk loads sent as an Arrow IPC stream (spooled to <data_dir>/spool, loaded as a job)."))
    read_timeout_s: float = setting(10.0, gt=0, le=3600, description=(
        "How long a request's headers may take to arrive, and then its body (plus a second per MiB received): past "
        "it the request is answered 408 and its connection closed. The body is read before the request takes an "
        "in-flight slot, so a slow client holds a socket, nothing more."))

    max_connections: int | None = setting(None, ge=16, le=10_000_000, description=(
        "Most connections each HTTP process holds open. Default: its open-file limit (RLIMIT_NOFILE, which `serve` "
        "raises to the hard limit) less a tenth, at least 256, kept for PostgreSQL, files and its own sockets; a "
        "larger value is lowered to that. At the cap a new connection closes the connection idle longest (one "
        "that never sent a byte, or waits between requests); with none idle, its requests are answered 503 "
        "too-many-connections with Retry-After, and the connection is closed."))
    keep_alive_s: int = setting(5, ge=1, le=3600, description=(
        "How long a connection may wait idle between two requests before it is closed (uvicorn's keep-alive "
        "timeout, in every process that serves HTTP)."))

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, key: object) -> object:
        # compose passes SWITCHYARD_API_KEY="" when the variable is unset: that means "no key", not "the empty key".
        return None if isinstance(key, str) and key.strip() == "" else key


class DatabaseSettings(Group):
    """PostgreSQL: the system of record, its connection pools and how its absence is handled."""

    url: str | None = setting(None, env="database_url", description=(
        "PostgreSQL URL (postgresql://user:pass@host:port/db); the server needs pgvector 0.8, and PostGIS for the "
        "postgis engine. Unset: an embedded PostgreSQL with pgvector runs in <data_dir>/postgres, started and "
        "stopped with the service."))
    pool_min: int = setting(1, env="db_pool_min", ge=0, description="Least connections of the asyncpg pool.")
    pool_max: int = setting(10, env="db_pool_max", ge=1, description="Most connections of the asyncpg pool.")
    connect_timeout_s: float = setting(30.0, env="db_connect_timeout_s", gt=0, description=(
        "How long start-up waits for the database to accept connections."))
    command_timeout_s: float = setting(300.0, env="db_command_timeout_s", gt=0, description=(
        "Per-statement client timeout."))
    acquire_timeout_s: float = setting(10.0, env="db_acquire_timeout_s", gt=0, le=600, description=(
        "How long a request waits for a free PostgreSQL connection before a 503 database-busy with Retry-After."))
    check_interval_s: float = setting(1.0, env="db_check_interval_s", gt=0, le=60, description=(
        "How often the service checks that PostgreSQL answers (at once when a request saw it gone)."))
    max_restarts: int = setting(10, env="db_max_restarts", ge=0, le=1000, description=(
        "Restarts in a row of a dead embedded PostgreSQL before the service stops trying (0: never restart it)."))
    readiness_timeout_s: float = setting(2.0, gt=0, description="How long /readyz waits for the database.")
    sql_pool_max: int = setting(4, ge=1, le=100, description=(
        "Connections of the separate pool that runs SSB queries and ad-hoc SQL on PostgreSQL, so slow queries "
        "never hold the connections of writes and readiness."))

    @field_validator("url")
    @classmethod
    def _postgres_scheme(cls, url: str | None) -> str | None:
        if url is None or url.strip() == "":
            return None
        if not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql:// or postgres://")
        return url


class VectorSettings(Group):
    """How searches are batched and where they run in the process."""

    batch_max: int = setting(64, ge=1, le=4096, description="Most single-vector searches merged into one engine call.")
    batch_window_ms: float = setting(0.0, ge=0, le=100, description=(
        "How long an idle collection waits for more searches before searching; 0: never wait, batch only what "
        "queues while the engine is busy."))
    inline_search_us: float | None = setting(None, ge=0, le=100_000, description=(
        "A lone single-vector search on the CPU whose engine time has averaged under this runs on the event loop "
        "instead of a worker thread (the hop costs more than a small search); 0: always a thread. Default: 500 "
        "where the process has a core to spare beside its event loop, 5,000 where the workers or engine processes "
        "are at least the cores (a worker thread would only take a core from another event loop)."))
    inline_turn_us: float = setting(3000, ge=0, le=100_000, description=(
        "Engine time the event loop spends answering searches in one of its turns (by each search's learnt cost; "
        "the first always runs); more arriving together go to a worker thread as a batch, so the loop keeps "
        "reading while the engine runs."))
    max_payload_keys: int = setting(1024, ge=1, le=100_000, description=(
        "Most distinct top-level payload keys one collection may hold (each is a column of the resident payload "
        "index); a write that would add more is refused with a 422 naming `payloads`, and nothing is stored. Keys "
        "count until the collection is dropped."))
    max_payload_value_bytes: int = setting(64 * 1024, ge=64, le=1 << 30, description=(
        "Largest top-level payload value, as bytes of its JSON: each string value is held in every replica's "
        "resident payload index. A write with a larger one is refused with a 422 naming `payloads[i].<key>`, and "
        "nothing is stored (JSON upserts and Arrow bulk loads alike)."))
    max_payload_row_bytes: int = setting(1 << 20, ge=64, le=1 << 30, description=(
        "Largest payload of one point, as bytes of its JSON; a write with a larger one is refused with a 422 "
        "naming `payloads[i]`, and nothing is stored."))
    express_protocol: bool = setting(True, description=(
        "Answer plain single-vector searches from the HTTP protocol itself (express's inline answers) when the "
        "resident CPU engine can at once; false: uvicorn's own protocol, every request through the ASGI app."))


class ReplicationSettings(Group):
    """Consistency levels of searches, following PostgreSQL's change log, and background rebuilds."""

    consistency: Literal["strong", "session", "bounded", "eventually"] = setting("bounded", description=(
        "Consistency level of searches that name none (docs/consistency.md)."))
    bounded_staleness_ms: float = setting(1000.0, gt=0, le=3_600_000, description=(
        "'bounded' searches see every write committed at least this long before they arrived."))
    consistency_timeout_ms: float = setting(2000.0, gt=0, le=600_000, description=(
        "How long a search waits for its replica to reach its level before pgvector answers (auto) or 503."))
    poll_ms: float = setting(200.0, env="replication_poll_ms", ge=10, le=60_000, description=(
        "How often each process polls every collection's head: the backstop of LISTEN/NOTIFY, and what keeps "
        "'bounded' searches from waiting. Keep it well under bounded_staleness_ms."))
    trace_dir: AbsolutePath | None = setting(None, env="replication_trace_dir", description=(
        "If set, each process appends '<collection id> <seq> <applied at, epoch s>' for every commit it applies "
        "to a file here (replication-lag measurements: loadtests/bench_replication.py)."))
    rebuild_dead_fraction: float = setting(0.2, gt=0, le=10, description=(
        "A resident index is rebuilt in the background when its dead rows exceed this share of its live rows."))
    rebuild_delta_rows: int = setting(10_000, ge=1, description=(
        "... or when more rows than this (and than 10% of the live rows) wait outside the ANN index."))


class AdmissionSettings(Group):
    """Admission control: in-flight limits, engine queues, deadlines, quotas and circuit breakers."""

    enabled: bool = setting(True, env="admission", description=(
        "Admission control (docs/operations.md): per-engine concurrency limits and short queues, 503 past them."))
    max_inflight: int = setting(default_factory=lambda: 64 * usable_cores(), ge=0, le=1_000_000, description=(
        "Most light /v1 requests (reads, searches) a process serves at once (default 64 per core); writes may take "
        "half as many, heavy work (SSB, SQL, joins, recall) a quarter, job submissions an eighth, each class under "
        "its own limit that adapts below this; past a class's limit and queue a request is answered 503 at once, "
        "before its body is read (0: no limit)."))
    inflight_latency_tolerance: float = setting(1.5, ge=0, le=1000, description=(
        "The in-flight limit is cut while admitted requests take more than this many times their least recent "
        "mean latency, and raised while they do not; 0: a fixed SWITCHYARD_MAX_INFLIGHT."))
    min_inflight: int = setting(default_factory=lambda: max(2, usable_cores()), ge=1, le=1_000_000,
                                description="The least the adaptive in-flight limit of light work goes down to "
                                "(default: the cores, at least 2; the other classes' floors are the same shares of "
                                "it as their limits).")
    loop_lag_target_ms: float = setting(2.0, ge=0, le=1000, description=(
        "If set, the most readable requests may wait for the event loop, standing: once the lag has stood past it "
        "for 100 ms with requests arriving meanwhile (a burst the loop drains sooner is no overload; nor is a loop "
        "slowed by a job while a request or two waits), a growing share of new /v1 requests is refused "
        "(503) at the least cost until the loop keeps up again (in the engine and in each front process), and "
        "inline answers no longer move the in-flight limit (0: off; the lag is measured all the same, "
        "switchyard_event_loop_lag_seconds; "
        "docs/design/serving.md)."))
    queue_wait_ms: float = setting(250.0, ge=0, le=60_000, description=(
        "The most a request waits in an engine's queue, or in its work class's queue for an in-flight slot (there "
        "also at most its route's unqueued latency), before it is refused with 503 (its deadline may cut "
        "it shorter)."))
    queue_depth: int | None = setting(None, ge=0, le=100_000, description=(
        "Requests that may wait per engine (default: twice the engine's concurrency limit)."))
    request_timeout_s: float | None = setting(None, gt=0, le=3600, description=(
        "Deadline of requests that send no X-Request-Timeout header (default: none)."))
    quota_requests_per_s: float = setting(0.0, ge=0, description=(
        "Requests per second per API key (or client address without one) on /v1 routes; 0: no quota."))
    quota_burst: float = setting(0.0, ge=0, description="Burst of the request quota (0: 2 seconds' worth).")
    quota_engine_seconds_per_s: float = setting(0.0, ge=0, description=(
        "Engine-seconds per second per API key or client; 0: no quota."))
    quota_engine_seconds_burst: float | None = setting(None, gt=0, description=(
        "Burst of the engine-seconds quota (default: 10 seconds' worth)."))
    breaker_failures: int = setting(5, ge=1, le=1000, description=(
        "Failures in a row after which `auto` routes around a resident engine for the cool-down."))
    breaker_cooldown_s: float = setting(30.0, gt=0, le=3600, description=(
        "How long a failing resident engine is skipped before one request probes it again."))


class JobSettings(Group):
    """Background jobs (bulk loads, index builds, SSB generation and import) and the disk they may use."""

    max_jobs: int = setting(2, ge=1, le=64, description="Jobs running at once; more wait queued.")
    max_queued_jobs: int = setting(16, ge=0, le=10_000, description=(
        "Jobs that may wait for a slot; past them new jobs get 503 with Retry-After."))
    disk_reserve_mb: int = setting(1024, ge=0, description=(
        "Free disk kept in reserve on the data directory's disk: SSB generation, imports and bulk loads whose "
        "estimate, added to what queued and running jobs will still write, would eat into it are refused with "
        "507."))
    ssb_quota_gb: float | None = setting(None, gt=0, description=(
        "Most disk SSB datasets may use: their Parquet files under <data_dir>/ssb and the PostgreSQL copy of the "
        "active one, with what queued and running SSB jobs will write (default: half of what is free on the data "
        "directory's disk when the service starts, plus what SSB datasets use then)."))
    ssb_import_dir: AbsolutePath | None = setting(None, description=(
        "POST /v1/olap/ssb/import reads .tbl files only from inside this directory (default <data_dir>/import)."))


class CpuSettings(Group):
    """What the CPU engines (FAISS, DuckDB) may take of the machine."""

    threads: int | None = setting(None, env="cpu_threads", ge=1, le=1024, description=(
        "Threads one CPU engine call may use (FAISS's OpenMP, numpy's BLAS, DuckDB). Default: the cores less one, "
        "which is left to the event loop, divided among the workers or engine processes (at least one)."))
    huge_pages: bool = setting(True, description=(
        "Back resident FAISS indexes' vectors and graph with 2 MiB transparent huge pages (Linux, THP mode "
        "'madvise' or 'always'): fewer TLB misses per graph search; false: 4 KiB pages."))
    duckdb_memory_mb: int | None = setting(None, ge=64, description=(
        "DuckDB's memory limit for SSB queries (default: a quarter of RAM divided among the workers or engine "
        "processes); a query that needs more is a 422 instead of taking the machine."))
    gil_switch_us: int = setting(1000, env="gil_switch_us", ge=100, le=100_000, description=(
        "How long a thread waiting for Python's GIL waits before the holder must yield it (sys.setswitchinterval; "
        "Python's default is 5,000): the event loop waits at most this long for a worker thread's Python work."))


class GpuSettings(Group):
    """The GPU engines: whether they may run, their memory pool and index builds."""

    mode: Literal["auto", "off"] = setting("auto", env="gpu", description=(
        "'off' hides any CUDA device from the engines."))
    memory_pool_mb: int = setting(0, env="gpu_memory_pool_mb", ge=-1, description=(
        "RMM pool set up when the GPU engines start, shared by CuPy, cuDF, cudf-polars and cuVS: its initial size "
        "in MiB (it may grow to 90% of the device); 0: half the device's memory; -1: no pool."))
    build_process: bool = setting(True, env="gpu_build_process", description=(
        "Build large cuVS indexes (4,000,000+ floats) in a child process with its own CUDA context, so a CAGRA "
        "build never holds the GPU worker thread every GPU search goes through; false: builds run on that thread."))


class ClusterSettings(Group):
    """Scale-out on Ray (docs/cluster.md): shards, partitions and their replicas as Ray actors."""

    ray_address: str | None = setting(None, description=(
        "Scale out on Ray: the cluster to join ('auto': the one this machine is part of, host:6379 or "
        "ray://host:10001). Needs the ray extra."))
    ray_namespace: str = setting("switchyard", min_length=1, max_length=64, description=(
        "On Ray: the namespace of this deployment's actors; two Switchyards sharing a cluster need two."))
    ray_ingress_replicas: int = setting(2, ge=1, le=1024, description=(
        "`switchyard serve --ray`: Ray Serve replicas of the HTTP ingress (2 or more: one answers while Ray "
        "restarts another that died)."))
    shards: int = setting(2, ge=1, le=1024, description="On Ray: shards per vector collection, by id hash.")
    shard_replicas: int = setting(2, ge=1, le=64, description=(
        "On Ray: replicas of each shard; a search goes to one of them, the next one if it is down."))
    olap_partitions: int = setting(2, ge=0, le=1024, description=(
        "On Ray: partitions of the SSB lineorder table, each held by OLAP actors (0: SSB stays in the ingress)."))
    olap_replicas: int = setting(1, ge=1, le=64, description="On Ray: replicas of each SSB partition.")
    spatial_partitions: int = setting(2, ge=0, le=1024, description=(
        "On Ray: partitions of every point layer for point-in-polygon joins, polygon layers with each "
        "(0: spatial joins stay in the ingress)."))
    spatial_replicas: int = setting(1, ge=1, le=64, description="On Ray: replicas of each spatial partition.")
    shard_cpus: float = setting(1.0, ge=0, le=1024, description="On Ray: CPUs reserved for each actor.")
    shard_gpus: float = setting(0.0, ge=0, le=64, description=(
        "On Ray: GPUs reserved for each actor (1 on GPU clusters: one replica per device)."))
    shard_call_timeout_s: float = setting(30.0, gt=0, le=3600, description=(
        "On Ray: the longest an ingress waits for one replica's answer before the shard counts as unavailable."))


GROUPS: dict[str, type[Group]] = {
    "server": ServerSettings, "database": DatabaseSettings, "vectors": VectorSettings,
    "replication": ReplicationSettings, "admission": AdmissionSettings, "jobs": JobSettings, "cpu": CpuSettings,
    "gpu": GpuSettings, "cluster": ClusterSettings,
}
# {flat name: (group, field)}: where each SWITCHYARD_* variable lives.
FLAT: dict[str, tuple[str, str]] = {flat: (group, name) for group, model in GROUPS.items()
                                    for flat, name in model.flat_names().items()}


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """Flat names ({"db_pool_max": 4}) moved into their groups ({"database": {"pool_max": 4}}); a flat name
    overrides the same setting given inside its group. Unknown names are refused."""
    nested: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in GROUPS and isinstance(value, Group):
            nested[key] = value.model_dump()
        elif key in GROUPS and isinstance(value, dict):  # SWITCHYARD_GPU and _ADMISSION name groups too
            names = GROUPS[key].flat_names()
            section = nested[key] = {k: v for k, v in value.items() if k not in names or names[k] == k}
            section.update((names[k], v) for k, v in value.items() if k in names and names[k] != k)
        elif key in FLAT:
            flat[key] = value
        else:
            raise ValueError(f"unknown setting {key!r}")
    for key, value in flat.items():
        group, name = FLAT[key]
        nested.setdefault(group, {})[name] = value
    return nested


class FlatEnvironment(PydanticBaseSettingsSource):
    """SWITCHYARD_<NAME> variables (any case), read into their groups."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every variable at once

    def __call__(self) -> dict[str, Any]:
        found = {key[len(ENV_PREFIX):].lower(): value for key, value in os.environ.items()
                 if key.upper().startswith(ENV_PREFIX)}
        return _nest({name: value for name, value in found.items() if name in FLAT})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    server: ServerSettings = Field(default_factory=ServerSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    vectors: VectorSettings = Field(default_factory=VectorSettings)
    replication: ReplicationSettings = Field(default_factory=ReplicationSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    jobs: JobSettings = Field(default_factory=JobSettings)
    cpu: CpuSettings = Field(default_factory=CpuSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, FlatEnvironment(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, values: Any) -> Any:
        return _nest(values) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def _one_layout(self) -> Settings:
        server = self.server
        several_engines = (server.engines or 1) > 1
        if server.uds is not None and (server.fronts or several_engines):
            raise ValueError("SWITCHYARD_UDS needs the engine process to serve HTTP itself: set SWITCHYARD_FRONTS=0")
        if several_engines and server.workers > 1:
            raise ValueError("SWITCHYARD_ENGINES and SWITCHYARD_WORKERS are two layouts: set one of them")
        if several_engines and server.fronts == 0:
            raise ValueError("several engine processes share the port through front processes: SWITCHYARD_FRONTS "
                             "must be 1 or more")
        return self

    @staticmethod
    def variable(loc: tuple[int | str, ...]) -> str:
        """The environment variable behind a validation error's location (("database", "url") ->
        SWITCHYARD_DATABASE_URL)."""
        if len(loc) >= 2 and loc[0] in GROUPS:
            flat = {name: alias for alias, name in GROUPS[str(loc[0])].flat_names().items()}
            key = str(loc[1])
            return ENV_PREFIX + flat.get(key, key).upper()
        return ENV_PREFIX + "_".join(map(str, loc)).upper()

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name: what a child or an actor is handed to build the same Settings."""
        return {alias: getattr(getattr(self, group), name) for alias, (group, name) in FLAT.items()}

    @property
    def data_dir(self) -> Path:
        return self.server.data_dir

    @property
    def engine_processes(self) -> int:
        """How many engine processes `serve` starts: one per visible CUDA device when a GPU engine is installed (as
        vLLM runs one engine core per device), else one."""
        server = self.server
        if server.engines is not None:
            return server.engines
        if server.workers > 1 or server.uds is not None or server.fronts == 0 or self.gpu.mode == "off":
            return 1
        from service.engines import gpu_engine_installed
        from service.process.devices import probe_cuda

        devices = len(probe_cuda(enabled=True).devices)
        return devices if devices > 1 and gpu_engine_installed() else 1

    @property
    def front_processes(self) -> int:
        """How many front processes `serve` starts: none for full replicas (workers > 1) or a unix socket."""
        server = self.server
        if server.workers > 1 or server.uds is not None:
            return 0
        if server.fronts is not None:
            return server.fronts
        cores = usable_cores()
        return cores if cores >= 4 or self.engine_processes > 1 else 0

    @property
    def replicas(self) -> int:
        """Processes on this machine that each hold the resident data (and share its cores and memory)."""
        return max(self.server.workers, self.server.engines or 1)

    @property
    def duckdb_memory(self) -> str:
        import psutil

        mb = self.cpu.duckdb_memory_mb or max(64, psutil.virtual_memory().total // 2**20 // 4 // self.replicas)
        return f"{mb}MB"

    @property
    def inline_search_s(self) -> float:
        """SWITCHYARD_INLINE_SEARCH_US in seconds, or its default for this machine's cores and processes."""
        us = self.vectors.inline_search_us
        if us is None:
            spare_core = self.replicas < usable_cores()
            us = INLINE_SEARCH_US if spare_core else INLINE_SEARCH_NO_SPARE_CORE_US
        return us / 1e6

    @property
    def engine_threads(self) -> int:
        # One core is the event loop's: a recall using both of two cores held a lone search's p99 at 2-4x.
        return self.cpu.threads or max(1, (usable_cores() - 1) // self.replicas)

    @property
    def ssb_imports(self) -> Path:
        return self.jobs.ssb_import_dir or self.data_dir / "import"

    @property
    def embedded_pgdata(self) -> Path:
        return self.data_dir / "postgres"
