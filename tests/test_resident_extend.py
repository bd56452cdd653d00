"""resident.py's rebuild by extension: with nothing dead, an index whose build is a sequence of adds (flat, HNSW)
gets the delta added to a copy of it instead of a build over every row. Answers checked against exact search."""

from __future__ import annotations

import numpy as np
import pytest

from indexes import planner
from indexes.distance import exact_search
from indexes.faiss_index import FaissBackend
from indexes.resident import ResidentCollection
from vector_data import clustered, recall

DIM = 16


class CountingBackend(FaissBackend):
    def __init__(self) -> None:
        super().__init__(threads=1)
        self.builds: list[int] = []

    def build(self, config, vectors):
        self.builds.append(len(vectors))
        return super().build(config, vectors)


def filled(index_type: str, params: dict, rows: int, seed: int = 0) -> tuple[ResidentCollection, CountingBackend]:
    backend = CountingBackend()
    r = ResidentCollection("c", DIM, "l2", index_type, params, backend)
    data = clustered(rows, DIM, seed=seed)
    for start in range(0, rows, 1000):  # large writes: they wait in the delta
        r.upsert(np.arange(start, start + 1000), data[start:start + 1000], seq=start // 1000 + 1)
    return r, backend


def exact_ids(r: ResidentCollection, queries: np.ndarray, k: int) -> np.ndarray:
    ids, vectors = r.live()
    return ids[exact_search(np, vectors, queries, k, "l2")[1]]


def test_a_delta_is_added_to_a_copy_of_the_index_and_the_held_out_rows_calibrate_it():
    r, backend = filled("hnsw", {"m": 16, "ef_construction": 64}, 6000)
    r.rebuild(hold_out=0)
    assert backend.builds == [6000] and r.index.size == 6000
    first = r.index
    more = clustered(3000, DIM, seed=1)
    r.upsert(np.arange(6000, 9000), more, seq=100)
    assert r.delta_rows == 3000
    r.rebuild(hold_out=500)
    assert backend.builds == [6000]  # no second build: the delta went into a copy
    assert r.index is not first and first.size == 6000  # searches that hold the old index keep it as it was
    assert r.index.size == 8500 and r.held_out == (8500, 9000)
    calibration = r.calibrate()
    assert calibration is not None and calibration.rows == 8500 and calibration.queries == 500
    r.absorb()
    assert r.index.size == 9000 and r.delta_rows == 0 and r.rebuilds == 2
    queries = clustered(200, DIM, seed=2)
    found = r.search(queries, 10, {"ef": 64})
    assert recall(found.ids, exact_ids(r, queries, 10)) >= 0.95


def test_rows_written_while_the_copy_grows_stay_searchable_and_exact_indexes_stay_exact(monkeypatch):
    r, backend = filled("brute_force", {}, 3000)
    r.rebuild()
    late = clustered(50, DIM, seed=3)
    original = type(r.index).add

    def add_then_write(index, vectors):  # a write lands between the copy and the swap
        original(index, vectors)
        if index is not r.index:
            r.upsert(np.arange(10_000, 10_050), late, seq=500)

    r.upsert(np.arange(3000, 4000), clustered(1000, DIM, seed=4), seq=400)
    monkeypatch.setattr(type(r.index), "add", add_then_write)
    r.rebuild()
    assert backend.builds == [3000] and r.count == 4050 and r.index.size == 4050  # the late rows joined at the swap
    queries = np.concatenate([late[:5], clustered(20, DIM, seed=5)])
    assert r.search(queries, 5, {}).ids == exact_ids(r, queries, 5).tolist()


def test_a_load_written_while_the_copy_grows_is_added_to_it_and_calibrated_at_its_end(monkeypatch):
    """Rows written during an extension are added to the copy too, outside the lock, in further passes: only
    the few written during the last pass join under the write lock, and the held-out calibration rows are the
    last of the load, not of the delta the rebuild began with (a 100,000 x 768 load's calibration at 35,000
    rows was stale at once, and another full build followed)."""
    r, backend = filled("hnsw", {"m": 16, "ef_construction": 64}, 6000)
    r.rebuild(hold_out=0)
    load = clustered(4000, DIM, seed=8)
    r.upsert(np.arange(6000, 7000), load[:1000], seq=100)
    original = type(r.index).add
    live_adds: list[int] = []

    def add_then_write(index, vectors):  # the load goes on while the copy grows: 1,000 rows per pass, twice
        original(index, vectors)
        if index is r.index:
            live_adds.append(len(vectors))
        elif r.n_rows < 9000:
            start = r.n_rows
            r.upsert(np.arange(start, start + 1000), load[start - 6000:start - 5000], seq=r.watermark + 1)

    monkeypatch.setattr(type(r.index), "add", add_then_write)
    r.rebuild(hold_out=500)
    assert backend.builds == [6000] and r.carried_over == 0
    assert r.index.size == 8500 and r.held_out == (8500, 9000)
    calibration = r.calibrate()
    assert calibration is not None and calibration.rows == 8500
    r.absorb()
    assert live_adds == [500] and r.index.size == r.count == 9000
    queries = clustered(100, DIM, seed=9)
    assert recall(r.search(queries, 10, {"ef": 64}).ids, exact_ids(r, queries, 10)) >= 0.95


@pytest.mark.parametrize("index_type, params", [("hnsw", {"m": 8, "ef_construction": 32}),
                                                ("ivf_flat", {"n_lists": 16})])
def test_dead_rows_or_an_index_trained_on_its_rows_mean_a_build(index_type, params):
    r, backend = filled(index_type, params, 3000)
    r.rebuild()
    r.upsert(np.arange(3000, 4000), clustered(1000, DIM, seed=6), seq=50)
    if index_type == "hnsw":
        r.delete(np.arange(10), seq=51)  # something to compact
    r.rebuild()
    assert backend.builds == [3000, 3990 if index_type == "hnsw" else 4000]
    assert r.n_dead == 0 and r.index.size == r.count


def test_calibration_rows_are_held_out_only_from_an_index_large_enough_to_calibrate():
    r, backend = filled("hnsw", {"m": 8, "ef_construction": 32}, 2000)
    r.rebuild()
    r.upsert(np.arange(2000, 3000), clustered(1000, DIM, seed=7), seq=60)
    r.rebuild(hold_out=500)
    assert 3000 - 500 < planner.MIN_CALIBRATION_ROWS
    assert r.held_out is None and r.index.size == 3000 and backend.builds == [2000]
