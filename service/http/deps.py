"""Typed dependency aliases for route handlers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from service.errors import ServiceUnavailable
from service.http.auth import require_api_key
from service.runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    # async: FastAPI would run a plain `def` dependency in a worker thread, a costly hop per request.
    return request.app.state.switchyard


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def domain(runtime: Runtime, name: str) -> Any:
    """The runtime's manager for a domain ("vectors", "olap", "spatial"); 503 while it starts or stops."""
    manager = getattr(runtime, name)
    if manager is None:
        raise ServiceUnavailable("the service is starting or stopping", headers={"Retry-After": "1"})
    return manager


def v1_router(**kwargs) -> APIRouter:
    """A router for /v1 routes, behind the API key when one is set.

    The prefix sits on the router (not on include_router) so each route's own path is its full template,
    which the metrics label requests with.
    """
    return APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], **kwargs)
