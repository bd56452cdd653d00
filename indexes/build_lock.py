"""One rebuild of a collection at a time among the processes that share a data directory (SWITCHYARD_WORKERS,
several engine processes): the others wait, then take the snapshot it wrote (Replica.adopt) instead of building
the same index again. An flock on a file beside the snapshot, which the kernel releases when its holder exits,
killed or not."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

POLL_S = 0.05


class BuildLock:
    """An exclusive flock on one file, taken without blocking the event loop and released by release()."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    async def acquire(self) -> None:
        """Take the lock (its file created if missing), waiting on the event loop while another holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(POLL_S)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None
