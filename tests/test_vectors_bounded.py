"""Memory in proportion to the data and the request (issue 34, items 2 and 3): the payload index holds entries
only for rows that have a key, and recall's exact ground truth holds FAISS's blocks of scores, never queries x rows."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import wait_job, wait_ready
from indexes import distance
from indexes.filters import parse
from indexes.payloads import PayloadIndex
from indexes.resident_search import ResidentSearch
from service.admission.priority import HEAVY_NICE
from service.settings import Settings
from vector_data import clustered, oracle


def array_bytes(index: PayloadIndex) -> int:
    """Every numpy array the index's columns hold, whatever their layout."""
    return sum(a.nbytes for column in index.columns.values() for a in vars(column).values()
               if isinstance(a, np.ndarray))


def test_many_keys_on_one_point_of_a_large_collection_cost_bytes_per_key_not_per_row():
    index = PayloadIndex()
    index.append(None, 20_000)  # rows without payloads
    index.append([{f"k{i}": i for i in range(500)}], 1)
    # Dense columns sized to the collection took 9 bytes per key per row here: 90 MB.
    assert array_bytes(index) <= 500 * 128
    mask = index.evaluate(parse({"k7": 7}), index.rows)
    assert np.flatnonzero(mask).tolist() == [20_000]


def test_payload_index_memory_follows_the_entries_present():
    rng = np.random.default_rng(3)
    keys, rows = 300, 30_000
    index, entries = PayloadIndex(), 0
    for _ in range(0, rows, 1000):
        payloads = []
        for _row in range(1000):
            chosen = rng.choice(keys, size=3, replace=False)
            payloads.append({f"k{j}": float(j) for j in chosen})
            entries += 3
        index.append(payloads, len(payloads))
    # rows (8) + kind (1) + number (8) bytes an entry, arrays at most twice what they hold, a little per key
    assert array_bytes(index) <= 2 * 17 * entries + 64 * keys


def oracle_mask(payloads: list[dict | None], field: str, test) -> list[int]:
    return [i for i, p in enumerate(payloads) if p is not None and field in p and test(p[field])]


def test_sparse_columns_filter_as_dense_ones_did_through_compaction_and_snapshots():
    rng = np.random.default_rng(5)
    payloads: list[dict | None] = []
    for i in range(2_000):
        if i % 5 == 0:
            payloads.append(None)
        else:
            p: dict = {}
            if i % 2:
                p["price"] = float(rng.integers(0, 100))
            if i % 3:
                p["color"] = ["red", "green", "blue"][i % 3]
            if i % 7 == 0:
                p["when"] = f"2024-0{1 + i % 9}-15"
            if i % 11 == 0:
                p["flag"] = bool(i % 2)
            payloads.append(p)
    index = PayloadIndex()
    for start in range(0, len(payloads), 300):
        chunk = payloads[start:start + 300]
        index.append(chunk, len(chunk))
    checks = [
        ({"price": {"$gte": 50}}, oracle_mask(payloads, "price", lambda v: v >= 50)),
        ({"color": {"$in": ["red", "blue"]}}, oracle_mask(payloads, "color", lambda v: v in ("red", "blue"))),
        ({"when": {"$lt": "2024-04-01"}}, oracle_mask(payloads, "when", lambda v: v < "2024-04-01")),
        ({"flag": True}, oracle_mask(payloads, "flag", lambda v: v is True)),
    ]
    for filter_, want in checks:
        assert np.flatnonzero(index.evaluate(parse(filter_), index.rows)).tolist() == want, filter_
    missing = {"color": {"$exists": False}}
    assert np.flatnonzero(index.evaluate(parse(missing), index.rows)).tolist() == [
        i for i, p in enumerate(payloads) if p is None or "color" not in p]
    # Only the first rows a search sees count.
    assert np.flatnonzero(index.evaluate(parse({"flag": True}), 500)).tolist() == [i for i in checks[3][1] if i < 500]

    # A compaction that keeps every third row, in reverse: each row keeps its values.
    kept = np.arange(len(payloads))[::3][::-1].copy()
    taken = index.take(kept)
    moved = [payloads[i] for i in kept]
    assert np.flatnonzero(taken.evaluate(parse({"price": {"$gte": 50}}), taken.rows)).tolist() == oracle_mask(
        moved, "price", lambda v: v >= 50)
    # A snapshot's arrays restore the same index.
    restored = PayloadIndex.restore(*taken.state())
    for filter_, _ in checks:
        assert (restored.evaluate(parse(filter_), restored.rows) == taken.evaluate(parse(filter_), taken.rows)).all()
    alive = np.ones(taken.rows, bool)
    assert restored.describe(alive) == taken.describe(alive)
    assert restored.describe(alive)["flag"] == {
        "false": sum(1 for p in moved if p and p.get("flag") is False),
        "true": sum(1 for p in moved if p and p.get("flag") is True)}


