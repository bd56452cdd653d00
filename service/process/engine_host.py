"""The engine process's end of the front/engine split: the hot calls front processes send it, admitted and run
through the same pipeline as this process's own HTTP requests (service/pipeline.py)."""

from __future__ import annotations

from pathlib import Path

from service.admission.pressure import LIGHT, WRITE
from service.errors import ProblemError
from service.pipeline import HOT_KINDS, Pipeline, call_scope, is_search, problem_reply_of
from service.process.link import EngineServer, frame_limit
from service.process.messages import Reply, Request, SearchCall, UnparsedCall, UpsertCall
from service.runtime import Runtime


def engine_server(runtime: Runtime, pipeline: Pipeline, path: Path) -> EngineServer:
    admission = runtime.admission  # the in-flight limit covers the fronts' hot calls too

    def arrived(request: Request) -> None:
        """Once per call from a front: what the front refused meanwhile, counted here, where /metrics is read; and
        the call itself, for the event loop's lag gate (a backlog of calls is a backlog of requests)."""
        admission.loop_lag.arrive()
        for reason, count in request.refused.items():
            admission.shed("requests", reason, count)

    def screen(request: Request) -> Reply | None:
        """A call whose work class has no free slot and no room to wait, refused as it arrives, without a task, as
        the HTTP protocol refuses one from its headers (Express.refusal; with quotas on, handle answers it: a 429
        comes first)."""
        search = is_search(request.call)
        try:
            # screened: not one of the loop's share (as in handle, the fronts' gates and throttles bound these)
            admission.check_room(LIGHT if search else WRITE, HOT_KINDS[search], screened=True)
        except ProblemError as exc:
            arrived(request)
            reply = problem_reply_of(exc, call_scope(request.call, search)["path"])
            reply.id = request.id
            return reply
        return None

    async def handle(request: Request) -> Reply:
        # Each request runs as its own task here: what begin() sets holds for it alone.
        call, search = request.call, is_search(request.call)
        arrived(request)
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
    quota = bool(runtime.settings.admission.quota_requests_per_s)
    return EngineServer(path, dict.fromkeys((SearchCall, UpsertCall, UnparsedCall), handle),
                        max_frame=frame_limit(runtime.settings.server.max_body_bytes), screen=None if quota else screen)
