"""Operations endpoints, outside /v1: probes and metrics, open by default, behind the API key with
SWITCHYARD_OPS_AUTH=key."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from service import __version__
from service.http.auth import bearer_scheme, require_api_key
from service.http.deps import RuntimeDep


async def ops_auth(request: Request, credentials=Depends(bearer_scheme)) -> None:  # noqa: B008 - FastAPI's idiom
    if request.app.state.switchyard.settings.server.ops_auth == "key":
        await require_api_key(request, credentials)


router = APIRouter(tags=["operations"], dependencies=[Depends(ops_auth)])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, Any]:
    return {"status": "ok", "version": __version__}


@router.get(
    "/readyz",
    summary="Readiness: database reachable, migrations applied, engines loaded",
    responses={503: {"description": "Not ready; the body says which check failed."}},
)
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    ok, checks = await runtime.readiness()
    # pid: which process answered (one of several replicas of a Ray Serve ingress, or of `--workers`)
    body = {"status": "ready" if ok else "not ready", "checks": checks, "pid": os.getpid()}
    return JSONResponse(body, status_code=200 if ok else 503, headers=None if ok else {"Retry-After": "1"})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format.", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(runtime: RuntimeDep) -> Response:
    return Response(await runtime.metrics.render(), media_type=runtime.metrics.content_type)
