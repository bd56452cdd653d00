"""Point layers split across workers, polygon layers with every worker: a point-in-polygon join runs on each
worker's points against the whole polygon layer, counts add up, and pairs page through the workers in turn.

Engine-neutral and free of any distribution library: service/cluster places the partitions.
"""

from __future__ import annotations

import base64

import numpy as np
import orjson

from .geoarrow import GeometryError, Points
from .layers import Layer


def partition_of(layer: Layer, part: int, parts: int) -> Layer:
    """The points at positions part, part + parts, ... of a point layer; a polygon layer whole."""
    if layer.kind != "points" or parts == 1:
        return layer
    keep = np.arange(part, len(layer), parts)
    geometry = layer.geometry
    assert isinstance(geometry, Points)
    properties = None if layer.properties is None else [layer.properties[i] for i in keep]
    return Layer(layer.name, layer.kind, layer.ids[keep], Points(geometry.x[keep], geometry.y[keep]), properties)


def sum_counts(parts: list[dict]) -> dict:
    """One counts answer from every partition's counts over the same polygon layer."""
    first = parts[0]
    counts = np.sum([np.asarray(p["counts"], dtype=np.int64) for p in parts], axis=0)
    return {"polygon_ids": first["polygon_ids"], "counts": counts.tolist(), "points": sum(p["points"] for p in parts),
            "matched": int(counts.sum())}


def encode_cursor(part: int, inner: str | None) -> str:
    """Where the next page starts: a partition and the cursor inside it (None: its first page)."""
    return base64.urlsafe_b64encode(orjson.dumps({"part": part, "c": inner})).decode()


def decode_cursor(cursor: str | None, parts: int) -> tuple[int, str | None]:
    if cursor is None:
        return 0, None
    try:
        state = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))
        part, inner = state["part"], state["c"]
    except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        raise GeometryError("is not a cursor this service gave out", field="cursor") from None
    if type(part) is not int or not 0 <= part < parts or not (inner is None or isinstance(inner, str)):
        raise GeometryError("is not a cursor this service gave out", field="cursor")
    return part, inner


def next_cursor(part: int, parts: int, inner_next: str | None) -> str | None:
    """After a page of partition `part`: more of it, else the next partition's first page, else the end."""
    if inner_next is not None:
        return encode_cursor(part, inner_next)
    return encode_cursor(part + 1, None) if part + 1 < parts else None
