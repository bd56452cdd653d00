"""FAISS filtered searches reuse a filter's bitmap while its mask is the same array, and never another's."""

from __future__ import annotations

import numpy as np
import pytest

from indexes.ann import IndexConfig
from indexes.faiss_index import FaissIndex
from vector_data import clustered

DIM = 8


@pytest.mark.parametrize("index_type, params", [("brute_force", {}), ("hnsw", {"ef": 200})])
def test_a_filters_bitmap_is_made_once_per_mask_and_each_mask_is_obeyed(index_type, params):
    build = {"m": 16, "ef_construction": 64} if index_type == "hnsw" else {}
    index = FaissIndex.build(IndexConfig(index_type, "l2", DIM, build), clustered(2000, DIM, seed=1), threads=1)
    queries = clustered(20, DIM, seed=2)
    even = np.arange(2000) % 2 == 0
    _, rows = index.search(queries, 10, params, even)
    assert (rows % 2 == 0).all()
    cached = index._filtered
    _, again = index.search(queries, 10, params, even[:2000])  # a view of the same mask: the same bitmap
    assert index._filtered is cached and (again == rows).all()
    for _ in range(3):  # new masks, whatever their addresses: each obeyed
        odd = np.arange(2000) % 2 == 1
        _, rows = index.search(queries, 10, params, odd)
        assert (rows % 2 == 1).all() and index._filtered is not cached
        del odd
    _, tens = index.search(queries, 5, params, np.arange(2000) % 10 == 0)
    assert (tens % 10 == 0).all() and tens.shape == (20, 5)
