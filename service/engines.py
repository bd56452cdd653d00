"""The engine registry: which engines exist, whether each can run here, and whether each has its data loaded.

Engines live in the domain packages (indexes/, spatial/, olap/) and never import service/. The registry knows
each engine by a spec: its domain, kind, the modules it needs and where its implementation lives. Availability
is probed without importing anything heavy (importlib.util.find_spec, the CUDA driver), so a broken or absent
GPU library can never take the process down.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from service.process.devices import CudaProbe, configure_device_memory

log = logging.getLogger("switchyard.engines")

Domain = Literal["vectors", "spatial", "olap"]
Kind = Literal["gpu", "cpu", "postgres"]
KIND_ORDER: dict[str, int] = {"gpu": 0, "cpu": 1, "postgres": 2}  # `auto` tries engines in this order


class Engine(Protocol):
    """What an engine implementation offers the registry (structural: engines do not import this)."""

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    name: str
    domain: Domain
    kind: Kind
    summary: str
    modules: tuple[str, ...] = ()  # must be importable (checked with find_spec, never imported here)
    distribution: str | None = None  # whose version to report
    postgres_extension: str | None = None  # must be installable in the configured PostgreSQL
    implementation: str | None = None  # "package.module:Class"; None while the engine is not built yet
    planned_in: str | None = None  # where the engine is being built, said while implementation is None
    yields_to: str | None = None  # another engine of this domain and kind that serves instead where it starts


# Every engine Switchyard routes to, in the order `auto` prefers within a domain.
CATALOG: tuple[EngineSpec, ...] = (
    EngineSpec("cuvs", "vectors", "gpu", "cuVS brute force, IVF-Flat, IVF-PQ and CAGRA on device-resident indexes",
               modules=("cuvs", "cupy"), distribution="cuvs-cu12", implementation="indexes.engines:CuvsEngine"),
    EngineSpec("cupy", "vectors", "gpu", "exact search (matrix product + top-k) on device-resident vectors with CuPy",
               modules=("cupy",), distribution="cupy-cuda13x|cupy-cuda12x",
               implementation="indexes.engines:CupyExactEngine", yields_to="cuvs"),
    EngineSpec("faiss", "vectors", "cpu", "FAISS Flat, IVFFlat, IVFPQ and HNSW indexes resident in RAM",
               modules=("faiss",), distribution="faiss-cpu", implementation="indexes.engines:FaissEngine"),
    EngineSpec("pgvector", "vectors", "postgres", "pgvector HNSW, IVFFlat and exact search inside PostgreSQL",
               postgres_extension="vector", implementation="indexes.engines:PgvectorEngine"),
    EngineSpec("cuda-spatial", "spatial", "gpu", "numba-cuda kernels carrying cuSpatial's quadtree point-in-polygon",
               modules=("numba.cuda",), distribution="numba-cuda", implementation="spatial.engines:CudaSpatialHandle"),
    EngineSpec("cpu-spatial", "spatial", "cpu",
               "numba/numpy point-in-polygon and haversine joins over GeoArrow buffers",
               modules=("numba", "shapely"), distribution="numba", implementation="spatial.engines:CpuSpatialHandle"),
    EngineSpec("postgis", "spatial", "postgres",
               "PostGIS ST_Intersects (points in polygons) and ST_DWithin on geography",
               postgres_extension="postgis", implementation="spatial.engines:PostgisHandle"),
    EngineSpec("cudf", "olap", "gpu", "cuDF with the SSB tables resident in device memory",
               modules=("cudf", "polars"), distribution="cudf-cu12", implementation="olap.engines:CudfEngineHandle"),
    EngineSpec("duckdb", "olap", "cpu", "DuckDB with the SSB tables in memory",
               modules=("duckdb",), distribution="duckdb", implementation="olap.engines:DuckDBEngineHandle"),
    EngineSpec("postgres", "olap", "postgres", "PostgreSQL heap tables (schema ssb)",
               implementation="olap.engines:PostgresEngineHandle"),
)


@dataclass
class EngineStatus:
    spec: EngineSpec
    available: bool = False
    reasons: list[str] = field(default_factory=list)
    version: str | None = None
    device: str | None = None
    memory_bytes: int | None = None
    instance: Any = None
    error: str | None = None  # set when the engine failed to start: it is then unavailable

    @property
    def ready(self) -> bool:
        return bool(self.available and self.instance is not None and self.instance.ready)

    def as_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "name": s.name, "domain": s.domain, "kind": s.kind, "summary": s.summary,
            "available": self.available, "ready": self.ready,
            "reason": "; ".join(self.reasons) if self.reasons else None,
            "version": self.version, "device": self.device, "memory_bytes": self.memory_bytes,
        }


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def gpu_engine_installed(specs: tuple[EngineSpec, ...] = CATALOG) -> bool:
    """Whether any built GPU engine has its modules here: without one, a device gets no engine process of its own."""
    return any(s.kind == "gpu" and s.implementation and all(map(_module_present, s.modules)) for s in specs)


def _version(distribution: str | None) -> str | None:
    """The installed version of `distribution` (alternatives separated by "|": the first installed one)."""
    for name in (distribution or "").split("|"):
        try:
            return importlib.metadata.version(name) if name else None
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _load(implementation: str) -> Any:
    module_name, _, attr = implementation.partition(":")
    return getattr(importlib.import_module(module_name), attr)


class EngineRegistry:
    def __init__(self, cuda: CudaProbe, specs: tuple[EngineSpec, ...] = CATALOG, gpu_memory_pool_mb: int = -1) -> None:
        self.cuda = cuda
        self.gpu_memory_pool_mb = gpu_memory_pool_mb
        self.device_memory: str | None = None  # what configure_device_memory set up
        self.statuses = {spec.name: EngineStatus(spec) for spec in specs}
        self.started = False

    def probe(self, postgres_version: str | None, postgres_extensions: dict[str, str]) -> None:
        """Decide availability from modules, devices and the database's installable extensions."""
        for status in self.statuses.values():
            spec = status.spec
            reasons: list[str] = []
            if spec.implementation is None:
                reasons.append(f"not built yet ({spec.planned_in})" if spec.planned_in else "not built yet")
            if spec.kind == "gpu" and not self.cuda.present:
                reasons.append(self.cuda.reason or "no CUDA device")
            missing = [m for m in spec.modules if not _module_present(m)]
            if missing:
                hint = " (pip install 'switchyard[gpu]')" if spec.kind == "gpu" else ""
                reasons.append(f"python module {', '.join(missing)} not installed{hint}")
            if spec.postgres_extension and spec.postgres_extension not in postgres_extensions:
                reasons.append(f"extension {spec.postgres_extension} is not installable in the configured PostgreSQL")
            status.reasons = reasons
            status.available = not reasons
            status.version = _version(spec.distribution)
            if spec.kind == "postgres":
                ext = postgres_extensions.get(spec.postgres_extension or "")
                status.version = ext or postgres_version
                status.device = "postgresql"
            elif spec.kind == "gpu" and self.cuda.present:
                dev = self.cuda.devices[0]
                status.device, status.memory_bytes = f"cuda:{dev.index} {dev.name}", dev.total_memory_bytes
            elif spec.kind == "cpu":
                status.device = "cpu"

    async def start(self, **context: Any) -> None:
        """Start every available engine; one that fails is marked unavailable with its error, never fatal."""
        if self.cuda.present and any(s.available and s.spec.kind == "gpu" for s in self.statuses.values()):
            try:  # before any GPU engine allocates: one pool for the process
                self.device_memory = configure_device_memory(self.gpu_memory_pool_mb, self.cuda.devices[0])
                log.info("GPU memory: %s", self.device_memory)
            except Exception:  # noqa: BLE001 - without the pool each library allocates on its own
                log.exception("the RMM pool could not be set up")
        for status in self.statuses.values():
            if not status.available or status.spec.implementation is None:
                continue
            preferred = self.statuses.get(status.spec.yields_to or "")
            if preferred is not None and preferred.instance is not None:
                status.available = False
                status.reasons.append(f"{preferred.spec.name} serves the {status.spec.kind} {status.spec.domain} here")
                continue
            try:
                engine = _load(status.spec.implementation)(**context)
                await engine.start()
                status.instance = engine
            except Exception as exc:  # noqa: BLE001 - an engine's failure must not stop the service
                log.exception("engine %s failed to start", status.spec.name)
                status.available = False
                status.error = f"{type(exc).__name__}: {exc}"
                status.reasons.append(f"failed to start: {status.error}")
        self.started = True

    async def stop(self) -> None:
        for status in self.statuses.values():
            if status.instance is not None:
                try:
                    await status.instance.stop()
                except Exception:  # noqa: BLE001
                    log.exception("engine %s failed to stop cleanly", status.spec.name)
                status.instance = None
        self.started = False

    @property
    def ready(self) -> bool:
        """True once start-up finished and every engine that started has its data loaded."""
        return self.started and all(s.ready for s in self.statuses.values() if s.instance is not None)

    def not_ready(self) -> list[str]:
        return [s.spec.name for s in self.statuses.values() if s.instance is not None and not s.ready]

    def list(self, domain: str | None = None) -> list[EngineStatus]:
        rows = [s for s in self.statuses.values() if domain is None or s.spec.domain == domain]
        return sorted(rows, key=lambda s: (s.spec.domain, KIND_ORDER[s.spec.kind]))

