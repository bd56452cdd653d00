"""indexes/tasks.stop_tasks: shutdown never waits forever on a task stuck in a cancelled query (asyncpg #873)."""

from __future__ import annotations

import asyncio
import time

from indexes.tasks import stop_tasks


async def _swallows_cancels(times: int, log: list[str]) -> None:
    """Like a task inside asyncpg's shielded wait for a cancel acknowledgement: it outlives `times` cancels."""
    for _ in range(times):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            log.append("cancel")
    await asyncio.sleep(3600)


def test_a_task_that_outlives_one_cancel_is_cancelled_again():
    async def main() -> list[str]:
        log: list[str] = []
        task = asyncio.create_task(_swallows_cancels(1, log))
        quick = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)
        await stop_tasks(task, quick, None, grace_s=0.05)
        assert task.cancelled() and quick.cancelled()
        return log

    assert asyncio.run(main()) == ["cancel"]


def test_a_task_that_never_stops_is_left_behind_after_the_tries(caplog):
    async def main() -> asyncio.Task:
        task = asyncio.create_task(_swallows_cancels(10, []))
        await asyncio.sleep(0)
        started = time.monotonic()
        await stop_tasks(task, grace_s=0.05, tries=3)
        assert time.monotonic() - started < 1 and not task.done()
        task.cancel()  # let the test's loop close: the task swallows seven more cancels
        for _ in range(10):
            task.cancel()
            await asyncio.sleep(0)
        return task

    asyncio.run(main())
    assert "did not stop after 3 cancellations" in caplog.text
