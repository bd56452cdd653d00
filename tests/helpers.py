"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import socket
import time
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit

from fastapi.testclient import TestClient

PROBLEM = "application/problem+json"


def wait_ready(client: TestClient, timeout_s: float = 30.0) -> dict:
    """Poll /readyz until 200 (engines load in the background after start-up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.get("/readyz")
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.json()
            return r.json()
        time.sleep(0.05)


def assert_problem(response, status: int, slug: str, field: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM), response.headers["content-type"]
    body = response.json()
    assert body["status"] == status
    assert body["type"] == f"urn:switchyard:problem:{slug}", body
    assert body["title"] and body["detail"]
    if field is not None:
        assert body.get("field") == field, body
    return body


def wait_job(client: TestClient, location: str, timeout_s: float = 240.0) -> dict:
    """Poll a job until it ends; its last state."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.get(location)
        job = answer.json()
        assert answer.status_code == 200, (answer.status_code, dict(answer.headers), job)
        if job["state"] not in ("queued", "running"):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job did not finish in {timeout_s} s: {job}")
        time.sleep(0.05)


@contextmanager
def service_client(server_dsn: str, database: str, data_dir) -> Iterator[TestClient]:
    """A ready service on a fresh database of the test server, with `made`: collections a module made."""
    from conftest import fresh_database
    from service.http.app import create_app
    from service.settings import Settings

    with fresh_database(server_dsn, database) as dsn:
        with TestClient(create_app(Settings(database_url=dsn, data_dir=data_dir))) as client:
            wait_ready(client)
            client.made = {}
            yield client


@contextmanager
def ssb_service_client(server_dsn: str, database: str, data_dir, scale_factor: float) -> Iterator[TestClient]:
    """A ready service (server errors answered, not raised) with a generated SSB dataset: `dataset` is its folder,
    `dsn` its database."""
    from pathlib import Path

    from conftest import fresh_database
    from service.http.app import create_app
    from service.settings import Settings

    with fresh_database(server_dsn, database) as dsn:
        client = TestClient(create_app(Settings(database_url=dsn, data_dir=data_dir)), raise_server_exceptions=False)
        with client:
            wait_ready(client)
            r = client.post("/v1/olap/ssb/generate", json={"scale_factor": scale_factor})
            assert r.status_code == 202, r.text
            job = wait_job(client, r.headers["location"])
            assert job["state"] == "succeeded", job
            client.dataset = Path(job["result"]["dataset"])
            client.dsn = dsn
            yield client


def gpu_library_missing(module: str, label: str) -> str | None:
    """Why a GPU library cannot run here (no device, or `module` not importable), or None."""
    from service.process.devices import probe_cuda

    probe = probe_cuda()
    if not probe.present:
        return probe.reason
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{label} is not installed (pip install 'switchyard[gpu]')"
    return None


def cudf_missing() -> str | None:
    return gpu_library_missing("cudf", "cuDF")


def raw_socket(url: object) -> socket.socket:
    """A TCP connection to the service at `url` (http://host:port), for what a client library would not send."""
    parts = urlsplit(str(url))
    return socket.create_connection((parts.hostname, parts.port), timeout=15)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response (with a Content-Length) read from the socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response"
        body += chunk
    return int(lines[0].split()[1]), headers, body[:length]


def wait_job_state(client, job_id: str, state: str, timeout_s: float = 30) -> dict:
    """Poll GET /v1/jobs/{id} until the job is in `state` (asserted when the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] == state or time.monotonic() > deadline:
            assert job["state"] == state, job
            return job
        time.sleep(0.05)


async def new_event() -> asyncio.Event:
    """An asyncio.Event made on the loop that calls this (a TestClient's portal: `client.portal.call(new_event)`)."""
    return asyncio.Event()


def closed_by_server(sock: socket.socket, within_s: float | None = None) -> bool:
    """Whether the server closes the connection (after whatever it still sends) within `within_s` (default: the
    socket's own timeout)."""
    if within_s is not None:
        sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def migrated_pool(dsn: str):
    """A small asyncpg pool on `dsn` after the migrations ran: what a CollectionManager is given in the service."""
    import asyncpg

    from service.database.migrate import apply_migrations
    from service.database.postgres import open_pool

    conn = await asyncpg.connect(dsn)
    try:
        await apply_migrations(conn)
    finally:
        await conn.close()
    return await open_pool(dsn, min_size=1, max_size=4, command_timeout=60)


def run_in_cuda_simulator(test_file) -> None:
    """Run a test file again in a child pytest with NUMBA_ENABLE_CUDASIM=1 (it must be set before numba is first
    imported); fail with its output if it fails, skip if nothing ran there."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-rs",
                        "-p", "no:cacheprovider"], cwd=Path(__file__).resolve().parent.parent, env=env,
                       capture_output=True, text=True, check=False, timeout=280)
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    if r.returncode != 0:
        pytest.fail(f"simulator run failed:\n{tail}")
    if " passed" not in r.stdout:
        pytest.skip(f"nothing ran in the simulator:\n{tail}")


class FreeGuard:
    """Admission control's stand-in for a manager under test: every slot free, nothing cooling. `strict`: an
    engine failure raises instead of letting `auto` fall back, so a test sees it."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def cooling(self, name: str) -> None:
        return None

    @contextlib.asynccontextmanager
    async def slot(self, name: str):
        yield

    def failed(self, name: str, exc: BaseException | None = None) -> None:
        if self.strict:
            raise AssertionError(f"{name} failed: {exc!r}")

    def succeeded(self, name: str) -> None:
        pass


class MemoryLayerStore:
    """The spatial layer store's stand-in (PostgreSQL's): layers by name, in memory."""

    def __init__(self, layers) -> None:
        self.layers = {layer.name: layer for layer in layers}

    async def save(self, layer) -> None:
        self.layers[layer.name] = layer

    async def names(self) -> list[str]:
        return sorted(self.layers)

    async def load(self, name: str):
        return self.layers[name]
