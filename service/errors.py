"""Every error is application/problem+json (RFC 9457): type, title, status, detail, and for bad input the field.

Domain packages raise their own exceptions; this module is the one place that turns exceptions into HTTP.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from service.admission.deadlines import remaining
from service.database.postgres import DatabaseBusy, database_unavailable, from_database_client
from service.process.devices import is_out_of_memory
from service.settings import AdmissionSettings

log = logging.getLogger("switchyard.errors")

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:switchyard:problem:"


class ProblemError(Exception):
    """An error with its HTTP status; subclasses name the kind of problem."""

    status: int = 400
    slug: str = "bad-request"
    title: str = "Bad request"

    def __init__(
        self,
        detail: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field
        self.headers = headers or {}
        self.extra = extra


class BadRequest(ProblemError):
    pass


class Unprocessable(ProblemError):
    status, slug, title = 422, "validation-error", "Invalid request"


class Unauthorized(ProblemError):
    status, slug, title = 401, "unauthorized", "Unauthorized"


class Forbidden(ProblemError):
    status, slug, title = 403, "forbidden", "Forbidden"


class NotFound(ProblemError):
    status, slug, title = 404, "not-found", "Not found"


class Conflict(ProblemError):
    status, slug, title = 409, "conflict", "Conflict"


class PayloadTooLarge(ProblemError):
    status, slug, title = 413, "payload-too-large", "Payload too large"


class UnsupportedMediaType(ProblemError):
    status, slug, title = 415, "unsupported-media-type", "Unsupported media type"


class ServiceUnavailable(ProblemError):
    status, slug, title = 503, "unavailable", "Service unavailable"


def problem_response(
    status: int,
    slug: str,
    title: str,
    detail: str,
    *,
    instance: str | None = None,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> Response:
    return Response(problem_json(status, slug, title, detail, instance=instance, field=field, **extra),
                    status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


def problem_json(status: int, slug: str, title: str, detail: str, *, instance: str | None = None,
                 field: str | None = None, **extra: Any) -> bytes:
    """A problem's body (RFC 9457)."""
    body: dict[str, Any] = {"type": TYPE_PREFIX + slug, "title": title, "status": status, "detail": detail}
    if instance:
        body["instance"] = instance
    if field:
        body["field"] = field
    body.update(extra)
    return orjson.dumps(body)


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    # ("body", "vectors", 3) -> "vectors[3]"; the leading "body"/"query"/"path" is said in "in".
    parts = ([str(p) for p in loc[1:]] if loc and loc[0] in ("body", "query", "path", "header")
             else [str(p) for p in loc])
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or (str(loc[0]) if loc else "body")


def _validation_problem(request: Request, exc: RequestValidationError) -> Response:
    errors = []
    for err in exc.errors():
        loc = err.get("loc", ())
        errors.append({"field": _field_name(loc), "in": str(loc[0]) if loc else "body",
                       "reason": err.get("msg", "invalid")})
    first = errors[0] if errors else {"field": "body", "reason": "invalid"}
    detail = f"{first['field']}: {first['reason']}"
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more)"
    return problem_response(
        422, "validation-error", "Invalid request", detail,
        instance=request.url.path, field=first["field"], errors=errors,
    )


_HTTP_SLUGS = {
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    401: ("unauthorized", "Unauthorized"),
    413: ("payload-too-large", "Payload too large"),
}


