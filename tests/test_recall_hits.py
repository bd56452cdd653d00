"""indexes/manager_recall.count_hits, the vectorised recall count, against the plain per-query definition."""

from __future__ import annotations

import numpy as np

from indexes.manager_recall import count_hits


def per_query_hits(ids, truth_rows, truth_d, got_ids, got_d, k) -> int:
    """The definition: a returned id counts when it is a true neighbour or ties the k-th true distance."""
    hits = 0
    for qi, got in enumerate(got_ids):
        exact = set(ids[truth_rows[qi][truth_rows[qi] >= 0]].tolist())
        kth = truth_d[qi][min(k, len(exact)) - 1]
        hits += sum(1 for i, d in zip(got, got_d[qi]) if i in exact or d <= kth + 1e-5 * max(1.0, abs(kth)))
    return hits


def test_count_hits_equals_the_per_query_definition_on_ragged_answers_and_ties():
    rng = np.random.default_rng(1)
    for trial in range(303):  # the last three span several of count_hits' chunks of queries
        n, queries, k = int(rng.integers(1, 40)), int(rng.integers(1, 30)), int(rng.integers(1, 12))
        queries = queries if trial < 300 else 1300 + trial
        ids = rng.permutation(1000)[:n].astype(np.int64)
        found = min(k, n)
        truth_rows, truth_d = np.full((queries, k), -1), np.full((queries, k), np.inf)
        for q in range(queries):
            truth_rows[q, :found] = rng.permutation(n)[:found]
            truth_d[q, :found] = np.sort(rng.integers(0, 5, found)).astype(float)  # small integers: many ties
        ragged = rng.random() < 0.5
        widths = [int(rng.integers(0, k + 1)) if ragged else k for _ in range(queries)]
        got_ids = [rng.choice(ids, m).tolist() for m in widths]
        got_d = [rng.integers(0, 6, m).astype(float).tolist() for m in widths]
        expected = per_query_hits(ids, truth_rows, truth_d, got_ids, got_d, k)
        assert count_hits(ids[np.maximum(truth_rows, 0)], truth_rows >= 0, truth_d, got_ids, got_d, k) == expected
