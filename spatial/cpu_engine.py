"""CPU spatial engine: numba kernels over the shared GeoArrow buffers (spatial/geoarrow.py).

Point in polygon: a uniform grid over the polygons whose cells are decided once (inside or outside a part) where no
edge reaches them, and elsewhere an exact crossing number over the edges of the point's row band; pairs are
counted, scanned, then written. Distance join: b's 3-D unit vectors in a grid of cells at least the radius's chord
wide, so no antimeridian or pole cases. Index layout and rules: docs/design/spatial.md.

numba's cache tracks the source file of each cached function only: after editing kernels.py, clear
spatial/__pycache__/*.nbi/*.nbc if cpu_engine.py did not change too.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import tempfile
import threading
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from . import kernels
from .geoarrow import Points, Polygons, check_distance_join, pairs_prefix, point_range

K = kernels.compile_core(njit(cache=True))
_point_in_edges = K.point_in_edges
_dwithin_point = K.dwithin_point
_unit_vector = K.unit_vector
_cell_key = K.cell_key

OUTSIDE = kernels.OUTSIDE
INSIDE = kernels.INSIDE
BOUNDARY = kernels.BOUNDARY
PAD = 1e-6  # cells: the edge-to-cell marking margin (the cell arithmetic errs by < 1e-11 cells)
MAX_CELLS_PER_AXIS = 1 << 20  # the distance grid's key (ix * n + iy) * n + iz stays below 2^60
# numba's parallel loops must not be entered from two threads at once (its workqueue threading layer aborts the
# process): one engine call at a time in the process.
_PARALLEL_LOCK = threading.Lock()


def warm_up_lock(source: Path) -> Path:
    """The lock file of the warm-ups sharing `source`'s numba cache (it is kept per source file, beside it or
    under NUMBA_CACHE_DIR): another installation's compile, which writes a cache this one never reads, is not
    waited for (one machine-wide lock held a service's first join behind another venv's 20 s compile)."""
    key = f"{source.resolve()}\0{os.environ.get('NUMBA_CACHE_DIR', '')}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"switchyard-cpu-spatial-warm-up-{digest}.lock"


# --- PIP index -----------------------------------------------------------------------------------------------

@njit(cache=True)
def _cell(v, v0, inv, n):
    """The grid's cell function: monotone in v, clamped to [0, n)."""
    c = math.floor((v - v0) * inv)
    if c < 0:
        return 0
    if c > n - 1:
        return n - 1
    return c


@njit(cache=True)
def _cell_padded(v, v0, inv, n, pad):
    c = math.floor((v - v0) * inv + pad)
    if c < 0:
        return 0
    if c > n - 1:
        return n - 1
    return c


@njit(cache=True)
def _part_bounds(x, y, ring_offsets, part_offsets):
    n = part_offsets.shape[0] - 1
    vstart = np.empty(n, np.int64)
    vend = np.empty(n, np.int64)
    b = np.empty((4, n), np.float64)
    for p in range(n):
        s = ring_offsets[part_offsets[p]]
        e = ring_offsets[part_offsets[p + 1]]
        vstart[p] = s
        vend[p] = e
        b[0, p] = np.inf
        b[1, p] = np.inf
        b[2, p] = -np.inf
        b[3, p] = -np.inf
        for i in range(s, e):
            b[0, p] = min(b[0, p], x[i])
            b[1, p] = min(b[1, p], y[i])
            b[2, p] = max(b[2, p], x[i])
            b[3, p] = max(b[3, p], y[i])
    return vstart, vend, b


@njit(cache=True)
def _next_vertex(ring_offsets, nv):
    nxt = np.empty(nv, np.int64)
    for r in range(ring_offsets.shape[0] - 1):
        s = ring_offsets[r]
        e = ring_offsets[r + 1]
        for i in range(s, e):
            nxt[i] = i + 1 if i + 1 < e else s
    return nxt


