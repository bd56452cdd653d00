"""Geometry layers and joins through the service: answers equal shapely's (covers) and a brute-force haversine,
pages of pairs add up to the whole answer, layers survive a restart, bad input is a 4xx naming the feature."""

from __future__ import annotations

import base64
import io
import json
import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import shapely
from fastapi.testclient import TestClient

from conftest import fresh_database
from helpers import assert_problem, wait_ready
from service.http.app import create_app

SQUARE_WITH_HOLE = {"type": "Polygon", "coordinates": [
    [[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]], [[4, 4], [6, 4], [6, 6], [4, 6], [4, 4]]]}
TWO_ISLANDS = {"type": "MultiPolygon", "coordinates": [
    [[[20, 0], [25, 0], [25, 5], [20, 5], [20, 0]]], [[[30, 0], [35, 0], [32, 5], [30, 0]]]]}
ACROSS_ANTIMERIDIAN = {"type": "MultiPolygon", "coordinates": [  # split at +-180, as RFC 7946 asks
    [[[170, -10], [180, -10], [180, 10], [170, 10], [170, -10]]],
    [[[-180, -10], [-170, -10], [-170, 10], [-180, 10], [-180, -10]]]]}
NEIGHBOUR = {"type": "Polygon", "coordinates": [[[10, 0], [15, 0], [15, 10], [10, 10], [10, 0]]]}  # shares x = 10


def feature_collection(*geometries):
    return {"type": "FeatureCollection", "features": [
        {"type": "Feature", "id": 100 + i, "geometry": g, "properties": {"n": i}} for i, g in enumerate(geometries)]}


