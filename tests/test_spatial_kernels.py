"""The spatial scalar cores and the CPU engine: exact orientation, PIP equal to shapely `covers`, haversine, and
the distance join equal to brute force."""

from __future__ import annotations

import importlib.util
import itertools
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

shapely = pytest.importorskip("shapely")
numba = pytest.importorskip("numba")

from numba import njit
from shapely.geometry import MultiPolygon, Point, Polygon, box

from spatial import kernels
from spatial.cpu_engine import CpuSpatialEngine, K
from spatial.geoarrow import Points, Polygons, points_from_lonlat, polygons_from_shapely

_orient = K.orient2d
_point_in_part = K.point_in_part
_haversine = K.haversine_m


@njit(cache=True)
def orient_batch(a):
    out = np.empty(a.shape[0], np.int64)
    for i in range(a.shape[0]):
        out[i] = _orient(a[i, 0], a[i, 1], a[i, 2], a[i, 3], a[i, 4], a[i, 5])
    return out


@njit(cache=True)
def covers_ring_walk(px, py, x, y, ring_offsets, part_offsets, geometry_offsets):
    """(geometry x point) covered matrix by walking every ring of every part (no index)."""
    ng = geometry_offsets.shape[0] - 1
    out = np.zeros((ng, px.shape[0]), np.bool_)
    for g in range(ng):
        for p in range(geometry_offsets[g], geometry_offsets[g + 1]):
            for i in range(px.shape[0]):
                if not out[g, i]:
                    out[g, i] = _point_in_part(px[i], py[i], x, y, ring_offsets, part_offsets[p],
                                               part_offsets[p + 1]) != 0
    return out


@njit(cache=True)
def haversine_batch(lon1, lat1, lon2, lat2):
    out = np.empty(lon1.shape[0])
    for i in range(lon1.shape[0]):
        out[i] = _haversine(lon1[i], lat1[i], lon2[i], lat2[i])
    return out


def exact_sign(ax, ay, bx, by, px, py) -> int:
    F = Fraction
    v = (F(bx) - F(ax)) * (F(py) - F(ay)) - (F(by) - F(ay)) * (F(px) - F(ax))
    return (v > 0) - (v < 0)


def nudge(v: np.ndarray, ulps: np.ndarray) -> np.ndarray:
    out = v.copy()
    for k in range(int(np.abs(ulps).max(initial=0))):
        step = np.abs(ulps) > k
        out[step] = np.nextafter(out[step], np.where(ulps[step] > 0, np.inf, -np.inf))
    return out


# --- orientation -----------------------------------------------------------------------------------------------

def orientation_cases(rng: np.random.Generator) -> np.ndarray:
    cases = [rng.uniform(-180, 180, (2000, 6))]
    # near-collinear: p on the segment a-b as rounded, then nudged by a few ulps
    a = rng.uniform(-180, 180, (4000, 2))
    b = rng.uniform(-180, 180, (4000, 2))
    t = rng.uniform(-0.5, 1.5, (4000, 1))
    p = a + t * (b - a)
    p[:, 0] = nudge(p[:, 0], rng.integers(-3, 4, 4000))
    p[:, 1] = nudge(p[:, 1], rng.integers(-3, 4, 4000))
    cases.append(np.hstack([a, b, p]))
    # Shewchuk's classic failure grid: p = (0.5 + i ulp, 0.5 + j ulp) against the line (12, 12) -> (24, 24)
    i, j = np.meshgrid(np.arange(64), np.arange(64))
    ulp = 2.0 ** -53
    cases.append(np.column_stack([np.full(4096, 12.0), np.full(4096, 12.0), np.full(4096, 24.0),
                                  np.full(4096, 24.0), 0.5 + i.ravel() * ulp, 0.5 + j.ravel() * ulp]))
    # a lon/lat-like diagonal edge with a lattice of points around a point on it
    ax, ay, bx, by = 179.9, -45.3, -12.7, 60.1
    base_x = ax + 0.37 * (bx - ax)
    base_y = ay + 0.37 * (by - ay)
    i, j = np.meshgrid(np.arange(-16, 16), np.arange(-16, 16))
    px = nudge(np.full(1024, base_x), i.ravel())
    py = nudge(np.full(1024, base_y), j.ravel())
    cases.append(np.column_stack([np.full(1024, ax), np.full(1024, ay), np.full(1024, bx), np.full(1024, by),
                                  px, py]))
    # exactly collinear (dyadic) points, including repeated points
    k = rng.integers(-400, 400, (1000, 3)).astype(float) * 0.25
    cases.append(np.column_stack([k[:, 0], 2 * k[:, 0] + 1, k[:, 1], 2 * k[:, 1] + 1, k[:, 2], 2 * k[:, 2] + 1]))
    cases.append(np.column_stack([k[:, 0], k[:, 1], k[:, 0], k[:, 1], k[:, 2], k[:, 2]]))
    return np.ascontiguousarray(np.vstack(cases))