@njit(parallel=True, cache=True)
def _build_bands(x, y, nxt, vstart, vend, prow0, prow1, band_off, y0, invy, gy):
    nparts = vstart.shape[0]
    counts = np.zeros(band_off[nparts] + 1, np.int64)
    for p in prange(nparts):
        if vend[p] == vstart[p]:
            continue
        base = band_off[p] - prow0[p]
        for i in range(vstart[p], vend[p]):
            j = nxt[i]
            lo = max(_cell_padded(min(y[i], y[j]), y0, invy, gy, -PAD), prow0[p])
            hi = min(_cell_padded(max(y[i], y[j]), y0, invy, gy, PAD), prow1[p])
            for r in range(lo, hi + 1):
                counts[base + r + 1] += 1
    band_start = np.cumsum(counts)
    total = band_start[-1]
    ex0 = np.empty(total, np.float64)
    ey0 = np.empty(total, np.float64)
    ex1 = np.empty(total, np.float64)
    ey1 = np.empty(total, np.float64)
    cursor = band_start[:-1].copy()
    for p in prange(nparts):
        if vend[p] == vstart[p]:
            continue
        base = band_off[p] - prow0[p]
        for i in range(vstart[p], vend[p]):
            j = nxt[i]
            lo = max(_cell_padded(min(y[i], y[j]), y0, invy, gy, -PAD), prow0[p])
            hi = min(_cell_padded(max(y[i], y[j]), y0, invy, gy, PAD), prow1[p])
            for r in range(lo, hi + 1):
                k = cursor[base + r]
                cursor[base + r] = k + 1
                ex0[k] = x[i]
                ey0[k] = y[i]
                ex1[k] = x[j]
                ey1[k] = y[j]
    return band_start, ex0, ey0, ex1, ey1


@njit(parallel=True, cache=True)
def _build_cell_states(x, y, nxt, vstart, vend, pb, pcx0, pcx1, prow0, prow1, rect_off, band_off, band_start,
                       ex0, ey0, ex1, ey1, x0, y0, invx, invy, wx, wy, gx, gy):
    nparts = vstart.shape[0]
    states = np.zeros(rect_off[nparts], np.uint8)
    for p in prange(nparts):
        if vend[p] == vstart[p]:
            continue
        c0 = pcx0[p]
        c1 = pcx1[p]
        r0 = prow0[p]
        r1 = prow1[p]
        width = c1 - c0 + 1
        base = rect_off[p]
        for i in range(vstart[p], vend[p]):
            j = nxt[i]
            ca = max(_cell_padded(min(x[i], x[j]), x0, invx, gx, -PAD), c0)
            cb = min(_cell_padded(max(x[i], x[j]), x0, invx, gx, PAD), c1)
            ra = max(_cell_padded(min(y[i], y[j]), y0, invy, gy, -PAD), r0)
            rb = min(_cell_padded(max(y[i], y[j]), y0, invy, gy, PAD), r1)
            for r in range(ra, rb + 1):
                for c in range(ca, cb + 1):
                    states[base + (r - r0) * width + (c - c0)] = BOUNDARY
        for r in range(r0, r1 + 1):
            cy = y0 + (r + 0.5) * wy
            for c in range(c0, c1 + 1):
                idx = base + (r - r0) * width + (c - c0)
                if states[idx] == BOUNDARY:
                    continue
                cx = x0 + (c + 0.5) * wx
                if cx < pb[0, p] or cx > pb[2, p] or cy < pb[1, p] or cy > pb[3, p]:
                    continue  # OUTSIDE: a cell no edge reaches is all on one side
                rr = min(max(_cell(cy, y0, invy, gy), r0), r1)
                b = band_off[p] + rr - r0
                states[idx] = _point_in_edges(cx, cy, ex0, ey0, ex1, ey1, band_start[b], band_start[b + 1])
    return states


@njit(cache=True)
def _build_cells(states, vstart, vend, pcx0, pcx1, prow0, prow1, rect_off, gx, ncells):
    nparts = vstart.shape[0]
    counts = np.zeros(ncells + 1, np.int64)
    for p in range(nparts):
        if vend[p] == vstart[p]:
            continue
        width = pcx1[p] - pcx0[p] + 1
        for r in range(prow0[p], prow1[p] + 1):
            for c in range(pcx0[p], pcx1[p] + 1):
                if states[rect_off[p] + (r - prow0[p]) * width + (c - pcx0[p])] != OUTSIDE:
                    counts[r * gx + c + 1] += 1
    cell_start = np.cumsum(counts)
    entry_part = np.empty(cell_start[-1], np.int32)
    entry_state = np.empty(cell_start[-1], np.uint8)
    cursor = cell_start[:-1].copy()
    for p in range(nparts):  # in part order: every cell lists its parts (so geometries) ascending
        if vend[p] == vstart[p]:
            continue
        width = pcx1[p] - pcx0[p] + 1
        for r in range(prow0[p], prow1[p] + 1):
            for c in range(pcx0[p], pcx1[p] + 1):
                s = states[rect_off[p] + (r - prow0[p]) * width + (c - pcx0[p])]
                if s != OUTSIDE:
                    k = cursor[r * gx + c]
                    cursor[r * gx + c] = k + 1
                    entry_part[k] = p
                    entry_state[k] = s
    return cell_start, entry_part, entry_state


