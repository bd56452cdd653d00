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


def test_a_failed_job_says_why_without_a_librarys_text(client):
    from indexes.errors import InvalidInput

    wait_ready(client)
    jobs = client.app.state.switchyard.jobs

    async def failed(exc: Exception) -> dict:
        async def work(progress):
            raise exc

        job = await jobs.start("test", None, work)
        while job.id in jobs.running:
            await asyncio.sleep(0.01)
        return await jobs.get(job.id)

    ours = client.portal.call(failed, InvalidInput("vectors have dimension 3, the collection has 4", field="vector"))
    assert ours["state"] == "failed" and ours["message"] == "vectors have dimension 3, the collection has 4"
    library = client.portal.call(failed, IndexError("index 7 is out of bounds for axis 0 with size 3 (secret)"))
    assert (library["state"] == "failed" and "secret" not in library["message"]
            and "IndexError" not in library["message"])
    assert "error id" in library["message"]
