"""The hop between processes: typed messages (service/process/messages.py) in msgpack frames over a unix socket,
from the front processes to an engine process, and over TCP from an ingress to the shard replicas of a Ray cluster
(service/cluster/fanout.py), where every frame is signed (HMAC-SHA256) and checked before it is decoded.

A `Request` carries one call and its id; the handler for the call's type answers with a `Reply` of the same id.
Answers come back as they finish, so one connection carries every request of a front at once. Why this transport
(measured against ZeroMQ): docs/design/serving.md#front-and-engine-processes.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import os
import struct
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec

from service.process.messages import Call, Failure, Message, Reply, Request, encoder, reply_decoder, request_decoder

LENGTH = struct.Struct("!I")
SIGNATURE = 32  # bytes of HMAC-SHA256 before each signed frame


class EngineGone(ConnectionError):
    """The engine process cannot be reached, or went away before answering."""


def frame(message: Message, key: bytes | None = None) -> bytes:
    body = encoder.encode(message)
    if key is not None:
        body = hmac.digest(key, body, "sha256") + body
    return LENGTH.pack(len(body)) + body


class FrameProtocol(asyncio.Protocol):
    """Cuts the byte stream into frames and hands each message to `received` (a protocol, not streams: the hop
    is on every hot request, and StreamReader's two awaits per frame cost more than this loop)."""

    def __init__(self, received: Callable[[Any], None], decoder: msgspec.msgpack.Decoder,
                 key: bytes | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.received = received
        self.decoder = decoder
        self.key = key  # over TCP, frames are signed (HMAC-SHA256) and checked before anything is decoded
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buffer)
            end = LENGTH.size + length
            if len(buffer) < end:
                return
            body = bytes(buffer[LENGTH.size:end])
            del buffer[:end]
            if self.key is not None:
                signature, body = body[:SIGNATURE], body[SIGNATURE:]
                if not hmac.compare_digest(signature, hmac.digest(self.key, body, "sha256")):
                    if self.transport is not None:
                        self.transport.close()
                    return
            try:
                message = self.decoder.decode(body)
            except msgspec.DecodeError:  # not a message of ours: this peer is not one of ours either
                if self.transport is not None:
                    self.transport.close()
                return
            self.received(message)

    def send(self, message: Message) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(message, self.key))


Handler = Callable[[Request], Awaitable[Reply]]  # answers one kind of call
Address = Path | tuple[str, int]  # a unix socket, or a TCP host and port (0: any free one)


class _EngineSide(FrameProtocol):
    def __init__(self, handlers: dict[type, Handler], tasks: set[asyncio.Task], links: set[_EngineSide],
                 key: bytes | None) -> None:
        super().__init__(self._request, request_decoder, key)
        self.handlers = handlers
        self.tasks = tasks
        self.links = links

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.links.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.links.discard(self)

    def _request(self, request: Request) -> None:
        task = asyncio.ensure_future(self._answer(request))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, request: Request) -> None:
        try:
            reply = await self.handlers[type(request.call)](request)
        except Exception as exc:  # noqa: BLE001 - a handler's own failure (handlers answer expected errors)
            reply = Reply(request.id, status=500, value=Failure.of(exc))
        self.send(reply)


class EngineServer:
    """The engine process's end: runs each request's handler as its own task and sends answers as they finish."""

    def __init__(self, path: Address, handlers: dict[type, Handler], key: bytes | None = None) -> None:
        self.path = path
        self.key = key
        self.port: int | None = None  # the TCP port listened on, once started
        self.handlers = handlers
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._links: set[_EngineSide] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        make = lambda: _EngineSide(self.handlers, self._tasks, self._links, self.key)  # noqa: E731
        if isinstance(self.path, tuple):
            self._server = await loop.create_server(make, *self.path)
            self.port = self._server.sockets[0].getsockname()[1]
            return
        self.path.unlink(missing_ok=True)
        self._server = await loop.create_unix_server(make, str(self.path))
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for link in list(self._links):  # the fronts see the engine go, and fail what they wait for
                if link.transport is not None:  # it is: a link is added once connected
                    link.transport.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._server = None
        if not isinstance(self.path, tuple):
            self.path.unlink(missing_ok=True)


class _FrontSide(FrameProtocol):
    def __init__(self, key: bytes | None = None) -> None:
        super().__init__(self._answered, reply_decoder, key)
        self.pending: dict[int, asyncio.Future] = {}
        self.lost = False

    def _answered(self, reply: Reply) -> None:
        future = self.pending.get(reply.id)
        if future is not None and not future.done():
            future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for future in self.pending.values():
            if not future.done():
                future.set_exception(EngineGone("the engine process went away before answering"))


class EngineClient:
    """A front process's end: one connection, opened on first use and again after the engine restarts."""

    def __init__(self, path: Address, key: bytes | None = None) -> None:
        self.path = path
        self.key = key
        self._link: _FrontSide | None = None
        self._ids = itertools.count()
        self._lock = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._link.pending) if self._link is not None else 0

    async def call(self, call: Call, deadline: float | None = None, principal: str = "",
                   spent_s: float = 0.0) -> Reply:
        """The engine's reply; EngineGone if it cannot be reached or goes away before answering."""
        link = self._link
        if link is None or link.lost:
            link = await self._connect()
        rid = next(self._ids)
        answer = link.pending[rid] = asyncio.get_running_loop().create_future()
        try:
            link.send(Request(rid, call, deadline, principal, spent_s))
            return await answer
        finally:
            link.pending.pop(rid, None)

    async def _connect(self) -> _FrontSide:
        async with self._lock:
            if self._link is None or self._link.lost:
                loop = asyncio.get_running_loop()
                try:
                    make = lambda: _FrontSide(self.key)  # noqa: E731
                    if isinstance(self.path, tuple):
                        _, self._link = await loop.create_connection(make, *self.path)
                    else:
                        _, self._link = await loop.create_unix_connection(make, str(self.path))
                except OSError as exc:
                    raise EngineGone(f"the engine process is not reachable ({exc.strerror or exc})") from None
            return self._link

    async def close(self) -> None:
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()