class PipIndex:
    """The grid, bands and cell lists of one Polygons object (docs/design/spatial.md)."""

    def __init__(self, polygons: Polygons, target_cells: int | None = None) -> None:
        x = np.ascontiguousarray(polygons.x, dtype=np.float64)
        y = np.ascontiguousarray(polygons.y, dtype=np.float64)
        ring_offsets = np.ascontiguousarray(polygons.ring_offsets, dtype=np.int64)
        part_offsets = np.ascontiguousarray(polygons.part_offsets, dtype=np.int64)
        self.n_geometries = len(polygons)
        self.part_geom = np.ascontiguousarray(polygons.part_geometry(), dtype=np.int64)
        vstart, vend, pb = _part_bounds(x, y, ring_offsets, part_offsets)
        nonempty = vend > vstart
        self.empty = not nonempty.any()
        if self.empty:
            return
        x0, y0 = float(pb[0, nonempty].min()), float(pb[1, nonempty].min())
        x1, y1 = float(pb[2, nonempty].max()), float(pb[3, nonempty].max())
        width, height = x1 - x0, y1 - y0
        nv = len(x)
        if target_cells is None:
            target_cells = min(max(4 * nv, 1 << 16), 1 << 22)
        while True:  # keep the per-part cell rectangles within a memory budget
            gx, gy = self._grid_shape(width, height, target_cells)
            wx, wy = width / gx, height / gy
            invx = gx / width if width > 0 else 0.0
            invy = gy / height if height > 0 else 0.0
            pcx0 = np.array([_cell(v, x0, invx, gx) if ok else 0 for v, ok in zip(pb[0], nonempty)], np.int64)
            pcx1 = np.array([_cell(v, x0, invx, gx) if ok else -1 for v, ok in zip(pb[2], nonempty)], np.int64)
            prow0 = np.array([_cell(v, y0, invy, gy) if ok else 0 for v, ok in zip(pb[1], nonempty)], np.int64)
            prow1 = np.array([_cell(v, y0, invy, gy) if ok else -1 for v, ok in zip(pb[3], nonempty)], np.int64)
            areas = (pcx1 - pcx0 + 1) * (prow1 - prow0 + 1)
            if areas.sum() <= (1 << 26) or target_cells <= 1024:
                break
            target_cells //= 4
        nxt = _next_vertex(ring_offsets, nv)
        band_off = np.concatenate([[0], np.cumsum(prow1 - prow0 + 1)]).astype(np.int64)
        rect_off = np.concatenate([[0], np.cumsum(areas)]).astype(np.int64)
        band_start, ex0, ey0, ex1, ey1 = _build_bands(x, y, nxt, vstart, vend, prow0, prow1, band_off, y0, invy,
                                                      gy)
        states = _build_cell_states(x, y, nxt, vstart, vend, pb, pcx0, pcx1, prow0, prow1, rect_off, band_off,
                                    band_start, ex0, ey0, ex1, ey1, x0, y0, invx, invy, wx, wy, gx, gy)
        cell_start, entry_part, entry_state = _build_cells(states, vstart, vend, pcx0, pcx1, prow0, prow1,
                                                           rect_off, gx, gx * gy)
        self.grid = np.array([x0, y0, x1, y1, invx, invy], np.float64)
        self.shape = (gx, gy)
        self.pb, self.prow0, self.band_off = pb, prow0, band_off
        self.band_start, self.ex0, self.ey0, self.ex1, self.ey1 = band_start, ex0, ey0, ex1, ey1
        self.cell_start, self.entry_part, self.entry_state = cell_start, entry_part, entry_state

    @staticmethod
    def _grid_shape(width: float, height: float, cells: int) -> tuple[int, int]:
        if width <= 0 and height <= 0:
            return 1, 1
        if height <= 0:
            return min(cells, 1 << 16), 1
        if width <= 0:
            return 1, min(cells, 1 << 16)
        gx = round(math.sqrt(cells * width / height))
        gx = min(max(gx, 1), 1 << 16)
        gy = min(max(round(cells / gx), 1), 1 << 16)
        return gx, gy

    def args(self) -> tuple:
        return (self.grid, self.shape[0], self.shape[1], self.cell_start, self.entry_part, self.entry_state,
                self.part_geom, self.pb, self.prow0, self.band_off, self.band_start, self.ex0, self.ey0, self.ex1,
                self.ey1)


