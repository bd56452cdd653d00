"""The engine process's end of the front/engine split: the hot calls front processes send it, admitted and run
through the same pipeline as this process's own HTTP requests (service/pipeline.py)."""

from __future__ import annotations

from pathlib import Path

from service.admission.pressure import LIGHT, WRITE
from service.pipeline import HOT_KINDS, Pipeline, call_scope, is_search
from service.process.link import EngineServer, frame_limit
from service.process.messages import Reply, Request, SearchCall, UnparsedCall, UpsertCall
from service.runtime import Runtime


def engine_server(runtime: Runtime, pipeline: Pipeline, path: Path) -> EngineServer:
    admission = runtime.admission  # the in-flight limit covers the fronts' hot calls too

    async def handle(request: Request) -> Reply:
        # Each request runs as its own task here: what begin() sets holds for it alone.
        call, search = request.call, is_search(request.call)
        for reason, count in request.refused.items():  # refused by the front meanwhile: counted here, where
            admission.shed("requests", reason, count)  # /metrics is read
        try:
            admission.begin(request.deadline, request.principal)
            ticket = await admission.enter(LIGHT if search else WRITE, HOT_KINDS[search])
        except Exception as exc:  # noqa: BLE001 - over quota, or no slot: answered as the app answers it
            reply = await pipeline.refuse(exc, call_scope(call, search))
        else:
            answered = False
            try:
                reply = await pipeline.serve(call, request.spent_s)
                answered = reply.status == 200
            finally:
                ticket.leave(HOT_KINDS[search] if answered else None)
        reply.id = request.id
        return reply

    # A front sends at most a request body once parsed: a frame claiming more is refused before it is read.
    return EngineServer(path, dict.fromkeys((SearchCall, UpsertCall, UnparsedCall), handle),
                        max_frame=frame_limit(runtime.settings.server.max_body_bytes))
