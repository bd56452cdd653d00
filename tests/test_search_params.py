"""Search parameters and vector values are checked the same way whether or not a parameter set was seen before."""

import numpy as np
import pytest

from indexes.ann import check_params, search_params
from indexes.errors import InvalidInput
from indexes.vectors import check_finite


@pytest.mark.parametrize("index_type, given", [
    ("hnsw", None), ("hnsw", {"ef": 128}), ("hnsw", {"ef": 96.0}), ("ivf_pq", {"refine_ratio": 3, "n_probes": 7}),
    ("ivf_flat", {}), ("brute_force", None),
])
def test_search_params_equal_check_params_every_time(index_type, given):
    want = tuple(sorted(check_params("search", index_type, given, "params").items()))
    assert search_params(index_type, given) == want
    assert search_params(index_type, given) == want  # remembered, unchanged


@pytest.mark.parametrize("first, bad, field", [
    ({"ef": 1}, {"ef": True}, "params.ef"),  # True == 1 as a key: must not reuse ef=1's answer
    ({"ef": 64}, {"ef": [64]}, "params.ef"),  # unhashable
    ({"ef": 64}, {"ef": 10**9}, "params.ef"),
    ({"ef": 64}, {"nprobe": 3}, "params.nprobe"),
])
def test_bad_search_params_are_refused_after_good_ones(first, bad, field):
    search_params("hnsw", first)
    for _ in range(2):  # errors are never remembered as answers
        with pytest.raises(InvalidInput) as caught:
            search_params("hnsw", bad)
        assert caught.value.field == field


@pytest.mark.parametrize("value, message", [
    (np.nan, "non-finite"), (np.inf, "non-finite"), (-np.inf, "non-finite"), (1e16, "within"), (-2e15, "within"),
])
def test_check_finite_names_the_bad_value(value, message):
    matrix = np.zeros((3, 4), dtype=np.float32)
    check_finite(matrix, "vectors")
    matrix[2, 1] = value
    with pytest.raises(InvalidInput) as caught:
        check_finite(matrix, "vectors")
    assert message in str(caught.value)
    assert caught.value.field == ("vectors[2]" if message == "non-finite" else "vectors")


def test_check_finite_accepts_the_limit_and_empty():
    check_finite(np.full((2, 2), 1e15, dtype=np.float32) * np.float32(0.999), "v")
    check_finite(np.zeros((0, 4), dtype=np.float32), "v")


def test_default_pq_dim_divides_dim_and_fills_whole_bytes():
    from indexes.ann import default_pq_dim

    for dim in (4, 12, 24, 100, 128, 768, 7):
        for bits in (4, 5, 6, 7, 8):
            m = default_pq_dim(dim, bits)
            if m:
                assert dim % m == 0 and (m * bits) % 8 == 0 and m <= max(1, dim // 4)
            else:  # no divisor fits: every divisor up to dim/4 leaves a partial byte
                assert all(dim % d or (d * bits) % 8 for d in range(1, max(1, dim // 4) + 1))
    assert default_pq_dim(128) == 32 and default_pq_dim(100, 5) == 0