def test_orientation_is_exact_on_random_and_adversarial_inputs():
    cases = orientation_cases(np.random.default_rng(1))
    got = orient_batch(cases)
    want = np.array([exact_sign(*row) for row in cases.tolist()])
    assert (want == 0).sum() > 1500 and (want != 0).sum() > 5000  # both sides of the filter are exercised
    naive = np.sign((cases[:, 2] - cases[:, 0]) * (cases[:, 5] - cases[:, 1])
                    - (cases[:, 3] - cases[:, 1]) * (cases[:, 4] - cases[:, 0]))
    assert (naive != want).sum() > 100  # the inputs do defeat plain float64
    np.testing.assert_array_equal(got, want)
    swapped = orient_batch(np.ascontiguousarray(cases[:, [2, 3, 0, 1, 4, 5]]))
    np.testing.assert_array_equal(swapped, -want)


def test_orientation_source_runs_as_plain_python():
    cases = orientation_cases(np.random.default_rng(2))[::25]
    for row in cases.tolist():
        assert kernels.orient2d(*row) == exact_sign(*row)
    for a, b in ((0.1, 0.3), (179.99999999, -33.3333), (1e-3, 7.0 / 3.0)):
        x, y = kernels.two_product(a, b)
        assert Fraction(x) + Fraction(y) == Fraction(a) * Fraction(b) and x == a * b


# --- point in polygon vs shapely `covers` ----------------------------------------------------------------------

