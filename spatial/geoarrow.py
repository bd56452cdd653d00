"""The one columnar layout every spatial engine reads (GeoArrow-style, the layout cuSpatial used).

Points: x (longitude) and y (latitude) as float64 arrays.
Polygons: vertex coordinates x, y; ring_offsets (into vertices), part_offsets (into rings), geometry_offsets
(into parts), each of length n+1 and end-exclusive. A Polygon is a geometry with one part; a MultiPolygon has
several. Within a part, ring 0 is the shell and the others are holes. This is what shapely.to_ragged_array gives,
so shapely stays the independent oracle while the engines share these buffers (numpy here, device arrays on a GPU).

Boundary rule (every engine): a point on a polygon's boundary (an edge or a vertex of its shell or of a hole)
belongs to the polygon, as shapely's `covers`. Points inside a hole do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

EDGE_TOLERANCE = 1e-9  # degrees


class GeometryError(ValueError):
    """Input geometry that cannot be used: names the feature (by position) and the reason."""

    def __init__(self, message: str, *, field: str = "features", index: int | None = None) -> None:
        super().__init__(message)
        self.field = field if index is None else f"{field}[{index}]"
        self.index = index


@dataclass(frozen=True)
class Points:
    x: np.ndarray  # float64 longitude
    y: np.ndarray  # float64 latitude

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class Polygons:
    x: np.ndarray  # float64 vertex longitudes
    y: np.ndarray  # float64 vertex latitudes
    ring_offsets: np.ndarray  # int64, n_rings + 1
    part_offsets: np.ndarray  # int64, n_parts + 1
    geometry_offsets: np.ndarray  # int64, n_geometries + 1

    def __len__(self) -> int:
        return len(self.geometry_offsets) - 1

    @property
    def n_parts(self) -> int:
        return len(self.part_offsets) - 1

    def part_geometry(self) -> np.ndarray:
        """For each part, the geometry (feature) it belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.geometry_offsets))

    def part_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Bounding box of every part: minx, miny, maxx, maxy. Each part's vertices are contiguous (shell, then
        holes inside it), so one reduceat over the part starts gives them."""
        if self.n_parts == 0:
            return (np.empty(0),) * 4
        starts = self.ring_offsets[self.part_offsets[:-1]]
        return (np.minimum.reduceat(self.x, starts), np.minimum.reduceat(self.y, starts),
                np.maximum.reduceat(self.x, starts), np.maximum.reduceat(self.y, starts))


def points_from_lonlat(lon: object, lat: object, field: str | None = None) -> Points:
    """Points from longitudes and latitudes in degrees; an error names `lon[i]` / `lat[i]`, or with `field`
    (the points came as WKT, WKB or GeoJSON) `field[i]`."""
    x = np.ascontiguousarray(lon, dtype=np.float64)
    y = np.ascontiguousarray(lat, dtype=np.float64)
    if x.ndim != 1 or y.ndim != 1 or len(x) != len(y):
        raise GeometryError("lon and lat must be equal-length lists of numbers", field="lon")
    for values, name, limit in ((x, "lon", 180.0), (y, "lat", 90.0)):
        bad = ~np.isfinite(values) | (np.abs(values) > limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise GeometryError(f"{name} {float(values[i])!r} is outside [-{limit:g}, {limit:g}]",
                                field=field or name, index=i)
    return Points(x, y)


def polygons_from_shapely(geoms: np.ndarray, field: str = "features") -> Polygons:
    """Polygons / MultiPolygons (validated first) to the shared layout."""
    import shapely

    geoms = np.asarray(geoms, dtype=object)
    for i, g in enumerate(geoms):
        if g is None or g.is_empty:
            raise GeometryError("is empty", field=field, index=i)
        if g.geom_type not in ("Polygon", "MultiPolygon"):
            raise GeometryError(f"is a {g.geom_type}, not a Polygon or MultiPolygon", field=field, index=i)
    valid = shapely.is_valid(geoms)
    if not valid.all():
        i = int(np.argmin(valid))
        raise GeometryError(f"is not a valid polygon: {shapely.is_valid_reason(geoms[i])}", field=field, index=i)
    bounds = shapely.bounds(geoms)
    # A hair of tolerance: published data such as Natural Earth reaches 180.00000000000006 (then clamped).
    outside = (np.abs(bounds[:, [0, 2]]) > 180 + EDGE_TOLERANCE).any(axis=1) | \
        (np.abs(bounds[:, [1, 3]]) > 90 + EDGE_TOLERANCE).any(axis=1)
    if outside.any():
        raise GeometryError("has coordinates outside lon [-180, 180] / lat [-90, 90]", field=field,
                            index=int(np.argmax(outside)))
    if len(geoms) == 0:
        raise GeometryError("holds no polygons", field=field)
    as_multi = np.array([_as_multi(g) for g in geoms], dtype=object)
    _, coords, (ring_offsets, part_offsets, geometry_offsets) = shapely.to_ragged_array(as_multi)
    return Polygons(np.clip(coords[:, 0], -180, 180), np.clip(coords[:, 1], -90, 90),
                    ring_offsets.astype(np.int64), part_offsets.astype(np.int64), geometry_offsets.astype(np.int64))


def _as_multi(geom: Any) -> Any:
    """The uniform layout: every feature as a MultiPolygon, without empty parts (`MULTIPOLYGON(EMPTY, ...)` is
    valid, but an empty part's offsets crash shapely.from_ragged_array, and it covers nothing)."""
    import shapely

    if geom.geom_type == "Polygon":
        return shapely.MultiPolygon([geom])
    parts = list(geom.geoms)
    return geom if all(not p.is_empty for p in parts) else shapely.MultiPolygon([p for p in parts if not p.is_empty])


def polygons_to_shapely(polygons: Polygons) -> np.ndarray:
    import shapely

    coords = np.column_stack([polygons.x, polygons.y])
    return shapely.from_ragged_array(shapely.GeometryType.MULTIPOLYGON, coords,
                                     (polygons.ring_offsets, polygons.part_offsets, polygons.geometry_offsets))


def point_range(n: int, start: int | None, stop: int | None) -> tuple[int, int]:
    """A [start, stop) range of point positions (None: from the first / to the last)."""
    start = 0 if start is None else int(start)
    stop = n if stop is None else int(stop)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"[start, stop) = [{start}, {stop}) is not a range within [0, {n}]")
    return start, stop


