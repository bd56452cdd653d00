"""GPU spatial engine: cuSpatial's quadtree point-in-polygon, re-implemented with numba-cuda.

Nothing here imports numba.cuda (or cupy) at module import: `import spatial.cuda_engine` always works, and the
kernels are compiled on first use (`_build`). The kernels run on a CUDA device, or in numba-cuda's simulator
when NUMBA_ENABLE_CUDASIM=1 was set before numba was first imported (CI has no GPU). The array-namespace steps
use `xp`: cupy on a real device (device arrays end to end, the kernels take them through the CUDA array
interface), numpy under the simulator (or on a device without cupy, when numba copies per launch).

Point in polygon (after Zhang et al., ADMS 2019, and cuSpatial 25.04's quadtree_point_in_polygon). Where each
step runs ("device" = on the GPU, or in the simulator; "xp" = cupy kernels on a GPU, numpy under the simulator):

1. Part bounding boxes, one thread per part: `part_bbox_kernel` (device). The extent: xp.min / xp.max.
2. Morton key of every point over the polygons' extent, max_depth levels (scale = longest side / 2^max_depth):
   `morton_kernel` (device). A point outside the extent gets a sentinel key and is dropped after the sort
   (cuSpatial gives it the largest key and lets the refine reject it).
3. Sort of the keys, point_indices = the permutation: xp.argsort.
4. Quadtree, bottom-up: reduce_by_key of the sorted keys into the quadrants of level max_depth, then
   parent = child >> 2 level by level up to level 1, each node keeping its key, first point, point count, first
   child and child count: xp (run starts via flatnonzero, counts via a scan).
5. Breadth-first filter: every (part bbox, level-1 node) pair, then level by level the quadrant's extent (from
   key, level and scale, padded by one finest cell) against the bbox. A hit on a node with <= max_size points
   (or at max_depth) emits a (part, leaf) pair; a hit on an internal node expands to its children (scan of child
   counts, gather): xp. The host only drives the level loop.
6. Refine, one thread per (part, point) candidate (its pair found by a binary search over the scan of leaf
   sizes), running kernels.point_in_part, the same scalar core the CPU engine uses, compiled as a device
   function: flags (`refine_kernel`, device) -> exclusive scan (xp.cumsum) -> scatter (`scatter_kernel`,
   device): count, scan, write, with exact allocation, in chunks of at most `max_candidates` candidates.
7. Parts -> geometries, sort by (point, geometry) with xp.lexsort, drop repeats (a point in two parts of one
   MultiPolygon): xp. pip_counts is the bincount of those pairs' geometries (host numpy).

Distance join: the unit-vector grid of kernels.grid_side. `unit_key_kernel` (device) keys b and keeps its unit
vectors, xp.argsort orders it, then `dwithin_count_kernel` (count, device) -> xp.cumsum (exclusive scan) ->
`dwithin_write_kernel` (write, device), both running kernels.dwithin_point (the same chord check and haversine
core as the CPU), and xp.lexsort orders the pairs by (i, j).

Results are returned as numpy arrays. Floating point: the exact orientation keeps PIP identical to the CPU
engine on every device; its two rounded products go through libdevice dmul_rn on a real GPU (see
spatial/kernels.py). Haversine distances use libdevice's sin/cos/asin on a real GPU, which may differ from the
CPU's libm in the last ulp, so a pair at a distance within ~1e-9 m of the radius could be decided differently.
"""

from __future__ import annotations

import functools
import math
import types
from types import SimpleNamespace

import numpy as np

from . import cuspatial_adapter, kernels
from .geoarrow import Points, Polygons, check_distance_join, pairs_prefix, point_range

OUTSIDE = kernels.OUTSIDE
MAX_CELLS_PER_AXIS = 1 << 20

# --- kernel sources: plain functions, compiled by _build() with cuda.jit in a namespace holding `cuda` and the
# device versions of the kernels.py cores ------------------------------------------------------------------


def rmul_rn(a, b):
    return libdevice.dmul_rn(a, b)  # noqa: F821 (bound by _build on a real device)


def morton2(ix, iy, depth):
    """Interleave the low `depth` bits of ix (even bit positions) and iy (odd)."""
    key = 0
    for bit in range(depth):
        key |= ((ix >> bit) & 1) << (2 * bit)
        key |= ((iy >> bit) & 1) << (2 * bit + 1)
    return key


