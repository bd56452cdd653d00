"""What both clients share: each request's headers, and the methods that run a call's plan to its end."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Awaitable, Callable, Concatenate, ParamSpec, TypeVar

from ._ops import Operations
from ._wire import Plan, Request, body_size

P = ParamSpec("P")
R = TypeVar("R")
VERSION = "0.1.0"
DEFAULT_TIMEOUT_S = 300.0  # a socket's limit when the caller sets none (bulk loads can take minutes)
ANSWER_GRACE_S = 1.0  # at most this (and a tenth of the timeout) past the deadline, for the service's own answer


def wait_limit(request: Request) -> float:
    """How long the client waits for an answer: the call's timeout, plus a little for the service's answer to the
    deadline it was sent (503 not run, or 504 stopped: DeadlineExceeded, which says which), past which the client
    gives up by itself (TimedOut: whether the call ran is unknown)."""
    if request.timeout is None:
        return DEFAULT_TIMEOUT_S
    return request.timeout + min(ANSWER_GRACE_S, request.timeout / 10)


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
