"""PostgreSQL killed under traffic: the service restarts its embedded server and is ready again by itself, answers
503 database-unavailable with Retry-After meanwhile (never 500), and loses no acknowledged write."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from loadtests.processes import local_service

DIM = 8


def vector_of(i: int) -> list[float]:
    return np.random.default_rng(i).standard_normal(DIM).astype(np.float32).tolist()


def postmaster_pid(pgdata) -> int:
    return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


@pytest.mark.timeout(240)
def test_killed_postgres_comes_back_and_no_acknowledged_write_is_lost(tmp_path):
    data = tmp_path / "data"
    with local_service(1, data, tmp_path / "serve.log") as url:
        client = httpx.Client(base_url=url, timeout=30)
        assert client.post("/v1/collections", json={"name": "faults", "dim": DIM}).status_code == 201
        stop = threading.Event()
        acked: list[int] = []
        answers: list[tuple[str, int, dict]] = []
        lock = threading.Lock()

        def writer(first: int) -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                i = first
                while not stop.is_set():
                    r = c.put("/v1/collections/faults/points", json={"ids": [i], "vectors": [vector_of(i)]})
                    with lock:
                        answers.append(("upsert", r.status_code, {**r.headers, "body": r.text[:300]}))
                        if r.status_code == 200:
                            acked.append(i)
                    i += 2

        def searcher() -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                while not stop.is_set():
                    r = c.post("/v1/collections/faults/search", json={"vector": vector_of(0), "k": 3})
                    with lock:
                        answers.append(("search", r.status_code, {**r.headers, "body": r.text[:300]}))

        threads = [threading.Thread(target=writer, args=(n,)) for n in (0, 1)] + [threading.Thread(target=searcher)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.5)
            before = len(acked)
            assert before > 0
            os.kill(postmaster_pid(data / "postgres"), signal.SIGKILL)
            killed = time.monotonic()
            time.sleep(0.3)
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() - killed < 30, "not ready again within 30 s of the kill"
                time.sleep(0.2)
            ready_after = time.monotonic() - killed
            acked_when_ready = len(acked)
            deadline = time.monotonic() + 20
            while len(acked) < acked_when_ready + 20:  # writes go on after the restart
                assert time.monotonic() < deadline, "no writes acknowledged after the restart"
                time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        print(f"ready again {ready_after:.1f} s after the kill; {len(acked)} writes acknowledged")

        log_tail = (tmp_path / "serve.log").read_text()[-3000:]
        statuses = {status for _, status, _ in answers}
        assert statuses <= {200, 503}, ([a for a in answers if a[1] not in (200, 503)][:3], log_tail)
        for kind, status, headers in answers:
            if status == 503:
                assert "retry-after" in headers, kind
        problem = client.get("/readyz").json()
        assert problem["checks"]["database"] == "ok"

        # Every acknowledged id is in PostgreSQL (pgvector answers from it) and in the resident index.
        vectors = [vector_of(i) for i in acked]
        for engine in ("pgvector", "cpu"):
            r = client.post("/v1/collections/faults/search", json={"vectors": vectors, "k": 1, "engine": engine,
                                                                   "consistency": "strong"})
            assert r.status_code == 200, r.text
            assert [ids[0] for ids in r.json()["ids"]] == acked, engine
        metrics = client.get("/metrics").text
        assert "switchyard_database_reconnects_total 1.0" in metrics


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_embedded_server_whose_holders_were_killed_is_stopped_by_the_last_one_out(tmp_path):
    """Two processes hold the embedded server; one is killed (it never lets go of its handle). The other one's
    stop still stops the server; and a server whose holders were all killed is stopped by `serve`'s supervisor
    (stop_if_unheld), which leaves a held one alone."""
    import subprocess
    import sys

    from service.database.postgres import EmbeddedPostgres

    pgdata = tmp_path / "pg"
    hold = ("import sys, time; from pathlib import Path; from service.database.postgres import EmbeddedPostgres; "
            "EmbeddedPostgres(Path(sys.argv[1])).start(); print('up', flush=True); time.sleep(600)")

    def holder() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", hold, str(pgdata)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        return proc

    procs: list[subprocess.Popen] = []
    try:
        killed = holder()
        procs.append(killed)
        survivor = EmbeddedPostgres(pgdata)
        survivor.start()
        pid = postmaster_pid(pgdata)
        killed.kill()
        killed.wait()
        survivor.stop()
        assert _gone(pid), "the last live holder left the server running"

        held, killed = holder(), holder()
        procs += [held, killed]
        pid = postmaster_pid(pgdata)
        assert not EmbeddedPostgres(pgdata).stop_if_unheld()  # a live process holds it
        assert not _gone(pid)
        for proc in (held, killed):
            proc.kill()
            proc.wait()
        assert EmbeddedPostgres(pgdata).stop_if_unheld()
        assert _gone(pid) and not (pgdata / "postmaster.pid").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if (pgdata / "postmaster.pid").exists() and not _gone(pid := postmaster_pid(pgdata)):
            os.kill(pid, signal.SIGINT)  # leave no server running, whatever failed above