@njit(cache=True)
def _point_geoms(px, py, grid, gx, gy, cell_start, entry_part, entry_state, part_geom, pb, prow0, band_off,
                 band_start, ex0, ey0, ex1, ey1, out, pos, cap):
    """The geometries covering (px, py), ascending and each once: writes the first `cap` to out[pos:] and
    returns how many there are."""
    if not (px >= grid[0] and px <= grid[2] and py >= grid[1] and py <= grid[3]):
        return 0  # also NaN
    cx = _cell(px, grid[0], grid[4], gx)
    cy = _cell(py, grid[1], grid[5], gy)
    c = cy * gx + cx
    found = 0
    last = -1
    for k in range(cell_start[c], cell_start[c + 1]):
        p = entry_part[k]
        g = part_geom[p]
        if g == last:
            continue
        if entry_state[k] == BOUNDARY:
            if px < pb[0, p] or px > pb[2, p] or py < pb[1, p] or py > pb[3, p]:
                continue
            b = band_off[p] + cy - prow0[p]
            if _point_in_edges(px, py, ex0, ey0, ex1, ey1, band_start[b], band_start[b + 1]) == OUTSIDE:
                continue
        if found < cap:
            out[pos + found] = g
        found += 1
        last = g
    return found


@njit(parallel=True, cache=True)
def _pip_counts(px, py, nblocks, n_geoms, grid, gx, gy, cell_start, entry_part, entry_state, part_geom, pb,
                prow0, band_off, band_start, ex0, ey0, ex1, ey1):
    n = px.shape[0]
    per_block = np.zeros((nblocks, n_geoms), np.int64)
    step = (n + nblocks - 1) // nblocks
    for t in prange(nblocks):
        buf = np.empty(n_geoms, np.int64)
        for i in range(t * step, min(n, (t + 1) * step)):
            c = _point_geoms(px[i], py[i], grid, gx, gy, cell_start, entry_part, entry_state, part_geom, pb,
                             prow0, band_off, band_start, ex0, ey0, ex1, ey1, buf, 0, n_geoms)
            for k in range(c):
                per_block[t, buf[k]] += 1
    counts = np.zeros(n_geoms, np.int64)
    for t in range(nblocks):
        for g in range(n_geoms):
            counts[g] += per_block[t, g]
    return counts


@njit(parallel=True, cache=True)
def _pip_pairs(px, py, start, grid, gx, gy, cell_start, entry_part, entry_state, part_geom, pb, prow0, band_off,
               band_start, ex0, ey0, ex1, ey1):
    n = px.shape[0]
    counts = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    for i in prange(n):  # count (and keep the first hit)
        counts[i] = _point_geoms(px[i], py[i], grid, gx, gy, cell_start, entry_part, entry_state, part_geom,
                                 pb, prow0, band_off, band_start, ex0, ey0, ex1, ey1, first, i, 1)
    offsets = np.empty(n + 1, np.int64)  # exclusive scan
    offsets[0] = 0
    for i in range(n):
        offsets[i + 1] = offsets[i] + counts[i]
    point = np.empty(offsets[n], np.int64)
    geom = np.empty(offsets[n], np.int64)
    for i in prange(n):  # write
        c = counts[i]
        if c == 0:
            continue
        o = offsets[i]
        if c == 1:
            geom[o] = first[i]
        else:
            _point_geoms(px[i], py[i], grid, gx, gy, cell_start, entry_part, entry_state, part_geom, pb, prow0,
                         band_off, band_start, ex0, ey0, ex1, ey1, geom, o, c)
        for k in range(c):
            point[o + k] = start + i
    return point, geom


# --- distance join -------------------------------------------------------------------------------------------

@njit(parallel=True, cache=True)
def _unit_keys(lon, lat, inv_h, n):
    m = lon.shape[0]
    keys = np.empty(m, np.int64)
    u = np.empty((3, m), np.float64)
    for i in prange(m):
        ux, uy, uz = _unit_vector(lon[i], lat[i])
        u[0, i] = ux
        u[1, i] = uy
        u[2, i] = uz
        keys[i] = _cell_key(ux, uy, uz, inv_h, n)
    return keys, u


@njit(cache=True)
def _sort_hits(j, d, lo, hi):
    """Sort j[lo:hi] ascending, carrying d along (insertion sort for the usual handful, argsort beyond)."""
    if hi - lo <= 32:
        for a in range(lo + 1, hi):
            vj = j[a]
            vd = d[a]
            b = a - 1
            while b >= lo and j[b] > vj:
                j[b + 1] = j[b]
                d[b + 1] = d[b]
                b -= 1
            j[b + 1] = vj
            d[b + 1] = vd
    else:
        order = np.argsort(j[lo:hi])
        sj = j[lo:hi][order]
        sd = d[lo:hi][order]
        j[lo:hi] = sj
        d[lo:hi] = sd


@njit(parallel=True, cache=True)
def _within_counts(alon, alat, start, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m, self_join):
    m = alon.shape[0]
    counts = np.empty(m, np.int64)
    dummy_j = np.empty(1, np.int64)
    dummy_d = np.empty(1, np.float64)
    for t in prange(m):
        counts[t] = _dwithin_point(start + t, alon[t], alat[t], b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys,
                                   inv_h, n, radius_m, self_join, dummy_j, dummy_d, 0, 0)
    return counts


@njit(parallel=True, cache=True)
def _within(alon, alat, start, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m, self_join, counts):
    m = alon.shape[0]
    offsets = np.empty(m + 1, np.int64)  # exclusive scan
    offsets[0] = 0
    for t in range(m):
        offsets[t + 1] = offsets[t] + counts[t]
    out_i = np.empty(offsets[m], np.int64)
    out_j = np.empty(offsets[m], np.int64)
    out_d = np.empty(offsets[m], np.float64)
    for t in prange(m):  # write, then sort each point's hits by j
        c = counts[t]
        if c == 0:
            continue
        o = offsets[t]
        _dwithin_point(start + t, alon[t], alat[t], b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n,
                       radius_m, self_join, out_j, out_d, o, c)
        for k in range(c):
            out_i[o + k] = start + t
        _sort_hits(out_j, out_d, o, o + c)
    return out_i, out_j, out_d


class DistanceGrid:
    """b's unit vectors bucketed for one radius: keys sorted, with b's coordinates and indices in key order."""

    def __init__(self, b: Points, radius_m: float) -> None:
        side, n = kernels.grid_side(radius_m, MAX_CELLS_PER_AXIS)
        self.inv_h, self.n = 1.0 / side, n
        lon = np.ascontiguousarray(b.x, dtype=np.float64)
        lat = np.ascontiguousarray(b.y, dtype=np.float64)
        keys, u = _unit_keys(lon, lat, self.inv_h, n)
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.index = order.astype(np.int64)
        self.lon = lon[order]
        self.lat = lat[order]
        self.ux, self.uy, self.uz = (np.ascontiguousarray(u[k][order]) for k in range(3))


class CpuSpatialEngine:
    """Point-in-polygon and great-circle distance joins on the CPU (numba, all cores)."""

    name = "cpu-spatial"
    kind = "cpu"
    ready = True

    def __init__(self, target_cells: int | None = None, cache_size: int = 4) -> None:
        self.target_cells = target_cells
        self.cache_size = cache_size
        self._pip: list[tuple[Polygons, PipIndex]] = []
        self._grids: list[tuple[Points, float, DistanceGrid]] = []
        self._lock = _PARALLEL_LOCK
        self.warm = False  # warm_up ran (prepare runs it once)

    def pip_index(self, polygons: Polygons) -> PipIndex:
        for poly, index in self._pip:
            if poly is polygons:
                return index
        index = PipIndex(polygons, self.target_cells)
        self._pip = [(polygons, index)] + self._pip[: self.cache_size - 1]
        return index

    def distance_grid(self, b: Points, radius_m: float) -> DistanceGrid:
        for pts, r, grid in self._grids:
            if pts is b and r == radius_m:
                return grid
        grid = DistanceGrid(b, radius_m)
        self._grids = [(b, radius_m, grid)] + self._grids[: self.cache_size - 1]
        return grid

    def forget(self, geometry: Points | Polygons) -> None:
        """Drop what was built for a layer that was rewritten or dropped."""
        with self._lock:
            self._pip = [entry for entry in self._pip if entry[0] is not geometry]
            self._grids = [entry for entry in self._grids if entry[0] is not geometry]

    def prepare(self, geometry: Points | Polygons) -> None:
        """A layer was written or loaded (SpatialManager.prepare, on this engine's thread): warm up once, so that
        a process holding layers compiles before its first join, and one without any never does."""
        if not self.warm:
            self.warm_up()

    def warm_up(self) -> None:
        """Load (or, on a fresh machine, compile: 10-20 s) the numba kernels a join needs, by joining two points with
        a square and with each other, for writable point arrays and for read-only ones (Arrow views of a stored
        layer), which numba compiles separately; the answers are checked. One warm-up per installation at a time:
        the processes that waited load what the first wrote to numba's cache instead of all compiling at once."""
        self.warm = True
        try:
            lock = open(warm_up_lock(Path(__file__)), "a")  # noqa: SIM115
        except OSError:  # another user's file: compile without waiting
            self._join_a_square()
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self._join_a_square()

    def _join_a_square(self) -> None:
        square = Polygons(np.array([0.0, 1.0, 1.0, 0.0, 0.0]), np.array([0.0, 0.0, 1.0, 1.0, 0.0]),
                          np.array([0, 5], np.int64), np.array([0, 1], np.int64), np.array([0, 1], np.int64))
        for writable in (True, False):
            x, y = np.array([0.5, 2.0, 0.5001]), np.array([0.5, 0.5, 0.5])
            x.flags.writeable = y.flags.writeable = writable
            points = Points(x, y)
            counts = self.pip_counts(points, square)
            first, second = self.pip_pairs(points, square, 0, 3)
            i, j, _ = self.within_distance(points, points, 1000.0, 0, 3, self_join=True)
            answers = (counts.tolist(), first.tolist(), second.tolist(), i.tolist(), j.tolist())
            if answers != ([2], [0, 2], [0, 0], [0], [2]):
                raise RuntimeError(f"the CPU spatial engine answered its warm-up wrong: {answers}")
            self.forget(points)
        self.forget(square)

    def drop_results(self) -> None:
        """Nothing to drop: this engine caches structures (PIP indexes, distance grids), never join results, so
        every join is computed (the GPU engine's method of the same name clears its result cache)."""

    def pip_counts(self, points: Points, polygons: Polygons) -> np.ndarray:
        """Number of points covered by each geometry (boundary included; once per MultiPolygon)."""
        with self._lock:
            index = self.pip_index(polygons)
            if index.empty or len(points) == 0:
                return np.zeros(len(polygons), np.int64)
            px = np.ascontiguousarray(points.x, dtype=np.float64)
            py = np.ascontiguousarray(points.y, dtype=np.float64)
            nblocks = max(1, min(16 * numba.get_num_threads(), len(px) // 4096 + 1))
            return _pip_counts(px, py, nblocks, index.n_geometries, *index.args())

    def pip_pairs(self, points: Points, polygons: Polygons, start: int | None = 0,
                  stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(point index, geometry index) for points[start:stop] covered by a geometry: unique, sorted by
        (point, geometry); point indices are positions in `points`."""
        start, stop = point_range(len(points), start, stop)
        with self._lock:
            index = self.pip_index(polygons)
            if index.empty or stop == start:
                return np.empty(0, np.int64), np.empty(0, np.int64)
            px = np.ascontiguousarray(points.x[start:stop], dtype=np.float64)
            py = np.ascontiguousarray(points.y[start:stop], dtype=np.float64)
            return _pip_pairs(px, py, start, *index.args())

    def within_distance(self, a: Points, b: Points, radius_m: float, start: int | None = 0, stop: int | None = None,
                        self_join: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(i, j, metres) for a[start:stop] and b with haversine distance <= radius_m, sorted by (i, j). With
        self_join (a and b the same points) only i < j."""
        return self.within_distance_page(a, b, radius_m, start, stop, self_join)[:3]

    def within_distance_page(self, a: Points, b: Points, radius_m: float, start: int | None = 0,
                             stop: int | None = None, self_join: bool = False, max_pairs: int | None = None
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """within_distance for the leading points of a[start:stop] whose pairs fit max_pairs
        (geoarrow.pairs_prefix), and the position after the last point it covered."""
        start, stop, radius_m = check_distance_join(a, b, radius_m, start, stop, self_join)
        if stop == start or len(b) == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64), stop
        with self._lock:
            grid = self.distance_grid(b, radius_m)
            alon = np.ascontiguousarray(a.x[start:stop], dtype=np.float64)
            alat = np.ascontiguousarray(a.y[start:stop], dtype=np.float64)
            args = (start, grid.lon, grid.lat, grid.ux, grid.uy, grid.uz, grid.index, grid.keys, grid.inv_h, grid.n,
                    radius_m, bool(self_join))
            counts = _within_counts(alon, alat, *args)
            m = pairs_prefix(np.cumsum(counts), max_pairs)
            return (*_within(alon[:m], alat[:m], *args, counts[:m]), start + m)
