"""Jobs under limits: a bounded number run, a bounded number wait, clients cancel and delete them; SSB datasets
are deleted on request; work that would fill the disk is refused before it starts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.admission.control import Shed
from tests.helpers import assert_problem, new_event, wait_job_state, wait_ready


@pytest.fixture
def limited(make_client):
    client = make_client(raise_server_exceptions=False, max_jobs=1, max_queued_jobs=1)
    wait_ready(client)
    return client


def test_jobs_past_the_running_and_queued_limits_are_refused(limited):
    runner = limited.app.state.switchyard.jobs
    release = limited.portal.call(new_event)

    async def work(progress):
        await release.wait()
        return {"ok": True}

    first = limited.portal.call(runner.start, "test", None, work)
    second = limited.portal.call(runner.start, "test", None, work)
    time.sleep(0.2)
    assert limited.get(f"/v1/jobs/{first.id}").json()["state"] == "running"
    assert limited.get(f"/v1/jobs/{second.id}").json()["state"] == "queued"  # one runs at a time
    with pytest.raises(Shed) as refused:
        limited.portal.call(runner.start, "test", None, work)
    assert refused.value.status == 503 and int(refused.value.headers["Retry-After"]) >= 1

    cancelled = limited.post(f"/v1/jobs/{second.id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    limited.portal.call(release.set)
    wait_job_state(limited, first.id, "succeeded")
    assert limited.get(f"/v1/jobs/{second.id}").json()["state"] == "cancelled"  # recorded in PostgreSQL too
    assert_problem(limited.post(f"/v1/jobs/{second.id}/cancel"), 404, "not-found", field="job_id")

    assert limited.delete(f"/v1/jobs/{first.id}").status_code == 204
    assert_problem(limited.get(f"/v1/jobs/{first.id}"), 404, "not-found")
    assert_problem(limited.delete(f"/v1/jobs/{first.id}"), 404, "not-found")


def test_cancelling_stops_work_in_a_worker_thread(limited):
    runner = limited.app.state.switchyard.jobs
    stopped = threading.Event()

    def grind(progress):
        try:
            for i in range(10_000):
                progress(i, 10_000, "grinding")
                time.sleep(0.01)
        finally:
            stopped.set()

    async def work(progress):
        await asyncio.to_thread(grind, progress)
        return {}

    job = limited.portal.call(runner.start, "test", None, work)
    time.sleep(0.2)
    assert limited.delete(f"/v1/jobs/{job.id}").status_code == 204
    assert stopped.wait(5), "the worker thread went on after the job was cancelled"


def test_ssb_datasets_are_deleted_on_request_but_not_the_active_one(make_client):
    client = make_client(raise_server_exceptions=False)
    wait_ready(client)
    for seed in (0, 1):
        job = client.post("/v1/olap/ssb/generate", json={"scale_factor": 0.01, "seed": seed}).json()["job"]
        wait_job_state(client, job, "succeeded", timeout_s=120)
    datasets = {d["path"].rsplit("/", 1)[-1]: d for d in client.get("/v1/olap/ssb/datasets").json()}
    assert set(datasets) == {"sf0.01", "sf0.01-seed1"} and datasets["sf0.01-seed1"]["active"]
    assert_problem(client.delete("/v1/olap/ssb/datasets/sf0.01-seed1"), 409, "conflict")
    assert client.delete("/v1/olap/ssb/datasets/sf0.01").status_code == 204
    assert [d["path"].rsplit("/", 1)[-1] for d in client.get("/v1/olap/ssb/datasets").json()] == ["sf0.01-seed1"]
    assert_problem(client.delete("/v1/olap/ssb/datasets/sf0.01"), 404, "not-found", field="name")
    assert client.post("/v1/olap/ssb/queries/1.1", json={"engine": "duckdb"}).status_code == 200


def test_work_that_would_fill_the_disk_is_refused_before_it_starts(make_client):
    client = make_client(raise_server_exceptions=False, disk_reserve_mb=10**12)  # more than any disk has
    wait_ready(client)
    r = client.post("/v1/olap/ssb/generate", json={"scale_factor": 0.01})
    body = assert_problem(r, 507, "insufficient-storage", field="scale_factor")
    assert "free" in body["detail"]
    quota = make_client(raise_server_exceptions=False, ssb_quota_gb=0.001)
    wait_ready(quota)
    assert_problem(quota.post("/v1/olap/ssb/generate", json={"scale_factor": 0.05}), 507, "insufficient-storage")
    assert not list((quota.app.state.switchyard.settings.data_dir / "ssb").glob("sf*"))  # nothing was written


