"""The hop between processes: typed messages (service/process/messages.py) in msgpack frames over a unix socket,
from the front processes to an engine process, and over TCP from an ingress to the shard replicas of a Ray cluster
(service/cluster/fanout.py).

Each frame is its length (4 bytes) and its body. A reader refuses a frame longer than its limit from the length
alone, before it buffers any of the body, and closes the connection: an engine takes requests up to
`frame_limit(SWITCHYARD_MAX_BODY_BYTES)`. Over TCP both ends first prove they hold the channel's key (a
challenge-response handshake, HMAC-SHA256 over fresh nonces from each end) before any frame is read, so a peer
without the key costs a socket for at most HANDSHAKE_TIMEOUT_S and the few bytes of the handshake; after it every
frame is signed with a key of this connection alone and checked before it is decoded.

A `Request` carries one call and its id; the handler for the call's type answers with a `Reply` of the same id.
Answers come back as they finish, so one connection carries every request of a front at once. Why this transport
(measured against ZeroMQ): docs/design/serving.md#front-and-engine-processes.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import struct
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec

from service.process.messages import Call, Failure, Message, Reply, Request, encoder, reply_decoder, request_decoder

log = logging.getLogger("switchyard.link")

LENGTH = struct.Struct("!I")
SIGNATURE = 32  # bytes of HMAC-SHA256 before each signed frame, and of each handshake proof
NONCE = 32  # bytes of each end's handshake challenge
MAX_FRAME = 2**32 - 1  # the most a length can say
HANDSHAKE_TIMEOUT_S = 5.0  # a TCP peer that has not proved it holds the key by then is closed


def frame_limit(max_body_bytes: int) -> int:
    """The largest request frame an engine reads: a request body of up to `max_body_bytes` once parsed (a JSON
    vector's `0,` becomes 4 bytes of float32, a payload's `1e15` is re-encoded as `1000000000000000.0`: under 4
    times the body), and room for the rest of the call."""
    return min(MAX_FRAME, 4 * max_body_bytes + 2**20)


class EngineGone(ConnectionError):
    """The engine process cannot be reached, or went away before answering."""


def frame(message: Message, key: bytes | None = None) -> bytes:
    body = encoder.encode(message)
    if key is not None:
        body = hmac.digest(key, body, "sha256") + body
    return LENGTH.pack(len(body)) + body


def _mac(key: bytes, label: bytes, nonces: bytes) -> bytes:
    return hmac.digest(key, label + nonces, "sha256")


class FrameProtocol(asyncio.Protocol):
    """Cuts the byte stream into frames and hands each message to `received` (a protocol, not streams: the hop
    is on every hot request, and StreamReader's two awaits per frame cost more than this loop).

    With a key (TCP), the handshake comes first: the accepting end sends its nonce; the connecting end answers
    with its own nonce and HMAC(key, "connect" + both nonces); the accepting end checks it and answers with
    HMAC(key, "accept" + both nonces), which the connecting end checks. Frames are then signed with
    HMAC(key, "session" + both nonces), so a frame recorded on one connection is worth nothing on another."""

    initiator = False  # the end that connected: it speaks second in the handshake

    def __init__(self, received: Callable[[Any], None], decoder: msgspec.msgpack.Decoder,
                 key: bytes | None = None, max_frame: int = MAX_FRAME,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.transport: asyncio.Transport | None = None
        self.received = received
        self.decoder = decoder
        self.key = key
        self.max_frame = max_frame
        self.handshake_timeout_s = handshake_timeout_s
        self.signing: bytes | None = None  # this connection's frame key, once the handshake is done
        self._buffer = bytearray()
        self._awaiting = 0  # handshake bytes still to come before frames (0: frames)
        self._nonces = b""
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.key is None:
            return
        self._timer = asyncio.get_running_loop().call_later(self.handshake_timeout_s, self._refuse,
                                                             "did not complete the handshake in time")
        if self.initiator:
            self._awaiting = NONCE  # the accepting end's challenge
        else:
            self._nonces = os.urandom(NONCE)
            self._awaiting = NONCE + SIGNATURE  # the connecting end's challenge and its proof
            self._write(self._nonces)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        buffer = self._buffer
        buffer += data
        if self._awaiting and not self._shake():
            return
        while len(buffer) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buffer)
            if length > self.max_frame:  # refused from its length alone: nothing of it is kept
                self._refuse(f"sent a frame of {length} bytes, over the limit of {self.max_frame}")
                return
            end = LENGTH.size + length
            if len(buffer) < end:
                return
            body = bytes(buffer[LENGTH.size:end])
            del buffer[:end]
            if self.signing is not None:
                signature, body = body[:SIGNATURE], body[SIGNATURE:]
                if not hmac.compare_digest(signature, hmac.digest(self.signing, body, "sha256")):
                    self._refuse("sent a frame with a wrong signature")
                    return
            try:
                message = self.decoder.decode(body)
            except msgspec.DecodeError:  # not a message of ours: this peer is not one of ours either
                self._refuse("sent a frame that is not a message")
                return
            self.received(message)

    def _shake(self) -> bool:
        """One step of the handshake once its bytes are in; False when there is nothing more to read now."""
        assert self.key is not None
        buffer = self._buffer
        while self._awaiting:
            if len(buffer) < self._awaiting:
                return False
            got = bytes(buffer[:self._awaiting])
            del buffer[:self._awaiting]
            if self.initiator and not self._nonces:  # the challenge: answer it with ours and the proof
                self._nonces = got + os.urandom(NONCE)
                self._write(self._nonces[NONCE:] + _mac(self.key, b"connect", self._nonces))
                self._awaiting = SIGNATURE
                continue
            if self.initiator:  # the accepting end's proof
                if not hmac.compare_digest(got, _mac(self.key, b"accept", self._nonces)):
                    self._refuse("failed the handshake (another key)")
                    return False
            else:  # the connecting end's challenge and proof
                self._nonces += got[:NONCE]
                if not hmac.compare_digest(got[NONCE:], _mac(self.key, b"connect", self._nonces)):
                    self._refuse("failed the handshake (no or another key)")
                    return False
                self._write(_mac(self.key, b"accept", self._nonces))
            self._awaiting = 0
            self.signing = _mac(self.key, b"session", self._nonces)
            if self._timer is not None:
                self._timer.cancel()
            self.handshake_done()
        return True

    def handshake_done(self) -> None:
        """Called once both ends proved they hold the key."""

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _refuse(self, why: str) -> None:
        """Close a connection whose peer broke the protocol, keeping nothing it sent."""
        if self._refused:
            return
        self._refused = True
        self._buffer = bytearray()
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        log.warning("closed a link: the peer%s %s", f" {peer}" if peer else "", why)
        if self.transport is not None:
            self.transport.close()

    def send(self, message: Message) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(message, self.signing))


Handler = Callable[[Request], Awaitable[Reply]]  # answers one kind of call
Screen = Callable[[Request], "Reply | None"]  # answers a request as it arrives, without a task; None: its handler does
Address = Path | tuple[str, int]  # a unix socket, or a TCP host and port (0: any free one)


class _EngineSide(FrameProtocol):
    def __init__(self, handlers: dict[type, Handler], tasks: set[asyncio.Task], links: set[_EngineSide],
                 key: bytes | None, max_frame: int, handshake_timeout_s: float, screen: Screen | None) -> None:
        super().__init__(self._request, request_decoder, key, max_frame, handshake_timeout_s)
        self.handlers = handlers
        self.screen = screen
        self.tasks = tasks
        self.links = links

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.links.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.links.discard(self)

    def _request(self, request: Request) -> None:
        if self.screen is not None and (reply := self.screen(request)) is not None:
            self.send(reply)
            return
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
    """The engine process's end: runs each request's handler as its own task and sends answers as they finish;
    `screen` may answer a request as it arrives instead (a refusal, which a task would cost as much again as).
    A request frame over `max_frame` bytes closes its connection (see frame_limit)."""

    def __init__(self, path: Address, handlers: dict[type, Handler], key: bytes | None = None,
                 max_frame: int = MAX_FRAME, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 screen: Screen | None = None) -> None:
        self.path = path
        self.screen = screen
        self.key = key
        self.max_frame = max_frame
        self.handshake_timeout_s = handshake_timeout_s
        self.port: int | None = None  # the TCP port listened on, once started
        self.handlers = handlers
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._links: set[_EngineSide] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        make = lambda: _EngineSide(self.handlers, self._tasks, self._links, self.key,  # noqa: E731
                                   self.max_frame, self.handshake_timeout_s, self.screen)
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
    initiator = True

    def __init__(self, key: bytes | None = None) -> None:
        super().__init__(self._answered, reply_decoder, key)  # replies: the engine's own, any size it makes
        self.pending: dict[int, asyncio.Future] = {}
        self.lost = False
        self.ready = asyncio.get_running_loop().create_future()  # the handshake is done (at once without a key)
        if key is None:
            self.ready.set_result(None)

    def handshake_done(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)

    def _answered(self, reply: Reply) -> None:
        future = self.pending.get(reply.id)
        if future is not None and not future.done():
            future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.lost = True
        gone = EngineGone("the engine process went away before answering")
        if not self.ready.done():
            self.ready.set_exception(gone)
            self.ready.exception()  # retrieved: a connect that gave up waiting must not log it
        for future in self.pending.values():
            if not future.done():
                future.set_exception(gone)


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

    async def call(self, call: Call, deadline: float | None = None, principal: str = "", spent_s: float = 0.0,
                   refused: dict[str, int] | None = None) -> Reply:
        """The engine's reply; EngineGone if it cannot be reached or goes away before answering. `refused`: the
        requests the front refused itself since its last call, by reason, for the engine's metrics."""
        link = self._link
        if link is None or link.lost:
            link = await self._connect()
        rid = next(self._ids)
        answer = link.pending[rid] = asyncio.get_running_loop().create_future()
        try:
            link.send(Request(rid, call, deadline, principal, spent_s, refused or {}))
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
                        _, link = await loop.create_connection(make, *self.path)
                    else:
                        _, link = await loop.create_unix_connection(make, str(self.path))
                except OSError as exc:
                    raise EngineGone(f"the engine process is not reachable ({exc.strerror or exc})") from None
                try:  # over TCP, no request before both ends proved they hold the key
                    await asyncio.wait_for(asyncio.shield(link.ready), HANDSHAKE_TIMEOUT_S)
                except (EngineGone, TimeoutError):
                    if link.transport is not None:
                        link.transport.close()
                    raise EngineGone("the engine process did not complete the link's handshake") from None
                self._link = link
            return self._link

    async def close(self) -> None:
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()
