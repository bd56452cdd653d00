"""GPU spatial engine: cuSpatial's quadtree point-in-polygon and a grid distance join, in numba-cuda.

Nothing here imports numba.cuda (or cupy) at module import: the kernels compile on first use (`_build`) and run on
a CUDA device, or in numba-cuda's simulator when NUMBA_ENABLE_CUDASIM=1 was set before numba was first imported
(CI has no GPU). Array steps use `xp`: cupy on a device, numpy under the simulator. The refine and distance kernels
run the scalar cores of spatial/kernels.py, so point-in-polygon answers equal the CPU engine's and distance joins
its pairs (distances within device_distance's tolerance); results are numpy arrays. The pipeline step by step
(after Zhang et al., ADMS 2019, and cuSpatial 25.04): docs/design/spatial.md.
"""

from __future__ import annotations

import functools
import math
import types
from collections import Counter, OrderedDict
from types import SimpleNamespace
from typing import Any, Callable, cast

import numpy as np

from . import kernels
from .geoarrow import Points, Polygons, check_distance_join, point_range

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
# Plain-Python stand-ins for kernels.py cores, compiled as device functions by the next _build() (after
# _build.cache_clear()): the CPU tests emulate a device's arithmetic with them (e.g. a haversine some ulps off).
DEVICE_CORE_OVERRIDES: dict[str, Callable] = {}


def simulator_enabled() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # numba sets it from the environment at run time


@functools.lru_cache(maxsize=1)
def _build() -> SimpleNamespace:
    """Compile the device cores and kernels (lazily: numba-cuda compiles each kernel at its first launch)."""
    from numba import cuda

    ns = dict(globals())
    ns["cuda"] = cuda
    overrides = {name: cuda.jit(device=True)(fn) for name, fn in DEVICE_CORE_OVERRIDES.items()}
    if not simulator_enabled():
        from numba.cuda import libdevice

        ns["libdevice"] = libdevice
        overrides.setdefault("rmul", cuda.jit(device=True)(_rebind(rmul_rn, ns)))
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


def _upload(xp, a, dtype):
    """A layer's host array on the device, writable and C-contiguous whatever its source (a layer loaded from the
    store holds read-only Arrow views): the argument types the warm-up compiled every kernel for."""
    return xp.asarray(np.require(a, dtype, ["C", "W"]))


class _Resident:
    """One layer's device buffers and what was derived from them (quadtree, distance grids, part boxes)."""

    def __init__(self, geometry: Points | Polygons, arrays: SimpleNamespace) -> None:
        self.geometry = geometry  # held so that its id() names this layer for as long as it is cached
        self.arrays = arrays
        self.derived: dict[str, Any] = {}  # "quadtree", "part_boxes"
        self.grids: OrderedDict[float, Any] = OrderedDict()  # by radius, the least recently used dropped first