def _domain_problem(exc: Exception) -> tuple[int, str, str, dict[str, str]]:
    """Status, slug, title and headers for the domain packages' errors (they know nothing of HTTP)."""
    from indexes import errors as vec
    from olap.manager import DatasetInUse, EngineNotReady
    from olap.results import QueryFailed
    from olap.sqlguard import SqlRejected
    from spatial.manager import SpatialEngineNotReady
    from spatial.store import LayerExists, LayerNotFound

    if isinstance(exc, DatasetInUse):
        return 409, "conflict", "Conflict", {}
    if isinstance(exc, LayerNotFound):
        return 404, "not-found", "Not found", {}
    if isinstance(exc, LayerExists):
        return 409, "conflict", "Conflict", {}
    if isinstance(exc, SpatialEngineNotReady):
        return 409, "engine-unavailable", "Engine unavailable", {}
    if isinstance(exc, vec.InvalidInput):
        return 422, "validation-error", "Invalid request", {}
    if isinstance(exc, vec.CollectionNotFound):
        return 404, "not-found", "Not found", {}
    if isinstance(exc, (vec.CollectionExists, vec.CollectionEmpty)):
        return 409, "conflict", "Conflict", {}
    if isinstance(exc, (vec.EngineUnavailable, EngineNotReady)):
        return 409, "engine-unavailable", "Engine unavailable", {}
    if isinstance(exc, (vec.NotCaughtUp, vec.ShardUnavailable, vec.CollectionBusy)):
        return 503, "unavailable", "Service unavailable", {"Retry-After": "1"}
    if isinstance(exc, SqlRejected):
        return 422, "sql-rejected", "SQL not allowed", {}
    if isinstance(exc, QueryFailed):
        return 422, "query-failed", "Query failed", {}
    if isinstance(exc, TimeoutError):
        return 422, "query-timeout", "Query took too long", {}
    if isinstance(exc, ValueError):  # parameter and import errors of the domain packages
        return 422, "validation-error", "Invalid request", {}
    return 503, "engine-failed", "Engine failed", {"Retry-After": "1"}


def _out_of_memory_problem(request: Request, exc: Exception) -> Response | None:
    """An engine out of memory (a full GPU, most often): 503 with the breaker's cool-down as Retry-After (the
    engine was marked cooling down when it failed), never a crash or a 500."""
    if not (is_out_of_memory(exc) or (exc.__cause__ is not None and is_out_of_memory(exc.__cause__))):
        return None
    error_id = _log_failure(request, exc, "engine out of memory")
    runtime = getattr(request.app.state, "switchyard", None)
    admission = runtime.settings.admission if runtime is not None else AdmissionSettings()
    cooldown = admission.breaker_cooldown_s
    return problem_response(503, "out-of-memory", "Engine out of memory",
                            f"the engine ran out of memory on this request and cools down for {cooldown:g} s; `auto` "
                            f"routes around it meanwhile (error id {error_id})", instance=request.url.path,
                            headers={"Retry-After": str(max(1, math.ceil(cooldown)))}, error_id=error_id)


def problem_of(exc: ProblemError, instance: str | None) -> Response:
    """A ProblemError as its problem response: the app's handler, and express where no handler runs."""
    return problem_response(exc.status, exc.slug, exc.title, exc.detail, instance=instance, field=exc.field,
                            headers=exc.headers, **exc.extra)


def internal_problem(method: str | None, path: str | None, exc: Exception) -> Response:
    """500 for an unexpected failure: logged with its traceback under an id the client can quote; its text is never
    sent (it can leak internals)."""
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s on %s %s", error_id, method, path, exc_info=exc)
    return problem_response(
        500, "internal-error", "Internal server error",
        f"the server failed to handle this request; quote error id {error_id} when reporting it",
        instance=path, error_id=error_id,
    )


def _log_failure(request: Request, exc: Exception, what: str = "engine failure") -> str:
    error_id = uuid.uuid4().hex[:16]
    log.error("%s %s on %s %s", what, error_id, request.method, request.url.path, exc_info=exc)
    return error_id


def _supervisor(request: Request) -> Any:
    """The runtime's database supervisor (service/database/supervisor.py), or None before it starts."""
    return getattr(getattr(request.app.state, "switchyard", None), "database", None)


async def _database_down(request: Request, exc: Exception) -> bool:
    """Whether `exc` is the database being (or having just been) unavailable rather than a bug."""
    if database_unavailable(exc):
        return True
    supervisor = _supervisor(request)
    return supervisor is not None and from_database_client(exc) and await supervisor.was_down()


def _database_problem(request: Request, exc: Exception) -> Response:
    """PostgreSQL is gone (killed, restarting, unreachable): 503 with Retry-After, never 500. The request was not
    acknowledged; a write cut off during its COMMIT may still have landed, which a retry makes harmless (writes
    are upserts and deletes by id)."""
    supervisor = _supervisor(request)
    retry_after = 2
    if supervisor is not None:
        supervisor.poke()
        retry_after = supervisor.retry_after_s()
    log.warning("database unavailable on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return problem_response(
        503, "database-unavailable", "Database unavailable",
        "PostgreSQL, the system of record, cannot be reached right now (it may be restarting); this request "
        "was not acknowledged: retry it after the time in Retry-After", instance=request.url.path,
        headers={"Retry-After": str(retry_after)})


