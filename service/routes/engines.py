"""GET /v1/engines: every engine, whether it can run here (and why not), and whether its data is loaded."""

from __future__ import annotations

from typing import Literal

from fastapi import Query
from pydantic import BaseModel, Field

from ..deps import RuntimeDep, v1_router

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


@router.get("/engines", summary="List engines with availability and readiness")
async def list_engines(
    runtime: RuntimeDep,
    domain: Literal["vectors", "spatial", "olap"] | None = Query(default=None, description="Only this domain."),
) -> EnginesOut:
    return EnginesOut(engines=[EngineOut(**s.as_dict()) for s in runtime.registry.list(domain)])
