"""CPU spatial engine: numba kernels over the shared GeoArrow buffers (spatial/geoarrow.py).

Point in polygon: the grid index of spatial/cpu_pip_index.py, then an exact crossing number over the edges of the
point's row band. Distance join: b's 3-D unit vectors in a grid of cells at least the radius's chord wide, so no
antimeridian or pole cases. Pairs are counted per point, a page is cut at whole points within its pair budget
(geoarrow.pairs_prefix), and only those pairs are written. The kernels run over chunks of points, so a join whose
caller gave up (the manager sets `cancel`) stops within one chunk. Index layout and rules: docs/design/spatial.md.

numba's cache tracks the source file of each cached function only: after editing kernels.py, clear
spatial/__pycache__/*.nbi/*.nbc if cpu_engine.py and cpu_pip_index.py did not change too.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from . import kernels
from .cpu_pip_index import BOUNDARY, OUTSIDE, K, PipIndex, _cell
from .geoarrow import Points, Polygons, check_distance_join, pairs_prefix, point_range

_point_in_edges = K.point_in_edges  # K: re-exported for device_distance and the tests
_dwithin_point = K.dwithin_point
_unit_vector = K.unit_vector
_cell_key = K.cell_key

MAX_CELLS_PER_AXIS = 1 << 20  # the distance grid's key (ix * n + iy) * n + iz stays below 2^60
CHUNK_POINTS = 1 << 14  # a join's first chunk of points; later ones double while a chunk takes < CHUNK_SECONDS / 2
MAX_CHUNK_POINTS = 1 << 20
CHUNK_SECONDS = 0.2
# numba's parallel loops must not be entered from two threads at once (its workqueue threading layer aborts the
# process): one engine call at a time in the process.
_PARALLEL_LOCK = threading.Lock()


class JoinStopped(RuntimeError):
    """The join's caller gave up (its deadline passed): the engine stopped between two chunks of points."""


def _chunks(n: int, cancel: threading.Event | None, first: int = CHUNK_POINTS) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges covering n points, for one kernel call each, with `cancel` checked before each. The caller
    runs the kernel while the generator is suspended at `yield`, so the time around it is the chunk's: light joins
    grow to few, large chunks, heavy ones (many polygons over each point) keep short ones."""
    lo, size = 0, max(1, first)
    while lo < n:
        if cancel is not None and cancel.is_set():
            raise JoinStopped(f"the join was stopped after {lo} of {n} points: its caller gave up")
        hi = min(n, lo + size)
        began = time.perf_counter()
        yield lo, hi
        if time.perf_counter() - began < CHUNK_SECONDS / 2:
            size = min(2 * size, MAX_CHUNK_POINTS)
        lo = hi


def warm_up_lock(source: Path) -> Path:
    """The lock file of the warm-ups sharing `source`'s numba cache (it is kept per source file, beside it or
    under NUMBA_CACHE_DIR): another installation's compile, which writes a cache this one never reads, is not
    waited for (one machine-wide lock held a service's first join behind another venv's 20 s compile)."""
    key = f"{source.resolve()}\0{os.environ.get('NUMBA_CACHE_DIR', '')}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"switchyard-cpu-spatial-warm-up-{digest}.lock"



# --- point in polygon ----------------------------------------------------------------------------------------

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
def _pip_pair_counts(px, py, counts, first, grid, gx, gy, cell_start, entry_part, entry_state, part_geom, pb,
                     prow0, band_off, band_start, ex0, ey0, ex1, ey1):
    """Each point's number of covering geometries into counts, and its first one into first."""
    for i in prange(px.shape[0]):
        counts[i] = _point_geoms(px[i], py[i], grid, gx, gy, cell_start, entry_part, entry_state, part_geom,
                                 pb, prow0, band_off, band_start, ex0, ey0, ex1, ey1, first, i, 1)


@njit(parallel=True, cache=True)
def _pip_write(px, py, start, counts, first, point, geom, grid, gx, gy, cell_start, entry_part, entry_state,
               part_geom, pb, prow0, band_off, band_start, ex0, ey0, ex1, ey1):
    """The pairs of points px, py (positions start, start + 1, ...) into point, geom (sum(counts) long each)."""
    n = px.shape[0]
    offsets = np.empty(n + 1, np.int64)  # exclusive scan
    offsets[0] = 0
    for i in range(n):
        offsets[i + 1] = offsets[i] + counts[i]
    for i in prange(n):
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
def _within_counts(alon, alat, start, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m, self_join,
                   counts):
    dummy_j = np.empty(1, np.int64)
    dummy_d = np.empty(1, np.float64)
    for t in prange(alon.shape[0]):
        counts[t] = _dwithin_point(start + t, alon[t], alat[t], b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys,
                                   inv_h, n, radius_m, self_join, dummy_j, dummy_d, 0, 0)


