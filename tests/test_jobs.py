"""Jobs: a progress write that reaches the database after the job finished never turns it back to running."""

from __future__ import annotations

import asyncio
import dataclasses

from helpers import wait_ready


def test_a_late_progress_write_does_not_undo_a_finished_job(client):
    wait_ready(client)
    jobs = client.app.state.switchyard.jobs

    async def scenario() -> dict:
        async def work(progress):
            progress(1, 2, "halfway")
            return {"ok": True}

        job = await jobs.start("test", None, work)
        while job.id in jobs.running:
            await asyncio.sleep(0.01)
        # A progress flush scheduled from a worker thread before the end, running only now.
        await jobs._flush(dataclasses.replace(job, state="running", message="halfway"))
        return await jobs.get(job.id)

    state = client.portal.call(scenario)
    assert state["state"] == "succeeded" and state["result"] == {"ok": True}
