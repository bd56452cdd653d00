"""The engine process's end of the front/engine split: the hot operations a front process sends it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from service.admission.control import PRINCIPAL, Shed
from service.admission.deadlines import set_deadline
from service.http.express import HOT_KINDS, observe_hot
from service.http.routes.vectors import answer_search, answer_upsert
from service.process.link import EngineServer, Handler
from service.runtime import Runtime


def engine_server(runtime: Runtime, path: Path) -> EngineServer:
    quota = bool(runtime.settings.admission.quota_requests_per_s)
    pressure = runtime.admission.pressure  # the in-flight limit covers the fronts' hot requests too

    def counted(answer: Callable[[Any, str, Any], Awaitable[bytes]], search: bool) -> Handler:
        """Answer a parsed request, counted in the metrics with the time the front spent on it."""
        async def handle(name: str, parsed: Any, front_s: float, deadline: float | None, principal: str) -> bytes:
            # Each request runs as its own task here: these hold for it alone. Deadlines are time.monotonic(),
            # one clock for every process of the machine.
            set_deadline(deadline)
            PRINCIPAL.set(principal)
            if quota:
                runtime.admission.check_request(principal)
            if pressure is not None and not await pressure.enter(True):
                # No slot: the front replays the request through this process's full app, which answers 503
                # (or serves it, if a slot came free meanwhile).
                raise Shed("no slot under the in-flight limit", 1.0, reason="inflight")
            start = time.perf_counter()
            answered = False
            try:
                body = await answer(runtime, name, parsed)
                answered = True
            finally:
                if pressure is not None:
                    pressure.leave(True, HOT_KINDS[search] if answered else None, time.perf_counter() - start)
            observe_hot(runtime.metrics, search, front_s + time.perf_counter() - start)
            return body

        return handle

    return EngineServer(path, {"search": counted(answer_search, True), "upsert": counted(answer_upsert, False)})