class CudaSpatialEngine:
    """cuSpatial's quadtree PIP and a grid distance join as numba-cuda kernels (docs/design/spatial.md).

    Layers stay resident on the device between requests: each Points / Polygons object is uploaded once, and what
    is derived from it (the points' quadtree, a distance grid per radius, the parts' boxes) and the PIP result of
    each (points, polygons) pair are built once and reused. Layers are versioned by object: a write makes a new
    Layer, so its buffers are uploaded afresh (by `prepare`, which the manager calls on the write), and `forget`
    (called on a write or drop) frees the old one's at once. `counters` counts uploads, builds, joins and the
    distance pairs decided on the host (the tests read them). Calls come from one thread (the manager's executor),
    so the caches take no lock."""

    name = "cuda-spatial"
    kind = "gpu"
    ready = True

    def __init__(self, max_depth: int = 15, max_size: int = 128, max_candidates: int = 1 << 26,
                 threads_per_block: int | None = None, max_layers: int = 16, max_grids: int = 4,
                 max_joins: int = 8) -> None:
        if not 1 <= max_depth <= 15:
            raise ValueError("max_depth must be within [1, 15] (30-bit Morton keys)")
        self.max_depth, self.max_size, self.max_candidates = max_depth, max_size, max_candidates
        self.threads_per_block = threads_per_block
        self.max_layers, self.max_grids, self.max_joins = max_layers, max_grids, max_joins
        self._layers: OrderedDict[int, _Resident] = OrderedDict()
        self._joins: OrderedDict[tuple[int, int], SimpleNamespace] = OrderedDict()
        self.counters: Counter[str] = Counter()
        self.last_stats: dict[str, int] = {}  # of the last PIP join built: quadtree and candidate sizes
        self.launched: set[str] = set()  # kernels launched so far (the warm-up checks it covered all of them)
        self.launching: str | None = None  # the kernel being launched, named when a launch fails

    # -- residency
    def _launch(self, name: str, n: int, *args) -> None:
        if n <= 0:
            return
        self.launching = name
        kernel = getattr(_build(), name)
        tpb = self.threads_per_block or (32 if simulator_enabled() else 256)
        kernel[(n + tpb - 1) // tpb, tpb](*args)
        self.launched.add(name)
        self.launching = None

    def _resident(self, geometry: Points | Polygons) -> _Resident:
        key = id(geometry)
        layer = self._layers.get(key)
        if layer is not None and layer.geometry is geometry:
            self._layers.move_to_end(key)
            return layer
        self._drop(key)
        xp = _xp()
        arrays = SimpleNamespace(x=_upload(xp, geometry.x, np.float64), y=_upload(xp, geometry.y, np.float64))
        if isinstance(geometry, Polygons):
            arrays.ring_offsets = _upload(xp, geometry.ring_offsets, np.int64)
            arrays.part_offsets = _upload(xp, geometry.part_offsets, np.int64)
            arrays.part_geom = _upload(xp, geometry.part_geometry(), np.int64)
        self.counters["uploads"] += 1
        layer = _Resident(geometry, arrays)
        self._layers[key] = layer
        while len(self._layers) > self.max_layers:
            self._drop(next(iter(self._layers)))
        return layer

    def _derive(self, cache: dict, key: Any, build: Callable[[], Any], limit: int | None = None) -> Any:
        """cache[key], built once; with `limit`, the cache is an OrderedDict kept to that many entries."""
        if key in cache:
            if limit is not None:
                cast(OrderedDict, cache).move_to_end(key)
            return cache[key]
        value = build()
        self.counters["builds"] += 1
        cache[key] = value
        while limit is not None and len(cache) > limit:
            cast(OrderedDict, cache).popitem(last=False)
        return value

    def _drop(self, key: int) -> None:
        self._layers.pop(key, None)
        for pair in [pair for pair in self._joins if key in pair]:
            del self._joins[pair]

    def forget(self, geometry: Points | Polygons) -> None:
        """Free a layer's device buffers, structures and joins (its layer was rewritten or dropped)."""
        layer = self._layers.get(id(geometry))
        if layer is not None and layer.geometry is geometry:
            self._drop(id(geometry))

    def prepare(self, geometry: Points | Polygons) -> None:
        """Upload a new layer version and build what depends on it alone (a point layer's quadtree, a polygon
        layer's part boxes), so that its first join finds it resident (the manager calls it on a write and on
        loading layers at start). Distance grids wait for their radius."""
        layer = self._resident(geometry)
        if isinstance(geometry, Polygons):
            self._part_boxes(layer)
        elif len(geometry):
            self._point_quadtree(layer)

    def drop_results(self) -> None:
        """Drop the cached join results while layers and structures stay resident: the next join is computed
        again on resident structures (what a benchmark times as "resident", never a cache hit)."""
        self._joins.clear()

    def resident_layers(self) -> int:
        return len(self._layers)

    def warm_up(self, points: int | None = None) -> dict[str, Any]:
        """Compile and launch every kernel and run every array step at request sizes on synthetic layers with
        known answers (spatial/cuda_warmup.py); raises WarmUpError when a kernel cannot launch or answers wrong."""
        from .cuda_warmup import warm_up

        return warm_up(self, points)

    # -- point in polygon
    def _part_boxes(self, layer: _Resident) -> SimpleNamespace:
        def build() -> SimpleNamespace:
            xp, a = _xp(), layer.arrays
            assert isinstance(layer.geometry, Polygons)  # part boxes: of a polygon layer
            n_parts = layer.geometry.n_parts
            boxes = SimpleNamespace(minx=xp.empty(n_parts, np.float64), miny=xp.empty(n_parts, np.float64),
                                    maxx=xp.empty(n_parts, np.float64), maxy=xp.empty(n_parts, np.float64))
            self._launch("part_bbox_kernel", n_parts, a.x, a.y, a.ring_offsets, a.part_offsets, boxes.minx,
                         boxes.miny, boxes.maxx, boxes.maxy)
            boxes.empty = len(layer.geometry.x) == 0 or n_parts == 0
            return boxes

        return self._derive(layer.derived, "part_boxes", build)

    def _point_quadtree(self, layer: _Resident) -> SimpleNamespace:
        """The points' Morton-order quadtree over their own extent (as cuSpatial's quadtree_on_points is used)."""
        def build() -> SimpleNamespace:
            xp, a = _xp(), layer.arrays
            depth = self.max_depth
            xmin, ymin, xmax, ymax = (float(v) for v in _host(xp.stack([a.x.min(), a.y.min(), a.x.max(),
                                                                         a.y.max()])))
            side = max(xmax - xmin, ymax - ymin)
            scale = side / float(1 << depth) if side > 0 else 1.0
            keys = xp.empty(a.x.shape[0], np.int64)
            self._launch("morton_kernel", a.x.shape[0], a.x, a.y, xmin, ymin, xmax, ymax, 1.0 / scale, depth, keys)
            order = xp.argsort(keys)
            return SimpleNamespace(xmin=xmin, ymin=ymin, scale=scale, point_indices=order.astype(np.int64),
                                   levels=self._quadtree(xp, keys[order], depth))

        return self._derive(layer.derived, "quadtree", build)

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

    def _pip_join(self, points: Points, polygons: Polygons) -> SimpleNamespace:
        """Every (point, geometry) pair of the two layers, sorted and unique, and the per-geometry counts, on the
        device: built once per pair of layer versions, then each page is a slice of it."""
        key = (id(points), id(polygons))
        pts, polys = self._resident(points), self._resident(polygons)  # also makes both keys current
        join = self._joins.get(key)
        if join is not None:
            self._joins.move_to_end(key)
            return join
        xp = _xp()
        point, geom = xp.empty(0, np.int64), xp.empty(0, np.int64)
        boxes = self._part_boxes(polys)
        if len(points) and not boxes.empty:
            point, geom = self._refine(xp, pts, polys, boxes, self._point_quadtree(pts))
        join = SimpleNamespace(point=point, geom=geom, counts=xp.bincount(geom, minlength=len(polygons)))
        self.counters["joins"] += 1
        self._joins[key] = join
        while len(self._joins) > self.max_joins:
            self._joins.popitem(last=False)
        return join

    def _refine(self, xp, pts: _Resident, polys: _Resident, boxes: SimpleNamespace, tree: SimpleNamespace):
        depth = self.max_depth
        pair_part, pair_first, pair_count = self._candidate_pairs(xp, tree.levels, boxes, tree.xmin, tree.ymin,
                                                                  tree.scale, depth)
        empty = xp.empty(0, np.int64), xp.empty(0, np.int64)
        if pair_part.shape[0] == 0:
            return empty
        pair_offsets = xp.concatenate([xp.zeros(1, np.int64), xp.cumsum(pair_count)])
        total = int(pair_offsets[-1])
        self.last_stats = {"points_in_extent": int(tree.point_indices.shape[0]),
                           "finest_quadrants": int(tree.levels[depth].key.shape[0]),
                           "pairs": int(pair_part.shape[0]), "candidates": total}
        a, p = pts.arrays, polys.arrays
        hits_point, hits_part = [], []
        for c0 in range(0, total, self.max_candidates):  # refine in chunks: flags -> scan -> scatter
            m = min(self.max_candidates, total - c0)
            flags = xp.empty(m, np.int64)
            self._launch("refine_kernel", m, c0, pair_offsets, pair_part, pair_first, tree.point_indices, a.x, a.y,
                         p.x, p.y, p.ring_offsets, p.part_offsets, flags)
            incl = xp.cumsum(flags)
            found = int(incl[-1])
            if found == 0:
                continue
            offsets = incl - flags
            out_point, out_part = xp.empty(found, np.int64), xp.empty(found, np.int64)
            self._launch("scatter_kernel", m, c0, pair_offsets, pair_part, pair_first, tree.point_indices, flags,
                         offsets, out_point, out_part)
            hits_point.append(out_point)
            hits_part.append(out_part)
        if not hits_point:
            return empty
        point = xp.concatenate(hits_point)
        geom = p.part_geom[xp.concatenate(hits_part)]
        order = xp.lexsort(xp.stack([geom, point]))
        point, geom = point[order], geom[order]
        keep = xp.concatenate([xp.ones(1, bool), (point[1:] != point[:-1]) | (geom[1:] != geom[:-1])])
        return point[keep], geom[keep]

    # -- public API
    def pip_pairs(self, points: Points, polygons: Polygons, start: int | None = 0,
                  stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(point index, geometry index) for points[start:stop] covered by a geometry: unique, sorted by
        (point, geometry); point indices are positions in `points`."""
        return self.pip_pairs_page(points, polygons, start, stop)[:2]

    def pip_pairs_page(self, points: Points, polygons: Polygons, start: int | None = 0, stop: int | None = None,
                       max_pairs: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """pip_pairs for the leading points of points[start:stop] whose pairs fit max_pairs, and the position
        after the last point it covered: geoarrow.pairs_prefix's cut (the CPU engine's page, pair for pair), found
        by binary search in the cached join on the device, so only the page's pairs are copied to the host. The
        join itself holds every pair of the two layers on the device (built once, then sliced)."""
        start, stop = point_range(len(points), start, stop)
        if stop == start or len(polygons) == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64), stop
        join = self._pip_join(points, polygons)
        xp = _xp()
        lo, hi = (int(v) for v in _host(xp.searchsorted(join.point, xp.asarray([start, stop], dtype=np.int64))))
        if max_pairs is not None and hi - lo > max_pairs:
            # The point of pair max_pairs + 1 is the first whose pairs do not all fit: the page ends before it,
            # or after it when it is the page's first point (at least one point per page).
            stop = max(start + 1, int(_host(join.point[lo + max_pairs])))
            hi = int(_host(xp.searchsorted(join.point, xp.asarray([stop], dtype=np.int64)))[0])
        return _host(join.point[lo:hi]).astype(np.int64), _host(join.geom[lo:hi]).astype(np.int64), stop

    def pip_counts(self, points: Points, polygons: Polygons) -> np.ndarray:
        """Number of points covered by each geometry (boundary included; once per MultiPolygon), counted on the
        device: only the counts come back."""
        if len(polygons) == 0:
            return np.zeros(0, np.int64)
        return _host(self._pip_join(points, polygons).counts).astype(np.int64)

    # -- distance join
    def _distance_grid(self, layer: _Resident, radius_m: float) -> SimpleNamespace:
        """b's unit vectors keyed into the grid of one radius and sorted by key."""
        def build() -> SimpleNamespace:
            xp, a = _xp(), layer.arrays
            side, n = kernels.grid_side(radius_m, MAX_CELLS_PER_AXIS)
            m = a.x.shape[0]
            keys = xp.empty(m, np.int64)
            unit = [xp.empty(m, np.float64) for _ in range(3)]
            self._launch("unit_key_kernel", m, a.x, a.y, 1.0 / side, n, keys, *unit)
            order = xp.argsort(keys)
            return SimpleNamespace(inv_h=1.0 / side, n=n, keys=keys[order], index=order.astype(np.int64),
                                   lon=a.x[order], lat=a.y[order], unit=[u[order] for u in unit])

        return self._derive(layer.grids, radius_m, build, limit=self.max_grids)

    def within_distance(self, a: Points, b: Points, radius_m: float, start: int | None = 0, stop: int | None = None,
                        self_join: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(i, j, metres) for a[start:stop] and b with haversine distance <= radius_m, sorted by (i, j). With
        self_join (a and b the same points) only i < j. The pairs are the CPU engine's (device_distance)."""
        return self.within_distance_page(a, b, radius_m, start, stop, self_join)[:3]

    def within_distance_page(self, a: Points, b: Points, radius_m: float, start: int | None = 0,
                             stop: int | None = None, self_join: bool = False, max_pairs: int | None = None
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """within_distance for the leading points of a[start:stop] whose pairs fit max_pairs, and the position
        after the last point it covered. The kernels admit pairs up to the band's upper edge and the host decides
        those in the band (device_distance), so a page is cut on the admitted counts: whole points, never more
        than max_pairs pairs unless its one point has more, possibly fewer points than the CPU engine's page."""
        from . import device_distance  # imports the CPU engine's compiled cores (numba, never numba.cuda)

        start, stop, radius_m = check_distance_join(a, b, radius_m, start, stop, self_join)
        empty = np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64)
        if stop == start or len(b) == 0:
            return (*empty, stop)
        xp = _xp()
        lo, hi = device_distance.band(radius_m)
        left = self._resident(a).arrays
        g = self._distance_grid(self._resident(b), radius_m)  # its cells are wide enough for hi as well
        alon, alat = left.x[start:stop], left.y[start:stop]
        m = stop - start
        counts = xp.empty(m, np.int64)
        dummy_j, dummy_d = xp.empty(1, np.int64), xp.empty(1, np.float64)
        grid_args = (g.lon, g.lat, *g.unit, g.index, g.keys, g.inv_h, g.n, hi, bool(self_join))
        self._launch("dwithin_count_kernel", m, alon, alat, start, *grid_args, dummy_j, dummy_d, counts)
        incl = xp.cumsum(counts)
        total = int(incl[-1])
        if max_pairs is not None and total > max_pairs:  # pairs_prefix on the device: whole points that fit
            m = max(1, int(xp.searchsorted(incl, max_pairs, side="right")))
            counts, incl, alon, alat = counts[:m], incl[:m], alon[:m], alat[:m]
            total = int(incl[-1])
        if total == 0:
            return (*empty, start + m)
        offsets = incl - counts
        out_i, out_j, out_d = xp.empty(total, np.int64), xp.empty(total, np.int64), xp.empty(total, np.float64)
        self._launch("dwithin_write_kernel", m, alon, alat, start, *grid_args, counts, offsets, out_i, out_j, out_d)
        order = xp.lexsort(xp.stack([out_j, out_i]))
        out_i, out_j, out_d = out_i[order], out_j[order], out_d[order]
        in_band = _host(xp.flatnonzero(out_d > lo))
        i, j, d = _host(out_i), _host(out_j), _host(out_d)
        if len(in_band):
            self.counters["band_pairs"] += len(in_band)
            i, j, d = device_distance.decide_band(i, j, d, in_band, a, b, radius_m)
        return i, j, d, start + m