def star(rng, cx, cy, r, n=24, hole=True) -> Polygon:
    ang = np.sort(rng.uniform(0, 2 * np.pi, n))
    rad = r * rng.uniform(0.6, 1.0, n)
    shell = np.column_stack([cx + rad * np.cos(ang), cy + rad * np.sin(ang)])
    holes = []
    if hole:
        m = max(5, n // 3)
        ang = np.sort(rng.uniform(0, 2 * np.pi, m))
        rad = r * rng.uniform(0.15, 0.4, m)
        holes.append(np.column_stack([cx + rad * np.cos(ang), cy + rad * np.sin(ang)])[::-1])
    return Polygon(shell, holes)


def triangulated_grid(x0, y0, step, nx, ny) -> list[Polygon]:
    """Cells of a lattice, each split along a diagonal: triangles sharing axis-aligned and diagonal edges."""
    out = []
    for i in range(nx):
        for j in range(ny):
            xa, xb, ya, yb = x0 + i * step, x0 + (i + 1) * step, y0 + j * step, y0 + (j + 1) * step
            if (i + j) % 2:
                out += [Polygon([(xa, ya), (xb, ya), (xb, yb)]), Polygon([(xa, ya), (xb, yb), (xa, yb)])]
            else:
                out += [Polygon([(xa, ya), (xb, ya), (xa, yb)]), Polygon([(xb, ya), (xb, yb), (xa, yb)])]
    return out


def boundary_points(geoms, rng, per_edge=2) -> np.ndarray:
    """Every vertex, the float midpoint of every edge and points at random fractions of it (on or within an
    ulp or two of the edge: exactly the cases an inexact predicate gets wrong)."""
    pts = []
    for g in geoms:
        rings = []
        for poly in getattr(g, "geoms", [g]):
            rings += [np.asarray(poly.exterior.coords)] + [np.asarray(h.coords) for h in poly.interiors]
        for c in rings:
            a, b = c[:-1], c[1:]
            pts += [a, (a + b) / 2]
            for _ in range(per_edge):
                t = rng.uniform(0, 1, (len(a), 1))
                pts.append(a + t * (b - a))
    return np.vstack(pts)


def expected(geoms, x, y):
    points = shapely.points(x, y)
    geoms = np.array(list(geoms), dtype=object)
    shapely.prepare(geoms)  # prepared: fast, same exact answers
    covered = np.vstack([shapely.covers(g, points) for g in geoms])
    g_idx, p_idx = np.nonzero(covered)
    order = np.lexsort((g_idx, p_idx))
    return covered.sum(axis=1), p_idx[order].astype(np.int64), g_idx[order].astype(np.int64)


def check_engine(geoms, x, y, engine=None, walk_every=1):
    engine = engine or CpuSpatialEngine()
    polys = polygons_from_shapely(np.array(geoms, dtype=object))
    pts = points_from_lonlat(x, y)
    counts, p_want, g_want = expected(geoms, pts.x, pts.y)
    np.testing.assert_array_equal(engine.pip_counts(pts, polys), counts)
    p_got, g_got = engine.pip_pairs(pts, polys, 0, len(pts))
    np.testing.assert_array_equal(p_got, p_want)
    np.testing.assert_array_equal(g_got, g_want)
    # the plain ring walk (kernels.point_in_part, the GPU's refine core) agrees too
    sub = slice(None, None, walk_every)
    walk = covers_ring_walk(pts.x[sub], pts.y[sub], polys.x, polys.y, polys.ring_offsets, polys.part_offsets,
                            polys.geometry_offsets)
    want = expected(geoms, pts.x[sub], pts.y[sub])[0] if walk_every != 1 else counts
    np.testing.assert_array_equal(walk.sum(axis=1), want)
    return counts


def on_boundary(geoms, x, y) -> int:
    """How many of the points lie exactly on some geometry's boundary (GEOS decides exactly)."""
    points = shapely.points(x, y)
    return int(np.any([shapely.intersects(g.boundary, points) for g in geoms], axis=0).sum())


def test_random_polygons_with_holes_and_multipolygons():
    rng = np.random.default_rng(3)
    geoms = []
    for k in range(12):
        cx, cy = rng.uniform(-150, 150), rng.uniform(-70, 70)
        if k % 3 == 0:  # multipolygon of three disjoint stars, one without hole
            geoms.append(MultiPolygon([star(rng, cx + dx, cy, 2.0, hole=dx != 6) for dx in (0, 6, 12)]))
        else:
            geoms.append(star(rng, cx, cy, rng.uniform(1, 8), n=int(rng.integers(8, 60))))
    assert shapely.is_valid(np.array(geoms, dtype=object)).all()
    lo, hi = shapely.total_bounds(np.array(geoms, dtype=object)).reshape(2, 2)
    rand = rng.uniform(lo, hi, (20000, 2))
    centres = np.array([g.centroid.coords[0] for g in geoms])  # inside the holes
    bnd = boundary_points(geoms, rng)
    pts = np.vstack([rand, centres, bnd])
    counts = check_engine(geoms, pts[:, 0], pts[:, 1])
    assert counts.min() > 0


def test_vertices_and_edges_axis_aligned_and_diagonal_with_holes():
    # a diamond (diagonal edges) with a square hole, a square with a diamond hole, and an L sharing an edge
    for scale in (1.0, 0.1, 1 / 3):  # dyadic, then coordinates that are not exact in binary
        def s(coords, scale=scale):
            return [(u * scale, v * scale) for u, v in coords]

        geoms = [
            Polygon(s([(0, 4), (4, 0), (8, 4), (4, 8)]), [s([(3, 3), (5, 3), (5, 5), (3, 5)])]),
            Polygon(s([(10, 0), (18, 0), (18, 8), (10, 8)]), [s([(14, 2), (16, 4), (14, 6), (12, 4)])]),
            Polygon(s([(18, 0), (22, 0), (22, 2), (20, 2), (20, 8), (18, 8)])),
            MultiPolygon([Polygon(s([(0, 10), (3, 13), (0, 13)])), Polygon(s([(3, 13), (6, 10), (6, 13)]))]),
        ]
        i, j = np.meshgrid(np.arange(-1, 47), np.arange(-1, 29))
        lattice = np.column_stack([i.ravel() * 0.5 * scale, j.ravel() * 0.5 * scale])  # vertices, edges, holes
        lattice2 = np.column_stack([i.ravel() * (scale / 2), j.ravel() * (scale / 2)])  # computed differently
        bnd = boundary_points(geoms, np.random.default_rng(4), per_edge=4)
        pts = np.vstack([lattice, lattice2, bnd])
        check_engine(geoms, pts[:, 0], pts[:, 1])
        diagonal = boundary_points([geoms[0], geoms[3]], np.random.default_rng(5), per_edge=4)
        exact = on_boundary(geoms, diagonal[:, 0], diagonal[:, 1])
        assert 40 < exact < len(diagonal)  # points exactly on diagonal edges, and ulps off them


def test_shared_borders_count_for_both_geometries():
    rng = np.random.default_rng(5)
    for x0, step in ((0.0, 0.25), (-3.7, 0.3), (100.123, 0.7)):
        geoms = triangulated_grid(x0, 10.0, step, 6, 5)
        i, j = np.meshgrid(np.arange(13), np.arange(11))
        lattice = np.column_stack([x0 + i.ravel() * (step / 2), 10.0 + j.ravel() * (step / 2)])
        bnd = boundary_points(geoms, rng)
        rand = rng.uniform([x0, 10.0], [x0 + 6 * step, 10 + 5 * step], (3000, 2))
        pts = np.vstack([lattice, bnd, rand])
        counts = check_engine(geoms, pts[:, 0], pts[:, 1])
        assert counts.sum() > len(rand)  # shared edges and vertices are counted by every geometry touching them
        assert on_boundary(geoms, pts[:, 0], pts[:, 1]) > 500


def test_antimeridian_split_multipolygon():
    geoms = [
        MultiPolygon([box(170, -10, 180, 10), box(-180, -10, -170, 10)]),
        MultiPolygon([Polygon([(177, -18), (180, -18), (180, -16), (178.5, -15)]),
                      Polygon([(-180, -18), (-178, -17), (-180, -16)])]),
        box(-170, -10, -160, 10),  # shares the edge lon = -170 with the first
    ]
    rng = np.random.default_rng(6)
    lon = np.concatenate([np.full(200, 180.0), np.full(200, -180.0), np.full(200, 179.99999),
                          np.full(200, -179.99999), np.full(200, -170.0), rng.uniform(-180, 180, 5000),
                          rng.uniform(175, 180, 2000), rng.uniform(-180, -175, 2000)])
    lat = np.concatenate([rng.uniform(-20, 12, 1000), rng.uniform(-20, 12, 5000), rng.uniform(-20, 12, 4000)])
    lat[:50] = 10.0  # on the top edges
    lat[200:250] = -10.0
    check_engine(geoms, lon, lat)
    assert on_boundary(geoms, lon, lat) > 300  # lon +-180 and -170 are edges


def test_realistic_shapes_from_shapely():
    rng = np.random.default_rng(7)
    ring = Point(10, 45).buffer(3.0).difference(Point(10.5, 45.2).buffer(1.0))  # an annulus
    blobs = shapely.unary_union([Point(20 + dx, 40 + dy).buffer(r) for dx, dy, r in
                                 [(0, 0, 1.5), (2, 0.5, 1.2), (8, -1, 2.0), (9.5, 0.2, 1.0)]])  # multipolygon
    wiggly = Polygon([(30 + 5 * math.cos(t) * (1 + 0.3 * math.sin(7 * t)),
                       44 + 4 * math.sin(t) * (1 + 0.3 * math.sin(7 * t))) for t in np.linspace(0, 2 * math.pi, 400)])
    wiggly = shapely.make_valid(wiggly)
    geoms = [ring, blobs, wiggly, box(8, 43, 12, 47)]  # the box overlaps the annulus
    lo, hi = shapely.total_bounds(np.array(geoms, dtype=object)).reshape(2, 2)
    pts = np.vstack([rng.uniform(lo, hi, (30000, 2)), boundary_points(geoms, rng, per_edge=1)])
    check_engine(geoms, pts[:, 0], pts[:, 1])


def test_naturalearth_countries():
    if importlib.util.find_spec("pyogrio") is None:
        pytest.skip("pyogrio is not installed: its naturalearth_lowres fixture is the real-polygon data")
    from pathlib import Path

    import pyogrio

    path = Path(pyogrio.__file__).parent / "tests/fixtures/naturalearth_lowres/naturalearth_lowres.shp"
    if not path.exists():
        pytest.skip("this pyogrio wheel ships no naturalearth_lowres fixture")
    _, _, wkb, _ = pyogrio.raw.read(path)
    # Russia reaches lon 180.00000000000006 in this file: clamp to the valid range first
    geoms = shapely.transform(shapely.from_wkb(wkb), lambda c: np.clip(c, [-180, -90], [180, 90]))
    geoms = shapely.make_valid(geoms)
    geoms = np.array([g if g.geom_type in ("Polygon", "MultiPolygon") else
                      shapely.MultiPolygon([p for p in g.geoms if p.geom_type == "Polygon"]) for g in geoms],
                     dtype=object)
    rng = np.random.default_rng(8)
    pts = np.vstack([np.column_stack([rng.uniform(-180, 180, 40000), rng.uniform(-90, 84, 40000)]),
                     boundary_points(geoms[:40], rng, per_edge=1)])
    check_engine(list(geoms), pts[:, 0], pts[:, 1], walk_every=20)


def test_unclosed_rings_and_zero_length_edges():
    # one part: shell unclosed, with a repeated vertex (a zero-length edge); hole closed
    x = np.array([0, 4, 4, 4, 0, 1, 2, 2, 1, 1], float)
    y = np.array([0, 0, 4, 4, 4, 1, 1, 2, 2, 1], float)
    polys = Polygons(x, y, np.array([0, 5, 10]), np.array([0, 2]), np.array([0, 1]))
    ref = Polygon([(0, 0), (4, 0), (4, 4), (0, 4)], [[(1, 1), (2, 1), (2, 2), (1, 2)]])
    i, j = np.meshgrid(np.arange(-2, 19), np.arange(-2, 19))
    px, py = i.ravel() * 0.25, j.ravel() * 0.25
    pts = Points(px, py)
    counts, p_want, _ = expected([ref], px, py)
    engine = CpuSpatialEngine()
    np.testing.assert_array_equal(engine.pip_counts(pts, polys), counts)
    np.testing.assert_array_equal(engine.pip_pairs(pts, polys)[0], p_want)


def test_chunked_pip_pairs_concatenate_to_the_whole():
    rng = np.random.default_rng(9)
    geoms = triangulated_grid(-10, -10, 2.5, 8, 8) + [star(rng, 0, 0, 9)]
    polys = polygons_from_shapely(np.array(geoms, dtype=object))
    pts = points_from_lonlat(rng.uniform(-12, 12, 20000), rng.uniform(-12, 12, 20000))
    engine = CpuSpatialEngine()
    whole = engine.pip_pairs(pts, polys, 0, len(pts))
    cuts = [0, 1, 777, 5000, 5000, 13001, len(pts)]
    parts = [engine.pip_pairs(pts, polys, a, b) for a, b in itertools.pairwise(cuts)]
    for k in range(2):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
    assert len(whole[0]) - len(np.unique(whole[0])) > 4000  # points in the star and a triangle have two hits
    with pytest.raises(ValueError):
        engine.pip_pairs(pts, polys, 10, 5)


# --- haversine and the distance join -------------------------------------------------------------------------

def vincenty_sphere(lon1, lat1, lon2, lat2):
    p1, p2, dl = np.radians(lat1), np.radians(lat2), np.radians(lon2 - lon1)
    num = np.hypot(np.cos(p2) * np.sin(dl), np.cos(p1) * np.sin(p2) - np.sin(p1) * np.cos(p2) * np.cos(dl))
    den = np.sin(p1) * np.sin(p2) + np.cos(p1) * np.cos(p2) * np.cos(dl)
    return kernels.EARTH_RADIUS_M * np.arctan2(num, den)


def test_haversine_against_the_vincenty_formula():
    rng = np.random.default_rng(10)
    n = 20000
    lon1, lat1 = rng.uniform(-180, 180, n), np.degrees(np.arcsin(rng.uniform(-1, 1, n)))
    lon2, lat2 = rng.uniform(-180, 180, n), np.degrees(np.arcsin(rng.uniform(-1, 1, n)))
    near = np.arange(n) % 4 == 0  # a quarter of the pairs are metres apart
    lon2[near] = lon1[near] + rng.normal(0, 1e-4, near.sum())
    lat2[near] = np.clip(lat1[near] + rng.normal(0, 1e-4, near.sum()), -90, 90)
    got = haversine_batch(lon1, lat1, lon2, lat2)
    ref = vincenty_sphere(lon1, lat1, lon2, lat2)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-6)
    far = ~near
    np.testing.assert_allclose(got[far], ref[far], rtol=1e-12, atol=1e-3)
    R = kernels.EARTH_RADIUS_M
    assert math.isclose(kernels.haversine_m(0, 0, 1, 0), R * math.pi / 180, rel_tol=1e-14)
    assert math.isclose(kernels.haversine_m(12, 90, -100, -90), R * math.pi, rel_tol=1e-15)
    assert kernels.haversine_m(179.9, 0, -179.9, 0) == pytest.approx(R * math.radians(0.2), rel=1e-12)
    assert _haversine(3.5, 4.5, -6.25, 7.75) == kernels.haversine_m(-6.25, 7.75, 3.5, 4.5)  # symmetric