def sample_points(seed: int = 0, n: int = 3000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lon = rng.uniform(-5, 40, n)
    lat = rng.uniform(-15, 15, n)
    # Points exactly on vertices and edges (shared, diagonal, hole), in holes, and near the antimeridian.
    special = np.array([[0, 0], [10, 5], [10, 10], [5, 4], [4, 5], [5, 5], [32.5, 2.5], [31, 1.6666666666666667],
                        [180, 0], [-180, 0], [179.999, 9.999], [-175, -10], [20, 2.5], [15, 10]])
    lon = np.concatenate([lon, special[:, 0], rng.uniform(165, 180, 200), rng.uniform(-180, -165, 200)])
    lat = np.concatenate([lat, special[:, 1], rng.uniform(-12, 12, 400)])
    return lon, lat


@pytest.fixture
def app(make_settings, server_dsn, request):
    """A service on a database of this test's own (layer names are reused from test to test)."""
    with fresh_database(server_dsn, request.node.name) as dsn:
        with TestClient(create_app(make_settings(database_url=dsn))) as client:
            wait_ready(client)
            yield client


@pytest.fixture
def layers(app):
    lon, lat = sample_points()
    assert app.post("/v1/spatial/layers", json={"name": "pts", "kind": "points", "lon": lon.tolist(),
                                                "lat": lat.tolist()}).status_code == 201
    polys = feature_collection(SQUARE_WITH_HOLE, TWO_ISLANDS, ACROSS_ANTIMERIDIAN, NEIGHBOUR)
    r = app.post("/v1/spatial/layers", json={"name": "polys", "kind": "polygons", "geojson": polys})
    assert r.status_code == 201, r.text
    return lon, lat, polys


def oracle_pairs(lon, lat, polys) -> set[tuple[int, int]]:
    points = shapely.points(lon, lat)
    out = set()
    for f in polys["features"]:
        geom = shapely.geometry.shape(f["geometry"])
        for i in np.flatnonzero(shapely.covers(geom, points)):
            out.add((int(i), f["id"]))
    return out


def test_counts_equal_shapely_covers(app, layers):
    lon, lat, polys = layers
    body = app.post("/v1/spatial/joins/point-in-polygon", json={"points": "pts", "polygons": "polys"}).json()
    truth = oracle_pairs(lon, lat, polys)
    want = [sum(1 for _, p in truth if p == f["id"]) for f in polys["features"]]
    assert body["polygon_ids"] == [f["id"] for f in polys["features"]]
    assert body["counts"] == want and body["engine"] == "cpu-spatial"


def test_pairs_paged_with_a_cursor_add_up_to_shapely(app, layers):
    lon, lat, polys = layers
    got, cursor, pages = [], None, 0
    while True:
        body = app.post("/v1/spatial/joins/point-in-polygon", json={
            "points": "pts", "polygons": "polys", "mode": "pairs", "cursor": cursor, "page_size": 500}).json()
        got.extend(tuple(p) for p in body["pairs"])
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert pages > 3
    assert len(got) == len(set(got)) and set(got) == oracle_pairs(lon, lat, polys)


def haversine_m(lon1, lat1, lon2, lat2, r=6371008.8):
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * r * math.asin(math.sqrt(a))


def test_within_distance_equals_brute_force(app):
    rng = np.random.default_rng(4)
    centers = np.array([[2.35, 48.85], [179.99, -16.5], [-179.99, -16.5], [0, 89.99], [-73.98, 40.75]])
    pts = centers[rng.integers(0, len(centers), 800)] + rng.normal(0, 0.01, (800, 2))
    pts[:, 0] = (pts[:, 0] + 180) % 360 - 180
    pts[:, 1] = np.clip(pts[:, 1], -90, 90)
    assert app.post("/v1/spatial/layers", json={"name": "near", "kind": "points", "lon": pts[:, 0].tolist(),
                                                "lat": pts[:, 1].tolist()}).status_code == 201
    got, cursor = {}, None
    while True:
        body = app.post("/v1/spatial/joins/within-distance", json={"left": "near", "right": "near", "radius_m": 1000,
                                                                   "cursor": cursor, "page_size": 100}).json()
        for (i, j), d in zip(body["pairs"], body["distances_m"]):
            got[(i, j)] = d
        cursor = body["next_cursor"]
        if cursor is None:
            break
    want = {}
    for i in range(len(pts)):
        for j in range(i + 1, len(pts)):
            d = haversine_m(pts[i, 0], pts[i, 1], pts[j, 0], pts[j, 1])
            if d <= 1000:
                want[(i, j)] = d
    assert set(got) == set(want) and len(want) > 1000
    assert any(abs(pts[i, 0]) > 179.9 and pts[i, 0] * pts[j, 0] < 0 for i, j in want)  # pairs across +-180
    for key, d in want.items():
        assert got[key] == pytest.approx(d, rel=1e-9, abs=1e-6)


def test_geoparquet_upload(app):
    rng = np.random.default_rng(2)
    lon, lat = rng.uniform(0, 10, 50), rng.uniform(0, 10, 50)
    table = pa.table({"id": np.arange(1000, 1050), "geometry": shapely.to_wkb(shapely.points(lon, lat))})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    r = app.put("/v1/spatial/layers/gp?kind=points", content=sink.getvalue(),
                headers={"content-type": "application/vnd.apache.parquet"})
    assert r.status_code == 201 and r.json()["count"] == 50
    polys = feature_collection(SQUARE_WITH_HOLE)
    app.post("/v1/spatial/layers", json={"name": "sq", "kind": "polygons", "geojson": polys})
    body = app.post("/v1/spatial/joins/point-in-polygon",
                    json={"points": "gp", "polygons": "sq", "mode": "pairs"}).json()
    assert {p[0] for p in body["pairs"]} == {1000 + i for i, _ in oracle_pairs(lon, lat, polys)}


def test_a_geoparquet_bomb_is_refused_from_its_metadata(app):
    from spatial.layers import MAX_UPLOAD_ROWS

    # One repeated point compresses to a few KB however many rows there are.
    rows = MAX_UPLOAD_ROWS + 1
    table = pa.table({"geometry": pa.array([shapely.to_wkb(shapely.Point(1, 2))] * rows, pa.binary())})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    assert len(sink.getvalue()) < 1 << 20
    started = time.monotonic()
    r = app.put("/v1/spatial/layers/bomb?kind=points", content=sink.getvalue(),
                headers={"content-type": "application/vnd.apache.parquet"})
    body = assert_problem(r, 422, "validation-error", "body")
    assert f"at most {MAX_UPLOAD_ROWS:,}" in body["detail"]
    assert time.monotonic() - started < 5  # refused from the metadata, never decoded
    assert app.get("/v1/spatial/layers").status_code == 200


def test_layers_survive_a_restart(make_settings, tmp_path):
    settings = make_settings()
    with TestClient(create_app(settings)) as client:
        wait_ready(client)
        client.post("/v1/spatial/layers", json={"name": "kept", "kind": "polygons",
                                                "wkt": [shapely.to_wkt(shapely.geometry.shape(TWO_ISLANDS))]})
    with TestClient(create_app(settings)) as client:
        wait_ready(client)
        assert {"name": "kept", "kind": "polygons", "count": 1} in client.get("/v1/spatial/layers").json()


@pytest.mark.parametrize("body, field", [
    ({"name": "b", "kind": "points", "lon": [0, 181], "lat": [0, 0]}, "lon[1]"),
    ({"name": "b", "kind": "points", "lon": [0], "lat": [-91]}, "lat[0]"),
    ({"name": "b", "kind": "points", "lon": [0, 1], "lat": [0]}, "lon"),
    ({"name": "b", "kind": "polygons", "wkt": ["POLYGON ((0 0, 10 10, 10 0, 0 10, 0 0))"]}, "wkt[0]"),  # bow-tie
    ({"name": "b", "kind": "polygons", "wkt": ["POLYGON ((0 0, 1 0"]}, "wkt[0]"),
    ({"name": "b", "kind": "polygons", "wkt": ["POINT (1 1)"]}, "wkt[0]"),
    ({"name": "b", "kind": "polygons", "wkb_b64": ["@@@"]}, "wkb_b64[0]"),
    ({"name": "b", "kind": "polygons", "geojson": {"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": SQUARE_WITH_HOLE},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [200, 0], [0, 1], [0, 0]]]}}]}},
     "geojson.features[1]"),
    ({"name": "b", "kind": "polygons", "lon": [1]}, "lon"),
    # points given as geometry are named by their feature, not as lon/lat
    ({"name": "b", "kind": "points", "wkt": ["POINT (1 1)", "POINT (200 0)"]}, "wkt[1]"),
    ({"name": "b", "kind": "points", "wkb_b64": [base64.b64encode(shapely.Point(0, 95).wkb).decode()]}, "wkb_b64[0]"),
    ({"name": "b", "kind": "polygons", "wkt": ["CURVEPOLYGON (CIRCULARSTRING (0 0, 1 1, 2 0, 1 -1, 0 0))"]}, "wkt[0]"),
    ({"name": "b", "kind": "polygons", "wkt": ["POLYGON ((0 0, 1 0, 1 1, 0 1, 0 0))\x00 POLYGON"]}, "wkt[0]"),
    ({"name": "b", "kind": "polygons", "geojson": {"type": "FeatureCollection", "features": []}}, "geojson.features"),
    *[({"name": "b", "kind": kind, "geojson": {"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": geometry}]}}, "geojson.features[0]") for kind, geometry in [
        ("polygons", {"type": "MultiPolygon", "coordinates": [[], [[[0, 0], [1, 0], [1, 1], [0, 0]]]]}),
        ("points", {"type": "Point", "coordinates": [1]}),
        ("points", {"type": "Point", "coordinates": ["1", "2"]}),
        ("points", {"type": "Point", "coordinates": [True, False]}),
        ("points", {"type": "Point", "coordinates": [[1, 2]]}),
        ("polygons", {"type": "Polygon", "coordinates": [[[0, 0], [1, "0"], [1, 1], [0, 0]]]}),
    ]],
])
def test_bad_layers_are_422_naming_the_feature(app, body, field):
    assert_problem(app.post("/v1/spatial/layers", json=body), 422, "validation-error", field)
    assert "b" not in [layer["name"] for layer in app.get("/v1/spatial/layers").json()]