def _past_deadline(request: Request) -> Response | None:
    """A request whose deadline (X-Request-Timeout) passed while it ran fails with 504, whatever stopped it (a
    statement_timeout, an engine's own limit, a cancelled wait)."""
    left = remaining()
    if left is None or left > 0:
        return None
    return problem_response(504, "deadline-exceeded", "Deadline exceeded", (
        "the request's deadline passed while it ran; it was stopped (a write is acknowledged only by a 2xx "
        "answer)"), instance=request.url.path, field="X-Request-Timeout")


def _disk_full_problem(request: Request, exc: Exception) -> Response | None:
    from service.jobs.disk import disk_full

    if not disk_full(exc):
        return None
    log.error("disk full on %s %s: %s", request.method, request.url.path, exc)
    return problem_response(507, "insufficient-storage", "Insufficient storage", (
        "the disk holding the data directory or PostgreSQL is full; this write was not acknowledged. Reads go "
        "on; free disk space (delete SSB datasets or collections) and retry"), instance=request.url.path)


def _allowed_methods(request: Request) -> list[str]:
    """Each method some route of this path takes (FastAPI nests included routers: ask them by matching)."""
    methods = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
    return [m for m in methods
            if any(route.matches({**request.scope, "method": m})[0] == Match.FULL
                   for route in request.app.router.routes)]


def install_error_handlers(app: FastAPI) -> None:
    from indexes.errors import VectorError
    from olap.importer import SsbImportError
    from olap.manager import DatasetInUse, EngineNotReady
    from olap.queries import QueryParamError
    from olap.results import QueryFailed
    from olap.sqlguard import SqlRejected

    async def _domain(request: Request, exc: Exception) -> Response:
        if await _database_down(request, exc):
            return _database_problem(request, exc)
        if full := _disk_full_problem(request, exc):
            return full
        status, slug, title, headers = _domain_problem(exc)
        if slug in ("engine-failed", "query-timeout", "query-failed") and (late := _past_deadline(request)):
            return late
        if slug == "engine-failed" and (oom := _out_of_memory_problem(request, exc)):
            return oom
        if slug == "engine-failed":  # the text is a library's exception: log it, give the client a stable message
            error_id = _log_failure(request, exc)
            return problem_response(status, slug, title, f"the engine failed on this request; quote error id "
                                    f"{error_id} when reporting it", instance=request.url.path,
                                    headers=headers or None, error_id=error_id)
        detail = getattr(exc, "detail", None) or str(exc)
        return problem_response(status, slug, title, detail, instance=request.url.path,
                                field=getattr(exc, "field", None), headers=headers or None)

    from spatial.geoarrow import GeometryError
    from spatial.manager import SpatialEngineNotReady
    from spatial.store import LayerExists, LayerNotFound

    for domain_error in (VectorError, EngineNotReady, DatasetInUse, SqlRejected, QueryFailed, QueryParamError,
                         SsbImportError, TimeoutError, GeometryError, SpatialEngineNotReady, LayerExists,
                         LayerNotFound):
        app.add_exception_handler(domain_error, _domain)

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> Response:
        return problem_of(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _validation_problem(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        slug, title = _HTTP_SLUGS.get(exc.status_code, ("http-error", "HTTP error"))
        detail = exc.detail if isinstance(exc.detail, str) else title
        headers = exc.headers
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # bytes that are not JSON
            return problem_response(422, "validation-error", "Invalid request", "body: not valid JSON",
                                    instance=request.url.path, field="body")
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:  # Starlette names the methods of the first route of the path only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return problem_response(exc.status_code, slug, title, detail, instance=request.url.path, headers=headers)

    @app.exception_handler(DatabaseBusy)
    async def _busy(request: Request, exc: DatabaseBusy) -> Response:
        log.warning("database busy on %s %s: %s", request.method, request.url.path, exc)
        return problem_response(503, "database-busy", "Database busy", (
            "every PostgreSQL connection stayed busy; this request was not run: retry it after the time in "
            "Retry-After"), instance=request.url.path, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        if await _database_down(request, exc):
            return _database_problem(request, exc)
        if late := _past_deadline(request):
            return late
        if full := _disk_full_problem(request, exc):
            return full
        if oom := _out_of_memory_problem(request, exc):
            return oom
        return internal_problem(request.method, request.url.path, exc)
