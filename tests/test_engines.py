"""The engine registry: listing, availability with reasons, GPU detection without RAPIDS, engine lifecycle."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import wait_ready
from service.engines import CATALOG, EngineRegistry, EngineSpec
from service.process.devices import CudaDevice, CudaProbe, probe_cuda

NO_GPU = CudaProbe(reason="no CUDA device: test")
ONE_GPU = CudaProbe(devices=(CudaDevice(0, "Test GPU", 16 << 30),))


def test_lists_every_engine_of_every_domain(client):
    engines = client.get("/v1/engines").json()["engines"]
    assert {e["name"] for e in engines} == {s.name for s in CATALOG}
    for domain in ("vectors", "spatial", "olap"):
        kinds = [e["kind"] for e in engines if e["domain"] == domain]
        want = ["gpu", "gpu", "cpu", "postgres"] if domain == "vectors" else ["gpu", "cpu", "postgres"]
        assert kinds == want, domain  # the order `auto` prefers (vectors: cuVS, or CuPy's exact engine)
    for e in engines:
        assert set(e) >= {"name", "domain", "kind", "available", "ready", "reason", "version", "device", "memory_bytes"}
        assert e["available"] or e["reason"], e  # unavailable always says why


def test_no_gpu_engine_is_available_on_this_machine_and_each_says_why(client):
    if probe_cuda().present:
        pytest.skip(f"this machine has a CUDA device: {probe_cuda().devices[0].name}")
    gpu = [e for e in client.get("/v1/engines").json()["engines"] if e["kind"] == "gpu"]
    assert len(gpu) == 4
    for e in gpu:
        assert e["available"] is False and e["ready"] is False
        assert "CUDA" in e["reason"] or "disabled" in e["reason"], e


def test_domain_filter(client):
    engines = client.get("/v1/engines", params={"domain": "olap"}).json()["engines"]
    assert {e["domain"] for e in engines} == {"olap"} and len(engines) == 3


def test_postgres_engines_report_the_server(client):
    engines = {e["name"]: e for e in client.get("/v1/engines").json()["engines"]}
    assert engines["pgvector"]["device"] == "postgresql"
    assert engines["pgvector"]["version"].startswith("0.8")  # the extension's version


def test_gpu_off_setting_is_the_reason(make_client):
    client = make_client(gpu="off")
    gpu = [e for e in client.get("/v1/engines").json()["engines"] if e["kind"] == "gpu"]
    assert all("SWITCHYARD_GPU=off" in e["reason"] for e in gpu)


class GoodEngine:
    def __init__(self, **context):
        self.context = context
        self.ready = False

    async def start(self):
        self.ready = True

    async def stop(self):
        self.ready = False


class BrokenEngine(GoodEngine):
    async def start(self):
        raise MemoryError("out of device memory")


def _spec(name, kind="cpu", implementation=None, **kw):
    return EngineSpec(name, "vectors", kind, "test engine", implementation=implementation, **kw)


async def _start(registry):
    await registry.start(pool=None)


def test_registry_starts_available_engines_and_survives_a_broken_one():
    import asyncio

    registry = EngineRegistry(ONE_GPU, (
        _spec("good", implementation="test_engines:GoodEngine"),
        _spec("broken", kind="gpu", implementation="test_engines:BrokenEngine"),
        _spec("unbuilt", planned_in="issue #99"),
        _spec("needs-module", implementation="test_engines:GoodEngine", modules=("no_such_module_xyz",)),
        _spec("needs-extension", kind="postgres", implementation="test_engines:GoodEngine",
              postgres_extension="postgis"),
    ))
    registry.probe("18.6", {"vector": "0.8.6"})
    asyncio.run(_start(registry))
    status = {s.spec.name: s for s in registry.list()}
    assert status["good"].ready and status["good"].instance.context == {"pool": None}
    assert not status["broken"].available and "MemoryError: out of device memory" in status["broken"].reasons[-1]
    assert status["broken"].device == "cuda:0 Test GPU" and status["broken"].memory_bytes == 16 << 30
    assert status["unbuilt"].reasons == ["not built yet (issue #99)"]
    assert "no_such_module_xyz not installed" in status["needs-module"].reasons[0]
    assert "postgis is not installable" in status["needs-extension"].reasons[0]
    assert registry.ready  # the engines that did start are loaded
    asyncio.run(registry.stop())
    assert not registry.ready


def test_an_engine_that_yields_starts_only_where_the_preferred_one_did_not():
    import asyncio

    for preferred, want_fallback in (("test_engines:GoodEngine", False), ("test_engines:BrokenEngine", True)):
        registry = EngineRegistry(ONE_GPU, (
            _spec("preferred", kind="gpu", implementation=preferred),
            _spec("fallback", kind="gpu", implementation="test_engines:GoodEngine", yields_to="preferred"),
        ))
        registry.probe("18.6", {})
        asyncio.run(_start(registry))
        status = {s.spec.name: s for s in registry.list()}
        assert status["fallback"].available is want_fallback
        assert (status["fallback"].instance is not None) is want_fallback
        if not want_fallback:
            assert status["fallback"].reasons == ["preferred serves the gpu vectors here"]
        asyncio.run(registry.stop())


def test_gpu_engine_needs_a_device():
    registry = EngineRegistry(NO_GPU, (_spec("g", kind="gpu", implementation="test_engines:GoodEngine"),))
    registry.probe("18.6", {})
    (status,) = registry.list()
    assert not status.available and status.reasons == ["no CUDA device: test"]


def test_cuda_probe_honours_cuda_visible_devices(monkeypatch):
    probe_cuda.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        probe = probe_cuda()
        assert not probe.present and "CUDA_VISIBLE_DEVICES" in probe.reason
    finally:
        probe_cuda.cache_clear()


def test_serving_imports_no_gpu_library(database_url, tmp_path):
    """Starting the app and listing engines must not import RAPIDS, cupy or numba.cuda."""
    code = f"""
import json, sys
from fastapi.testclient import TestClient
from service.http.app import create_app
from service.settings import Settings
app = create_app(Settings(database_url={database_url!r}, data_dir={str(tmp_path)!r}))
with TestClient(app) as c:
    assert c.get('/v1/engines').status_code == 200
heavy = ['cupy', 'cudf', 'cuvs', 'numba.cuda', 'rmm', 'cuspatial', 'pylibraft']
print(json.dumps([m for m in heavy if m in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


class LoadingEngine(GoodEngine):
    async def start(self):
        self.ready = False  # still loading its data when start-up finishes


def test_readyz_is_503_while_an_engine_loads(make_settings):
    from fastapi.testclient import TestClient

    from service.http.app import create_app

    app = create_app(make_settings())
    runtime = app.state.switchyard
    runtime.registry = EngineRegistry(NO_GPU, (_spec("slowpoke", implementation="test_engines:LoadingEngine"),))
    with TestClient(app) as client:
        for _ in range(100):
            r = client.get("/readyz")
            if r.json()["checks"].get("engines") != "starting":
                break
        assert r.status_code == 503 and r.json()["checks"]["engines"] == "loading: slowpoke"
        runtime.registry.statuses["slowpoke"].instance.ready = True
        wait_ready(client)
