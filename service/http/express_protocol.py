"""Uvicorn's httptools protocol with express's inline answers: searches answered from the parser's callbacks.

A single-vector search the resident CPU engine can answer at once (loaded, consistent enough, a free slot, cheap
enough for the event loop) needs no ASGI cycle: express claims it from its headers (Express.claim) and, when its
body is complete, answers it (Express.answer_inline); this protocol writes the answer itself. Whatever express
declines, and every other request, becomes the ASGI cycle uvicorn would have made, body already read, so errors
and metrics are the app's own. A request whose work class has no free slot and no room to wait is refused here
too, from its headers (Express.refusal), once its small body is read: under overload most requests are refused, and
an ASGI cycle for each cost as much as an answer. Relies on HttpToolsProtocol's per-request attributes (url,
headers, cycle, pipeline, parser) and STATUS_LINE: uvicorn is pinned to the versions tests/test_express_protocol.py
checks them on. SWITCHYARD_EXPRESS_PROTOCOL=false leaves uvicorn's protocol. Why: docs/design/serving.md.

It also bounds the time a request takes to arrive, which uvicorn does not (its keep-alive timer runs only between
requests, and stops at a request's first byte): a connection's headers must be complete within
SWITCHYARD_READ_TIMEOUT_S of its opening or of the request's first byte, and a body held for an inline answer within
that long of its headers; past it the client gets a 408 problem and the connection is closed. (Bodies that go to the
app are timed by express itself: service/http/limits.py.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from service.errors import problem_response
from service.http.connections import CappedProtocol
from service.http.express import INLINE_MAX_BODY, PARSED_CALL, QUEUED, SCREENED, Claim, Express
from service.http.limits import BODY_MIN_RATE
from service.process.messages import Reply

log = logging.getLogger("switchyard")
# What this protocol reads or sets of HttpToolsProtocol's own state (checked against the installed uvicorn by
# tests/test_express_protocol.py).
UVICORN_STATE = ("url", "headers", "scope", "expect_100_continue", "cycle", "pipeline", "parser", "transport",
                 "server_state", "timeout_keep_alive_task", "timeout_keep_alive", "loop", "app", "flow")


def find_express(app: Any) -> Express | None:
    """Express inside uvicorn's wrappers of the app (proxy headers, message logger), if any."""
    for _ in range(8):
        if isinstance(app, Express):
            return app
        if isinstance(getattr(app, "express", None), Express):  # the app (service/http/app.py)
            return app.express
        app = vars(app).get("app") if hasattr(app, "__dict__") else None
        if app is None:
            return None
    return None


