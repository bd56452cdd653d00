"""Geometry layers from what clients send: lon/lat arrays, GeoJSON, WKT, WKB or GeoParquet, checked and turned
into the shared GeoArrow-style buffers. Every error names the feature (by position) and the reason."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from .geoarrow import GeometryError, Points, Polygons, points_from_lonlat, polygons_from_shapely


@dataclass
class Layer:
    name: str
    kind: str  # "points" | "polygons"
    ids: np.ndarray  # int64, one per feature
    geometry: Points | Polygons
    properties: list[dict[str, Any] | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)


def _ids(ids: Any, n: int) -> np.ndarray:
    if ids is None:
        return np.arange(n, dtype=np.int64)
    try:
        array = np.asarray(ids, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        raise GeometryError("ids must be integers", field="ids") from None
    if array.shape != (n,):
        raise GeometryError(f"{len(array)} ids for {n} features", field="ids")
    if len(np.unique(array)) != n:
        raise GeometryError("ids must be unique", field="ids")
    return array


# How deep a GeoJSON geometry's positions lie in its coordinates: a Point's is a position, a Polygon's a list of
# rings of positions. Other types (GeometryCollection, MultiLineString) are no layer's geometry.
GEOJSON_DEPTH = {"Point": 0, "MultiPoint": 1, "LineString": 1, "Polygon": 2, "MultiPolygon": 3}


def _positions_nested(coordinates: Any, depth: int) -> bool:
    """Whether `coordinates` are lists `depth` deep of positions, each [lon, lat] or [lon, lat, z] numbers (JSON
    numbers: shapely would read "1" or true as one)."""
    if depth < 0 or not isinstance(coordinates, list):
        return False
    if depth == 0:
        return 2 <= len(coordinates) <= 3 and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) for c in coordinates)
    return all(_positions_nested(c, depth - 1) for c in coordinates)


def _shapes_from_geojson(data: Any) -> tuple[np.ndarray, list[Any], list[dict | None]]:
    import shapely

    if (not isinstance(data, dict) or data.get("type") != "FeatureCollection"
            or not isinstance(data.get("features"), list)):
        raise GeometryError("must be a GeoJSON FeatureCollection", field="geojson")
    geoms, ids, props = [], [], []
    for i, feature in enumerate(data["features"]):
        if not isinstance(feature, dict) or not isinstance(feature.get("geometry"), dict):
            raise GeometryError("is not a GeoJSON Feature with a geometry", field="geojson.features", index=i)
        geometry = feature["geometry"]
        if not _positions_nested(geometry.get("coordinates"), GEOJSON_DEPTH.get(geometry.get("type"), -1)):
            raise GeometryError("is not a GeoJSON Point, MultiPoint, LineString, Polygon or MultiPolygon whose "
                                "coordinates are [lon, lat] numbers nested as its type says",
                                field="geojson.features", index=i)
        try:
            geoms.append(shapely.geometry.shape(geometry))
        # NotImplementedError: shapely's answer to a geometry it does not model (a curve), not a stub of ours
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, NotImplementedError,
                shapely.errors.GEOSException) as exc:
            raise GeometryError(f"has an unreadable geometry ({exc})", field="geojson.features", index=i) from None
        ids.append(feature.get("id"))
        props.append(feature.get("properties"))
    return np.array(geoms, dtype=object), ids, props


def _shapes_from_text(values: Any, field: str) -> np.ndarray:
    import shapely

    if not isinstance(values, list) or not values:
        raise GeometryError("must be a non-empty list", field=field)
    out = []
    for i, value in enumerate(values):
        if isinstance(value, str) and "\x00" in value:  # GEOS would read only up to it
            raise GeometryError("holds a NUL character", field=field, index=i)
        try:
            if field == "wkt":
                out.append(shapely.from_wkt(value))
            else:
                out.append(shapely.from_wkb(base64.b64decode(value, validate=True)))
        except (binascii.Error, ValueError, TypeError, NotImplementedError,  # NotImplementedError: a curve
                shapely.errors.GEOSException) as exc:
            raise GeometryError(f"is not valid {field.upper().replace('_B64', '')} ({str(exc)[:120]})", field=field,
                                index=i) from None
    return np.array(out, dtype=object)


MAX_UPLOAD_ROWS = 5_000_000  # rows of one GeoParquet layer upload
MAX_UPLOAD_BYTES = 1 << 30  # its decompressed size


def shapes_from_geoparquet(data: bytes, max_rows: int = MAX_UPLOAD_ROWS,
                           max_bytes: int = MAX_UPLOAD_BYTES) -> tuple[np.ndarray, list[Any] | None]:
    """A GeoParquet file's `geometry` column (WKB) and its `id` column if it has one. The file's own metadata
    (rows, uncompressed size) is checked against the limits before anything is decompressed: a 10 KB file once
    inflated to 2,000,000 points."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import shapely

    try:
        meta = pq.ParquetFile(io.BytesIO(data)).metadata
        inflated = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > max_rows:
            raise GeometryError(f"holds {meta.num_rows:,} rows; a layer upload takes at most {max_rows:,}",
                                field="body")
        if inflated > max_bytes:
            raise GeometryError(f"decompresses to {inflated:,} bytes; a layer upload takes at most {max_bytes:,}",
                                field="body")
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise GeometryError(f"is not a readable Parquet file ({exc})", field="body") from None
    if "geometry" not in table.column_names:
        raise GeometryError(f"has no 'geometry' column; it has {table.column_names}", field="body")
    try:
        geoms = shapely.from_wkb(table.column("geometry").to_numpy(zero_copy_only=False))
    except (ValueError, shapely.errors.GEOSException) as exc:
        raise GeometryError(f"geometry column is not WKB ({exc})", field="geometry") from None
    ids = table.column("id").to_pylist() if "id" in table.column_names else None
    return np.asarray(geoms, dtype=object), ids


