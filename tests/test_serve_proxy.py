"""The middleware Ray Serve's HTTP proxy runs (service/cluster/serve_proxy.py), through Ray's own hook: a request
the proxy ended without an answer (its replica died after accepting it) is answered 503 problem+json with
Retry-After; everything else passes through unchanged."""

from __future__ import annotations

import asyncio

import orjson
import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.http_util import _apply_middlewares, validate_http_proxy_callback_return  # noqa: E402
from ray.serve._private.utils import call_function_from_import_path  # noqa: E402

from service.cluster.serve_proxy import PROXY_CALLBACK  # noqa: E402


def _through_proxy_hook(inner):
    """`inner` wrapped as Serve's proxy wraps its app: the middlewares our callback returns, validated and applied
    by Ray's own functions (what the proxy actor does with RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    middlewares = validate_http_proxy_callback_return(call_function_from_import_path(PROXY_CALLBACK))
    return _apply_middlewares(inner, middlewares)


def _call(app, scope_type="http"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": scope_type, "method": "PUT", "path": "/v1/collections/c/points", "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent


def _answer(sent):
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body


async def _replica_died(scope, receive, send):
    """What the proxy does on a RayActorError after the replica accepted: status 500 recorded, nothing sent."""
    return None


async def _proxy_raised(scope, receive, send):
    raise RuntimeError("the proxy's own failure before any answer")


async def _answered(scope, receive, send):
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


async def _raised_mid_answer(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise RuntimeError("the stream broke after the answer started")


@pytest.mark.parametrize("inner", [_replica_died, _proxy_raised], ids=["replica-died", "proxy-raised"])
def test_a_request_ended_without_an_answer_gets_503_problem_with_retry_after(inner):
    status, headers, body = _answer(_call(_through_proxy_hook(inner)))
    problem = orjson.loads(body)
    assert status == 503 and headers["retry-after"] == "1"
    assert headers["content-type"] == "application/problem+json"
    assert problem["type"].endswith(":replica-lost") and problem["status"] == 503
    assert problem["instance"] == "/v1/collections/c/points" and "send it again" in problem["detail"]
    assert "x-request-id" in headers  # Serve's own RequestIdMiddleware still runs inside ours


def test_an_answer_passes_through_unchanged():
    status, headers, body = _answer(_call(_through_proxy_hook(_answered)))
    assert (status, headers["content-type"], body) == (201, "application/json", b'{"ok": true}')


def test_a_failure_after_the_answer_started_is_not_answered_twice():
    with pytest.raises(RuntimeError, match="after the answer started"):
        _call(_through_proxy_hook(_raised_mid_answer))


def test_other_scopes_pass_through():
    assert _call(_through_proxy_hook(_replica_died), scope_type="lifespan") == []
