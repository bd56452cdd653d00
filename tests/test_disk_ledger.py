"""One accounting of disk for jobs: free space less what queued and running jobs will write, SSB datasets' every
copy (Parquet and PostgreSQL) against the quota, and a default quota on a fresh install.

The free space is simulated where it matters: shutil.disk_usage, which the service asks, answers for the data
directory as if its disk had `fake_disk["free"]` bytes free. Jobs that would write tens of GB never run: a test
job holds the one job slot, so they stay queued, and they are cancelled before the slot is given back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_problem, new_event, wait_job_state, wait_ready


@pytest.fixture
def fake_disk(monkeypatch, tmp_path):
    real = shutil.disk_usage
    state = {"free": 70 * 10**9}
    root = tmp_path.resolve()

    def usage(path):
        answer = real(path)
        if Path(path).resolve().is_relative_to(root):
            used = 30 * 10**9
            return answer._replace(total=state["free"] + used, used=used, free=state["free"])
        return answer

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return state


@pytest.fixture
def one_slot(make_client, fake_disk):
    """A service whose one job slot is held by a test job (so SSB jobs stay queued); make(**settings)."""
    held = []

    def make(**overrides):
        client = make_client(raise_server_exceptions=False, max_jobs=1, max_queued_jobs=8, **overrides)
        wait_ready(client)
        runner = client.app.state.switchyard.jobs
        release = client.portal.call(new_event)

        async def hold(progress):
            await release.wait()
            return {}

        client.portal.call(runner.start, "test", None, hold)
        held.append((client, runner, release))
        return client

    yield make
    for client, runner, release in held:  # nothing queued behind the test job may run
        for job_id in list(runner.running):
            client.post(f"/v1/jobs/{job_id}/cancel")
        client.portal.call(release.set)


def test_job_admission_counts_what_queued_jobs_will_write(one_slot):
    client = one_slot(ssb_quota_gb=1000)  # the quota is not what refuses here
    first = client.post("/v1/olap/ssb/generate", json={"scale_factor": 40})
    assert first.status_code == 202, first.text
    second = client.post("/v1/olap/ssb/generate", json={"scale_factor": 41})
    body = assert_problem(second, 507, "insufficient-storage", field="scale_factor")
    assert body["free_bytes"] == 70 * 10**9
    assert body["claimed_bytes"] >= 40 * 10**9  # SF 40, queued, with its PostgreSQL copy
    assert body["need_bytes"] >= 41 * 10**9 and body["reserve_bytes"] == 1024 * 2**20
    assert body["quota_bytes"] == 1000 * 10**9
    assert "claimed by 1 queued or running job" in body["detail"]

    # The claim goes with the job: once SF 40 is cancelled, SF 41 fits.
    assert client.post(f"/v1/jobs/{first.json()['job']}/cancel").json()["state"] == "cancelled"
    third = client.post("/v1/olap/ssb/generate", json={"scale_factor": 41})
    assert third.status_code == 202, third.text


def test_a_fresh_install_has_an_ssb_quota(one_slot):
    client = one_slot()  # no SWITCHYARD_SSB_QUOTA_GB: half of the 70 GB free at start
    body = assert_problem(client.post("/v1/olap/ssb/generate", json={"scale_factor": 60}), 507,
                          "insufficient-storage", field="scale_factor")
    assert body["quota_bytes"] == pytest.approx(35 * 10**9, rel=0.01)
    assert "SWITCHYARD_SSB_QUOTA_GB" in body["detail"]
    assert client.post("/v1/olap/ssb/generate", json={"scale_factor": 30}).status_code == 202  # within it


def test_the_ssb_quota_counts_the_postgresql_copy(make_client):
    client = make_client(raise_server_exceptions=False, ssb_quota_gb=0.015)
    wait_ready(client)
    job = client.post("/v1/olap/ssb/generate", json={"scale_factor": 0.01}).json()["job"]  # ~10 MB of 15
    wait_job_state(client, job, "succeeded", timeout_s=120)
    pool = client.app.state.switchyard.pool
    postgres = client.portal.call(pool.fetchval, "SELECT sum(pg_total_relation_size(c.oid))::bigint FROM pg_class c "
                                  "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'ssb'")
    assert postgres > 5 * 10**6  # the PostgreSQL copy outweighs the Parquet files several times over

    again = client.post("/v1/olap/ssb/generate", json={"scale_factor": 0.01, "seed": 1})
    body = assert_problem(again, 507, "insufficient-storage", field="scale_factor")
    assert body["ssb_used_bytes"] >= postgres and body["claimed_bytes"] == 0  # the finished job claims nothing
    assert "PostgreSQL" in body["detail"]