def test_a_snapshot_column_past_its_rows_is_refused():
    index = PayloadIndex()
    index.append([{"a": 1}, {"a": 2}], 2)
    meta, arrays = index.state()
    meta["rows"] = 1
    with pytest.raises(ValueError):
        PayloadIndex.restore(meta, arrays)


# -- recall's ground truth -----------------------------------------------------------------------------------
class Spy:
    """Records the (queries, rows) shape, OpenMP threads and thread CPU priority (nice value) of every exact
    ground truth recall computes, and the nice value of each resident engine search's thread."""

    def __init__(self, monkeypatch) -> None:
        self.truths: list[tuple[int, int, int, int]] = []  # (queries, rows, OpenMP threads, nice)
        self.searches: list[int] = []
        real, real_search = distance.exact_search, ResidentSearch.search

        def spied(xp, data, queries, k, metric, keep=None, threads=1):
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.truths.append((queries.shape[0], data.shape[0], threads, nice))
            return real(xp, data, queries, k, metric, keep, threads)

        def spied_search(index, *args, **kwargs):
            self.searches.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return real_search(index, *args, **kwargs)

        monkeypatch.setattr("indexes.manager_recall.exact_search", spied)
        monkeypatch.setattr(ResidentSearch, "search", spied_search)


@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
@pytest.mark.parametrize("threads", [1, 2])
def test_exact_search_of_many_queries_equals_the_oracle(metric, threads):
    data = clustered(1000, 16, seed=1)
    queries = clustered(45, 16, seed=2)
    scores, rows = distance.exact_search(np, distance.prepare(np, data, metric), distance.prepare(np, queries, metric),
                                         10, metric, threads=threads)
    want_rows, want_d = oracle(data, queries, 10, metric)
    assert np.allclose(distance.from_engine(np, scores, metric), want_d, atol=1e-4)
    assert (rows == want_rows).mean() > 0.99  # ties aside


def test_exact_search_with_fewer_rows_than_k():
    data = clustered(3, 4, seed=1)
    scores, rows = distance.exact_search(np, data, data[:2], 5, "l2")
    assert rows[:, :3].min() >= 0 and (rows[:, 3:] == -1).all() and np.isinf(scores[:, 3:]).all()
    assert rows[0, 0] == 0 and rows[1, 0] == 1


PEAK_SCRIPT = """
import resource, sys, numpy as np
sys.path.insert(0, sys.argv[1])
from indexes import distance, faiss_index
nq, call = int(sys.argv[2]), sys.argv[3]
data = np.random.default_rng(1).standard_normal((400_000, 4)).astype(np.float32)
queries, keep = data[:nq].copy(), np.arange(len(data)) % 2 == 0
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
scores, rows = distance.exact_search(np, data, queries, 10, "l2", keep if call == "masked" else None,
                                     threads=2 if call == "threads" else 1)
assert (rows[:, 0] == np.arange(nq)).all() if call != "masked" else (rows % 2 == 0).all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""


@pytest.mark.parametrize("call, queries", [("threads", 2000), ("search", 2000), ("masked", 300)])
def test_exact_search_memory_does_not_grow_with_queries_times_rows(tmp_path, call, queries):
    """Queries x 400,000 rows, a score matrix of 480 MB-3.2 GB: exact search peaks at the data, the answer and
    bounded blocks. Measured in a fresh process, whose peak RSS is this call's."""
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, str(script), root, str(queries), call], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 150, out.stdout  # MB above the data


def test_masked_exact_search_in_blocks_equals_the_oracle(monkeypatch):
    monkeypatch.setattr(distance, "HOST_SCORE_BLOCK_BYTES", 4 * 1000 * 7)  # blocks of 7 queries
    data, queries = clustered(1000, 8, seed=3), clustered(45, 8, seed=4)
    keep = np.arange(1000) % 3 != 0
    scores, rows = distance.exact_search(np, data, queries, 10, "l2", keep)
    want_rows, want_d = oracle(data[keep], queries, 10, "l2")
    assert np.allclose(distance.from_engine(np, scores, "l2"), want_d, atol=1e-4)
    assert (rows == np.flatnonzero(keep)[want_rows]).mean() > 0.99  # ties aside


def test_recall_ground_truth_is_exact_search_on_a_thread_of_lower_priority(client, monkeypatch):
    wait_ready(client)
    name = f"r{time.monotonic_ns()}"
    data = clustered(1500, 8, seed=4)
    assert client.post("/v1/collections", json={"name": name, "dim": 8, "index": {"type": "brute_force"}}
                       ).status_code == 201
    assert client.put(f"/v1/collections/{name}/points", json={"ids": list(range(1500)),
                                                               "vectors": data.tolist()}).status_code == 200
    spy = Spy(monkeypatch)
    r = client.post(f"/v1/collections/{name}/recall", json={"sample": 200, "k": 10, "engine": "cpu"})
    assert r.status_code == 200, r.text
    assert r.json()["recall"] == 1.0 and r.json()["queries"] == 200
    # Heavy work: on a thread of lower CPU priority than the event loop's (this thread's), so searches come first,
    # with the engines' threads (which inherit the priority): the exact answer, and the engine's own search of
    # the sample; a search of the same batch is not heavy work.
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert spy.truths == [(200, 1500, Settings().engine_threads, min(19, mine + HEAVY_NICE))], (spy.truths, mine)
    assert spy.searches == [min(19, mine + HEAVY_NICE)], (spy.searches, mine)
    r = client.post(f"/v1/collections/{name}/search", json={"vectors": data[:200].tolist(), "k": 10, "engine": "cpu"})
    assert r.status_code == 200 and spy.searches[1:] == [mine], (r.text, spy.searches, mine)


