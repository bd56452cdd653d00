"""The GPU engine's numba-cuda kernels, run in numba-cuda's CUDA simulator, give exactly the CPU engine's answers.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, which in a whole-suite run has long happened,
so in an ordinary run this module holds one test that runs this very file again in a child pytest with the
variable set; there (SIM true) the real tests below are defined. The simulator runs every CUDA thread in Python:
the inputs are kept to a few hundred points and a handful of polygons.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import run_in_cuda_simulator

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
# `make gpu-check` runs this file with SWITCHYARD_GPU_KERNELS=device: the same tests, compiled for a real device.
DEVICE = not SIM and os.environ.get("SWITCHYARD_GPU_KERNELS") == "device"
ROOT = Path(__file__).resolve().parent.parent


if not (SIM or DEVICE):

    def test_importing_the_gpu_engine_needs_no_cuda():
        code = ("import sys, spatial.cuda_engine as m; assert 'numba.cuda' not in sys.modules, 'numba.cuda imported';"
                " assert 'cupy' not in sys.modules; e = m.CudaSpatialEngine(); print(e.name, e.kind)")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["cuda-spatial", "gpu"]

    PTX_CHECK = r"""
import re, sys
try:
    from numba import cuda, types as T
    import numba.cuda.dispatcher as dispatcher
    from spatial import cuda_engine
except Exception as exc:
    print(f"numba.cuda cannot be imported: {exc}"); sys.exit(3)

class Device:  # no GPU here: device functions are compiled for compute capability 7.5
    compute_capability = (7, 5)

if not hasattr(dispatcher, "get_current_device"):
    print("this numba-cuda compiles device functions differently"); sys.exit(3)
dispatcher.get_current_device = lambda: Device()
k = cuda_engine._build()
i8, f8, b1 = T.int64, T.float64, T.boolean
I, F = i8[::1], f8[::1]
sigs = {
    "part_bbox_kernel": (F, F, I, I, F, F, F, F),
    "morton_kernel": (F, F, f8, f8, f8, f8, f8, i8, I),
    "refine_kernel": (i8, I, I, I, I, F, F, F, F, I, I, I),
    "scatter_kernel": (i8, I, I, I, I, I, I, I, I),
    "unit_key_kernel": (F, F, f8, i8, I, F, F, F),
    "dwithin_count_kernel": (F, F, i8, F, F, F, F, F, I, I, f8, i8, f8, b1, I, F, I),
    "dwithin_write_kernel": (F, F, i8, F, F, F, F, F, I, I, f8, i8, f8, b1, I, I, I, I, F),
}
for name, sig in sigs.items():
    try:
        ptx, _ = cuda.compile_ptx(getattr(k, name).py_func, sig, cc=(7, 5))
    except Exception as exc:
        if "NVVM" in str(exc) or "nvvm" in str(exc):
            print(f"NVVM is not available: {exc}"); sys.exit(3)
        raise
    if name == "refine_kernel":  # the exact orientation: rounded products, never fused into an fma
        assert re.search(r"\bmul\.rn\.f64", ptx) and not re.search(r"\bfma\.rn\.f64", ptx), name
