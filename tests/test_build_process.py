"""Index builds in a child process (indexes/build_process.py): what comes back is the index a build in this process
would give, a failing or dying child is a clear error, and, through the manager with an engine of the GPU's kind
(one engine thread), a running build holds neither that thread nor the searches of other collections."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import run
from gated_build import GATE, GatedBackend
from helpers import migrated_pool
from indexes.ann import IndexConfig
from indexes.build_process import BuildFailed, DetachedBuilder
from indexes.distance import exact_search
from indexes.faiss_index import FaissBackend
from indexes.manager import CollectionManager
from indexes.vectors import Points
from service.admission.control import Admission
from service.settings import Settings

TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def child_path(monkeypatch):
    """The children import this directory's stand-in backends."""
    monkeypatch.setenv("PYTHONPATH", TESTS)


def test_a_child_builds_the_index_this_process_would(tmp_path, child_path):
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((3_000, 16)).astype(np.float32)
    queries = rng.standard_normal((50, 16)).astype(np.float32)
    builder = DetachedBuilder("indexes.faiss_index:FaissBackend", min_values=0)
    truth_scores, truth = exact_search(np, vectors, queries, 10, "l2")

    flat = IndexConfig("brute_force", "l2", 16, {})
    index = FaissBackend().load(flat, builder.build(flat, vectors, tmp_path))
    scores, rows = index.search(queries, 10, {}, None)
    assert np.array_equal(rows, truth) and np.allclose(scores, truth_scores, rtol=1e-5)

    hnsw = IndexConfig("hnsw", "l2", 16, {"m": 16, "ef_construction": 64})
    index = FaissBackend().load(hnsw, builder.build(hnsw, vectors, tmp_path))
    _, rows = index.search(queries, 10, {"ef": 128}, None)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows.tolist(), truth.tolist())])
    assert index.size == 3_000 and recall >= 0.95
    assert builder.builds == 2
    assert list(tmp_path.iterdir()) == []  # the vectors and index files are gone


@pytest.mark.parametrize("factory, says", [
    ("gated_build:FailingBackend", "ValueError: no index for these vectors"),
    ("gated_build:DyingBackend", "exited with 9"),
    ("gated_build:NoSuchBackend", "AttributeError"),
])
def test_a_failing_or_dying_build_is_a_clear_error(tmp_path, child_path, factory, says):
    builder = DetachedBuilder(factory, min_values=0)
    with pytest.raises(BuildFailed, match=says):
        builder.build(IndexConfig("brute_force", "l2", 4, {}), np.ones((10, 4), np.float32), tmp_path)
    assert builder.builds == 0 and list(tmp_path.iterdir()) == []


def test_only_large_builds_go_to_a_child():
    builder = DetachedBuilder("indexes.faiss_index:FaissBackend", min_values=1_000_000)
    assert builder.wants(10_000, 128) and not builder.wants(1_000, 128)


def test_a_build_in_a_child_blocks_no_search(tmp_path, database_url, child_path, monkeypatch):
    """The engine has one thread, as cuVS's does. While collection a's rebuild waits in its child process, b (and
    a, from its old index) are searched on that thread; opened, the build is loaded and swapped in."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE, str(gate))
    run(_searches_go_on_during_a_build(database_url, tmp_path / "data", gate))


async def _searches_go_on_during_a_build(dsn: str, data_dir: Path, gate: Path) -> None:
    pool = await migrated_pool(dsn)
    manager = CollectionManager(pool, data_dir, dsn=dsn, guard=Admission(Settings(database_url=dsn, data_dir=data_dir)))
    backend = GatedBackend(detached=True)
    manager.attach("gpu", backend)
    await manager.start()
    try:  # with builds on the engine's thread, the writes below would wait at the gate: a failure, not a hang
        await asyncio.wait_for(_scenario(manager, backend, gate), 180)
    finally:
        gate.touch()  # a build waiting at the gate would hold stop() (the engine thread's shutdown) for ever
        await manager.stop()
        await pool.close()


async def _scenario(manager: CollectionManager, backend: GatedBackend, gate: Path) -> None:
    rng = np.random.default_rng(11)
    dim, n = 8, 400
    data = {}
    for name in ("a", "b"):
        await manager.create(name, dim, "l2", "brute_force", None, {"type": "none"})
        data[name] = rng.standard_normal((n, dim)).astype(np.float32)
        await manager.upsert(name, Points(np.arange(n, dtype=np.int64), data[name], None))
    gone = np.arange(0, n, 4, dtype=np.int64)  # dead rows, so the rebuild has something to compact
    _, seq = await manager.delete("a", gone)
    queries = rng.standard_normal((5, dim)).astype(np.float32)

    async def check(name: str, alive: np.ndarray) -> None:
        answer = await asyncio.wait_for(manager.search(name, queries, 10, "gpu", consistency="session", seq=seq), 30)
        assert answer.engine == backend.name  # the GPU kind's engine: the backend's own name
        ids = np.flatnonzero(alive)
        _, truth = exact_search(np, data[name][ids], queries, 10, "l2")
        assert answer.result.ids == ids[truth].tolist()

    alive_a = ~np.isin(np.arange(n), gone)
    rebuild = asyncio.create_task(manager.rebuild_resident("a"))
    for _ in range(600):  # the child is started
        if backend.builder._children:
            break
        await asyncio.sleep(0.05)
    assert backend.builder._children, "the rebuild never started a build process"
    await check("b", np.ones(n, bool))
    await check("a", alive_a)
    assert not rebuild.done() and backend.builder.builds == 0
    gate.touch()
    report = await asyncio.wait_for(rebuild, 120)
    # b's first build, started in the background by its writes, waited at the gate too
    assert report["resident_index"] == "brute_force" and backend.builder.builds >= 1
    r = manager.resident["a"].index
    assert r.n_dead == 0 and r.count == len(np.flatnonzero(alive_a)) and r.rebuilds >= 1
    await check("a", alive_a)


def test_files_of_a_killed_services_build_are_swept(tmp_path, child_path):
    import subprocess
    import sys

    from indexes.build_process import sweep

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, live = tmp_path / f"build-{gone.pid}-abc", tmp_path / f"build-{os.getpid()}-def"
    for d in (stale, live):
        d.mkdir()
        (d / "vectors.npy").write_bytes(b"x" * 100)
    assert sweep(tmp_path) == [stale.name] and live.exists() and not stale.exists()
    DetachedBuilder("indexes.faiss_index:FaissBackend", min_values=0).build(
        IndexConfig("brute_force", "l2", 4, {}), np.ones((10, 4), np.float32), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [live.name]  # its own directory is gone after the build