def pairs_prefix(cumulative: np.ndarray, max_pairs: int | None) -> int:
    """How many leading points of a page fit `max_pairs` pairs, given their cumulative pair counts: whole points
    only, and at least one (a point with more pairs than that is returned whole). Every engine cuts here, so a
    within-distance page never allocates more than one page of pairs plus one point's."""
    m = len(cumulative)
    if max_pairs is None or m == 0 or cumulative[-1] <= max_pairs:
        return m
    return max(1, int(np.searchsorted(cumulative, max_pairs, side="right")))


def check_distance_join(a: Points, b: Points, radius_m: float, start: int | None, stop: int | None,
                        self_join: bool) -> tuple[int, int, float]:
    """The arguments every engine's within_distance checks the same way: (start, stop, radius_m)."""
    start, stop = point_range(len(a), start, stop)
    radius_m = float(radius_m)
    if not radius_m >= 0 or not np.isfinite(radius_m):
        raise ValueError(f"radius_m must be a finite number >= 0, not {radius_m!r}")
    if self_join and len(a) != len(b):
        raise ValueError("a self-join needs a and b to be the same points")
    for pts, label in ((a, "a"), (b, "b")):
        if not (np.isfinite(pts.x).all() and np.isfinite(pts.y).all()):
            raise ValueError(f"{label} holds a coordinate that is not a finite number")
    return start, stop, radius_m