def test_a_multipolygon_with_an_empty_part_is_its_other_parts(app):
    """`MULTIPOLYGON (EMPTY, ...)` is valid; its empty part covers nothing and is dropped (its offsets made
    shapely.from_ragged_array, which saving the layer calls, crash the process), so joins answer as for the other
    parts alone."""
    wkt = ["MULTIPOLYGON (EMPTY, ((0 0, 1 0, 1 1, 0 1, 0 0)))", "MULTIPOLYGON (((2 2, 3 2, 3 3, 2 2)), EMPTY)"]
    assert app.post("/v1/spatial/layers", json={"name": "holey", "kind": "polygons", "wkt": wkt}).status_code == 201
    assert app.post("/v1/spatial/layers", json={"name": "two", "kind": "points", "lon": [0.5, 2.9],
                                                "lat": [0.5, 2.5]}).status_code == 201
    r = app.post("/v1/spatial/joins/point-in-polygon", json={"points": "two", "polygons": "holey"})
    assert r.status_code == 200 and r.json()["counts"] == [1, 1], r.text


def test_cursors_past_the_layer_or_not_integers_are_refused(app, layers):
    """A cursor is the next point's position: past the layer's end (a genuine one, kept while the layer was
    replaced by a smaller one) or not an integer, it is a 422 naming it, never a 500."""
    forged = [{"p": 10**6}, {"p": 1e308}, {"p": 1.5}, {"p": True}, {"p": "1"}, {"p": -1}]
    for state in forged:
        cursor = base64.urlsafe_b64encode(json.dumps(state).encode()).decode()
        for path, body in (("point-in-polygon", {"points": "pts", "polygons": "polys", "mode": "pairs"}),
                           ("within-distance", {"left": "pts", "right": "pts", "radius_m": 10.0})):
            assert_problem(app.post(f"/v1/spatial/joins/{path}", json={**body, "cursor": cursor}),
                           422, "validation-error", "cursor")


