"""Access logging off the event loop: uvicorn's own access log is off (it formatted and wrote a line inside the
loop for every request, about a fifth of a search's cost); requests are logged here instead, through a
QueueHandler so that formatting and writing happen on a background thread. The metrics middleware logs each
request that reaches the full app; express logs hot calls that fail, and successful ones only when sampled
(service/http/express.py)."""

from __future__ import annotations

import logging
import logging.handlers
import queue

from starlette.types import Scope

log = logging.getLogger("switchyard.access")
_listener: logging.handlers.QueueListener | None = None


def start() -> None:
    """Route switchyard.access through a queue to the handlers it had (the root's when none); idempotent. Its
    level stays the configured one (SWITCHYARD_LOG_LEVEL): at warning, no access lines."""
    global _listener
    if _listener is not None:
        return
    handlers = log.handlers or logging.getLogger().handlers
    if not handlers:
        handlers = [logging.StreamHandler()]
    records: queue.SimpleQueue = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(records, *handlers, respect_handler_level=True)
    log.handlers = [logging.handlers.QueueHandler(records)]
    log.propagate = False
    _listener.start()


def stop() -> None:
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


def log_request(scope: Scope, status: int, seconds: float, sampled: bool = False) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    query = scope.get("query_string") or b""
    path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
    log.info('%s - "%s %s HTTP/%s" %d %.1fms%s', f"{client[0]}:{client[1]}" if client else "-", scope["method"], path,
             scope.get("http_version", "1.1"), status, seconds * 1000, " (sampled)" if sampled else "")
