"""The app factory: one FastAPI app per Settings, so tests can build many."""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from service import __version__
from service.errors import install_error_handlers
from service.http import access_log, openapi
from service.http.express import Express, InThisProcess
from service.http.limits import BodySizeLimitMiddleware
from service.http.routes import engines, jobs, olap, ops, spatial, vectors
from service.metrics import HTTPMetricsMiddleware
from service.pipeline import Pipeline
from service.process.links import ProcessLinks
from service.runtime import Runtime
from service.settings import Settings

DESCRIPTION = """
Switchyard routes vector search, geometry joins and Star Schema Benchmark aggregates to the fastest engine
that can do them: GPU (cuVS, numba-cuda, cuDF) when a device is present, CPU (FAISS, numba, DuckDB), or
PostgreSQL (pgvector, PostGIS, heap tables).

Every error is `application/problem+json` (RFC 9457) with `type`, `title`, `status`, `detail` and, for bad
input, `field`. With `SWITCHYARD_API_KEY` set, every `/v1` route needs `Authorization: Bearer <key>`.

Any `/v1` request may carry `X-Request-Timeout: <seconds>` (at most 3600): a request still queued at its deadline is
dropped and answered 503 `deadline-exceeded` (not run), one still running is stopped and answered 504.
"""


class SwitchyardApp(FastAPI):
    """The FastAPI app with express (service/http/express.py) in front of everything, FastAPI's own middleware
    included: express admits every request, answers searches and JSON upserts itself and hands the rest to
    FastAPI (`serve_full`)."""

    express: Express

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.express(scope, receive, send)

    async def serve_full(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None, links: ProcessLinks | None = None) -> SwitchyardApp:
    """One app, its runtime and its request pipeline."""
    settings = settings or Settings()
    engine_socket = (links or ProcessLinks.handed_down()).engine_socket
    runtime = Runtime(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.server.access_log or settings.server.access_log_sample:
            access_log.start()
        await runtime.start()
        # What start-up made (modules, FastAPI's routes, pydantic's schemas: a few hundred thousand objects) lives
        # as long as the process: out of the collector's sight, a full collection no longer walks it, which cost
        # ~25 us of CPU per request on the hot search path (loadtests/bench_overhead.py).
        gc.collect()
        gc.freeze()
        link = None
        if engine_socket is not None:  # the engine process of `switchyard serve` with front processes
            from service.process.engine_host import engine_server

            link = engine_server(runtime, pipeline, engine_socket)
            await link.start()
        try:
            yield
        finally:
            gc.unfreeze()  # what the app held may be collected again once it stops (tests build many apps)
            if link is not None:
                await link.stop()
            await runtime.stop()
            access_log.stop()

    app = SwitchyardApp(title="Switchyard", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.switchyard = runtime
    install_error_handlers(app)
    openapi.install(app, settings)

    for module in (ops, engines, vectors, spatial, olap, jobs):
        app.include_router(module.router)

    # Added innermost first: metrics see every response, including the 413s the size limit sends.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.server.max_body_bytes,
                       max_bulk_bytes=settings.server.max_bulk_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=runtime.metrics, log_requests=settings.server.access_log)
    pipeline = runtime.pipeline = Pipeline(runtime, app.exception_handlers, app)
    # Behind fronts (engine_socket set), the HTTP socket is the fronts' alone: their client header is trusted.
    app.express = Express(app.serve_full, settings, InThisProcess(pipeline), runtime.admission, pipeline.refuse,
                          inline=settings.vectors.express_protocol, trust_forwarded=engine_socket is not None)
    return app