def part_bbox_kernel(x, y, ring_offsets, part_offsets, minx, miny, maxx, maxy):
    p = cuda.grid(1)  # noqa: F821
    if p >= minx.shape[0]:
        return
    s = ring_offsets[part_offsets[p]]
    e = ring_offsets[part_offsets[p + 1]]
    x0 = math.inf
    y0 = math.inf
    x1 = -math.inf
    y1 = -math.inf
    for i in range(s, e):
        x0 = min(x0, x[i])
        y0 = min(y0, y[i])
        x1 = max(x1, x[i])
        y1 = max(y1, y[i])
    minx[p] = x0
    miny[p] = y0
    maxx[p] = x1
    maxy[p] = y1


def morton_kernel(px, py, xmin, ymin, xmax, ymax, inv_scale, max_depth, keys):
    i = cuda.grid(1)  # noqa: F821
    if i >= keys.shape[0]:
        return
    x = px[i]
    y = py[i]
    if not (x >= xmin and x <= xmax and y >= ymin and y <= ymax):
        keys[i] = 1 << (2 * max_depth)  # sentinel: outside every part's bbox, dropped after the sort
        return
    last = (1 << max_depth) - 1
    ix = min(int((x - xmin) * inv_scale), last)
    iy = min(int((y - ymin) * inv_scale), last)
    keys[i] = morton2(ix, iy, max_depth)


def refine_kernel(c0, pair_offsets, pair_part, pair_first, point_indices, px, py, x, y, ring_offsets,
                  part_offsets, flags):
    t = cuda.grid(1)  # noqa: F821
    if t >= flags.shape[0]:
        return
    k = c0 + t
    pr = upper_bound(pair_offsets, 0, pair_offsets.shape[0], k) - 1  # noqa: F821
    pt = point_indices[pair_first[pr] + (k - pair_offsets[pr])]
    part = pair_part[pr]
    s = point_in_part(px[pt], py[pt], x, y, ring_offsets, part_offsets[part], part_offsets[part + 1])  # noqa: F821
    flags[t] = 0 if s == OUTSIDE else 1


def scatter_kernel(c0, pair_offsets, pair_part, pair_first, point_indices, flags, offsets, out_point, out_part):
    t = cuda.grid(1)  # noqa: F821
    if t >= flags.shape[0] or flags[t] == 0:
        return
    k = c0 + t
    pr = upper_bound(pair_offsets, 0, pair_offsets.shape[0], k) - 1  # noqa: F821
    o = offsets[t]
    out_point[o] = point_indices[pair_first[pr] + (k - pair_offsets[pr])]
    out_part[o] = pair_part[pr]


def unit_key_kernel(lon, lat, inv_h, n, keys, ux, uy, uz):
    i = cuda.grid(1)  # noqa: F821
    if i >= keys.shape[0]:
        return
    x, y, z = unit_vector(lon[i], lat[i])  # noqa: F821
    ux[i] = x
    uy[i] = y
    uz[i] = z
    keys[i] = cell_key(x, y, z, inv_h, n)  # noqa: F821


def dwithin_count_kernel(alon, alat, start, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m,
                         self_join, dummy_j, dummy_d, counts):
    t = cuda.grid(1)  # noqa: F821
    if t >= counts.shape[0]:
        return
    counts[t] = dwithin_point(start + t, alon[t], alat[t], b_lon, b_lat, b_ux, b_uy, b_uz,  # noqa: F821
                              b_index, b_keys, inv_h, n, radius_m, self_join, dummy_j, dummy_d, 0, 0)


def dwithin_write_kernel(alon, alat, start, b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h, n, radius_m,
                         self_join, counts, offsets, out_i, out_j, out_d):
    t = cuda.grid(1)  # noqa: F821
    if t >= counts.shape[0]:
        return
    c = counts[t]
    if c == 0:
        return
    o = offsets[t]
    dwithin_point(start + t, alon[t], alat[t], b_lon, b_lat, b_ux, b_uy, b_uz, b_index, b_keys, inv_h,  # noqa: F821
                  n, radius_m, self_join, out_j, out_d, o, c)
    for k in range(c):
        out_i[o + k] = start + t


_KERNELS = ("part_bbox_kernel", "morton_kernel", "refine_kernel", "scatter_kernel", "unit_key_kernel",
            "dwithin_count_kernel", "dwithin_write_kernel")


