"""GET /v1/jobs/{id}: state and progress of long work (bulk loads, builds, SSB generation)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ..deps import RuntimeDep, domain, v1_router
from ..errors import NotFound

router = v1_router(tags=["jobs"])


class JobOut(BaseModel):
    id: str
    kind: str
    subject: str | None
    state: str = Field(description="queued, running, succeeded or failed")
    done: int
    total: int | None
    message: str | None
    result: dict[str, Any] | None
    created_at: float
    updated_at: float


@router.get("/jobs/{job_id}", summary="A job's state and progress")
async def get_job(job_id: str, runtime: RuntimeDep) -> JobOut:
    job = await domain(runtime, "jobs").get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}", field="job_id")
    return JobOut(**job)
