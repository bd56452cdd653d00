"""What Ray Serve's HTTP proxy answers when the ingress replica serving a request dies under it.

Ray Serve 2.60 resends a request to another replica only if the first died before accepting it; once accepted,
the proxy maps the actor's death to status 500 and sends nothing (`http_util.get_http_response_status`,
`send_http_response_on_exception`), so uvicorn answers a bare "Internal Server Error" without Retry-After. The
proxy cannot know whether the request was acted on; neither can we, but a client can resend it (upserts and
deletes are idempotent by id; a creation resent is answered 409). So a request the proxy ended without an answer
is answered 503 problem+json with Retry-After, like every other "try again" of the service.

Installed through Serve's own hook: the proxy actor calls the function named by
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (`PROXY_CALLBACK`) at start and wraps its ASGI app in the Starlette
middlewares it returns. `serve --ray` sets the variable for the local Ray it starts; a cluster joined needs it in
the environment of its `ray start`.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("switchyard.serve_proxy")

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "service.cluster.serve_proxy:middlewares"
RETRY_AFTER_S = 1


class AnswerLostRequests:
    """ASGI middleware for Serve's proxy: a request the proxy ended without starting a response (its replica
    died, or was unreachable, after accepting it) is answered 503 `replica-lost` with Retry-After."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - the proxy failed the request: answered below, as a lost one
            if started:
                raise
            log.exception("Ray Serve's proxy failed %s %s before answering", scope.get("method"), scope.get("path"))
        if not started:
            await send_lost(scope, receive, send)


async def send_lost(scope: Scope, receive: Receive, send: Send) -> None:
    """The 503 problem+json of a request whose replica was lost."""
    from service.errors import problem_response

    headers = {"Retry-After": str(RETRY_AFTER_S)}
    # Serve's RequestIdMiddleware, inside this one, put the request's id among the request headers: answer with it
    request_id = dict(scope.get("headers") or ()).get(b"x-request-id")
    if request_id:
        headers["X-Request-ID"] = request_id.decode("latin-1")
    await problem_response(
        503, "replica-lost", "Replica lost",
        "the ingress replica serving this request stopped before answering (Ray Serve starts another); the request "
        "may or may not have taken effect: send it again (writes are idempotent by id)",
        instance=scope.get("path"), headers=headers)(scope, receive, send)


def middlewares() -> list[Any]:
    """PROXY_CALLBACK: the middlewares Serve's proxy wraps its app in."""
    from starlette.middleware import Middleware

    return [Middleware(AnswerLostRequests)]
