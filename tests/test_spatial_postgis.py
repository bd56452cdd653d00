"""The PostGIS engine answers as the CPU engine does, on a real PostGIS. Needs a PostgreSQL where PostGIS is
installable: SWITCHYARD_TEST_POSTGIS_URL=postgresql://user:pass@host:port/db (the user may create databases),
e.g. Debian's postgresql-15-postgis-3. Skipped without one: the embedded PostgreSQL ships no PostGIS.
The engine is driven directly (the spatial tables of migration 0004 are all it reads), so the server need not
have pgvector."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import fresh_database, run
from service.database.migrate import load_migrations
from service.database.postgres import open_pool
from spatial.cpu_engine import CpuSpatialEngine
from spatial.layers import parse_layer
from spatial.postgis_engine import PostgisEngine
from spatial.store import SpatialStore
from test_spatial_service import NEIGHBOUR, SQUARE_WITH_HOLE, TWO_ISLANDS, feature_collection, sample_points

POSTGIS_URL = os.environ.get("SWITCHYARD_TEST_POSTGIS_URL")
pytestmark = pytest.mark.skipif(not POSTGIS_URL, reason="postgis engine: set SWITCHYARD_TEST_POSTGIS_URL to a "
                                "PostgreSQL with PostGIS installable (the embedded PostgreSQL has none)")


def test_postgis_answers_equal_the_cpu_engine():
    lon, lat = sample_points(seed=3, n=2000)
    points = parse_layer("pts", "points", {"lon": lon.tolist(), "lat": lat.tolist()})
    polygons = parse_layer("polys", "polygons",
                           {"geojson": feature_collection(SQUARE_WITH_HOLE, TWO_ISLANDS, NEIGHBOUR)})
    rng = np.random.default_rng(9)
    near = parse_layer("near", "points", {"lon": rng.normal(2.35, 0.01, 400).tolist(),
                                          "lat": rng.normal(48.85, 0.01, 400).tolist()})
    cpu = CpuSpatialEngine()

    async def check(dsn: str) -> None:
        pool = await open_pool(dsn, min_size=1, max_size=2, command_timeout=120, init=None)
        try:
            spatial_tables = next(m for m in load_migrations() if m.name == "spatial_layers")
            await pool.execute(spatial_tables.sql)
            store = SpatialStore(pool)
            for layer in (points, polygons, near):
                await store.save(layer)
            engine = PostgisEngine(pool)
            await engine.start()
            counts = await engine.pip_counts("pts", "polys")
            assert counts.tolist() == np.asarray(cpu.pip_counts(points.geometry, polygons.geometry)).tolist()
            got = await engine.pip_pairs("pts", "polys", 0, len(points))
            want = cpu.pip_pairs(points.geometry, polygons.geometry, 0, len(points))
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
            gi, gj, gd = await engine.within_distance("near", "near", 500.0, 0, len(near), True)
            wi, wj, wd = cpu.within_distance(near.geometry, near.geometry, 500.0, 0, len(near), True)
            assert np.array_equal(gi, wi) and np.array_equal(gj, wj) and len(wi) > 100
            np.testing.assert_allclose(gd, wd, rtol=1e-6)
        finally:
            await pool.close()

    with fresh_database(POSTGIS_URL, "postgis_engine") as dsn:
        run(check(dsn))
