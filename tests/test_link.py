"""Frames over the links between processes (service/process/link.py) against peers that break the protocol: a
frame longer than the reader's limit is refused from its length, before any of it is kept, and over TCP nothing is
read as a frame before the peer proved it holds the key."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from pathlib import Path

import orjson
import pytest

from service.http.vector_requests import parse_upsert
from service.process.link import LENGTH, EngineClient, EngineGone, EngineServer, frame, frame_limit
from service.process.messages import Reply, Request, UnparsedCall

MiB = 2**20
DECLARED = 400_000_000  # what the hostile peer says its frame holds


def _echo_call(body: bytes) -> UnparsedCall:
    return UnparsedCall(True, "echo", body, "", "")


async def _server(address: Path | tuple[str, int], handled: list[bytes], **options) -> EngineServer:
    async def echo(request: Request) -> Reply:
        handled.append(request.call.body)
        return Reply(request.id, body=request.call.body)

    server = EngineServer(address, {UnparsedCall: echo}, **options)
    await server.start()
    return server


async def _open(server: EngineServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if isinstance(server.path, tuple):
        return await asyncio.open_connection(server.path[0], server.port)
    return await asyncio.open_unix_connection(str(server.path))


async def _flood(server: EngineServer, first: bytes, total: int) -> tuple[float | None, int]:
    """Send `first`, then junk up to `total` bytes in 64 KiB chunks, while reading: (seconds until the server
    closed the connection or None if it never did, peak bytes allocated meanwhile in this process)."""
    reader, writer = await _open(server)
    tracemalloc.start()
    started = time.monotonic()
    closed_after: float | None = None
    try:
        writer.write(first)
        sent, chunk = len(first), b"\0" * (64 * 1024)
        while sent < total:
            writer.write(chunk)
            sent += len(chunk)
            await writer.drain()
            await asyncio.sleep(0)
            if reader.at_eof():
                break
        try:
            while await asyncio.wait_for(reader.read(1 << 16), 2.0):
                pass  # the accepting end's handshake challenge, over TCP
            closed_after = time.monotonic() - started
        except TimeoutError:
            pass
    except (ConnectionResetError, BrokenPipeError):
        closed_after = time.monotonic() - started
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        writer.close()
    return closed_after, peak


def test_a_frame_declared_over_the_limit_is_refused_before_its_body_is_read(tmp_path):
    """Over the unix socket: a frame saying it holds 400 MB, then 16 MB of it, against a 1 MiB limit."""
    handled: list[bytes] = []

    async def run() -> None:
        server = await _server(tmp_path / "e.sock", handled, max_frame=MiB)
        client = EngineClient(tmp_path / "e.sock")
        try:
            closed_after, peak = await _flood(server, LENGTH.pack(DECLARED) + b"\x93" * 100, 16 * MiB)
            assert closed_after is not None and closed_after < 2.0, "the server kept reading the frame"
            assert peak < 4 * MiB, f"{peak / MiB:.1f} MiB allocated while refusing the frame"
            assert not server._links  # nothing of that connection is left
            # An honest client still works, up to the limit, and is refused over it.
            near = b"v" * (MiB - 4096)
            assert (await client.call(_echo_call(near))).body == near
            with pytest.raises(EngineGone):
                await asyncio.wait_for(client.call(_echo_call(b"v" * (MiB + 1))), 5)
            assert (await client.call(_echo_call(b"again"))).body == b"again"  # it reconnects
            assert handled == [near, b"again"]
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())


def test_an_unsigned_tcp_peer_gets_nothing_read_and_a_signed_one_works(tmp_path):
    """Over TCP (the shard replicas' channel): a peer without the key is closed at the handshake, whatever it
    sends (a 400 MB frame header, or nothing at all), with nothing buffered; the key's holders pass large frames."""
    handled: list[bytes] = []
    key = b"k" * 32

    async def run() -> None:
        server = await _server(("127.0.0.1", 0), handled, key=key, max_frame=64 * MiB, handshake_timeout_s=0.5)
        good = EngineClient(("127.0.0.1", server.port), key)
        wrong = EngineClient(("127.0.0.1", server.port), b"x" * 32)
        try:
            # An unsigned frame of the old protocol, as big as the limit allows and then some: refused unread.
            unsigned = frame(Request(1, _echo_call(b"u")))
            closed_after, peak = await _flood(server, LENGTH.pack(DECLARED) + unsigned, 16 * MiB)
            assert closed_after is not None and closed_after < 2.0, "the server kept reading an unsigned peer"
            assert peak < 4 * MiB, f"{peak / MiB:.1f} MiB allocated for an unsigned peer"
            # A peer that connects and says nothing holds its socket for the handshake's time, no longer.
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            started = time.monotonic()
            assert len(await reader.readexactly(32)) == 32  # the server's challenge
            assert await asyncio.wait_for(reader.read(), 3.0) == b""
            assert time.monotonic() - started < 2.0
            writer.close()
            with pytest.raises(EngineGone):
                await asyncio.wait_for(wrong.call(_echo_call(b"forged")), 5)
            big = b"b" * (20 * MiB)  # a legitimate frame well under the limit
            assert (await good.call(_echo_call(big))).body == big
            assert (await good.call(_echo_call(b"small"))).body == b"small"
            assert handled == [big, b"small"]
            assert not server._links - {link for link in server._links if link.signing is not None}
        finally:
            await good.close()
            await wrong.close()
            await server.stop()

    asyncio.run(run())


def test_the_engines_frame_limit_holds_the_largest_body_a_front_can_send():
    """A JSON upsert as large as SWITCHYARD_MAX_BODY_BYTES, written to grow the most when parsed (one-digit
    floats become 4 bytes each, `1e15` in a payload is re-encoded as `1000000000000000.0`), fits the limit the
    engine reads with; a 400 MB frame does not fit the default's."""
    limit_body = 4 * MiB
    rows, dim = 64, 4096
    vectors = [[0] * dim for _ in range(rows)]
    rest = limit_body - len(orjson.dumps({"ids": list(range(rows)), "vectors": vectors})) - 16 * rows
    payload_numbers = rest // 5 // rows
    body = orjson.dumps({"ids": list(range(rows)), "vectors": vectors,
                         "payloads": [{"a": [1e15] * payload_numbers} for _ in range(rows)]})
    body = body.replace(b"1000000000000000.0", b"1e15")
    assert len(body) <= limit_body
    call = parse_upsert("c", body)
    sent = len(frame(Request(1, call)))
    assert sent > 2 * len(body)  # the worst case does grow
    assert sent <= frame_limit(limit_body)
    assert frame_limit(64 * MiB) < DECLARED