def numpy_haversine(lon1, lat1, lon2, lat2):
    d2r = kernels.DEG2RAD
    s1 = np.sin((lat2 - lat1) * d2r * 0.5)
    s2 = np.sin((lon2 - lon1) * d2r * 0.5)
    h = np.minimum(s1 * s1 + np.cos(lat1 * d2r) * np.cos(lat2 * d2r) * (s2 * s2), 1.0)
    return 2.0 * kernels.EARTH_RADIUS_M * np.arcsin(np.sqrt(h))


def brute_force_within(a, b, radius_m, self_join):
    """Every pair examined: unit-vector dot products (a generous prefilter), then the haversine."""
    def unit(p):
        lat, lon = np.radians(p.y), np.radians(p.x)
        return np.column_stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)])

    ua, ub = unit(a), unit(b)
    cos_limit = math.cos(min(radius_m / kernels.EARTH_RADIUS_M * 1.001 + 1e-7, math.pi))
    out_i, out_j = [], []
    for s in range(0, len(a), 1000):
        ii, jj = np.nonzero(ua[s:s + 1000] @ ub.T >= cos_limit)
        out_i.append(ii + s)
        out_j.append(jj)
    i, j = np.concatenate(out_i), np.concatenate(out_j)
    d = numpy_haversine(a.x[i], a.y[i], b.x[j], b.y[j])
    keep = d <= radius_m
    if self_join:
        keep &= i < j
    order = np.lexsort((j[keep], i[keep]))
    return i[keep][order], j[keep][order], d[keep][order]


