"""PostgreSQL, the system of record for geometry layers (binary COPY in, CSV COPY out)."""

from __future__ import annotations

import io
from typing import Any

import asyncpg
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.csv as pacsv

from .geoarrow import Points, Polygons, polygons_from_shapely, polygons_to_shapely
from .layers import Layer


class LayerExists(ValueError):
    field = "name"


class LayerNotFound(LookupError):
    def __init__(self, message: str, field: str = "layer") -> None:
        super().__init__(message)
        self.field = field  # the request's field that named it


class SpatialStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def save(self, layer: Layer) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            try:
                layer_id = await conn.fetchval(
                    "INSERT INTO spatial_layers (name, kind, count) VALUES ($1, $2, $3) RETURNING id",
                    layer.name, layer.kind, len(layer))
            except asyncpg.UniqueViolationError:
                raise LayerExists(f"layer {layer.name!r} already exists") from None
            positions = np.arange(len(layer), dtype=np.int64)
            if layer.kind == "points":
                g = layer.geometry
                table = pa.table({"layer_id": pa.array(np.full(len(layer), layer_id)), "position": positions,
                                  "id": layer.ids, "lon": g.x, "lat": g.y})
                await _copy_csv(conn, "spatial_points", table)
            else:
                import shapely

                assert isinstance(layer.geometry, Polygons)  # kind "polygons"
                wkb = shapely.to_wkb(polygons_to_shapely(layer.geometry))
                props = [orjson.dumps(p).decode() if p is not None else None
                         for p in (layer.properties or [None] * len(layer))]
                await conn.copy_records_to_table(
                    "spatial_polygons", columns=["layer_id", "position", "id", "wkb", "properties"],
                    records=[(layer_id, int(i), int(fid), bytes(b), p)
                             for i, fid, b, p in zip(positions, layer.ids, wkb, props)])

    async def drop(self, name: str) -> None:
        status = await self.pool.execute("DELETE FROM spatial_layers WHERE name = $1", name)
        if status.endswith(" 0"):
            raise LayerNotFound(f"no layer named {name!r}")

    async def versions(self) -> dict[str, int]:
        """Each layer's row id: a layer written again gets a new one."""
        return {r["name"]: r["id"] for r in await self.pool.fetch("SELECT name, id FROM spatial_layers")}

    async def names(self) -> list[str]:
        return [r["name"] for r in await self.pool.fetch("SELECT name FROM spatial_layers ORDER BY name")]

    async def load(self, name: str) -> Layer:
        row = await self.pool.fetchrow("SELECT id, kind FROM spatial_layers WHERE name = $1", name)
        if row is None:
            raise LayerNotFound(f"no layer named {name!r}")
        if row["kind"] == "points":
            buffer = io.BytesIO()
            async with self.pool.acquire() as conn:
                await conn.copy_from_query(
                    f"SELECT id, lon, lat FROM spatial_points WHERE layer_id = {int(row['id'])} ORDER BY position",
                    output=buffer, format="csv")
            table = pacsv.read_csv(io.BytesIO(buffer.getvalue()), read_options=pacsv.ReadOptions(
                column_names=["id", "lon", "lat"]), convert_options=pacsv.ConvertOptions(
                column_types={"id": pa.int64(), "lon": pa.float64(), "lat": pa.float64()}))
            points = Points(table.column("lon").to_numpy(), table.column("lat").to_numpy())
            return Layer(name, "points", table.column("id").to_numpy(), points)
        import shapely

        rows = await self.pool.fetch(
            "SELECT id, wkb, properties FROM spatial_polygons WHERE layer_id = $1 ORDER BY position", row["id"])
        geoms = shapely.from_wkb([r["wkb"] for r in rows])
        props: list[dict[str, Any] | None] = [orjson.loads(r["properties"]) if r["properties"] else None for r in rows]
        return Layer(name, "polygons", np.array([r["id"] for r in rows], dtype=np.int64),
                     polygons_from_shapely(np.asarray(geoms, dtype=object)), props)


async def _copy_csv(conn: asyncpg.Connection, table_name: str, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False))
    await conn.copy_to_table(table_name, source=io.BytesIO(sink.getvalue().to_pybytes()),
                             columns=table.column_names, format="csv")
