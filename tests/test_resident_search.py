"""indexes/resident_search.py's answer shaping: per query, its valid results in order, however large the batch."""

from __future__ import annotations

import numpy as np

from indexes import resident_search
from indexes.resident_search import _shape


def test_a_batch_is_shaped_in_pieces_as_row_by_row(monkeypatch):
    """Converted SHAPE_ROWS queries at a time (so the GIL is let go between pieces), with the rows the engines
    ended with -1 (fewer results than k) cut there, on either side of every piece's edge."""
    monkeypatch.setattr(resident_search, "SHAPE_ROWS", 7)
    rng = np.random.default_rng(3)
    for queries, k in ((1, 1), (7, 3), (50, 5), (0, 4)):
        ids = rng.integers(0, 1000, (queries, k))
        distances = rng.random((queries, k)).astype(np.float32)
        cut = rng.integers(0, k + 1, queries)  # valid results per query
        for q in range(queries):
            ids[q, cut[q]:] = -1
        got = _shape(ids, distances, watermark=9)
        assert got.watermark == 9 and len(got.ids) == len(got.distances) == queries
        for q in range(queries):
            assert got.ids[q] == ids[q, :cut[q]].tolist()
            assert got.distances[q] == distances[q, :cut[q]].tolist()