def clustered_points(rng, n=20000) -> Points:
    centres = [(179.996, 10.0), (-179.997, 10.0), (180.0, -35.0), (-180.0, -35.0), (0.0, 89.995),
               (45.0, -89.996), (2.35, 48.85)] + [(rng.uniform(-180, 180), rng.uniform(-80, 80)) for _ in range(23)]
    lon, lat = [], []
    per = 400
    for cx, cy in centres:
        lat_c = np.clip(cy + rng.normal(0, 0.006, per), -90, 90)
        lon_c = cx + rng.normal(0, 0.006, per) / max(math.cos(math.radians(cy)), 0.01)
        if abs(cy) > 89:  # around a pole: every longitude
            lon_c = rng.uniform(-180, 180, per)
        lon.append((lon_c + 180) % 360 - 180)
        lat.append(lat_c)
    rest = n - per * len(centres)
    lon.append(rng.uniform(-180, 180, rest))
    lat.append(np.degrees(np.arcsin(rng.uniform(-1, 1, rest))))
    lon, lat = np.concatenate(lon), np.concatenate(lat)
    lon[:5] = [180.0, -180.0, 179.99999999, -179.99999999, 0.0]
    lat[:5] = [10.0, 10.0, 10.0, 10.0, 90.0]
    return points_from_lonlat(lon, lat)


