"""The current request's deadline, set by the outermost layer (service/http/express.py) and read wherever the request
waits or works: engine queues (service/admission/control.py) and PostgreSQL statements (service/database/postgres.py).

A deadline belongs to the task that serves the request. Tasks started from it inherit its context variables, but
many of those outlive the request or serve others too (a group commit's drain, a job, a background rebuild), so
only the owning task sees the deadline.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar

_DEADLINE: ContextVar[tuple[float, object] | None] = ContextVar("switchyard_deadline", default=None)


def set_deadline(at: float | None) -> None:
    """Give the current task a deadline (time.monotonic() based, one clock for every process of the machine)."""
    _DEADLINE.set(None if at is None else (at, asyncio.current_task()))


def deadline() -> float | None:
    held = _DEADLINE.get()
    if held is None or held[1] is not asyncio.current_task():
        return None
    return held[0]


def remaining() -> float | None:
    """Seconds left before the current request's deadline (None: it has none; may be negative)."""
    at = deadline()
    return None if at is None else at - time.monotonic()