def test_the_service_lets_the_event_loop_have_the_gil_within_its_setting(client):
    """Worker threads' Python (a batch answer shaped in pieces, recall's count) yields the GIL to the event loop
    after SWITCHYARD_GIL_SWITCH_US, not Python's default 5 ms."""
    wait_ready(client)
    assert sys.getswitchinterval() == pytest.approx(Settings().cpu.gil_switch_us / 1e6)
    assert Settings().cpu.gil_switch_us < 5000


def test_recall_is_bounded_as_a_search_is(client):
    wait_ready(client)
    name = f"r{time.monotonic_ns()}"
    assert client.post("/v1/collections", json={"name": name, "dim": 4}).status_code == 201
    assert client.put(f"/v1/collections/{name}/points", json={
        "ids": [1, 2], "vectors": [[1, 2, 3, 4], [4, 3, 2, 1]]}).status_code == 200
    queries = np.ones((2000, 4)).tolist()
    r = client.post(f"/v1/collections/{name}/recall", json={"queries": queries, "k": 1000})
    assert r.status_code == 422 and r.json()["field"] == "queries", r.text


def test_what_the_service_made_at_startup_is_out_of_the_collectors_passes(client):
    """Startup's objects are frozen (gc.freeze), so a full collection, which holds the GIL, walks only what came
    after them: a 10-14 ms pass of the collector on a worker thread stalled the event loop as long."""
    import gc

    wait_ready(client)
    deadline = time.monotonic() + 30
    while gc.get_freeze_count() == 0 and time.monotonic() < deadline:  # the engines start in the background
        time.sleep(0.05)
    assert gc.get_freeze_count() > 10_000


def test_an_index_build_takes_every_core_at_a_lower_priority(client, monkeypatch):
    """A build is background work: on a thread of lower CPU priority than the event loop's, whose OpenMP threads
    (which it starts, and which inherit its priority) may then be as many as there are cores."""
    from indexes import faiss_index

    wait_ready(client)
    calls: list[tuple[str, int, int]] = []  # (thread, nice, OpenMP threads) of each FAISS call's setting
    real = faiss_index.omp_threads

    def spied(n: int) -> None:
        calls.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), n))
        real(n)

    monkeypatch.setattr(faiss_index, "omp_threads", spied)
    name = f"b{time.monotonic_ns()}"
    data = clustered(2000, 8, seed=6)
    assert client.post("/v1/collections", json={"name": name, "dim": 8, "index": {"type": "hnsw"}}).status_code == 201
    assert client.put(f"/v1/collections/{name}/points", json={"ids": list(range(2000)),
                                                               "vectors": data.tolist()}).status_code == 200
    job = client.post(f"/v1/collections/{name}/build").json()
    assert wait_job(client, job["location"])["state"] == "succeeded"
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    builds = [(nice, n) for thread, nice, n in calls if thread.startswith("vectors-cpu-build")]
    assert (min(19, mine + HEAVY_NICE), os.cpu_count()) in builds, calls
    assert all(nice == min(19, mine + HEAVY_NICE) for nice, _ in builds), builds


def test_recalls_take_turns_through_a_gate_and_the_rest_are_refused(client, monkeypatch):
    """Recall runs on the one heavy thread: 20 at once were all admitted and queued there, each taking 20 times its
    own time. They go through a gate of that one slot; those that cannot get it within the queue's wait are 503."""
    from concurrent.futures import ThreadPoolExecutor

    from indexes import manager_recall

    wait_ready(client)
    name = f"r{time.monotonic_ns()}"
    data = clustered(300, 8, seed=5)
    assert client.post("/v1/collections", json={"name": name, "dim": 8}).status_code == 201
    assert client.put(f"/v1/collections/{name}/points", json={"ids": list(range(300)),
                                                               "vectors": data.tolist()}).status_code == 200
    real = manager_recall.exact_search

    def slow(*args, **kwargs):  # an exact search well past the queue's wait (SWITCHYARD_QUEUE_WAIT_MS, 250 ms)
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(manager_recall, "exact_search", slow)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: client.post(f"/v1/collections/{name}/recall",
                                                      json={"sample": 50, "k": 5, "engine": "cpu"}), range(4)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses[0] == 200 and 503 in statuses, [r.text for r in answers]
    for r in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] and r.json()["engine"] == "recall", r.text