print("ok")
"""

    def test_gpu_kernels_compile_to_ptx():
        """Type-checks every kernel with the real CUDA compiler (NVVM comes with numba-cuda[cu12]; no GPU needed):
        the simulator runs kernels as Python and would not catch a typing error."""
        if importlib.util.find_spec("numba") is None:
            pytest.skip("numba is not installed")
        r = subprocess.run([sys.executable, "-c", PTX_CHECK], cwd=ROOT, capture_output=True, text=True, check=False,
                           timeout=280)
        if r.returncode == 3:
            pytest.skip(r.stdout.strip()[-500:])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert r.stdout.strip().endswith("ok")

    def test_gpu_kernels_in_the_cuda_simulator():
        for module in ("numba", "shapely"):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{module} is not installed")
        run_in_cuda_simulator(__file__)

else:
    shapely = pytest.importorskip("shapely")
    try:
        from numba import cuda  # noqa: F401  (the simulator; needs numba-cuda[cu12])
    except Exception as exc:  # noqa: BLE001  (any failure to load the simulator means: skip)
        pytest.skip(f"numba.cuda cannot be imported: {exc}", allow_module_level=True)
    if DEVICE and not cuda.is_available():
        pytest.skip("no CUDA device numba-cuda can use", allow_module_level=True)

    from shapely.geometry import MultiPolygon, Polygon, box

    from spatial import device_distance
    from spatial.cpu_engine import CpuSpatialEngine
    from spatial.cuda_engine import _KERNELS, CudaSpatialEngine, simulator_enabled
    from spatial.geoarrow import Points, Polygons, points_from_lonlat, polygons_from_shapely

    def assert_the_cpu_engines_pairs(got, want):
        """The distance contract (docs/design/spatial.md): pairs and their order exactly the CPU engine's,
        distances within DISTANCE_RTOL / DISTANCE_ATOL_M (bit for bit in the simulator, which runs the CPU's
        math)."""
        for k in range(2):
            np.testing.assert_array_equal(got[k], want[k])
        assert device_distance.agrees(got[2], want[2]), np.abs(np.asarray(got[2]) - want[2]).max()
        if SIM:
            np.testing.assert_array_equal(got[2], want[2])

    def fixture():
        rng = np.random.default_rng(21)
        geoms = [
            Polygon([(0, 0), (4, 0), (4, 4), (0, 4)], [[(1, 1), (3, 1), (3, 3), (1, 3)]]),  # square, square hole
            box(4, 0, 6, 2),  # shares the edge x = 4 with the square
            MultiPolygon([Polygon([(0, 5), (2, 7), (0, 7)]), Polygon([(2, 7), (4, 5), (4, 7)])]),  # diagonals
            Polygon([(6, 4), (8, 6), (6, 8), (4.5, 6)], [[(5.9, 5.8), (6.3, 6), (6, 6.4)]]),
        ]
        i, j = np.meshgrid(np.arange(0, 17), np.arange(0, 17))
        lattice = np.column_stack([i.ravel() * 0.5, j.ravel() * 0.5])  # vertices, edges, holes, shared borders
        rand = rng.uniform(-0.5, 8.5, (400, 2))
        pts = np.vstack([lattice, rand, [[2.0, 2.0], [1.0, 2.0], [6.0, 6.0], [9.0, 9.0], [-1.0, 3.0]]])
        return points_from_lonlat(pts[:, 0], pts[:, 1]), polygons_from_shapely(np.array(geoms, dtype=object)), geoms

    def test_runs_where_it_was_asked_to():
        assert simulator_enabled() == SIM

    @pytest.mark.parametrize("max_depth, max_size", [(6, 8), (15, 32)])
    def test_pip_equals_the_cpu_engine_and_shapely(max_depth, max_size):
        pts, polys, geoms = fixture()
        gpu = CudaSpatialEngine(max_depth=max_depth, max_size=max_size)
        cpu = CpuSpatialEngine()
        counts = gpu.pip_counts(pts, polys)
        stats = gpu.last_stats
        assert stats["candidates"] < stats["points_in_extent"] * polys.n_parts  # the quadtree filter prunes
        np.testing.assert_array_equal(counts, cpu.pip_counts(pts, polys))
        want = [int(shapely.covers(g, shapely.points(pts.x, pts.y)).sum()) for g in geoms]
        np.testing.assert_array_equal(counts, want)
        p, g = gpu.pip_pairs(pts, polys, 0, len(pts))
        cp, cg = cpu.pip_pairs(pts, polys, 0, len(pts))
        np.testing.assert_array_equal(p, cp)
        np.testing.assert_array_equal(g, cg)
        assert len(np.unique(p)) < len(p)  # points on the shared edge x = 4 belong to two geometries
        chunks = [gpu.pip_pairs(pts, polys, a, b) for a, b in ((0, 100), (100, 101), (101, len(pts)))]
        np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks]), cp)
        np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), cg)

    def test_distance_join_equals_the_cpu_engine():
        rng = np.random.default_rng(22)
        centres = np.array([[179.999, 5.0], [-179.999, 5.0], [10.0, 89.999], [-60.0, -20.0], [3.0, 40.0]])
        xy = np.repeat(centres, 30, axis=0) + rng.normal(0, 0.004, (150, 2))
        xy[:, 0] = (xy[:, 0] + 180) % 360 - 180
        xy[:, 1] = np.clip(xy[:, 1], -90, 90)
        xy[60:90, 0] = rng.uniform(-180, 180, 30)  # around the north pole: every longitude
        a = points_from_lonlat(xy[:, 0], xy[:, 1])
        b = points_from_lonlat((xy[::2, 0] + 180.001) % 360 - 180, xy[::2, 1])
        gpu, cpu = CudaSpatialEngine(), CpuSpatialEngine()
        for other, self_join in ((a, True), (b, False)):
            got = gpu.within_distance(a, other, 800.0, 0, len(a), self_join=self_join)
            want = cpu.within_distance(a, other, 800.0, 0, len(a), self_join=self_join)
            assert len(want[0]) > 200
            assert_the_cpu_engines_pairs(got, want)
        part = gpu.within_distance(a, a, 800.0, 40, 95, self_join=True)
        whole = cpu.within_distance(a, a, 800.0, 0, len(a), self_join=True)
        sel = (whole[0] >= 40) & (whole[0] < 95)
        assert_the_cpu_engines_pairs(part, [w[sel] for w in whole])
        for max_pairs in (1, 37, 400):  # a bounded page: whole points, the budget kept, the CPU engine's pairs
            got = gpu.within_distance_page(a, a, 800.0, 10, len(a), True, max_pairs)
            assert 10 < got[3] <= len(a) and (len(got[0]) <= max_pairs or got[3] == 11)
            want = cpu.within_distance(a, a, 800.0, 10, got[3], self_join=True)
            assert_the_cpu_engines_pairs(got[:3], want)
            if SIM:  # no pair near the radius here: the same cut as the CPU engine's
                assert got[3] == cpu.within_distance_page(a, a, 800.0, 10, len(a), True, max_pairs)[3]

    def test_layers_stay_resident_and_a_write_invalidates_only_its_layer(monkeypatch):
        """A second join on unchanged layers uploads nothing and builds nothing; a new version of the points
        layer uploads and rebuilds that layer alone."""
        from spatial import cuda_engine

        uploaded = []  # host arrays sent to the device (a page's [start, stop] pair aside)

        class SpyXp:
            def __getattr__(self, name):
                return getattr(np, name)

            @staticmethod
            def asarray(a, *args, **kwargs):
                if isinstance(a, np.ndarray) and a.size > 2:
                    uploaded.append(a.size)
                return np.asarray(a, *args, **kwargs)

        monkeypatch.setattr(cuda_engine, "_xp", lambda: SpyXp())
        pts, polys, _ = fixture()
        gpu, cpu = CudaSpatialEngine(max_depth=6, max_size=8), CpuSpatialEngine()

        def joins():
            counts = gpu.pip_counts(pts_now, polys)
            pages = [gpu.pip_pairs(pts_now, polys, a, b) for a, b in ((0, 100), (100, len(pts_now)))]
            near = gpu.within_distance(pts_now, pts_now, 60_000.0, 0, len(pts_now), self_join=True)
            return counts, pages, near

        pts_now = pts
        first = joins()
        assert gpu.counters == {"uploads": 2, "builds": 3, "joins": 1}  # boxes, quadtree, grid
        assert len(uploaded) == 7  # the points' x, y; the polygons' x, y, ring and part offsets, part geometry
        uploaded.clear()
        again = joins()
        assert gpu.counters == {"uploads": 2, "builds": 3, "joins": 1} and uploaded == []
        np.testing.assert_array_equal(again[0], first[0])
        for k in range(3):
            np.testing.assert_array_equal(again[2][k], first[2][k])  # the same device computed both

        x, y = pts.x.copy(), pts.y.copy()
        x[:50] += 0.25  # a write: the layer comes back as a new object
        pts_now = points_from_lonlat(x, y)
        gpu.forget(pts)  # what the manager does on the write
        assert gpu.resident_layers() == 1
        counts, pages, near = joins()
        assert gpu.counters == {"uploads": 3, "builds": 5, "joins": 2}  # the points' quadtree and grid only
        assert len(uploaded) == 2  # the new points' x and y; the polygons stayed
        np.testing.assert_array_equal(counts, cpu.pip_counts(pts_now, polys))
        want = cpu.pip_pairs(pts_now, polys, 0, len(pts_now))
        for k in range(2):
            np.testing.assert_array_equal(np.concatenate([p[k] for p in pages]), want[k])
        want = cpu.within_distance(pts_now, pts_now, 60_000.0, 0, len(pts_now), self_join=True)
        assert_the_cpu_engines_pairs(near, want)
        assert not np.array_equal(counts, first[0])

    def test_warm_up_launches_every_kernel_checks_its_answers_and_leaves_nothing_resident():
        gpu = CudaSpatialEngine()
        stats = gpu.warm_up(None if SIM else 1 << 16)
        assert gpu.launched == set(_KERNELS)
        assert gpu.resident_layers() == 0 and gpu.counters["joins"] == 1 and not gpu._joins
        assert gpu.counters["band_pairs"] > 0  # pairs at the radius itself were decided on the host
        assert stats["points"] == (320 if SIM else 1 << 16) and stats["distance_points"] > 80

    def lattice():
        """Rows of points STEP degrees apart along parallels (one across the antimeridian): within a row, every
        pair k steps apart has the same haversine bit for bit, so a radius can sit exactly on many pairs."""
        step = 2.0 ** -10
        k = np.arange(40)
        lon = np.concatenate([3.0 + k * step, -20.0 + k * step, 50.0 + k * step, 180.0 - 20 * step + k * step])
        lat = np.repeat([0.0, -45.0, 60.0, 10.0], 40)
        lon = (lon + 180.0) % 360.0 - 180.0
        return points_from_lonlat(lon, lat)

    @pytest.mark.parametrize("ulp_below", [False, True])
    def test_pairs_at_the_radius_itself_are_the_cpu_engines(ulp_below):
        """A radius equal to the CPU engine's distance of every 3-step pair of the equator's row (or 1 ulp below
        it): the device returns exactly the CPU engine's pairs, whatever the last bits of its own distances."""
        pts = lattice()
        gpu, cpu = CudaSpatialEngine(), CpuSpatialEngine()
        d3 = float(cpu.within_distance(pts, pts, 400.0, 0, 4, self_join=True)[2][2])  # pair (0, 3)
        radius = float(np.nextafter(d3, 0.0)) if ulp_below else d3
        want = cpu.within_distance(pts, pts, radius, 0, len(pts), self_join=True)
        assert (np.sum(want[2] == d3) == 0) if ulp_below else (np.sum(want[2] == d3) >= 37)
        got = gpu.within_distance(pts, pts, radius, 0, len(pts), self_join=True)
        assert_the_cpu_engines_pairs(got, want)
        assert gpu.counters["band_pairs"] >= 37
        at = np.isin(got[2], [d3])
        np.testing.assert_array_equal(got[2][at], want[2][at])  # decided on the host: its distance too

    def test_drop_results_recomputes_on_resident_layers():
        """What a benchmark times as resident: the join computed again, nothing uploaded or built again."""
        pts, polys, _ = fixture()
        gpu = CudaSpatialEngine(max_depth=6, max_size=8)
        first = gpu.pip_counts(pts, polys)
        gpu.pip_counts(pts, polys)
        assert gpu.counters == {"uploads": 2, "builds": 2, "joins": 1}  # the repeat was the cached result
        gpu.drop_results()
        np.testing.assert_array_equal(gpu.pip_counts(pts, polys), first)
        assert gpu.counters == {"uploads": 2, "builds": 2, "joins": 2} and gpu.resident_layers() == 2

    def test_a_written_or_loaded_layer_is_resident_before_its_first_join():
        """The manager prepares a layer loaded at start and a layer written later in the GPU engine's thread:
        the first join uploads and builds nothing."""
        import asyncio

        import pyarrow as pa

        from helpers import FreeGuard, MemoryLayerStore
        from spatial.layers import Layer
        from spatial.manager import SpatialManager

        pts, polys, _ = fixture()
        # as SpatialStore.load gives them: read-only views of Arrow buffers
        stored = Points(pa.array(pts.x).to_numpy(), pa.array(pts.y).to_numpy())
        assert not stored.x.flags.writeable

        async def scenario():
            manager = SpatialManager(None, FreeGuard(strict=True))
            manager.store = MemoryLayerStore([Layer("pts", "points", np.arange(len(pts)), stored)])
            gpu = CudaSpatialEngine(max_depth=6, max_size=8)
            manager.attach(gpu)
            await manager.start()
            await manager.loading
            assert manager.ready and gpu.counters == {"uploads": 1, "builds": 1}  # the points and their quadtree
            await manager.create(Layer("polys", "polygons", np.arange(len(polys)), polys))
            await asyncio.wrap_future(manager.executors["gpu"].submit(lambda: None))
            assert gpu.counters == {"uploads": 2, "builds": 2}  # the polygons and their part boxes
            answer = await manager.point_in_polygon("pts", "polys", "counts", "gpu", None, 100)
            assert gpu.counters == {"uploads": 2, "builds": 2, "joins": 1}
            await manager.stop()
            return answer

        answer = asyncio.run(scenario())
        assert answer.engine == "cuda-spatial"
        assert answer.body["counts"] == CpuSpatialEngine().pip_counts(pts, polys).tolist()

    def test_the_gpu_checks_spatial_benchmark_runs_and_compares():
        import sys

        sys.path.insert(0, str(ROOT / "loadtests"))
        from gpu_check import bench_spatial

        result = bench_spatial({"points": 400, "polygons": 12, "distance_points": 300}, 1)
        assert result["pip_equal"] and result["distance_equal"], result
        assert result["pip_matched"] > 0 and result["distance_pairs"] > 0

    def test_distance_grids_beyond_their_limit_never_evict_the_quadtree():
        pts, polys, _ = fixture()
        gpu = CudaSpatialEngine(max_depth=6, max_size=8, max_grids=2)
        gpu.pip_counts(pts, polys)
        for radius in (1e4, 2e4, 3e4):  # the third grid drops the first, and only a grid
            gpu.within_distance(pts, pts, radius, 0, 50, self_join=True)
        builds = gpu.counters["builds"]
        other = Polygons(polys.x.copy(), polys.y, polys.ring_offsets, polys.part_offsets, polys.geometry_offsets)
        gpu.pip_counts(pts, other)  # a new polygons layer: its part boxes are built, the points' quadtree reused
        gpu.within_distance(pts, pts, 3e4, 0, 50, self_join=True)
        assert gpu.counters["builds"] == builds + 1
        gpu.within_distance(pts, pts, 1e4, 0, 50, self_join=True)
        assert gpu.counters["builds"] == builds + 2
