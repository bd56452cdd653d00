"""A connection's pipelined requests, bounded: at most MAX_PIPELINED wait behind the one being answered.

uvicorn parses all it reads and resumes reading after every answer, and whenever the app waits for a body. A client
that pipelines requests without reading the answers was read as fast as it sent: 250,000 requests queued and 700 MB
held in 5 s from one connection. Past the bound, bytes read are held unparsed and reading stays paused until the
queue shrinks; reading pauses too while answers wait unread in the write buffer. The client's sends then block on
TCP's own flow control.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_PIPELINED = 64  # requests of one connection queued behind the one being answered


class HeldFlow(FlowControl):
    """uvicorn's flow control, whose reads stay paused while the protocol holds unparsed bytes (`held`)."""

    held = False

    def resume_reading(self) -> None:
        if not self.held:
            super().resume_reading()


class BoundedPipeline(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backlog: bytes | None = None  # read but not parsed while MAX_PIPELINED requests wait

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow: HeldFlow = HeldFlow(transport)  # before any cycle takes it

    def data_received(self, data: bytes) -> None:
        if self.backlog is not None or len(self.pipeline) >= MAX_PIPELINED:
            self.backlog = data if self.backlog is None else self.backlog + data
            self.flow.held = True
            self.flow.pause_reading()
            return
        super().data_received(data)

    def pause_writing(self) -> None:
        """The client reads its answers slower than it sends requests: read no more of them until it catches up
        (answers the protocol writes itself, the express protocol's, await no drain)."""
        super().pause_writing()
        self.flow.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self.pipeline and (self.cycle is None or self.cycle.response_complete):  # else the cycle resumes it
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.backlog is not None and len(self.pipeline) < MAX_PIPELINED and not self.transport.is_closing():
            data, self.backlog = self.backlog, None
            self.flow.held = False
            self.data_received(data)  # held again if the queue fills
        if self.flow.write_paused:  # uvicorn resumes reading after each answer, even one its client has not read
            self.flow.pause_reading()
