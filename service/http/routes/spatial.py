"""Geometry layers and joins over HTTP: point-in-polygon (counts or paged pairs) and within-distance pairs."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from service.http.deps import RuntimeDep, domain, v1_router
from service.http.jsonnum import UNIQUE_ITEMS, Float, Int, IntList
from service.http.openapi import exactly_one_of
from spatial.manager import MAX_PAGE

router = v1_router(tags=["spatial"])

LayerName = Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
Engine = Literal["auto", "gpu", "cpu", "postgis"]
PARQUET = "application/vnd.apache.parquet"



class LayerIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of(
        ("lon", "lat"), ("geojson",), ("wkt",), ("wkb_b64",)))
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
    kind: Literal["points", "polygons"]
    lon: list[Float] | None = Field(default=None, description="Points: longitudes in degrees (-180..180).")
    lat: list[Float] | None = Field(default=None, description="Points: latitudes in degrees (-90..90).")
    geojson: dict[str, Any] | None = Field(default=None, description="A GeoJSON FeatureCollection.")
    wkt: list[str] | None = Field(default=None, min_length=1, description="WKT geometries.")
    wkb_b64: list[str] | None = Field(default=None, min_length=1, description="WKB geometries, base64-encoded.")
    ids: IntList | None = Field(default=None, json_schema_extra=UNIQUE_ITEMS,
                                description="One id per feature (default 0..n-1).")


class LayerOut(BaseModel):
    name: str
    kind: str
    count: int


class PipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    points: str
    polygons: str
    mode: Literal["counts", "pairs"] = "counts"
    engine: Engine = "auto"
    cursor: str | None = Field(default=None, description="next_cursor of the previous page of pairs.")
    page_size: Int = Field(default=10_000, ge=1, le=MAX_PAGE, description="Points per page of pairs.")


class DistanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    left: str
    right: str = Field(description="The same layer as left for a self-join (pairs i < j).")
    radius_m: Float = Field(gt=0, le=100_000, description="Great-circle distance in metres (haversine).")
    engine: Engine = "auto"
    cursor: str | None = None
    page_size: Int = Field(default=10_000, ge=1, le=MAX_PAGE)


def _answer(answer: Any) -> dict[str, Any]:
    return {**answer.body, "engine": answer.engine, "took_ms": answer.took_ms, "fallback": answer.fallback}


@router.post("/spatial/layers", status_code=201, summary="Create a layer of points or polygons")
async def create_layer(body: LayerIn, runtime: RuntimeDep) -> LayerOut:
    from spatial.layers import parse_layer

    layer = parse_layer(body.name, body.kind, body.model_dump())
    await domain(runtime, "spatial").create(layer)
    return LayerOut(name=layer.name, kind=layer.kind, count=len(layer))


@router.put("/spatial/layers/{name}", status_code=201, summary="Create a layer from a GeoParquet file",
            openapi_extra={"requestBody": {"required": True,
                                           "content": {PARQUET: {"schema": {"type": "string", "format": "binary"}}}}})
async def upload_layer(request: Request, runtime: RuntimeDep, name: str = LayerName,
                       kind: Literal["points", "polygons"] = Query()) -> LayerOut:
    from spatial.geoarrow import polygons_from_shapely
    from spatial.layers import Layer, _ids, points_from_shapes, shapes_from_geoparquet

    def decode(data: bytes) -> Layer:  # CPU work of up to seconds: off the event loop
        geoms, ids = shapes_from_geoparquet(data)
        geometry = (points_from_shapes(geoms, "geometry") if kind == "points"
                    else polygons_from_shapely(geoms, "geometry"))
        return Layer(name, kind, _ids(ids, len(geoms)), geometry)

    layer = await asyncio.to_thread(decode, await request.body())
    await domain(runtime, "spatial").create(layer)
    return LayerOut(name=name, kind=kind, count=len(layer))


@router.get("/spatial/layers", summary="List layers")
async def list_layers(runtime: RuntimeDep) -> list[LayerOut]:
    return [LayerOut(name=layer.name, kind=layer.kind, count=len(layer))
            for layer in domain(runtime, "spatial").layers.values()]


@router.delete("/spatial/layers/{name}", status_code=204, summary="Delete a layer")
async def delete_layer(runtime: RuntimeDep, name: str = LayerName) -> Response:
    await domain(runtime, "spatial").drop(name)
    return Response(status_code=204)


@router.post("/spatial/joins/point-in-polygon", summary="Which points fall in which polygons")
async def point_in_polygon(body: PipRequest, runtime: RuntimeDep) -> dict[str, Any]:
    return _answer(await domain(runtime, "spatial").point_in_polygon(body.points, body.polygons, body.mode, body.engine,
                                                           body.cursor, body.page_size))


@router.post("/spatial/joins/within-distance", summary="Pairs of points within a distance on the sphere")
async def within_distance(body: DistanceRequest, runtime: RuntimeDep) -> dict[str, Any]:
    return _answer(await domain(runtime, "spatial").within_distance(body.left, body.right, body.radius_m, body.engine,
                                                          body.cursor, body.page_size))
