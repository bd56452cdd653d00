"""Thin cuSpatial adapter: where `cuspatial` is importable, its quadtree and bounding-box join produce the
point-in-polygon candidates; the refine stays ours (spatial/cuda_engine.py), so the boundary rule is the same
as every other engine's (cuSpatial's own refine excludes boundary points).

cuSpatial is archived upstream (25.04 was its last release, pinned to cuDF/RMM 25.04), so it cannot share an
environment with this project's `gpu` extra; this is only used when a user's environment already has it.
Calls follow cuSpatial 25.04 (rapidsai/cuspatial v25.04.00, python/cuspatial/cuspatial/core/spatial/indexing.py,
join.py, bounding.py, and core/binpreds/contains.py::_quadtree_contains_properly for the chain). Never run here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .geoarrow import Polygons


def available() -> bool:
    try:
        return importlib.util.find_spec("cuspatial") is not None
    except (ImportError, ValueError):
        return False


def candidates(xp: Any, px: Any, py: Any, polygons: Polygons, extent: tuple[float, float, float, float],
               scale: float, max_depth: int, max_size: int) -> tuple[Any, Any, Any, Any]:
    """(point_indices, pair_part, pair_first, pair_count) as cuda_engine's refine expects them: point_indices
    orders the points by quadrant; each pair is a polygon part and a run of point_indices to test against it."""
    import cudf
    import cuspatial

    xmin, ymin, xmax, ymax = extent
    xy = xp.empty(2 * px.shape[0], dtype=xp.float64)
    xy[0::2], xy[1::2] = px, py
    # GeoSeries.from_points_xy(interleaved xy); from_polygons_xy(xy, ring_offset, part_offset, geometry_offset).
    points = cuspatial.GeoSeries.from_points_xy(cudf.Series(xy))
    pxy = xp.empty(2 * len(polygons.x), dtype=xp.float64)
    pxy[0::2], pxy[1::2] = xp.asarray(polygons.x), xp.asarray(polygons.y)
    polys = cuspatial.GeoSeries.from_polygons_xy(
        cudf.Series(pxy), cudf.Series(xp.asarray(polygons.ring_offsets)), cudf.Series(xp.asarray(polygons.part_offsets)),
        cudf.Series(xp.asarray(polygons.geometry_offsets)))
    # quadtree_on_points(points, x_min, x_max, y_min, y_max, scale, max_depth, max_size)
    #   -> (point_indices, quadtree[key, level, is_internal_node, length, offset])
    point_indices, quadtree = cuspatial.quadtree_on_points(points, xmin, xmax, ymin, ymax, scale, max_depth, max_size)
    bboxes = cuspatial.polygon_bounding_boxes(polys)  # one row per polygon part
    # join_quadtree_and_bounding_boxes(...) -> DataFrame[bbox_offset, quad_offset], quad_offset naming leaf quadrants
    pairs = cuspatial.join_quadtree_and_bounding_boxes(quadtree, bboxes, xmin, xmax, ymin, ymax, scale, max_depth)
    quad = pairs["quad_offset"].values
    return (xp.asarray(point_indices.values).astype(xp.int64), xp.asarray(pairs["bbox_offset"].values).astype(xp.int64),
            xp.asarray(quadtree["offset"].values[quad]).astype(xp.int64),
            xp.asarray(quadtree["length"].values[quad]).astype(xp.int64))
