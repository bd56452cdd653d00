"""GET /v1/engines: every engine, whether it can run here (and why not), and whether its data is loaded."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Query
from pydantic import BaseModel, Field

from service.http.deps import RuntimeDep, v1_router

router = v1_router(tags=["engines"])


class EngineOut(BaseModel):
    name: str
    domain: Literal["vectors", "spatial", "olap"]
    kind: Literal["gpu", "cpu", "postgres"]
    summary: str
    available: bool = Field(description="Its library, device or extension is present and it started.")
    ready: bool = Field(description="Its working set is loaded and it answers queries.")
    reason: str | None = Field(description="Why it is not available, when it is not.")
    version: str | None
    device: str | None
    memory_bytes: int | None = Field(description="Device memory, for GPU engines.")


class EnginesOut(BaseModel):
    engines: list[EngineOut]
    shards: list[dict[str, Any]] | None = Field(default=None, description=(
        "On a Ray cluster: the vector shards, each with its replicas (`host`, `pid`, `engine`, `ready`); null in "
        "one process."))
    partitions: list[dict[str, Any]] | None = Field(default=None, description=(
        "On a Ray cluster: the SSB lineorder partitions, each with its replicas (`dataset` held, `ready`); null in "
        "one process."))
    spatial_partitions: list[dict[str, Any]] | None = Field(default=None, description=(
        "On a Ray cluster: the point-layer partitions, each with its replicas (`layers` held, `ready`); null in "
        "one process."))


@router.get("/engines", summary="List engines with availability and readiness")
async def list_engines(
    runtime: RuntimeDep,
    domain: Literal["vectors", "spatial", "olap"] | None = Query(default=None, description="Only this domain."),
) -> EnginesOut:
    return EnginesOut(engines=[EngineOut(**s.as_dict()) for s in runtime.registry.list(domain)],
                      shards=await _layout(runtime.vectors, domain, "vectors"),
                      partitions=await _layout(runtime.olap, domain, "olap"),
                      spatial_partitions=await _layout(runtime.spatial, domain, "spatial"))


async def _layout(manager: Any, asked: str | None, domain: str) -> list[dict[str, Any]] | None:
    """Where a domain's parts run on a cluster; None in one process (its manager has no layout)."""
    layout = getattr(manager, "layout", None)
    return await layout() if layout is not None and asked in (None, domain) else None
