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


def test_a_build_whose_collection_is_deleted_meanwhile_says_so(client, database_url):
    """Another process drops the collection just as the build reaches pgvector's index: the job fails saying the
    collection is gone, not with an internal error id."""
    import threading

    import asyncpg

    from indexes.store import CollectionStore
    from vector_data import b64, clustered

    wait_ready(client)
    assert client.post("/v1/collections", json={"name": "doomed", "dim": 8}).status_code == 201
    assert client.put("/v1/collections/doomed/points",
                      json={"ids": list(range(50)), "vectors_b64": b64(clustered(50, 8, seed=3))}).status_code == 200
    runtime = client.app.state.switchyard

    def drop_elsewhere() -> None:  # as another worker would, on its own connection; the build waits for it
        async def drop() -> None:
            pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
            try:
                await CollectionStore(pool).drop("doomed")
            finally:
                await pool.close()

        thread = threading.Thread(target=asyncio.run, args=(drop(),))
        thread.start()
        thread.join()

    async def scenario() -> dict:
        async def work(progress):
            def report(done, total, message):
                if message == "building the pgvector index":
                    drop_elsewhere()
                progress(done, total, message)

            return await runtime.vectors.build("doomed", report, fallback="wait")

        job = await runtime.jobs.start("build", "doomed", work)
        while job.id in runtime.jobs.running:
            await asyncio.sleep(0.01)
        return await runtime.jobs.get(job.id)

    state = client.portal.call(scenario)
    assert state["state"] == "failed", state
    assert "error id" not in state["message"] and "deleted" in state["message"] and "doomed" in state["message"]


def test_a_finished_job_says_done_not_its_last_step(client):
    """A succeeded job's counters and message are its end, not the last progress report ("copying ... into
    PostgreSQL", 0 of 314,299); a failed one keeps how far it got."""
    wait_ready(client)
    jobs = client.app.state.switchyard.jobs

    async def run(fail: bool) -> str:
        async def work(progress):
            progress(3, 10, "copying lineorder into PostgreSQL")
            if fail:
                raise RuntimeError("boom")
            return {"ok": True}

        job = await jobs.start("test", None, work)
        while job.id in jobs.running:
            await asyncio.sleep(0.01)
        return job.id

    done = client.get(f"/v1/jobs/{client.portal.call(run, False)}").json()  # read back from the table
    assert (done["state"], done["done"], done["total"], done["message"]) == ("succeeded", 10, 10, "done"), done
    failed = client.get(f"/v1/jobs/{client.portal.call(run, True)}").json()
    assert (failed["state"], failed["done"], failed["total"]) == ("failed", 3, 10), failed


def test_a_job_answers_to_its_id_in_either_case_and_to_no_other_spelling(client):
    """An upper-case id named a running job's row in the table (stale) and could not cancel it; braces, URNs and
    hex without hyphens name no job."""
    import uuid

    wait_ready(client)
    jobs = client.app.state.switchyard.jobs

    async def start() -> str:
        async def work(progress):
            while True:
                progress(0, None, "waiting")
                await asyncio.sleep(0.01)

        job = await jobs.start("test", None, work)
        while job.state != "running":
            await asyncio.sleep(0.01)
        return job.id

    job_id = client.portal.call(start)
    upper = job_id.upper()
    for other in (f"{{{job_id}}}", f"urn:uuid:{job_id}", uuid.UUID(job_id).hex):
        assert client.get(f"/v1/jobs/{other}").status_code == 404, other
        assert client.post(f"/v1/jobs/{other}/cancel").status_code == 404, other
    assert client.get(f"/v1/jobs/{upper}").json()["state"] == "running"
    cancelled = client.post(f"/v1/jobs/{upper}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text
    assert client.get(f"/v1/jobs/{job_id}").json()["id"] == job_id
    assert client.delete(f"/v1/jobs/{upper}").status_code == 204
    assert client.get(f"/v1/jobs/{job_id}").status_code == 404
