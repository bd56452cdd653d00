"""Several engine processes behind the fronts: `switchyard serve --engines 2` (one per device on a GPU machine).

Each engine holds every resident index and follows PostgreSQL's change log, as any replica does; the fronts spread
requests among them. On this CPU machine the engines are forced (SWITCHYARD_ENGINES=2) and pinned to no device;
the device pinning is checked on the plan `serve` makes from a probe.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_ready
from loadtests.processes import local_service
from service import engines
from service.database.postgres import EmbeddedPostgres
from service.process import devices
from service.process.devices import CudaDevice, CudaProbe, device_pins
from service.process.front import LeastBusy, merge_metrics
from service.process.links import ProcessLinks
from service.settings import Settings
from vector_data import clustered, oracle, search_concurrently

DIM = 16
TWO_GPUS = CudaProbe(devices=(CudaDevice(0, "GPU A", 80 * 2**30), CudaDevice(1, "GPU B", 80 * 2**30)))


def test_each_engine_is_pinned_to_one_device_as_its_parent_names_it():
    assert device_pins(TWO_GPUS, None) == ["0", "1"]
    assert device_pins(TWO_GPUS, "") == ["0", "1"]
    assert device_pins(TWO_GPUS, "2,3") == ["2", "3"]  # device 1 of a process that sees 2,3 is the machine's 3
    assert device_pins(TWO_GPUS, "GPU-aa, MIG-bb") == ["GPU-aa", "MIG-bb"]
    assert device_pins(CudaProbe(reason="no CUDA device"), "0,1") == []


@pytest.fixture
def two_gpus(monkeypatch):
    for name in [name for name in os.environ if name.startswith("SWITCHYARD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(devices, "probe_cuda", lambda enabled=True: TWO_GPUS if enabled else CudaProbe(reason="off"))
    monkeypatch.setattr(engines, "gpu_engine_installed", lambda specs=engines.CATALOG: True)
    monkeypatch.setattr("service.settings.usable_cores", lambda: 8)


def test_one_engine_process_per_device_when_a_gpu_engine_can_use_it(two_gpus, monkeypatch):
    settings = Settings()
    assert (settings.engine_processes, settings.front_processes) == (2, 8)
    assert Settings(fronts=3).engine_processes == 2
    assert Settings(engines=1).engine_processes == 1
    assert Settings(gpu="off").engine_processes == 1
    assert Settings(workers=2).engine_processes == 1  # full replicas are the other layout
    assert Settings(fronts=0).engine_processes == 1  # one process serving HTTP itself
    monkeypatch.setattr(engines, "gpu_engine_installed", lambda specs=engines.CATALOG: False)
    assert Settings().engine_processes == 1  # a device no engine can use gets no process
    monkeypatch.setattr("service.settings.usable_cores", lambda: 2)
    assert Settings(engines=2).front_processes == 2  # several engines share the port through fronts, even on 2 cores
    assert Settings(engines=2, cpu_threads=None).engine_threads == 1  # the cores are divided among the engines


def test_heavy_work_leaves_one_core_to_the_event_loop(monkeypatch):
    """A recall's exact search and batch searches on every core held a lone search's p99 at 2-4x on 2 cores."""
    for name in [name for name in os.environ if name.startswith("SWITCHYARD_")]:
        monkeypatch.delenv(name)
    for cores, workers, threads in ((2, 1, 1), (1, 1, 1), (8, 1, 7), (16, 3, 5)):
        monkeypatch.setattr("service.settings.usable_cores", lambda cores=cores: cores)
        assert Settings(workers=workers, gpu="off").engine_threads == threads, (cores, workers)
    assert Settings(cpu_threads=8).engine_threads == 8  # as configured


def test_the_service_holds_blas_to_the_engine_threads(make_client):
    """numpy's BLAS (exact search over many queries) takes no more threads than an engine call may."""
    from threadpoolctl import threadpool_info, threadpool_limits

    before = max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
    try:
        client = make_client(cpu_threads=1)
        wait_ready(client)
        blas = {i["filepath"]: i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas" and i.get("threading_layer") != "openmp"}  # FAISS's: per call
        assert blas and set(blas.values()) == {1}, blas
    finally:
        threadpool_limits(limits=before, user_api="blas")  # process-wide: the other tests get theirs back


def test_a_gpu_engine_needs_its_modules():
    gpu = engines.EngineSpec("x", "vectors", "gpu", "test", modules=("json",), implementation="json:dumps")
    absent = engines.EngineSpec("y", "vectors", "gpu", "test", modules=("no_such_module_here",),
                                implementation="json:dumps")
    cpu = engines.EngineSpec("z", "vectors", "cpu", "test", modules=("json",), implementation="json:dumps")
    assert engines.gpu_engine_installed((gpu, cpu))
    assert not engines.gpu_engine_installed((absent, cpu))


@pytest.mark.parametrize("layout, field", [
    (dict(engines=2, workers=2), "SWITCHYARD_WORKERS"),
    (dict(engines=2, fronts=0), "SWITCHYARD_FRONTS"),
    (dict(engines=2, uds="/tmp/sy.sock"), "SWITCHYARD_UDS"),
])
def test_conflicting_layouts_are_refused_by_name(layout, field):
    with pytest.raises(ValueError, match=field):
        Settings(**layout)


def test_least_busy_takes_the_idlest_and_spreads_ties():
    pick = LeastBusy()
    load = {"a": 0, "b": 0, "c": 0}
    assert {pick(list(load), load.get) for _ in range(3)} == {"a", "b", "c"}
    load.update(a=2, b=1, c=3)
    assert {pick(list(load), load.get) for _ in range(5)} == {"b"}


def _engine_metrics(value: float) -> str:
    registry = CollectorRegistry()
    Counter("sy_requests", "Requests.", ["engine", "route"], registry=registry).labels("faiss", "/a b").inc(value)
    Histogram("sy_seconds", "Time.", buckets=(0.1, 1.0), registry=registry).observe(value / 10)
    return generate_latest(registry).decode()


def test_merged_metrics_are_one_valid_exposition_with_each_engines_samples():
    merged = merge_metrics([_engine_metrics(3), _engine_metrics(5)])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert merged.count("# TYPE sy_requests_total counter") == 1 and merged.count("# HELP sy_requests_total ") == 1
    requests = {s.labels["engine_process"]: s.value for s in families["sy_requests"].samples
                if s.name == "sy_requests_total"}
    assert requests == {"0": 3.0, "1": 5.0}
    assert all(s.labels["engine"] == "faiss" and s.labels["route"] == "/a b" for s in families["sy_requests"].samples
               if s.name == "sy_requests_total")
    counts = {s.labels["engine_process"]: s.value for s in families["sy_seconds"].samples
              if s.name == "sy_seconds_count"}
    assert counts == {"0": 1.0, "1": 1.0}


def _tree(url: str) -> tuple[psutil.Process, list[psutil.Process], list[psutil.Process]]:
    """The supervising `serve`, its engine processes and its front processes, found from the port's listener."""
    port = httpx.URL(url).port
    listener = next(c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN")
    serve = psutil.Process(listener)
    while "service.cli" not in " ".join(serve.cmdline()):
        serve = serve.parent()
    tree = [(p, " ".join(p.cmdline())) for p in serve.children(recursive=True)]
    return (serve, [p for p, command in tree if "service.http.app:create_app" in command],
            [p for p, command in tree if "service.process.front" in command or "spawn_main" in command])


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engines")
    with local_service(1, folder / "data", folder / "serve.log",
                       env={"SWITCHYARD_ENGINES": "2", "SWITCHYARD_FRONTS": "2"}) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def test_two_engines_answer_as_one_process_does_and_share_the_load(two_engines):
    serve, engine_processes, fronts = _tree(str(two_engines.base_url))
    assert len(engine_processes) == 2 and fronts
    sockets = {ProcessLinks.handed_down(p.environ()).engine_socket for p in engine_processes}
    assert len(sockets) == 2
    data = clustered(500, DIM, seed=41)
    assert two_engines.post("/v1/collections", json={"name": "e1", "dim": DIM}).status_code == 201
    seq = two_engines.put("/v1/collections/e1/points", json={"ids": list(range(500)),
                                                             "vectors": data.tolist()}).json()["seq"]
    queries = clustered(64, DIM, seed=42)
    truth, _ = oracle(data, queries, 5, "l2")

    assert search_concurrently(two_engines, "e1", queries, 5, seq, threads=8) == truth.tolist()
    replicas = two_engines.get("/v1/collections/e1").json()["replication"]["replicas"]
    assert len(replicas) == 2, replicas  # one copy per engine process
    metrics = {f.name: f for f in text_string_to_metric_families(two_engines.get("/metrics").text)}
    searches = {s.labels["engine_process"]: s.value for s in metrics["switchyard_http_requests"].samples
                if s.name == "switchyard_http_requests_total" and s.labels.get("status") == "200"
                and s.labels.get("route") == "/v1/collections/{name}/search"}
    assert set(searches) == {"0", "1"} and sum(searches.values()) >= len(queries), searches
    assert two_engines.get("/readyz").status_code == 200


def test_a_write_through_either_engine_is_read_through_the_other(two_engines):
    assert two_engines.post("/v1/collections", json={"name": "e2", "dim": DIM}).status_code == 201
    data = clustered(12, DIM, seed=43)
    for i, vector in enumerate(data):  # one at a time: each request goes to the idler engine, in turn when both idle
        r = two_engines.put("/v1/collections/e2/points", json={"ids": [i], "vectors": [vector.tolist()]})
        assert r.status_code == 200, r.text
        found = two_engines.post("/v1/collections/e2/search", json={"vector": vector.tolist(), "k": 1,
                                                                    "consistency": "strong"})
        assert found.json()["ids"] == [i], (i, found.text)
    assert two_engines.get("/v1/collections/e2").json()["count"] == len(data)
    bad = two_engines.put("/v1/collections/e2/points", json={"ids": [1], "vectors": [[0.0] * (DIM - 1)]})
    assert bad.status_code == 422 and bad.json()["field"].startswith("vectors")


def test_the_service_stops_when_an_engine_process_dies_and_so_does_its_postgres(tmp_path):
    pgdata = tmp_path / "data" / "postgres"
    try:
        with local_service(1, tmp_path / "data", tmp_path / "serve.log",
                           env={"SWITCHYARD_ENGINES": "2", "SWITCHYARD_FRONTS": "1"}) as url:
            postmaster = psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
            serve, engine_processes, fronts = _tree(url)
            engine_processes[1].send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 60
            survivors = [serve, engine_processes[0], *fronts]
            while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in survivors):
                assert time.monotonic() < deadline, "processes outlived a dead engine"
                time.sleep(0.2)
        assert "an engine process exited" in (tmp_path / "serve.log").read_text()
        # The killed engine never let go of its handle: the survivor (or the supervisor) stopped the server anyway.
        deadline = time.monotonic() + 10
        while postmaster.is_running() and postmaster.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the embedded PostgreSQL outlived the service"
            time.sleep(0.2)
        assert not (pgdata / "postmaster.pid").exists()
    finally:
        orphan = EmbeddedPostgres(pgdata)  # whatever happened above, leave no server running
        if orphan.alive():
            orphan.stop_if_unheld()