def test_distance_join_equals_brute_force():
    rng = np.random.default_rng(11)
    pts = clustered_points(rng)
    engine = CpuSpatialEngine()
    i, j, d = engine.within_distance(pts, pts, 1000.0, 0, len(pts), self_join=True)
    bi, bj, bd = brute_force_within(pts, pts, 1000.0, self_join=True)
    assert len(bi) > 100_000
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(j, bj)
    np.testing.assert_allclose(d, bd, rtol=1e-12, atol=1e-9)
    lon_i = pts.x[i]
    assert ((np.abs(lon_i) > 179.99) & (np.sign(lon_i) != np.sign(pts.x[j]))).sum() > 100  # across +-180
    assert (np.abs(pts.y[i]) > 89.99).sum() > 1000  # around the poles

    other = points_from_lonlat((pts.x[::3] + rng.normal(0, 0.004, len(pts.x[::3])) + 180) % 360 - 180,
                               pts.y[::3])
    i, j, d = engine.within_distance(pts, other, 1000.0, 0, len(pts), self_join=False)
    bi, bj, bd = brute_force_within(pts, other, 1000.0, self_join=False)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(j, bj)
    np.testing.assert_allclose(d, bd, rtol=1e-12, atol=1e-9)


# A budget of 50 pairs makes pages of a point or two: its pages are walked over the first 300 points only (all
# 14,000 took 85 s of page calls).
@pytest.mark.parametrize("max_pairs, walked", [(50, 300), (5_000, None), (100_000, None)])
def test_bounded_distance_pages_hold_whole_points_within_the_budget(max_pairs, walked):
    rng = np.random.default_rng(13)
    pts = clustered_points(rng, 14000)
    engine = CpuSpatialEngine()
    whole = engine.within_distance(pts, pts, 2500.0, 0, len(pts), self_join=True)
    per_point = np.bincount(whole[0], minlength=len(pts))
    pages, start = [], 0
    while start < (walked or len(pts)):
        stop = min(len(pts), start + 3000)  # as the manager asks: page_size points at most
        i, j, d, reached = engine.within_distance_page(pts, pts, 2500.0, start, stop, True, max_pairs)
        assert start < reached <= stop
        # Only whole points, and no more pairs than the budget unless a single point has more.
        np.testing.assert_array_equal(np.bincount(i, minlength=len(pts))[start:reached], per_point[start:reached])
        assert len(i) <= max_pairs or (reached - start == 1)
        if reached < stop:  # it stopped because the next point would not fit
            assert len(i) + per_point[reached] > max_pairs
        pages.append((i, j, d))
        start = reached
    walked_pairs = whole[0] < start
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in pages]), whole[k][walked_pairs])


