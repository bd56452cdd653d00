"""`switchyard serve` with no database configured: embedded PostgreSQL, ready, clean Ctrl-C, data dir reused."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import asyncpg
import httpx
import pytest

from conftest import run
from service.process.launcher import SOCKET_NAME_MAX, sockets_directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(data_dir: Path, port: int, workers: int = 1, **extra_env: str) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}, **extra_env}
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
         "--workers", str(workers)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def stop(proc: subprocess.Popen) -> str:
    """Ctrl-C (if it still runs), so that the service stops its embedded PostgreSQL too; SIGKILL only if that takes
    over a minute. What it printed since it was last read."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=60)[0] or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        return ""


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory under /tmp, short enough for unix sockets' names (sockets_directory)."""
    path = Path(tempfile.mkdtemp(dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def serving(data_dir: Path, port: int, workers: int = 1, **extra_env: str) -> Iterator[subprocess.Popen]:
    """`switchyard serve` for the duration of a block; stopped (and its PostgreSQL with it) even if a test fails."""
    proc = serve(data_dir, port, workers, **extra_env)
    try:
        yield proc
    finally:
        stop(proc)


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"not ready within {timeout_s} s:\n{stop(proc)}")


def interrupt(proc: subprocess.Popen) -> str:
    out = stop(proc)
    assert proc.returncode == 0, out
    return out


async def _sql(pgdata: Path, sql: str):
    conn = await asyncpg.connect(f"postgresql://postgres:@/postgres?host={pgdata}")
    try:
        return await conn.fetch(sql) if sql.lstrip().upper().startswith("SELECT") else await conn.execute(sql)
    finally:
        await conn.close()


def test_serve_embedded_ready_then_ctrl_c_then_reuse(tmp_path):
    data_dir, port = tmp_path / "data", free_port()
    pgdata = data_dir / "postgres"

    with serving(data_dir, port) as first:
        took = wait_ready(port, first)
        assert took < 60
        engines = httpx.get(f"http://127.0.0.1:{port}/v1/engines").json()["engines"]
        assert not any(e["available"] for e in engines if e["kind"] == "gpu")
        run(_sql(pgdata, "CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)"))
        out = interrupt(first)
    assert re.search(r"applied \d+ migration", out), out
    assert not (pgdata / "postmaster.pid").exists(), "the embedded server was not stopped"

    with serving(data_dir, port) as second:
        wait_ready(port, second)
        assert [r["x"] for r in run(_sql(pgdata, "SELECT x FROM kept"))] == [42]
        out = interrupt(second)
    assert "applied" not in out  # nothing to migrate the second time
    assert not (pgdata / "postmaster.pid").exists()


def test_several_workers_start_together_on_a_fresh_data_dir(tmp_path):
    """Each Uvicorn worker starts the embedded server; the first creates it, the others find it (no race)."""
    data_dir, port = tmp_path / "data", free_port()
    with serving(data_dir, port, workers=4) as proc:
        wait_ready(port, proc)
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(url + "/v1/collections", json={"name": "w", "dim": 2}).status_code == 201
        deadline = time.monotonic() + 30  # workers answer /readyz one by one
        while len(pids := {r["pid"] for r in
                           httpx.get(url + "/v1/collections/w").json()["replication"]["replicas"]}) < 4:
            assert time.monotonic() < deadline, pids
            time.sleep(0.2)
        out = interrupt(proc)
    assert not (data_dir / "postgres" / "postmaster.pid").exists()
    # Each worker logs the service's own lines as a single process does, its pid named.
    assert re.search(r"INFO switchyard\.[\w.]+\[worker \d+\]: ", out), out


def workers_reached(port: int, connections: int = 32) -> Counter:
    """The worker pids that answer `connections` connections opened together, before any request is sent."""
    import http.client
    import json

    opened = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(connections)]
    try:
        for conn in opened:
            conn.connect()
        time.sleep(0.3)  # every one accepted, by whichever worker
        pids: Counter = Counter()
        for conn in opened:
            conn.request("GET", "/readyz")
            pids[json.loads(conn.getresponse().read())["pid"]] += 1
        return pids
    finally:
        for conn in opened:
            conn.close()


def test_connections_opened_together_are_spread_over_the_workers(tmp_path):
    """Each worker listens on a socket of its own (service/process/workers.py), and the kernel spreads connections
    over them at random: of 32 opened at once, each of two workers gets at least 6 (a probe fails 1 time in 9,000).
    With the one socket they shared, the first worker to wake took all of them, or most. A worker killed is
    replaced on its socket, and a second service on the port is refused rather than let in beside it."""
    data_dir, port = tmp_path / "data", free_port()
    with serving(data_dir, port, workers=2) as proc:
        wait_ready(port, proc)
        deadline = time.monotonic() + 30  # the second worker may still be starting
        while len(pids := workers_reached(port)) < 2:
            assert time.monotonic() < deadline, pids
            time.sleep(0.5)
        spreads = [workers_reached(port) for _ in range(3)]
        assert all(len(pids) == 2 and min(pids.values()) >= 6 for pids in spreads), spreads
        killed = next(iter(pids))
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(pids := workers_reached(port)) < 2 or killed in pids:
            assert time.monotonic() < deadline, pids
            time.sleep(0.5)
        other = serve(tmp_path / "other", port, workers=2)
        out, _ = other.communicate(timeout=60)
        assert other.returncode == 3 and "Address already in use" in out, out
        assert len(workers_reached(port)) == 2
        interrupt(proc)