@njit(parallel=True, cache=True)
def _within(alon, alat, start, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m, self_join, counts,
            out_i, out_j, out_d):
    """The pairs of points alon, alat (positions start, ...) into out_i, out_j, out_d (sum(counts) long each)."""
    m = alon.shape[0]
    offsets = np.empty(m + 1, np.int64)  # exclusive scan
    offsets[0] = 0
    for t in range(m):
        offsets[t + 1] = offsets[t] + counts[t]
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
    """Point-in-polygon and great-circle distance joins on the CPU (numba, all cores). The join methods take
    `cancel`: once it is set (the manager sets it when the caller gives up) the join raises JoinStopped at its
    next chunk of points instead of running on while the next join waits for this engine's one thread."""

    name = "cpu-spatial"
    kind = "cpu"
    ready = True
    takes_cancel = True  # the manager passes its joins a threading.Event `cancel`

    def __init__(self, target_cells: int | None = None, cache_size: int = 4,
                 chunk_points: int = CHUNK_POINTS) -> None:
        self.target_cells = target_cells
        self.cache_size = cache_size
        self.chunk_points = chunk_points  # a join's first chunk of points (_chunks)
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

    def pip_counts(self, points: Points, polygons: Polygons, cancel: threading.Event | None = None) -> np.ndarray:
        """Number of points covered by each geometry (boundary included; once per MultiPolygon)."""
        with self._lock:
            index = self.pip_index(polygons)
            counts = np.zeros(len(polygons), np.int64)
            if index.empty or len(points) == 0:
                return counts
            px = np.ascontiguousarray(points.x, dtype=np.float64)
            py = np.ascontiguousarray(points.y, dtype=np.float64)
            for lo, hi in _chunks(len(px), cancel, self.chunk_points):
                nblocks = max(1, min(16 * numba.get_num_threads(), (hi - lo) // 1024 + 1))
                counts += _pip_counts(px[lo:hi], py[lo:hi], nblocks, index.n_geometries, *index.args())
            return counts

    def pip_pairs(self, points: Points, polygons: Polygons, start: int | None = 0,
                  stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(point index, geometry index) for points[start:stop] covered by a geometry: unique, sorted by
        (point, geometry); point indices are positions in `points`."""
        return self.pip_pairs_page(points, polygons, start, stop)[:2]

    def pip_pairs_page(self, points: Points, polygons: Polygons, start: int | None = 0, stop: int | None = None,
                       max_pairs: int | None = None, cancel: threading.Event | None = None
                       ) -> tuple[np.ndarray, np.ndarray, int]:
        """pip_pairs for the leading points of points[start:stop] whose pairs fit max_pairs
        (geoarrow.pairs_prefix), and the position after the last point it covered: each point's pairs are
        counted first, so only the page's pairs are ever allocated (plus one point's, if it alone has more)."""
        start, stop = point_range(len(points), start, stop)
        with self._lock:
            index = self.pip_index(polygons)
            if index.empty or stop == start:
                return np.empty(0, np.int64), np.empty(0, np.int64), stop
            px = np.ascontiguousarray(points.x[start:stop], dtype=np.float64)
            py = np.ascontiguousarray(points.y[start:stop], dtype=np.float64)
            args = index.args()
            counts, first = np.empty(len(px), np.int64), np.empty(len(px), np.int64)
            ends = self._counted(counts, cancel, max_pairs, lambda lo, hi: _pip_pair_counts(
                px[lo:hi], py[lo:hi], counts[lo:hi], first[lo:hi], *args))
            m = pairs_prefix(ends, max_pairs)
            point, geom = np.empty(ends[m - 1], np.int64), np.empty(ends[m - 1], np.int64)
            for lo, hi in _chunks(m, cancel, self.chunk_points):
                o0, o1 = (ends[lo - 1] if lo else 0), ends[hi - 1]
                _pip_write(px[lo:hi], py[lo:hi], start + lo, counts[lo:hi], first[lo:hi], point[o0:o1],
                           geom[o0:o1], *args)
            return point, geom, start + m

    def _counted(self, counts: np.ndarray, cancel: threading.Event | None, max_pairs: int | None,
                 count: Callable[[int, int], None]) -> np.ndarray:
        """The cumulative pair counts of a page's leading points, `count(lo, hi)` filling counts[lo:hi] a chunk at a
        time, up to the chunk that passes `max_pairs`: no point after it can be on the page (a page of 100,000
        dense points counted all their pairs, quadratic, to return the first 100,000 pairs)."""
        total = 0
        for lo, hi in _chunks(len(counts), cancel, self.chunk_points):
            count(lo, hi)
            total += int(counts[lo:hi].sum())
            if max_pairs is not None and total > max_pairs:
                return np.cumsum(counts[:hi])
        return np.cumsum(counts)

    def within_distance(self, a: Points, b: Points, radius_m: float, start: int | None = 0, stop: int | None = None,
                        self_join: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(i, j, metres) for a[start:stop] and b with haversine distance <= radius_m, sorted by (i, j). With
        self_join (a and b the same points) only i < j."""
        return self.within_distance_page(a, b, radius_m, start, stop, self_join)[:3]

    def within_distance_page(self, a: Points, b: Points, radius_m: float, start: int | None = 0,
                             stop: int | None = None, self_join: bool = False, max_pairs: int | None = None,
                             cancel: threading.Event | None = None
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
            args = (grid.lon, grid.lat, grid.ux, grid.uy, grid.uz, grid.index, grid.keys, grid.inv_h, grid.n,
                    radius_m, bool(self_join))
            counts = np.empty(len(alon), np.int64)
            ends = self._counted(counts, cancel, max_pairs, lambda lo, hi: _within_counts(
                alon[lo:hi], alat[lo:hi], start + lo, *args, counts[lo:hi]))
            m = pairs_prefix(ends, max_pairs)
            out_i, out_j = np.empty(ends[m - 1], np.int64), np.empty(ends[m - 1], np.int64)
            out_d = np.empty(ends[m - 1], np.float64)
            for lo, hi in _chunks(m, cancel, self.chunk_points):
                o0, o1 = (ends[lo - 1] if lo else 0), ends[hi - 1]
                _within(alon[lo:hi], alat[lo:hi], start + lo, *args, counts[lo:hi], out_i[o0:o1], out_j[o0:o1],
                        out_d[o0:o1])
            return out_i, out_j, out_d, start + m
