"""Bulk bodies spooled to a file as they arrive, so a load of gigabytes never sits in memory.

A body is written in FLUSH_BYTES pieces by a worker thread (the event loop never waits on the disk), with the
disk's free space checked before the first byte (against the declared length) and after every piece (a chunked
body declares none), less the reserve and what admitted jobs claimed (service/jobs/disk.py). The file lives
under <data dir>/spool until the job that reads it ends; what a crashed process left there is removed at the
next start.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Callable

from starlette.requests import Request

from indexes.build_process import pid_alive
from indexes.errors import InvalidInput
from service.errors import Unprocessable
from service.jobs.disk import DiskLedger

FLUSH_BYTES = 8 * 2**20
START_BYTES = 16  # what check_start is given


def spool_dir(data_dir: Path) -> Path:
    return data_dir / "spool"


def clear(data_dir: Path) -> None:
    """Remove the files of processes that are gone (their jobs went with them); replicas sharing the data
    directory keep theirs."""
    for path in spool_dir(data_dir).glob("*.arrows"):
        owner = path.name.split("-", 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            path.unlink(missing_ok=True)


async def spool(request: Request, ledger: DiskLedger, what: str,
                check_start: Callable[[bytes], None] | None = None) -> Path:
    """Write the request's body to a new file under the spool directory and return its path. On any failure
    (a client gone mid-body, a full disk, the body limit, `check_start` refusing the body's first bytes before the
    rest is read) the file is removed."""
    directory = spool_dir(ledger.data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    declared = request.headers.get("content-length", "")
    ledger.check_room(int(declared) if declared.isdigit() else 0, what)
    path = directory / f"{os.getpid()}-{uuid.uuid4().hex}.arrows"
    file = open(path, "wb")  # noqa: SIM115 - closed below, on every path
    try:
        buffer = bytearray()
        async for piece in request.stream():
            buffer += piece
            if check_start is not None and len(buffer) >= START_BYTES:
                try:
                    check_start(bytes(buffer[:START_BYTES]))
                except InvalidInput as exc:  # the rest is not read: the connection closes, nothing drains it
                    raise Unprocessable(str(exc), field=exc.field, headers={"Connection": "close"}) from None
                check_start = None
            if len(buffer) >= FLUSH_BYTES:
                await asyncio.to_thread(file.write, buffer)
                buffer = bytearray()
                ledger.check_room(0, what)
        await asyncio.to_thread(file.write, buffer)
        file.close()
    except BaseException:
        file.close()
        path.unlink(missing_ok=True)
        raise
    return path