def test_sigterm_with_fronts_removes_the_sockets_directory(tmp_path, short_tmp):
    """Uvicorn raises SIGTERM again once it has shut down; the engine's sockets' directory still goes."""
    data_dir, port, tmp = tmp_path / "data", free_port(), short_tmp
    with serving(data_dir, port, TMPDIR=str(tmp), SWITCHYARD_FRONTS="1") as proc:
        wait_ready(port, proc)
        assert [p.name for p in tmp.glob("switchyard-*")], "the sockets' directory is elsewhere"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, out  # the exit status still says SIGTERM
    assert not list(tmp.glob("switchyard-*")), out
    assert not (data_dir / "postgres" / "postmaster.pid").exists()


def test_bad_configuration_is_a_clear_error(tmp_path):
    env = {**os.environ, "SWITCHYARD_PORT": "99999"}
    out = subprocess.run([sys.executable, "-m", "service.cli", "serve"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "SWITCHYARD_PORT" in out.stderr and "less than or equal to 65535" in out.stderr


def test_load_vectors_command_shows_progress_and_loads(tmp_path):
    import numpy as np

    data_dir, port = tmp_path / "data", free_port()
    with serving(data_dir, port) as proc:
        wait_ready(port, proc)
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(url + "/v1/collections", json={"name": "cli", "dim": 4}).status_code == 201
        vectors = np.random.default_rng(0).standard_normal((3000, 4)).astype(np.float32)
        np.save(tmp_path / "v.npy", vectors)
        out = subprocess.run([sys.executable, "-m", "service.cli", "load-vectors", "cli", str(tmp_path / "v.npy"),
                              "--url", url, "--first-id", "100"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "3000/3000" in out.stderr and "upserted" in out.stdout
        assert httpx.get(url + "/v1/collections/cli").json()["count"] == 3000
        bad = subprocess.run([sys.executable, "-m", "service.cli", "load-vectors", "nope", str(tmp_path / "v.npy"),
                              "--url", url], capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "404" in bad.stderr and "nope" in bad.stderr
        missing = subprocess.run([sys.executable, "-m", "service.cli", "load-vectors", "cli", str(tmp_path / "no.npy"),
                                  "--url", url], capture_output=True, text=True, timeout=120)
        assert missing.returncode != 0 and "Traceback" not in missing.stderr
        assert "cannot read the vectors" in missing.stderr and "no.npy" in missing.stderr


def test_sigterm_drains_in_flight_requests_saves_snapshots_and_stops_postgres(tmp_path):
    import threading

    import numpy as np

    data_dir, port = tmp_path / "data", free_port()
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(7)
    rows = 30_000
    with serving(data_dir, port) as proc:
        wait_ready(port, proc)
        assert httpx.post(f"{base}/v1/collections", json={"name": "drain", "dim": 32}).status_code == 201
        import orjson

        body = orjson.dumps({"ids": list(range(rows)), "vectors": rng.random((rows, 32), dtype=np.float32).round(4)},
                            option=orjson.OPT_SERIALIZE_NUMPY)
        in_flight = threading.Event()

        def chunks():
            step = len(body) // 8
            for start in range(0, len(body), step):
                if start:
                    in_flight.set()  # the first chunk is out: the server has this request's headers
                yield body[start:start + step]

        answers = []
        sender = threading.Thread(target=lambda: answers.append(httpx.put(
            f"{base}/v1/collections/drain/points", content=chunks(), timeout=60,
            headers={"Content-Type": "application/json", "Content-Length": str(len(body))})))
        sender.start()
        assert in_flight.wait(30)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sender.join(60)
        out, _ = proc.communicate(timeout=60)
        # Uvicorn re-raises the signal once it has shut down cleanly, so the exit status says SIGTERM.
        assert proc.returncode in (0, -signal.SIGTERM), out
        assert "Application shutdown complete" in out, out
        assert answers and answers[0].status_code == 200, (answers, out)
        assert answers[0].json()["upserted"] == rows
    assert not (data_dir / "postgres" / "postmaster.pid").exists()  # the embedded server was stopped
    assert list((data_dir / "vectors").glob("*")), "no snapshot was saved at shutdown"
    with serving(data_dir, port) as again:
        wait_ready(port, again)
        described = httpx.get(f"{base}/v1/collections/drain").json()
        assert described["count"] == rows  # the acknowledged write is all there


def test_the_engines_sockets_go_under_tmp_when_the_temporary_directory_is_too_deep(tmp_path, short_tmp,
                                                                                  monkeypatch):
    """A unix socket's path is at most 107 bytes on Linux: under a deep $TMPDIR fronts could not bind one."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    for base, expected in ((deep, Path("/tmp")), (short_tmp, short_tmp)):
        monkeypatch.setattr(tempfile, "tempdir", str(base))
        folder = sockets_directory(12)
        try:
            assert folder.parent == expected
            path = folder / "engine-11-http.sock"
            assert len(os.fsencode(path)) <= SOCKET_NAME_MAX
            with socket.socket(socket.AF_UNIX) as bound:
                bound.bind(str(path))
        finally:
            shutil.rmtree(folder)
