"""The cuSpatial adapter is used only where cuSpatial is importable (and a device is present); then the GPU
engine's answers, with cuSpatial's candidates and our refine, equal the CPU engine's."""

from __future__ import annotations

import numpy as np
import pytest

from service.devices import probe_cuda
from spatial import cuspatial_adapter
from spatial.cpu_engine import CpuSpatialEngine
from spatial.cuda_engine import CudaSpatialEngine
from spatial.layers import parse_layer
from test_spatial_service import NEIGHBOUR, SQUARE_WITH_HOLE, TWO_ISLANDS, feature_collection, sample_points


def test_not_used_where_cuspatial_is_absent():
    if cuspatial_adapter.available():
        pytest.skip("cuspatial is importable here")
    assert CudaSpatialEngine().use_cuspatial is False


@pytest.mark.skipif(not (cuspatial_adapter.available() and probe_cuda().present),
                    reason="needs cuspatial (25.04, archived) and a CUDA device")
def test_cuspatial_candidates_give_the_cpu_engines_answers():
    lon, lat = sample_points(seed=5, n=5000)
    points = parse_layer("p", "points", {"lon": lon.tolist(), "lat": lat.tolist()}).geometry
    polygons = parse_layer("q", "polygons", {"geojson": feature_collection(SQUARE_WITH_HOLE, TWO_ISLANDS, NEIGHBOUR)}).geometry
    gpu = CudaSpatialEngine(use_cuspatial=True)
    got = gpu.pip_pairs(points, polygons, 0, len(points))
    want = CpuSpatialEngine().pip_pairs(points, polygons, 0, len(points))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
