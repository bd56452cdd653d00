"""One rebuild of a collection at a time among the processes that share a data directory (SWITCHYARD_WORKERS,
several engine processes): the others wait, then take the snapshot it wrote (Replica.adopt) instead of building
the same index again. An flock on a file beside the snapshot, which the kernel releases when its holder exits,
killed or not."""

from __future__ import annotations

import asyncio
import fcntl
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

POLL_S = 0.05


@asynccontextmanager
async def held(path: Path) -> AsyncIterator[None]:
    """Hold the lock of `path` (created if missing), waiting on the event loop while another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock
