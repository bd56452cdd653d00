"""Scalar cores shared by every spatial engine: written once, compiled twice.

Plain Python over scalars, `math` and array indexing, so the same source compiles with `numba.njit` (CPU engine)
and `numba.cuda.jit(device=True)` (GPU engine, CUDA simulator in CI); `compile_core(jit)` rebinds the functions so
that they call one another's compiled twins. Called directly they are ordinary Python (the tests check them against
`fractions.Fraction`). `orient2d` is exact (Shewchuk's filter, then an error-free expansion), so on-boundary
decisions equal GEOS's; `rmul` keeps the GPU build from fusing the products exactness needs; `point_in_part` counts
boundary points as covered; `haversine_m` is symmetric bit for bit. The arithmetic in detail: docs/design/spatial.md.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from types import SimpleNamespace

EPS = 2.0 ** -53  # unit roundoff of float64
SPLITTER = 134217729.0  # 2^27 + 1, Veltkamp's splitter for 53-bit significands
CCW_ERRBOUND_A = (3.0 + 16.0 * EPS) * EPS
SUM_SLACK = 1.0 + 2.0 ** -40  # covers the rounding of a float sum of < 2^10 non-negative terms
EARTH_RADIUS_M = 6371008.8  # IUGG mean radius R1 of the WGS84 ellipsoid, metres
DEG2RAD = math.pi / 180.0

OUTSIDE = 0
INSIDE = 1
BOUNDARY = 2

# Result of `edge_test` for one edge.
NO_CROSSING = 0
CROSSING = 1


# --- error-free transformations ------------------------------------------------------------------------------

def rmul(a, b):
    """a * b rounded once. The GPU build swaps in libdevice dmul_rn so NVVM cannot fuse it into an fma."""
    return a * b


def two_sum(a, b):
    """Knuth's TwoSum: s + e == a + b exactly, s = fl(a + b)."""
    s = a + b
    bv = s - a
    av = s - bv
    return s, (a - av) + (b - bv)


def split(a):
    """Veltkamp split: a == hi + lo exactly, each with at most 26 significant bits."""
    c = rmul(SPLITTER, a)
    big = c - a
    hi = c - big
    return hi, a - hi


def two_product(a, b):
    """Dekker's TwoProduct: x + y == a * b exactly, x = fl(a * b). The half products are exact."""
    x = rmul(a, b)
    ahi, alo = split(a)
    bhi, blo = split(b)
    err1 = x - ahi * bhi
    err2 = err1 - alo * bhi
    err3 = err2 - ahi * blo
    return x, alo * blo - err3


def sign_of_sum12(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11):
    """Exact sign of the sum of 12 doubles: VecSum passes (error-free, the sum never changes) until the
    running total p11 is larger than the sum of the magnitudes of all the other terms."""
    for _ in range(200):
        p1, p0 = two_sum(p1, p0)
        p2, p1 = two_sum(p2, p1)
        p3, p2 = two_sum(p3, p2)
        p4, p3 = two_sum(p4, p3)
        p5, p4 = two_sum(p5, p4)
        p6, p5 = two_sum(p6, p5)
        p7, p6 = two_sum(p7, p6)
        p8, p7 = two_sum(p8, p7)
        p9, p8 = two_sum(p9, p8)
        p10, p9 = two_sum(p10, p9)
        p11, p10 = two_sum(p11, p10)
        rest = (abs(p0) + abs(p1) + abs(p2) + abs(p3) + abs(p4) + abs(p5) + abs(p6) + abs(p7) + abs(p8)
                + abs(p9) + abs(p10))
        if rest * SUM_SLACK < abs(p11):
            return 1 if p11 > 0.0 else -1
        if rest == 0.0 and p11 == 0.0:
            return 0
    return 1 if p11 > 0.0 else (-1 if p11 < 0.0 else 0)  # not reached: VecSum converges in a few passes


# --- orientation ---------------------------------------------------------------------------------------------

def orient2d_exact(ax, ay, bx, by, px, py):
    """Exact sign of (b - a) x (p - a) = ax*by - ay*bx + bx*py - by*px + px*ay - py*ax."""
    t0, e0 = two_product(ax, by)
    t1, e1 = two_product(-ay, bx)
    t2, e2 = two_product(bx, py)
    t3, e3 = two_product(-by, px)
    t4, e4 = two_product(px, ay)
    t5, e5 = two_product(-py, ax)
    return sign_of_sum12(e0, e1, e2, e3, e4, e5, t0, t1, t2, t3, t4, t5)


def orient2d(ax, ay, bx, by, px, py):
    """+1 if p is left of the directed line a -> b, -1 if right, 0 if the three points are collinear. Exact."""
    detleft = (bx - ax) * (py - ay)
    detright = (by - ay) * (px - ax)
    det = detleft - detright
    errbound = CCW_ERRBOUND_A * (abs(detleft) + abs(detright))
    if det > errbound:
        return 1
    if -det > errbound:
        return -1
    return orient2d_exact(ax, ay, bx, by, px, py)


# --- point in polygon ----------------------------------------------------------------------------------------

def edge_test(px, py, ax, ay, bx, by):
    """One step of the crossing number for edge a -> b and a ray from p towards +x, with the half-open rule
    (a vertex counts as above when its y > py). Returns CROSSING, NO_CROSSING or BOUNDARY (p on the edge,
    decided exactly). A zero-length edge is BOUNDARY only when p equals its vertex."""
    if (ay > py) != (by > py):
        o = orient2d(ax, ay, bx, by, px, py)
        if o == 0:
            return BOUNDARY
        if (o > 0) == (by > ay):
            return CROSSING
        return NO_CROSSING
    if ay == py:
        if by == py:
            if ax <= px <= bx or bx <= px <= ax:
                return BOUNDARY
        elif ax == px:
            return BOUNDARY
    elif by == py and bx == px:
        return BOUNDARY
    return NO_CROSSING


def point_in_part(px, py, x, y, ring_offsets, ring_start, ring_stop):
    """Point against one polygon part given as rings [ring_start, ring_stop) of GeoArrow buffers (shell first,
    then holes): INSIDE, OUTSIDE or BOUNDARY."""
    inside = False
    for r in range(ring_start, ring_stop):
        s = ring_offsets[r]
        e = ring_offsets[r + 1]
        for i in range(s, e):
            j = i + 1
            if j == e:
                j = s
            t = edge_test(px, py, x[i], y[i], x[j], y[j])
            if t == BOUNDARY:
                return BOUNDARY
            if t == CROSSING:
                inside = not inside
    return INSIDE if inside else OUTSIDE


def point_in_edges(px, py, ex0, ey0, ex1, ey1, k0, k1):
    """The same crossing number over a pre-selected edge list [k0, k1) (the edges of one part whose y-range can
    contain py, each edge once): equal to `point_in_part` for every point whose y lies in the list's band."""
    inside = False
    for k in range(k0, k1):
        t = edge_test(px, py, ex0[k], ey0[k], ex1[k], ey1[k])
        if t == BOUNDARY:
            return BOUNDARY
        if t == CROSSING:
            inside = not inside
    return INSIDE if inside else OUTSIDE


# --- great-circle distance -----------------------------------------------------------------------------------

def haversine_m(lon1, lat1, lon2, lat2):
    """Great-circle distance in metres between two lon/lat points in degrees (R = EARTH_RADIUS_M)."""
    phi1 = lat1 * DEG2RAD
    phi2 = lat2 * DEG2RAD
    s1 = math.sin((lat2 - lat1) * DEG2RAD * 0.5)
    s2 = math.sin((lon2 - lon1) * DEG2RAD * 0.5)
    h = s1 * s1 + math.cos(phi1) * math.cos(phi2) * (s2 * s2)
    h = min(h, 1.0)
    return 2.0 * EARTH_RADIUS_M * math.asin(math.sqrt(h))


def unit_vector(lon, lat):
    """The point's 3-D unit vector (x towards lon 0, z towards the north pole)."""
    phi = lat * DEG2RAD
    lam = lon * DEG2RAD
    c = math.cos(phi)
    return c * math.cos(lam), c * math.sin(lam), math.sin(phi)


def cell_key(ux, uy, uz, inv_h, n):
    """Key of a unit vector's cell in a uniform grid of n^3 cells of side 1/inv_h over [-1, 1]^3. Two points
    whose chord is below the cell side are in the same or adjacent cells on every axis, whatever their
    longitudes (antimeridian) or latitudes (poles)."""
    # int(): numba-cuda types math.floor(float64) as float64 on the device (CPU numba and the simulator give
    # int64), and float keys past 2**53 round into other cells. The explicit conversion gives int64 everywhere.
    ix = int(math.floor((ux + 1.0) * inv_h))
    iy = int(math.floor((uy + 1.0) * inv_h))
    iz = int(math.floor((uz + 1.0) * inv_h))
    ix = min(max(ix, 0), n - 1)
    iy = min(max(iy, 0), n - 1)
    iz = min(max(iz, 0), n - 1)
    return (ix * n + iy) * n + iz


def unit_cell_key(lon, lat, inv_h, n):
    ux, uy, uz = unit_vector(lon, lat)
    return cell_key(ux, uy, uz, inv_h, n)


def lower_bound(keys, lo, hi, value):
    """First index in sorted keys[lo:hi] whose key is >= value (hi if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def upper_bound(keys, lo, hi, value):
    """First index in sorted keys[lo:hi] whose key is > value (hi if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] <= value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def dwithin_point(i, lon, lat, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m, self_join,
                  out_j, out_d, pos, cap):
    """Every b within radius_m (haversine <= radius_m) of point i = (lon, lat), from the 27 grid cells around
    it. b_lon, b_lat, b_ux, b_uy, b_uz (unit vector), b_index are b sorted by b_keys (its cell_key). A candidate
    whose chord exceeds the cell side (which bounds the chord of every pair within the radius, with margin) is
    skipped before the haversine. In a self-join only b_index > i is kept. Writes the first `cap` hits
    (b index, distance) to out_j, out_d from `pos` and returns how many there are: cap = 0 counts."""
    ux, uy, uz = unit_vector(lon, lat)
    key = cell_key(ux, uy, uz, inv_h, n)
    side = 1.0 / inv_h
    chord2 = side * side
    iz = key % n
    iy = (key // n) % n
    ix = key // (n * n)
    z0 = max(iz - 1, 0)
    z1 = min(iz + 1, n - 1)
    nb = b_keys.shape[0]
    found = 0
    for dx in range(-1, 2):
        cx = ix + dx
        if cx < 0 or cx >= n:
            continue
        for dy in range(-1, 2):
            cy = iy + dy
            if cy < 0 or cy >= n:
                continue
            base = (cx * n + cy) * n
            lo = lower_bound(b_keys, 0, nb, base + z0)
            hi = upper_bound(b_keys, lo, nb, base + z1)
            for k in range(lo, hi):
                j = b_index[k]
                if self_join and j <= i:
                    continue
                ex = ux - b_ux[k]
                ey = uy - b_uy[k]
                ez = uz - b_uz[k]
                if ex * ex + ey * ey + ez * ez > chord2:
                    continue
                d = haversine_m(lon, lat, b_lon[k], b_lat[k])
                if d <= radius_m:
                    if found < cap:
                        out_j[pos + found] = j
                        out_d[pos + found] = d
                    found += 1
    return found


def grid_side(radius_m, max_cells_per_axis):
    """Cell side and cells per axis of the unit-vector grid for a radius: the side is at least the chord of the
    radius's central angle with a margin (1e-6 relative + 1e-9 rad, far above the rounding of the unit vectors
    and of the haversine), so that no pair within the radius is ever two cells apart."""
    theta = min(radius_m / EARTH_RADIUS_M * (1.0 + 1e-6) + 1e-9, math.pi)
    chord = 2.0 * math.sin(theta * 0.5)
    side = max(chord * (1.0 + 1e-6) + 1e-12, 2.0 / max_cells_per_axis)
    n = max(1, min(int(2.0 / side), max_cells_per_axis))
    return side, n


CORE = ("rmul", "two_sum", "split", "two_product", "sign_of_sum12", "orient2d_exact", "orient2d", "edge_test",
        "point_in_part", "point_in_edges", "haversine_m", "unit_vector", "cell_key", "unit_cell_key", "lower_bound",
        "upper_bound", "dwithin_point")


def compile_core(jit: Callable, overrides: dict | None = None, env: dict | None = None) -> SimpleNamespace:
    """Compile every core function with `jit` (e.g. numba.njit(cache=True) or numba.cuda.jit(device=True)).

    Each function is rebound to one shared namespace (this module's constants plus the compiled cores), so the
    compiled versions call each other. `overrides` replaces cores by name with already compiled functions
    (the GPU build passes its fma-proof `rmul`); `env` replaces other names in that namespace (the tests run the
    cores as Python with a `math` whose floor returns a float, as numba-cuda types it on a device)."""
    ns = dict(globals())
    ns.update(env or {})
    compiled = {}
    for name in CORE:
        if overrides and name in overrides:
            compiled[name] = overrides[name]
            continue
        fn = globals()[name]
        rebound = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
        rebound.__qualname__ = fn.__qualname__
        rebound.__doc__ = fn.__doc__
        compiled[name] = jit(rebound)
    ns.update(compiled)  # compilation is lazy: the names resolve when a caller is first compiled
    return SimpleNamespace(**compiled)