def test_pairs_prefix_keeps_whole_points_and_at_least_one():
    from spatial.geoarrow import pairs_prefix

    cumulative = np.cumsum([3, 0, 4, 10, 0, 1])
    assert [pairs_prefix(cumulative, n) for n in (0, 2, 3, 6, 7, 16, 17, 18, None)] == [1, 1, 2, 2, 3, 3, 5, 6, 6]
    assert pairs_prefix(np.empty(0, np.int64), 5) == 0


def test_chunked_distance_join_concatenates_to_the_whole():
    rng = np.random.default_rng(12)
    pts = clustered_points(rng, 14000)
    engine = CpuSpatialEngine()
    whole = engine.within_distance(pts, pts, 2500.0, 0, len(pts), self_join=True)
    cuts = [0, 3, 4000, 4000, 9999, len(pts)]
    parts = [engine.within_distance(pts, pts, 2500.0, a, b, self_join=True) for a, b in itertools.pairwise(cuts)]
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
    # huge and zero radii
    few = points_from_lonlat(pts.x[:300], pts.y[:300])
    i, j, _ = engine.within_distance(few, few, 3e7, self_join=True)
    assert len(i) == 300 * 299 // 2
    i, j, d = engine.within_distance(few, few, 0.0, self_join=False)
    assert (d == 0).all() and set(zip(i.tolist(), j.tolist())) >= {(k, k) for k in range(300)}


# -- the device's arithmetic, emulated: numba-cuda types math.floor(float64) as float64 on a GPU -------------------

class _DeviceMath:
    """`math` as numba-cuda types it on a device: floor of a float64 is a float64 (CPU numba and the simulator
    give int64, so neither shows what the device computes)."""

    def __getattr__(self, name):
        return getattr(math, name)

    @staticmethod
    def floor(x):
        return float(math.floor(x))


def _device_typed_core():
    return kernels.compile_core(lambda fn: fn, env={"math": _DeviceMath()})


