"""PostGIS engine: the same joins as SQL, used only when the configured PostgreSQL has PostGIS.

A layer is given geometry tables the first time PostGIS joins it (points as geometry and geography, polygons as
geometry, each with a GiST index), built from the system-of-record tables spatial_points / spatial_polygons.
Point-in-polygon uses ST_Intersects on planar lon/lat geometry: for a point that is exactly the `covers` rule of
the other engines. The distance join uses ST_DWithin on geography with use_spheroid = false (a sphere of PostGIS's
mean radius, 6,371,008.77 m against the other engines' 6,371,008.8 m: pairs within a few micrometres of the
radius may be decided differently).
"""

from __future__ import annotations

from typing import Any

import asyncpg
import numpy as np

from .geoarrow import pairs_prefix


class PostgisEngine:
    name = "postgis"
    kind = "postgis"

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._ready_layers: set[int] = set()

    async def start(self) -> None:
        await self.pool.execute("CREATE EXTENSION IF NOT EXISTS postgis")

    async def _layer(self, conn: asyncpg.Connection, name: str) -> tuple[int, str]:
        row = await conn.fetchrow("SELECT id, kind FROM spatial_layers WHERE name = $1", name)
        if row is None:
            raise LookupError(f"no layer named {name!r}")
        layer_id, kind = row["id"], row["kind"]
        if layer_id not in self._ready_layers:
            table = f"spatial_postgis_{layer_id}"
            if kind == "points":
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {table} AS SELECT position, "
                    f"ST_SetSRID(ST_MakePoint(lon, lat), 4326) AS geom, "
                    f"ST_SetSRID(ST_MakePoint(lon, lat), 4326)::geography AS geog "
                    f"FROM spatial_points WHERE layer_id = {int(layer_id)}")
                await conn.execute(f"CREATE INDEX IF NOT EXISTS {table}_geog ON {table} USING gist (geog)")
            else:
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {table} AS SELECT position, "
                    "ST_Multi(ST_GeomFromWKB(wkb, 4326)) AS geom FROM spatial_polygons "
                    f"WHERE layer_id = {int(layer_id)}")
            await conn.execute(f"CREATE INDEX IF NOT EXISTS {table}_geom ON {table} USING gist (geom)")
            await conn.execute(f"ANALYZE {table}")
            self._ready_layers.add(layer_id)
        return layer_id, f"spatial_postgis_{layer_id}"

    async def pip_counts(self, points: str, polygons: str) -> np.ndarray:
        async with self.pool.acquire() as conn:
            _, pts = await self._layer(conn, points)
            _, polys = await self._layer(conn, polygons)
            rows = await conn.fetch(
                f"SELECT g.position, count(p.position) AS n FROM {polys} g LEFT JOIN {pts} p "
                f"ON ST_Intersects(g.geom, p.geom) GROUP BY g.position ORDER BY g.position")
        return np.array([r["n"] for r in rows], dtype=np.int64)

    async def pip_pairs(self, points: str, polygons: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return (await self.pip_pairs_page(points, polygons, start, stop))[:2]

    async def pip_pairs_page(self, points: str, polygons: str, start: int, stop: int, max_pairs: int | None = None
                             ) -> tuple[np.ndarray, np.ndarray, int]:
        """pip_pairs for the leading points whose pairs fit max_pairs, and the position after the last point
        covered: counted per point first, as within_distance_page."""
        async with self.pool.acquire() as conn:
            _, pts = await self._layer(conn, points)
            _, polys = await self._layer(conn, polygons)
            join = (f"FROM {pts} p JOIN {polys} g ON ST_Intersects(g.geom, p.geom) "
                    "WHERE p.position >= $1 AND p.position < $2")
            if max_pairs is not None:
                counted = await conn.fetch(f"SELECT p.position AS i, count(*) AS c {join} GROUP BY 1 ORDER BY 1",
                                           start, stop)
                positions, counts = _columns(counted, "i", "c")
                kept = pairs_prefix(np.cumsum(counts), max_pairs)
                if kept < len(positions):
                    stop = int(positions[kept])  # the first point whose pairs do not fit starts the next page
            rows = await conn.fetch(f"SELECT p.position AS i, g.position AS j {join} ORDER BY 1, 2", start, stop)
        i, j = _columns(rows, "i", "j")
        return i, j, stop

    async def within_distance(self, left: str, right: str, radius_m: float, start: int, stop: int,
                              self_join: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (await self.within_distance_page(left, right, radius_m, start, stop, self_join))[:3]

    async def within_distance_page(self, left: str, right: str, radius_m: float, start: int, stop: int,
                                   self_join: bool, max_pairs: int | None = None
                                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """within_distance for the leading points whose pairs fit max_pairs, and the position after the last
        point covered. The pairs are counted per point first, so no more than a page's rows are fetched."""
        async with self.pool.acquire() as conn:
            _, a = await self._layer(conn, left)
            _, b = await self._layer(conn, right)
            extra = "AND q.position > p.position" if self_join else ""
            join = (f"FROM {a} p JOIN {b} q ON ST_DWithin(p.geog, q.geog, $3, false) {extra} "
                    f"WHERE p.position >= $1 AND p.position < $2")
            if max_pairs is not None:
                counted = await conn.fetch(f"SELECT p.position AS i, count(*) AS c {join} GROUP BY 1 ORDER BY 1",
                                           start, stop, radius_m)
                positions, counts = _columns(counted, "i", "c")
                kept = pairs_prefix(np.cumsum(counts), max_pairs)
                if kept < len(positions):
                    stop = int(positions[kept])  # the first point whose pairs do not fit starts the next page
            rows = await conn.fetch(f"SELECT p.position AS i, q.position AS j, ST_Distance(p.geog, q.geog, false) AS d "
                                    f"{join} ORDER BY 1, 2", start, stop, radius_m)
        i, j = _columns(rows, "i", "j")
        return i, j, np.array([r["d"] for r in rows], dtype=np.float64), stop


def _columns(rows: list[Any], *names: str) -> tuple[np.ndarray, ...]:
    return tuple(np.array([r[n] for r in rows], dtype=np.int64) for n in names)
