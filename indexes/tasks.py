"""Stopping background tasks that may be inside a PostgreSQL query.

asyncpg answers a cancelled query by sending PostgreSQL a cancel request and waiting, shielded, for it to be
acknowledged; when that acknowledgement never comes the task stays "cancelling" forever (MagicStack/asyncpg
#873, #1326), and so did the service's shutdown (seen in CI: a test's teardown stuck on a replica's catch-up). A
second cancel gets a stuck task out; after a few, the task is left behind and logged rather than waited for.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("switchyard.tasks")


async def stop_tasks(*tasks: asyncio.Task | asyncio.Future | None, grace_s: float = 5.0, tries: int = 3) -> None:
    """Cancel the tasks and wait for them, cancelling again those still running after each `grace_s`."""
    pending = {t for t in tasks if t is not None and not t.done()}
    for _ in range(tries):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for task in pending:
        log.error("task %r did not stop after %d cancellations; leaving it behind", task, tries)