class ExpressProtocol(CappedProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.express = find_express(self.app)
        self.held: list[bytes] | None = None  # the body of a request express may answer inline ...
        self.claim: Claim | None = None  # ... and what express took of its headers, or ...
        self.refusing: Reply | None = None  # ... the 503 it answers once that body is read (Express.refusal)
        self.screened = False  # whether the request being read went through Express.refusal and was let through
        self.stopping = False
        self.answered = False  # whether the data being parsed completed a request answered here
        self.responded = False  # whether the inline answer to the request being completed was sent
        self.read_timeout_s = self.express.read_timeout_s if self.express is not None else None
        self.read_by: float | None = None  # when the headers or held body arriving now must be complete ...
        self.reading: asyncio.TimerHandle | None = None  # ... a timer for it, armed only while they are awaited

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_within(0.0)  # the first request's headers (uvicorn times nothing before a first response)
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._read_done()
        if self.reading is not None:
            self.reading.cancel()
            self.reading = None
        super().connection_lost(exc)

    def _read_within(self, extra_s: float) -> None:
        """The arrival deadline: SWITCHYARD_READ_TIMEOUT_S (+ extra_s) from now. No timer yet: most requests arrive
        whole in one read, and a timer armed and cancelled for each cost a refusal a fifth of its CPU."""
        if self.read_timeout_s is not None:
            self.read_by = self.loop.time() + self.read_timeout_s + extra_s

    def _read_done(self) -> None:
        self.read_by = None

    def _watch_reading(self) -> None:
        """After a read: a timer for the deadline of a request still arriving (one at a time, kept while it is)."""
        if self.read_by is not None and self.reading is None:
            self.reading = self.loop.call_at(self.read_by, self._read_timed_out)

    def _read_timed_out(self) -> None:
        """Headers, or a held body, still incomplete at their deadline: 408 and close. Not while the app is
        answering an earlier request of the connection."""
        self.reading = None
        if self.read_by is None or self.transport.is_closing():
            return  # nothing awaited now
        if self.loop.time() < self.read_by:  # a later request's deadline: watched from now on
            self._watch_reading()
            return
        if self.held is None and self.cycle is not None and not self.cycle.response_complete:
            self._read_within(0.0)  # a pipelined request's headers: looked at again once that answer is out
            self._watch_reading()
            return
        what = "body" if self.held is not None else "headers"
        problem = problem_response(408, "request-timeout", "Request timeout", (
            f"the request {what} did not arrive within {self.read_timeout_s:g} s (SWITCHYARD_READ_TIMEOUT_S)"),
            field="body" if what == "body" else None)
        defaults = self.server_state.default_headers
        head = [STATUS_LINE[408], *(name + b": " + value + b"\r\n" for name, value in defaults),
                b"content-type: application/problem+json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % len(problem.body)]
        self.transport.write(b"".join((*head, bytes(problem.body))))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.answered = False
        super().data_received(data)
        self._watch_reading()
        # The keep-alive timer, as uvicorn arms it once a response is complete: here once all of this data was
        # parsed, and only when no request is left in flight (a pipelined one may have started a cycle).
        if (self.answered and self.held is None and (self.cycle is None or self.cycle.response_complete)
                and self.timeout_keep_alive_task is None and not self.transport.is_closing()):
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def shutdown(self) -> None:
        if self.held is None:
            super().shutdown()
        else:  # a body is arriving: answer it, then close
            self.stopping = True

    def on_message_begin(self) -> None:
        # What uvicorn's on_message_begin sets but the ASGI scope, which only a request not answered inline
        # needs (a dict and a copy of the app state per request): made by _app_headers_complete. (uvicorn's own
        # __init__ sets it to None the same way.)
        self.url, self.expect_100_continue, self.headers, self.scope = b"", False, [], None  # type: ignore[assignment]
        self._read_within(0.0)  # this request's headers

    def on_headers_complete(self) -> None:
        self._read_done()
        self.screened = False
        if (self.express is not None and not self.pipeline and not self.refused
                and (self.cycle is None or self.cycle.response_complete) and not self.parser.should_upgrade()):
            method = self.parser.get_method()
            if (claim := self.express.claim(method, self.url, self.headers)) is not None:
                self.claim, self.held = claim, []  # the ASGI cycle, if one is needed, is made when the body is read
                self.screened = self.express.admission is not None  # answer_inline counts it in the loop's share
                self._read_within(INLINE_MAX_BODY / BODY_MIN_RATE)  # the held body's arrival, as express times others
                if self.expect_100_continue:  # as uvicorn's cycle does once the app reads the body
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    self.expect_100_continue = False
                return
            if not self.expect_100_continue:
                refusal, self.screened = self.express.refusal(method, self.url, self.headers)
                if refusal is not None:
                    self.refusing, self.held = refusal, []  # answered once its (small) body is read, as a claim's
                    self._read_within(INLINE_MAX_BODY / BODY_MIN_RATE)
                    return
        self._app_headers_complete()

    def _app_headers_complete(self) -> None:
        """uvicorn's on_message_begin (its scope) and on_headers_complete: the request goes to the app."""
        url, headers, expect_100_continue = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect_100_continue
        self.scope["headers"] = headers
        if self.screened:
            self.scope[SCREENED] = True  # type: ignore[literal-required]
        super().on_headers_complete()
        self.cycle.transport = OneWrite(self.cycle)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        if self.held is not None:
            self.held.append(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.held is None:
            super().on_message_complete()
            return
        raw, self.held = b"".join(self.held), None
        self._read_done()
        if self.refusing is not None:
            refusal, self.refusing = self.refusing, None
            self._refuse(refusal)
            return
        self.responded = False
        assert self.express is not None and self.claim is not None  # held: express claimed the request
        parsed = queued = None
        try:
            _, parsed, queued = self.express.answer_inline(self.claim, raw, self._respond, self._refuse)
        except Exception:  # noqa: BLE001 - unanswered, the ASGI path runs it again and answers whatever happens there
            log.exception("the inline search answer failed%s", "" if self.responded else
                          "; the request goes through the app")
        if not self.responded:
            self._app_headers_complete()  # the scope and the ASGI cycle uvicorn would have made, app started
            if parsed is not None:  # the app's task has not started yet: it finds the call, and does not parse again
                self.scope[PARSED_CALL] = parsed  # type: ignore[literal-required]
            if queued is not None:  # ... and the place in the queue taken for it
                self.scope[QUEUED] = queued  # type: ignore[literal-required]
            # uvicorn reads the body as bytes(body) only: bytes, not its bytearray, spare a copy
            self.cycle.body, self.cycle.more_body = raw, False  # type: ignore[assignment]
            self.cycle.keep_alive = self.cycle.keep_alive and not self.stopping
            self.cycle.message_event.set()

    def _respond(self, body: bytes) -> None:
        """What uvicorn's cycle writes for a 200 JSON answer, then what it does once a response is complete."""
        self._write(_head(self.server_state.default_headers), body)

    def _refuse(self, reply: Reply) -> None:
        """A refusal (a problem, with its own headers, content type included) answered here, as _respond answers a
        search."""
        self._write(_refusal_head(self.server_state.default_headers, reply), reply.body)

    def _write(self, head: bytes, body: bytes) -> None:
        keep_alive = (self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
                      and not self.stopping)
        tail = b"\r\n" if keep_alive else b"connection: close\r\n\r\n"
        self.transport.write(b"".join((head, b"%d\r\n" % len(body), tail, body)))
        if self.flow.write_paused:  # answers nothing awaits: read no more until they are (BoundedPipeline)
            self.flow.pause_reading()
        self.server_state.total_requests += 1
        self.answered = self.responded = True
        if not keep_alive:
            self.transport.close()


class OneWrite:
    """A cycle's transport that writes a whole response's head with its body: uvicorn writes the head alone at
    http.response.start, and on loopback each write wakes the client (two wakeups, two segments per answer). Only
    a head declaring its length is held, and only until the cycle's next write (its body, or a close): a chunked
    response's head, a HEAD request's (uvicorn writes no body for it), a 100 Continue and everything else go out
    at once."""

    __slots__ = ("cycle", "transport", "head")

    def __init__(self, cycle: Any) -> None:
        self.cycle: Any = cycle
        self.transport = cycle.transport
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.head is not None:
            data, self.head = self.head + data, None
        elif self.cycle is not None and self.cycle.response_started:  # the head: decided once, then the cycle is
            cycle, self.cycle = self.cycle, None  # let go (no reference loop between it and its transport)
            if cycle.chunked_encoding is False and cycle.scope["method"] != "HEAD":  # HEAD: no body write comes
                self.head = data
                return
        self.transport.write(data)

    def close(self) -> None:
        if self.head is not None:
            self.transport.write(self.head)
            self.head = None
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


_heads: tuple[object, bytes] = (None, b"")
_refusal_heads: tuple[object, dict[tuple, bytes]] = (None, {})
REFUSAL_HEADS_KEPT = 64  # distinct refusal heads kept per second (per Date)


def _head(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A 200 JSON answer's head up to its content length, with the server's default headers (date, server): made
    again only when uvicorn replaces them (each second, for the date)."""
    global _heads
    source, head = _heads
    if source is not default_headers:
        lines = [STATUS_LINE[200], *(name + b": " + value + b"\r\n" for name, value in default_headers)]
        head = b"".join(lines) + b"content-type: application/json\r\ncontent-length: "
        _heads = (default_headers, head)
    return head


def _refusal_head(default_headers: list[tuple[bytes, bytes]], reply: Reply) -> bytes:
    """A refusal's head up to its content length, kept per status and headers as _head keeps a 200's (a process
    under overload writes the same few refusals thousands of times a second)."""
    global _refusal_heads
    source, heads = _refusal_heads
    if source is not default_headers:
        heads = {}
        _refusal_heads = (default_headers, heads)
    key = (reply.status, *reply.headers)
    head = heads.get(key)
    if head is None:
        head = b"".join([
            STATUS_LINE[reply.status], *(name + b": " + value + b"\r\n" for name, value in default_headers),
            *(f"{name}: {value}\r\n".encode("latin-1") for name, value in reply.headers), b"content-length: "])
        if len(heads) < REFUSAL_HEADS_KEPT:
            heads[key] = head
    return head