def simulator_enabled() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@functools.lru_cache(maxsize=1)
def _build() -> SimpleNamespace:
    """Compile the device cores and kernels (lazily: numba-cuda compiles each kernel at its first launch)."""
    from numba import cuda

    ns = dict(globals())
    ns["cuda"] = cuda
    overrides = None
    if not simulator_enabled():
        from numba.cuda import libdevice

        ns["libdevice"] = libdevice
        overrides = {"rmul": cuda.jit(device=True)(_rebind(rmul_rn, ns))}
    core = kernels.compile_core(cuda.jit(device=True), overrides)
    ns.update(vars(core))
    ns["morton2"] = cuda.jit(device=True)(_rebind(morton2, ns))
    compiled = {name: cuda.jit(_rebind(globals()[name], ns)) for name in _KERNELS}
    return SimpleNamespace(cuda=cuda, core=core, **compiled)


def _rebind(fn, ns):
    return types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)


def _xp():
    if not simulator_enabled():
        try:
            import cupy

            return cupy
        except ImportError:
            pass
    return np


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


class CudaSpatialEngine:
    """cuSpatial's quadtree PIP and a grid distance join as numba-cuda kernels (see the module docstring)."""

    name = "cuda-spatial"
    kind = "gpu"
    ready = True

    def __init__(self, max_depth: int = 15, max_size: int = 128, max_candidates: int = 1 << 26,
                 threads_per_block: int | None = None, use_cuspatial: bool | None = None) -> None:
        if not 1 <= max_depth <= 15:
            raise ValueError("max_depth must be within [1, 15] (30-bit Morton keys)")
        self.max_depth, self.max_size, self.max_candidates = max_depth, max_size, max_candidates
        self.threads_per_block = threads_per_block
        self._polygons: tuple[Polygons, SimpleNamespace] | None = None
        self.last_stats: dict[str, int] = {}  # of the last pip_pairs: quadtree and candidate sizes
        # cuSpatial's candidates where it is importable (never under the simulator: it needs a device).
        self.use_cuspatial = (cuspatial_adapter.available() and not simulator_enabled()) if use_cuspatial is None \
            else use_cuspatial

    # -- helpers
    def _launch(self, kernel, n: int, *args) -> None:
        if n <= 0:
            return
        tpb = self.threads_per_block or (32 if simulator_enabled() else 256)
        kernel[(n + tpb - 1) // tpb, tpb](*args)

    def _device_polygons(self, polygons: Polygons) -> SimpleNamespace:
        if self._polygons is not None and self._polygons[0] is polygons:
            return self._polygons[1]
        k, xp = _build(), _xp()
        d = SimpleNamespace(
            x=xp.asarray(np.ascontiguousarray(polygons.x, np.float64)),
            y=xp.asarray(np.ascontiguousarray(polygons.y, np.float64)),
            ring_offsets=xp.asarray(np.ascontiguousarray(polygons.ring_offsets, np.int64)),
            part_offsets=xp.asarray(np.ascontiguousarray(polygons.part_offsets, np.int64)),
            part_geom=xp.asarray(polygons.part_geometry()),
            n_geometries=len(polygons))
        n_parts = polygons.n_parts
        d.minx, d.miny = xp.empty(n_parts, np.float64), xp.empty(n_parts, np.float64)
        d.maxx, d.maxy = xp.empty(n_parts, np.float64), xp.empty(n_parts, np.float64)
        self._launch(k.part_bbox_kernel, n_parts, d.x, d.y, d.ring_offsets, d.part_offsets, d.minx, d.miny, d.maxx,
                     d.maxy)
        d.empty = len(polygons.x) == 0 or n_parts == 0
        if not d.empty:
            d.extent = (float(xp.min(d.x)), float(xp.min(d.y)), float(xp.max(d.x)), float(xp.max(d.y)))
        self._polygons = (polygons, d)
        return d

    def _quadtree(self, xp, keys, max_depth: int) -> list[SimpleNamespace]:
        """Levels 1..max_depth of the point quadtree, bottom-up from the sorted Morton keys (index 0 unused)."""
        n = keys.shape[0]
        levels: list[SimpleNamespace] = [SimpleNamespace()] * (max_depth + 1)

        def runs(k):
            change = xp.concatenate([xp.ones(1, bool), k[1:] != k[:-1]])
            starts = xp.flatnonzero(change)
            ends = xp.concatenate([starts[1:], xp.asarray([k.shape[0]], dtype=starts.dtype)])
            return starts, ends

        starts, ends = runs(keys)  # reduce_by_key of the leaf keys
        levels[max_depth] = SimpleNamespace(key=keys[starts], first=starts, count=ends - starts,
                                            child_start=None, n_children=None)
        for d in range(max_depth - 1, 0, -1):
            child = levels[d + 1]
            parent_keys = child.key >> 2
            starts, ends = runs(parent_keys)
            cs = xp.concatenate([xp.zeros(1, child.count.dtype), xp.cumsum(child.count)])
            levels[d] = SimpleNamespace(key=parent_keys[starts], first=child.first[starts],
                                        count=cs[ends] - cs[starts], child_start=starts, n_children=ends - starts)
        for d in range(1, max_depth + 1):  # quadrant extents in cell units of the finest level
            lv = levels[d]
            ix = xp.zeros(lv.key.shape[0], np.int64)
            iy = xp.zeros(lv.key.shape[0], np.int64)
            for bit in range(d):
                ix |= ((lv.key >> (2 * bit)) & 1) << bit
                iy |= ((lv.key >> (2 * bit + 1)) & 1) << bit
            lv.ix, lv.iy = ix, iy
        assert int(levels[1].count.sum()) == n if n else True
        return levels

    def _candidate_pairs(self, xp, levels, d: SimpleNamespace, xmin: float, ymin: float, scale: float,
                         max_depth: int):
        """Breadth-first filter of (part bbox, quadrant) pairs down to leaves: (part, first point, count)."""
        n_parts = d.minx.shape[0]
        n1 = levels[1].key.shape[0]
        flat = xp.arange(n_parts * n1, dtype=np.int64)
        part, node = flat // n1, flat % n1
        out_part, out_first, out_count = [], [], []
        for lev in range(1, max_depth + 1):
            lv = levels[lev]
            size = scale * float(1 << (max_depth - lev))
            qx0 = xmin + lv.ix[node] * size - scale  # padded by one finest cell
            qy0 = ymin + lv.iy[node] * size - scale
            qx1 = qx0 + size + 2 * scale
            qy1 = qy0 + size + 2 * scale
            hit = (d.minx[part] <= qx1) & (d.maxx[part] >= qx0) & (d.miny[part] <= qy1) & (d.maxy[part] >= qy0)
            if lev == max_depth:
                leaf = hit
            else:
                leaf = hit & (lv.count[node] <= self.max_size)
            out_part.append(part[leaf])
            out_first.append(lv.first[node[leaf]])
            out_count.append(lv.count[node[leaf]])
            if lev == max_depth:
                break
            inner = hit & ~leaf
            part, node = part[inner], node[inner]
            nc = lv.n_children[node]
            total = int(nc.sum()) if nc.shape[0] else 0
            if total == 0:
                break
            ends = xp.cumsum(nc)
            idx = xp.arange(total, dtype=np.int64)
            owner = xp.searchsorted(ends, idx, side="right")  # expand: scan of child counts, gather
            node = lv.child_start[node[owner]] + (idx - (ends[owner] - nc[owner]))
            part = part[owner]
        cat = xp.concatenate
        return cat(out_part).astype(np.int64), cat(out_first).astype(np.int64), cat(out_count).astype(np.int64)

    # -- public API
    def pip_pairs(self, points: Points, polygons: Polygons, start: int | None = 0,
                  stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(point index, geometry index) for points[start:stop] covered by a geometry: unique, sorted by
        (point, geometry); point indices are positions in `points`."""
        start, stop = point_range(len(points), start, stop)
        empty = (np.empty(0, np.int64), np.empty(0, np.int64))
        if stop == start or len(polygons) == 0:
            return empty
        k, xp = _build(), _xp()
        d = self._device_polygons(polygons)
        if d.empty:
            return empty
        px = xp.asarray(np.ascontiguousarray(points.x[start:stop], np.float64))
        py = xp.asarray(np.ascontiguousarray(points.y[start:stop], np.float64))
        xmin, ymin, xmax, ymax = d.extent
        depth = self.max_depth
        side = max(xmax - xmin, ymax - ymin)
        scale = side / float(1 << depth) if side > 0 else 1.0
        n = stop - start
        if self.use_cuspatial:
            # cuSpatial's quadtree and bbox join give the candidates; the refine below stays ours.
            point_indices, pair_part, pair_first, pair_count = cuspatial_adapter.candidates(
                xp, px, py, polygons, d.extent, scale, depth, self.max_size)
            n_in, quadrants = n, None
        else:
            keys = xp.empty(n, np.int64)
            self._launch(k.morton_kernel, n, px, py, xmin, ymin, xmax, ymax, 1.0 / scale, depth, keys)
            order = xp.argsort(keys)
            sorted_keys = keys[order]
            sentinel = xp.asarray([1 << (2 * depth)], dtype=np.int64)
            n_in = int(xp.searchsorted(sorted_keys, sentinel)[0])  # drop the points outside the extent
            if n_in == 0:
                return empty
            point_indices = order[:n_in].astype(np.int64)
            levels = self._quadtree(xp, sorted_keys[:n_in], depth)
            pair_part, pair_first, pair_count = self._candidate_pairs(xp, levels, d, xmin, ymin, scale, depth)
            quadrants = int(levels[depth].key.shape[0])
        if pair_part.shape[0] == 0:
            return empty
        pair_offsets = xp.concatenate([xp.zeros(1, np.int64), xp.cumsum(pair_count)])
        total = int(pair_offsets[-1])
        self.last_stats = {"points_in_extent": n_in, "finest_quadrants": quadrants,
                           "pairs": int(pair_part.shape[0]), "candidates": total}
        hits_point, hits_part = [], []
        for c0 in range(0, total, self.max_candidates):  # refine in chunks: flags -> scan -> scatter
            m = min(self.max_candidates, total - c0)
            flags = xp.empty(m, np.int64)
            self._launch(k.refine_kernel, m, c0, pair_offsets, pair_part, pair_first, point_indices, px, py, d.x,
                         d.y, d.ring_offsets, d.part_offsets, flags)
            incl = xp.cumsum(flags)
            found = int(incl[-1])
            if found == 0:
                continue
            offsets = incl - flags
            out_point, out_part = xp.empty(found, np.int64), xp.empty(found, np.int64)
            self._launch(k.scatter_kernel, m, c0, pair_offsets, pair_part, pair_first, point_indices, flags,
                         offsets, out_point, out_part)
            hits_point.append(out_point)
            hits_part.append(out_part)
        if not hits_point:
            return empty
        point = xp.concatenate(hits_point) + start
        geom = d.part_geom[xp.concatenate(hits_part)]
        order = xp.lexsort(xp.stack([geom, point]))
        point, geom = point[order], geom[order]
        keep = xp.concatenate([xp.ones(1, bool), (point[1:] != point[:-1]) | (geom[1:] != geom[:-1])])
        return _host(point[keep]).astype(np.int64), _host(geom[keep]).astype(np.int64)

    def pip_counts(self, points: Points, polygons: Polygons) -> np.ndarray:
        """Number of points covered by each geometry (boundary included; once per MultiPolygon)."""
        _, geom = self.pip_pairs(points, polygons, 0, len(points))
        return np.bincount(geom, minlength=len(polygons)).astype(np.int64)

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
        empty = np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64)
        if stop == start or len(b) == 0:
            return (*empty, stop)
        k, xp = _build(), _xp()
        side, n = kernels.grid_side(radius_m, MAX_CELLS_PER_AXIS)
        inv_h = 1.0 / side
        blon = xp.asarray(np.ascontiguousarray(b.x, np.float64))
        blat = xp.asarray(np.ascontiguousarray(b.y, np.float64))
        bkeys = xp.empty(len(b), np.int64)
        bu = [xp.empty(len(b), np.float64) for _ in range(3)]
        self._launch(k.unit_key_kernel, len(b), blon, blat, inv_h, n, bkeys, *bu)
        order = xp.argsort(bkeys)
        b_keys, b_index, b_lon, b_lat = bkeys[order], order.astype(np.int64), blon[order], blat[order]
        b_u = [u[order] for u in bu]
        alon = xp.asarray(np.ascontiguousarray(a.x[start:stop], np.float64))
        alat = xp.asarray(np.ascontiguousarray(a.y[start:stop], np.float64))
        m = stop - start
        counts = xp.empty(m, np.int64)
        dummy_j, dummy_d = xp.empty(1, np.int64), xp.empty(1, np.float64)
        self._launch(k.dwithin_count_kernel, m, alon, alat, start, b_lon, b_lat, *b_u, b_index, b_keys, inv_h, n,
                     radius_m, bool(self_join), dummy_j, dummy_d, counts)
        incl = xp.cumsum(counts)
        if max_pairs is not None:  # one copy of m counts: the pairs past the budget are never written
            m = pairs_prefix(_host(incl), max_pairs)
        counts, incl, alon, alat = counts[:m], incl[:m], alon[:m], alat[:m]
        total = int(incl[-1])
        if total == 0:
            return (*empty, start + m)
        offsets = incl - counts
        out_i, out_j, out_d = xp.empty(total, np.int64), xp.empty(total, np.int64), xp.empty(total, np.float64)
        self._launch(k.dwithin_write_kernel, m, alon, alat, start, b_lon, b_lat, *b_u, b_index, b_keys, inv_h, n,
                     radius_m, bool(self_join), counts, offsets, out_i, out_j, out_d)
        order = xp.lexsort(xp.stack([out_j, out_i]))
        return _host(out_i[order]), _host(out_j[order]), _host(out_d[order]), start + m