def _emulated_gpu_distance_join(a: Points, b: Points, radius_m: float):
    """The GPU engine's distance join step by step (unit_key_kernel storing int64 keys, the sort, the dwithin
    kernels), running the cores as Python with the device's typing."""
    from spatial.cuda_engine import MAX_CELLS_PER_AXIS

    core = _device_typed_core()
    side, n = kernels.grid_side(radius_m, MAX_CELLS_PER_AXIS)
    inv_h = 1.0 / side
    keys = np.empty(len(b), np.int64)
    unit = np.empty((3, len(b)))
    for k in range(len(b)):
        unit[:, k] = core.unit_vector(b.x[k], b.y[k])
        keys[k] = core.cell_key(*unit[:, k], inv_h, n)  # the kernel writes into an int64 array
    order = np.argsort(keys, kind="stable")
    out_j, out_d = np.empty(len(b), np.int64), np.empty(len(b))
    pairs = set()
    for i in range(len(a)):
        found = core.dwithin_point(i, a.x[i], a.y[i], b.x[order], b.y[order], *unit[:, order], order, keys[order],
                                   inv_h, n, radius_m, False, out_j, out_d, 0, len(b))
        pairs.update((i, int(j)) for j in out_j[:found])
    return pairs


def test_cell_keys_are_exact_integers_with_the_devices_typing():
    """Fine grids (radius under ~60 m) have n**3 > 2**53 cells: a float key rounds into another cell."""
    rng = np.random.default_rng(40)
    core = _device_typed_core()
    for radius in (40.0, 5.0, 1000.0):
        side, n = kernels.grid_side(radius, 1 << 20)
        for lon, lat in rng.uniform([-180, -90], [180, 90], (200, 2)):
            u = kernels.unit_vector(lon, lat)
            want = kernels.cell_key(*u, 1.0 / side, n)  # Python's floor: exact integers
            got = core.cell_key(*u, 1.0 / side, n)
            assert type(got) is int and got == want, (radius, lon, lat, got, want)


def test_distance_join_with_the_devices_typing_misses_no_pair():
    """A dense city at 40 m: the GPU kernels' arithmetic, emulated, finds exactly the brute-force pairs."""
    rng = np.random.default_rng(41)
    lon = 2.35 + rng.uniform(0, 0.004, 500)  # about 300 m x 450 m of Paris
    lat = 48.85 + rng.uniform(0, 0.004, 500)
    a = points_from_lonlat(lon[:250], lat[:250])
    b = points_from_lonlat(lon[250:], lat[250:])
    bi, bj, _ = brute_force_within(a, b, 40.0, self_join=False)
    assert len(bi) > 500
    assert _emulated_gpu_distance_join(a, b, 40.0) == set(zip(bi.tolist(), bj.tolist()))


def test_the_cpu_engine_warms_up_once_at_its_first_layer(monkeypatch):
    """prepare (a layer written or loaded) runs the checked warm-up once: a process with layers compiles before its
    first join, one without never compiles."""
    from spatial.cpu_engine import CpuSpatialEngine
    from spatial.geoarrow import points_from_lonlat

    engine = CpuSpatialEngine()
    runs = []
    real = engine.warm_up
    monkeypatch.setattr(engine, "warm_up", lambda: (runs.append(1), real()))
    layer = points_from_lonlat([0.5, 1.5], [0.5, 0.5])
    engine.prepare(layer)
    engine.prepare(layer)
    assert runs == [1] and engine.warm
    wrong = CpuSpatialEngine()
    monkeypatch.setattr(wrong, "pip_counts", lambda points, polygons: np.array([0]))
    with pytest.raises(RuntimeError, match="answered its warm-up wrong"):
        wrong.warm_up()


def test_a_warm_up_waits_only_for_warm_ups_sharing_its_numba_cache(tmp_path):
    """Warm-ups of one installation take turns (the later ones load what the first compiled); another installation's
    compile, into a cache this one never reads, is not waited for."""
    import fcntl
    import threading

    import spatial.cpu_engine as cpu_engine

    here = cpu_engine.warm_up_lock(Path(cpu_engine.__file__))
    elsewhere = cpu_engine.warm_up_lock(tmp_path / "site-packages" / "spatial" / "cpu_engine.py")
    assert here != elsewhere and here == cpu_engine.warm_up_lock(Path(cpu_engine.__file__).parent / "cpu_engine.py")

    def warm_up_while_held(lock_path: Path) -> bool:
        with open(lock_path, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            thread = threading.Thread(target=CpuSpatialEngine().warm_up, daemon=True)
            thread.start()
            thread.join(60 if lock_path == elsewhere else 1.0)
            still_waiting = thread.is_alive()
        thread.join(60)
        assert not thread.is_alive()
        return still_waiting

    assert not warm_up_while_held(elsewhere)
    assert warm_up_while_held(here)
