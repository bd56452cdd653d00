"""Switchyard's problem+json answers as typed exceptions: one class per kind of failure a caller acts on."""

from __future__ import annotations

import json
from typing import Any

PREFIX = "urn:switchyard:problem:"


class SwitchyardError(Exception):
    """Any error answer of the service. `problem` is its whole problem+json body; `retry_after` its Retry-After
    header in seconds, when it had one."""

    def __init__(self, status: int, problem: dict[str, Any], method: str = "", path: str = "",
                 retry_after: float | None = None) -> None:
        self.status = status
        self.problem = problem
        self.retry_after = retry_after
        self.type = str(problem.get("type", "")).removeprefix(PREFIX)
        self.detail = str(problem.get("detail") or problem.get("title") or "")
        self.field: str | None = problem.get("field")
        self._where = f"{method} {path}: " if method else ""
        super().__init__(self._message())

    def _message(self) -> str:
        named = f" ({self.field})" if self.field else ""
        return f"{self._where}{self.status} {self.type or 'error'}{named}: {self.detail}"

    def renamed(self, wire_to_argument: dict[str, str]) -> "SwitchyardError":
        """The error naming the caller's argument, not the wire field it travelled in (`vectors_b64[2]` ->
        `vectors[2]`); `problem` keeps the service's own words."""
        for wire, argument in wire_to_argument.items():
            if self.field is not None and (self.field == wire or self.field.startswith(wire + "[")):
                self.field = argument + self.field[len(wire):]
                self.args = (self._message(),)
                break
        return self


class InvalidRequest(SwitchyardError):
    """422 validation-error (and 400 bad-request): `field` names what is wrong, `errors` lists every problem."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list(self.problem.get("errors") or [])


class Unauthorized(SwitchyardError):
    """401: no API key, or a wrong one."""


class Forbidden(SwitchyardError):
    """403."""


class NotFound(SwitchyardError):
    """404: an unknown collection, layer, job or route."""


class Conflict(SwitchyardError):
    """409: the request conflicts with the current state (a collection that exists already, ...)."""


class EngineUnavailable(Conflict):
    """409 engine-unavailable: the engine the call named cannot serve it here (not installed, not loaded)."""


class PayloadTooLarge(SwitchyardError):
    """413: the body is over the service's limit (`limit_bytes` in the problem)."""


class QueryFailed(SwitchyardError):
    """422 sql-rejected, query-failed or query-timeout: the SQL, not the request's shape, was refused."""


class Retryable(SwitchyardError):
    """503 or 429: not run (except `engine-failed`), worth retrying after `retry_after` seconds."""


class Overloaded(Retryable):
    """503 overloaded, too-many-connections or database-busy: the service is full right now."""


class Unavailable(Retryable):
    """503 unavailable, database-unavailable, engine-cooling-down, out-of-memory, engine-failed or replica-lost: an
    engine, a replica that has not caught up (or died under the request, on Ray), or the database cannot serve
    now."""


class DeadlineExceeded(Retryable):
    """503 deadline-exceeded (not run) or 504 (stopped while running)."""


class QuotaExceeded(Retryable):
    """429: the key's request or engine-seconds quota is spent."""


class InsufficientStorage(SwitchyardError):
    """507: the work would pass the disk reserve or the SSB quota."""


class ServerError(SwitchyardError):
    """500: a bug in the service; the problem's `error_id` is also in the server log."""


class TransportError(Exception):
    """The request could not be sent, or its answer not read (connection refused or reset, timed out)."""


class TimedOut(TransportError):
    """No answer within the call's timeout (the client's own limit; the service's own answer to a passed deadline is
    DeadlineExceeded). Whether the call ran is unknown."""


_BY_TYPE: dict[str, type[SwitchyardError]] = {
    "validation-error": InvalidRequest, "bad-request": InvalidRequest, "unauthorized": Unauthorized,
    "forbidden": Forbidden, "not-found": NotFound, "method-not-allowed": NotFound, "conflict": Conflict,
    "engine-unavailable": EngineUnavailable, "payload-too-large": PayloadTooLarge, "sql-rejected": QueryFailed,
    "query-failed": QueryFailed, "query-timeout": QueryFailed, "overloaded": Overloaded,
    "too-many-connections": Overloaded, "database-busy": Overloaded, "unavailable": Unavailable,
    "database-unavailable": Unavailable, "engine-cooling-down": Unavailable, "out-of-memory": Unavailable,
    "engine-failed": Unavailable, "replica-lost": Unavailable, "deadline-exceeded": DeadlineExceeded,
    "quota-exceeded": QuotaExceeded, "insufficient-storage": InsufficientStorage, "internal-error": ServerError,
}
_BY_STATUS: dict[int, type[SwitchyardError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 413: PayloadTooLarge,
    422: InvalidRequest, 429: QuotaExceeded, 503: Unavailable, 504: DeadlineExceeded, 507: InsufficientStorage,
}


def error_of(status: int, body: bytes, retry_after: str | None, method: str, path: str) -> SwitchyardError:
    """The exception for an error answer; a body that is not problem+json (a proxy's page) keeps its text."""
    try:
        problem = json.loads(body) if body else {}
        if not isinstance(problem, dict):
            raise ValueError
    except ValueError:
        problem = {"detail": body[:500].decode("utf-8", "replace")}
    try:
        seconds = None if retry_after is None else max(0.0, float(retry_after))
    except ValueError:  # an HTTP date: not one this service sends
        seconds = None
    kind = str(problem.get("type", "")).removeprefix(PREFIX)
    cls = _BY_TYPE.get(kind) or _BY_STATUS.get(status) or (ServerError if status >= 500 else SwitchyardError)
    return cls(status, problem, method, path, seconds)
