"""What both clients share: headers, the retry policy, and turning an answer into a result or an exception."""

from __future__ import annotations

import functools
import inspect
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Concatenate, ParamSpec, TypeVar

from ._ops import Operations
from ._wire import Plan, Request, Response, body_size
from .errors import Retryable, SwitchyardError, error_of

P = ParamSpec("P")
R = TypeVar("R")
VERSION = "0.1.0"
DEFAULT_TIMEOUT_S = 300.0  # a socket's limit when the caller sets none (bulk loads can take minutes)


@dataclass(frozen=True)
class RetryPolicy:
    """Idempotent calls refused with 503 or 429 are sent again after the answer's Retry-After (else a jittered
    backoff from `base_s`), at most `max_retries` times and `budget_s` seconds of waiting in all. Nothing that is
    not idempotent is ever sent twice."""

    max_retries: int = 3
    budget_s: float = 30.0
    base_s: float = 0.05

    def wait_s(self, error: SwitchyardError, attempt: int, waited_s: float) -> float | None:
        """Seconds to wait before sending again, or None to raise `error`."""
        if not isinstance(error, Retryable) or attempt >= self.max_retries:
            return None
        wait = error.retry_after if error.retry_after is not None else self.base_s * 2 ** attempt
        wait *= random.uniform(1.0, 1.25)  # apart, so that refused clients do not all come back at once
        return wait if waited_s + wait <= self.budget_s else None


def headers_for(request: Request, api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": f"switchyard-client/{VERSION}"}
    if request.content_type is not None:
        headers["Content-Type"] = request.content_type
    if request.body is not None and not isinstance(request.body, bytes):
        headers["Content-Length"] = str(body_size(request.body))  # also rewinds it, for each attempt
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if request.timeout is not None:  # the service drops the call once this has passed (not run, or stopped)
        headers["X-Request-Timeout"] = f"{request.timeout:g}"
    return headers


def checked(request: Request, response: Response) -> Response:
    """The response, or its problem raised as a typed exception."""
    if response.status < 400 or response.status in request.accept:
        return response
    raise error_of(response.status, response.body, response.headers.get("retry-after"), request.method,
                   request.path.split("?", 1)[0])


def blocking(op: Callable[Concatenate[Operations, P], Plan[R]]) -> Callable[Concatenate[Any, P], R]:
    """A Client method running the operation's plan to its end."""

    @functools.wraps(op)
    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(op(self._ops, *args, **kwargs))  # type: ignore[no-any-return]

    return with_result_signature(method, op)


def awaitable(op: Callable[Concatenate[Operations, P], Plan[R]]) -> Callable[Concatenate[Any, P], Awaitable[R]]:
    """An AsyncClient method running the operation's plan to its end."""

    @functools.wraps(op)
    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(op(self._ops, *args, **kwargs))  # type: ignore[no-any-return]

    return with_result_signature(method, op)


def with_result_signature(method: Any, op: Any) -> Any:
    """help() and IDEs show the call's result (SearchResult), not the plan (Plan[SearchResult])."""
    signature = inspect.signature(op)
    result = str(signature.return_annotation)
    if result.startswith("Plan[") and result.endswith("]"):
        signature = signature.replace(return_annotation=result[len("Plan["):-1])
    method.__signature__ = signature
    return method
