"""A filter's plans are remembered with its cached rows (planner.FilterRows.plan) while the collection is unchanged.
Calibrating or swapping the index changes no row, so the cached rows stay: the plans must not."""

from __future__ import annotations

import numpy as np

from indexes import filters
from indexes.faiss_index import FaissBackend
from indexes.resident import ResidentCollection
from vector_data import clustered

DIM = 16


def filled(rows: int = 8000) -> ResidentCollection:
    r = ResidentCollection("c", DIM, "l2", "hnsw", {"m": 16, "ef_construction": 64}, FaissBackend(threads=1))
    r.upsert(np.arange(rows), clustered(rows, DIM, seed=6), seq=1, payloads=[{"n": i % 2} for i in range(rows)])
    return r


def test_a_calibration_replans_a_filter_whose_rows_are_cached():
    r = filled()
    r.rebuild(hold_out=500)
    where, queries = filters.parse({"n": 0}), clustered(3, DIM, seed=7)
    before = r.search(queries, 10, {}, where, recall_target=0.9).plan
    assert before["calibrated_recall"] == 1.0 and "not calibrated" in before["why"]
    assert r.filters.hits + r.filters.misses == 1
    calibration = r.calibrate()
    assert calibration is not None
    after = r.search(queries, 10, {}, where, recall_target=0.9).plan
    assert r.filters.hits == 1  # the same cached rows ...
    point = calibration.cheapest(0.9)
    assert after["calibrated_recall"] == point["recall"] and "not calibrated" not in (after.get("why") or "")


def test_a_remembered_plan_is_per_k_parameters_and_target():
    r = filled()
    r.rebuild()
    where, queries = filters.parse({"n": 1}), clustered(3, DIM, seed=8)
    low = r.search(queries, 10, {"ef": 16}, where).plan
    high = r.search(queries, 10, {"ef": 64}, where).plan
    again = r.search(queries, 10, {"ef": 16}, where).plan
    assert low["params"] != high["params"] and again == low
    deeper = r.search(queries, 50, {"ef": 16}, where).plan
    assert deeper != low and r.filters.misses == 1  # a deeper k: its own plan (a higher ef, or exact)


def test_a_write_replans_and_answers_from_the_new_rows():
    r = filled()
    r.rebuild()
    where, queries = filters.parse({"n": 1}), clustered(3, DIM, seed=9)
    first = r.search(queries, 5, {}, where)
    assert first.plan["matched_rows"] == 4000
    r.upsert(np.arange(100_000, 100_010), queries.repeat(4, axis=0)[:10], seq=2, payloads=[{"n": 1}] * 10)
    second = r.search(queries, 5, {}, where)
    assert second.plan["matched_rows"] == 4010 and r.filters.misses == 2
    assert all(ids[0] >= 100_000 for ids in second.ids)  # each query's own copy is now its nearest match