def test_unknown_duplicate_and_wrong_kind(app, layers):
    for path, body, field in (("point-in-polygon", {"points": "nope", "polygons": "polys"}, "points"),
                              ("point-in-polygon", {"points": "pts", "polygons": "nope"}, "polygons"),
                              ("within-distance", {"left": "pts", "right": "nope", "radius_m": 1.0}, "right")):
        assert_problem(app.post(f"/v1/spatial/joins/{path}", json=body), 404, "not-found", field)
    assert_problem(app.post("/v1/spatial/layers", json={"name": "pts", "kind": "points", "lon": [0], "lat": [0]}),
                   409, "conflict")
    assert_problem(app.post("/v1/spatial/joins/point-in-polygon", json={"points": "polys", "polygons": "polys"}),
                   422, "validation-error", "points")
    assert_problem(app.post("/v1/spatial/joins/point-in-polygon", json={"points": "pts", "polygons": "polys",
                                                                         "mode": "pairs", "cursor": "garbage"}),
                   422, "validation-error", "cursor")


def test_an_engine_out_of_memory_is_a_503_and_a_rewritten_layer_is_forgotten(make_settings, server_dsn, request):
    """A join that runs its engine out of memory answers 503 with Retry-After (never a 500, the process goes on);
    replacing a layer drops what the engines built for the old one."""
    with fresh_database(server_dsn, request.node.name) as dsn:
        with TestClient(create_app(make_settings(database_url=dsn, breaker_cooldown_s=45)),
                        raise_server_exceptions=False) as client:
            wait_ready(client)
            lon, lat = sample_points(n=200)
            client.post("/v1/spatial/layers", json={"name": "pts", "kind": "points", "lon": lon.tolist(),
                                                    "lat": lat.tolist()})
            polys = feature_collection(SQUARE_WITH_HOLE, NEIGHBOUR)
            client.post("/v1/spatial/layers", json={"name": "polys", "kind": "polygons", "geojson": polys})
            join = {"points": "pts", "polygons": "polys", "engine": "cpu"}
            assert client.post("/v1/spatial/joins/point-in-polygon", json=join).status_code == 200
            spatial = client.app.state.switchyard.spatial
            engine = spatial.engines["cpu"]
            old = spatial.layers["polys"].geometry
            assert any(entry[0] is old for entry in engine._pip)
            client.delete("/v1/spatial/layers/polys")
            spatial.executors["cpu"].submit(lambda: None).result()  # the engine's thread ran the forget
            assert not any(entry[0] is old for entry in engine._pip)

            client.post("/v1/spatial/layers", json={"name": "polys", "kind": "polygons", "geojson": polys})

            def full(*args, **kwargs):
                raise MemoryError("std::bad_alloc: out_of_memory: CUDA error")

            engine.pip_counts = full
            r = client.post("/v1/spatial/joins/point-in-polygon", json=join)
            body = assert_problem(r, 503, "out-of-memory")
            assert r.headers["Retry-After"] == "45" and "bad_alloc" not in body["detail"]
            r = client.post("/v1/spatial/joins/point-in-polygon", json=join)
            assert_problem(r, 503, "engine-cooling-down")
            assert client.get("/readyz").status_code == 200


# --- pair pages within their pair budget; a join given up on stops --------------------------------------------

class Recorder:
    """An engine as the manager sees it, recording how many pairs each pairs call handed back (all it wrote)."""

    def __init__(self, engine):
        self.engine, self.pairs = engine, []

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if not name.startswith(("pip_pairs", "within_distance")):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            self.pairs.append(len(out[0]))
            return out

        return call


