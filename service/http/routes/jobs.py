"""Jobs: state and progress of long work (bulk loads, builds, SSB generation and import); cancel and forget."""

from __future__ import annotations

from typing import Any

from fastapi import Response
from pydantic import BaseModel, Field

from service.errors import NotFound
from service.http.deps import RuntimeDep, domain, v1_router

router = v1_router(tags=["jobs"])


class JobOut(BaseModel):
    id: str
    kind: str
    subject: str | None
    state: str = Field(description="queued, running, succeeded, failed or cancelled")
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


@router.post("/jobs/{job_id}/cancel", summary="Cancel a queued or running job",
             responses={404: {"description": "No such job queued or running in this process."}})
async def cancel_job(job_id: str, runtime: RuntimeDep) -> JobOut:
    job = await domain(runtime, "jobs").cancel(job_id)
    if job is None:
        raise NotFound(f"no queued or running job {job_id!r}", field="job_id")
    return JobOut(**job)


@router.delete("/jobs/{job_id}", status_code=204, summary="Cancel a job if it still runs, and forget it",
               responses={404: {"description": "No such job."}})
async def delete_job(job_id: str, runtime: RuntimeDep) -> Response:
    if not await domain(runtime, "jobs").delete(job_id):
        raise NotFound(f"no job {job_id!r}", field="job_id")
    return Response(status_code=204)