def points_from_shapes(geoms: np.ndarray, field: str) -> Points:
    import shapely

    for i, g in enumerate(geoms):
        if g is None or g.geom_type != "Point" or g.is_empty:
            raise GeometryError(f"is not a Point ({getattr(g, 'geom_type', None)})", field=field, index=i)
    coords = shapely.get_coordinates(geoms)
    return points_from_lonlat(coords[:, 0], coords[:, 1], field)


def parse_layer(name: str, kind: str, body: dict[str, Any]) -> Layer:
    """A layer from a JSON body: points from lon/lat, geojson, wkt or wkb_b64; polygons from geojson, wkt, wkb_b64."""
    given = [k for k in ("lon", "geojson", "wkt", "wkb_b64") if body.get(k) is not None]
    if len(given) != 1:
        raise GeometryError("give exactly one of lon/lat, geojson, wkt and wkb_b64", field="body")
    source = given[0]
    if kind == "points" and source == "lon":
        geometry: Points | Polygons = points_from_lonlat(body["lon"], body.get("lat", []))
        return Layer(name, kind, _ids(body.get("ids"), len(geometry)), geometry)
    if source == "lon":
        raise GeometryError("polygon layers come as geojson, wkt or wkb_b64", field="lon")
    props = None
    if source == "geojson":
        geoms, feature_ids, props = _shapes_from_geojson(body["geojson"])
        ids = body.get("ids") or (feature_ids if all(isinstance(i, int) for i in feature_ids) else None)
    else:
        geoms = _shapes_from_text(body[source], source)
        ids = body.get("ids")
    field = "geojson.features" if source == "geojson" else source
    geometry = points_from_shapes(geoms, field) if kind == "points" else polygons_from_shapely(geoms, field)
    return Layer(name, kind, _ids(ids, len(geoms)), geometry, props if kind == "polygons" else None)