def overlapping_layers(app, copies=25):
    """Points under `copies` identical boxes and the shapes of `layers`, and shapely's pairs of them."""
    lon, lat = sample_points(n=300)
    geoms = [shapely.box(-6, -16, 41, 16)] * copies + [shapely.geometry.shape(g) for g in (
        SQUARE_WITH_HOLE, TWO_ISLANDS, ACROSS_ANTIMERIDIAN, NEIGHBOUR)]
    assert app.post("/v1/spatial/layers", json={"name": "many", "kind": "points", "lon": lon.tolist(),
                                                "lat": lat.tolist()}).status_code == 201
    assert app.post("/v1/spatial/layers", json={"name": "stack", "kind": "polygons",
                                                "wkt": [shapely.to_wkt(g) for g in geoms]}).status_code == 201
    points = shapely.points(lon, lat)
    return {(int(i), g) for g, geom in enumerate(geoms) for i in np.flatnonzero(shapely.covers(geom, points))}


def test_pip_pair_pages_write_only_their_pair_budget(app):
    """Every point here lies in up to 27 polygons: a page of 200 points holds thousands of pairs, yet the engine
    writes only the leading whole points whose pairs fit 200 (one point if it alone has more), and the pages
    concatenate, in order, to shapely's answer (the old engine computed all of the page's points' pairs)."""
    truth = overlapping_layers(app)
    spatial = app.app.state.switchyard.spatial
    recorder = spatial.engines["cpu"] = Recorder(spatial.engines["cpu"])
    got, cursor, page_size = [], None, 200
    while True:
        body = app.post("/v1/spatial/joins/point-in-polygon", json={
            "points": "many", "polygons": "stack", "mode": "pairs", "engine": "cpu", "cursor": cursor,
            "page_size": page_size}).json()
        page = [tuple(p) for p in body["pairs"]]
        assert recorder.pairs[-1] == len(page)  # written = returned
        assert len(page) <= page_size or len({i for i, _ in page}) == 1
        got += page
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert len(recorder.pairs) > 30 and max(recorder.pairs) <= page_size
    assert got == sorted(truth) and len(truth) > 5000


def test_a_join_past_its_deadline_stops_the_engine(app):
    """The 504 of a join whose X-Request-Timeout passed stops the CPU engine at its next chunk of points, so the
    next join does not wait for one nobody reads."""
    overlapping_layers(app, copies=3)
    spatial = app.app.state.switchyard.spatial
    engine = spatial.engines["cpu"]
    outcome = []

    class Slow:
        name, kind, takes_cancel = engine.name, engine.kind, True

        def pip_counts(self, points, polygons, cancel):
            cancel.wait(10)  # the join runs on past the request's deadline
            try:
                return engine.pip_counts(points, polygons, cancel=cancel)
            except Exception as exc:
                outcome.append(type(exc).__name__)
                raise

    spatial.engines["cpu"] = Slow()
    join = {"points": "many", "polygons": "stack", "engine": "cpu"}
    r = app.post("/v1/spatial/joins/point-in-polygon", json=join, headers={"X-Request-Timeout": "0.3"})
    assert_problem(r, 504, "deadline-exceeded")
    spatial.executors["cpu"].submit(lambda: None).result(timeout=10)  # the engine's thread is free again
    assert outcome == ["JoinStopped"]
    spatial.engines["cpu"] = engine
    assert app.post("/v1/spatial/joins/point-in-polygon", json=join).status_code == 200


def world_stack(copies, n, seed=5):
    """The probe's shape, scaled down: `copies` identical near-world polygons and a few small ones over n points."""
    from spatial.geoarrow import points_from_lonlat, polygons_from_shapely

    rng = np.random.default_rng(seed)
    geoms = [shapely.box(-179, -84, 179, 84)] * copies + [shapely.box(x, -10, x + 20, 10) for x in range(-60, 60, 15)]
    lon, lat = rng.uniform(-180, 180, n), rng.uniform(-90, 90, n)
    return points_from_lonlat(lon, lat), polygons_from_shapely(np.array(geoms, dtype=object)), geoms


@pytest.mark.parametrize("max_pairs", [1, 37, 1000, None])
def test_cpu_pip_pages_hold_whole_points_within_the_budget(monkeypatch, max_pairs):
    """Pages of pip_pairs_page (in chunks of a few points) keep whole points within max_pairs, write no more than
    they return, and concatenate to pip_pairs' whole answer, which equals shapely's."""
    from spatial import cpu_engine

    written, counted = [], []
    write, count = cpu_engine._pip_write, cpu_engine._pip_pair_counts
    monkeypatch.setattr(cpu_engine, "_pip_write", lambda *a: (written.append(len(a[5])), write(*a))[1])
    monkeypatch.setattr(cpu_engine, "_pip_pair_counts", lambda *a: (counted.append(len(a[0])), count(*a))[1])
    pts, polys, geoms = world_stack(60, 1500)
    engine = cpu_engine.CpuSpatialEngine(chunk_points=7)
    whole = cpu_engine.CpuSpatialEngine().pip_pairs(pts, polys, 0, len(pts))
    per_point = np.bincount(whole[0], minlength=len(pts))
    pages, start = [], 0
    while start < len(pts):
        stop = min(len(pts), start + 400)  # as the manager asks: page_size points at most
        written.clear()
        counted.clear()
        point, geom, reached = engine.pip_pairs_page(pts, polys, start, stop, max_pairs)
        assert start < reached <= stop and sum(written) == len(point)
        # Counting stops at the chunk that passes the budget (chunks of 7 points, doubling): not the whole range.
        assert max_pairs is None or sum(counted) <= 4 * (reached - start) + 7, (sum(counted), reached - start)
        np.testing.assert_array_equal(np.bincount(point, minlength=len(pts))[start:reached], per_point[start:reached])
        assert max_pairs is None or len(point) <= max_pairs or reached - start == 1
        if reached < stop:  # it stopped because the next point would not fit
            assert len(point) + per_point[reached] > max_pairs
        pages.append((point, geom))
        start = reached
    for k in range(2):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in pages]), whole[k])
    shapes = shapely.points(pts.x, pts.y)
    truth = sorted((int(i), g) for g, geom in enumerate(geoms) for i in np.flatnonzero(shapely.covers(geom, shapes)))
    assert list(zip(whole[0].tolist(), whole[1].tolist())) == truth


def test_a_cancelled_cpu_join_stops_between_chunks(monkeypatch):
    """`cancel` set while a join runs stops it at its next chunk of points (JoinStopped), for each join."""
    import threading

    from spatial import cpu_engine

    pts, polys, _ = world_stack(5, 2000)
    engine = cpu_engine.CpuSpatialEngine(chunk_points=100)
    for name, call in (("_pip_counts", lambda c: engine.pip_counts(pts, polys, cancel=c)),
                       ("_pip_pair_counts", lambda c: engine.pip_pairs_page(pts, polys, 0, len(pts), None, c)),
                       ("_within_counts", lambda c: engine.within_distance_page(pts, pts, 1e5, 0, len(pts), True,
                                                                                None, c))):
        cancel, chunks = threading.Event(), []
        kernel = getattr(cpu_engine, name)

        def first_chunk_then_cancel(*args, kernel=kernel, cancel=cancel, chunks=chunks):
            chunks.append(1)
            cancel.set()  # the caller gives up while this chunk runs
            return kernel(*args)

        monkeypatch.setattr(cpu_engine, name, first_chunk_then_cancel)
        with pytest.raises(cpu_engine.JoinStopped):
            call(cancel)
        assert chunks == [1], name
        monkeypatch.setattr(cpu_engine, name, kernel)
        call(threading.Event())  # an Event never set: the whole join


GPU_PAGES = r"""
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_spatial_service import world_stack
from spatial.cpu_engine import CpuSpatialEngine
from spatial.cuda_engine import CudaSpatialEngine

pts, polys, _ = world_stack(12, 300)
gpu, cpu = CudaSpatialEngine(max_depth=6, max_size=16), CpuSpatialEngine()
for max_pairs in (1, 5, 40, 700, None):
    for start, stop in ((0, 300), (17, 120), (299, 300)):
        got, want = gpu.pip_pairs_page(pts, polys, start, stop, max_pairs), cpu.pip_pairs_page(pts, polys, start,
                                                                                                stop, max_pairs)
        assert got[2] == want[2], (max_pairs, start, got[2], want[2])
        for k in range(2):
            np.testing.assert_array_equal(got[k], want[k])
print("gpu pages ok")
"""


def test_gpu_pip_pages_are_the_cpu_engines_in_the_simulator():
    """The GPU engine cuts a pairs page where the CPU engine does (pairs_prefix), in numba-cuda's simulator."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("numba.cuda") is None:  # found, not imported: no CUDA set up in this process
        pytest.skip("numba.cuda is not installed")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", GPU_PAGES], cwd=root, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"),
                       capture_output=True, text=True, check=False, timeout=280)
    assert r.returncode == 0 and "gpu pages ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
