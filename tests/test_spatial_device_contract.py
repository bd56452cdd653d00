"""The GPU spatial engine's start and its distance contract, checked without a device.

A kernel that cannot launch (numba-cuda 0.30.4 with numpy 2.5) leaves `cuda-spatial` unavailable with the reason
and `auto` on the CPU engine; the manager prepares layers in the engine's own thread; a device whose haversine
is a few ulps off the CPU's (as an H200's was) still returns exactly the CPU engine's pairs, those at the radius
itself included. The device's arithmetic is emulated: on the host for the band decision, and in numba-cuda's
simulator (this file again, in a child pytest with NUMBA_ENABLE_CUDASIM=1) for the whole engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import os
import threading
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import FreeGuard, MemoryLayerStore, run_in_cuda_simulator

pytest.importorskip("numba")
pytest.importorskip("shapely")

from shapely.geometry import box  # noqa: E402

from spatial import device_distance, kernels  # noqa: E402
from spatial.cpu_engine import CpuSpatialEngine  # noqa: E402
from spatial.geoarrow import points_from_lonlat, polygons_from_shapely  # noqa: E402
from spatial.layers import Layer  # noqa: E402
from spatial.manager import SpatialManager  # noqa: E402

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
ROOT = Path(__file__).resolve().parent.parent
STEP = 2.0 ** -10


def lattice():
    """Rows of points STEP degrees apart along parallels (one across the antimeridian): within a row, every pair k
    steps apart has the same haversine bit for bit, so a radius can sit exactly on many pairs."""
    k = np.arange(40)
    lon = np.concatenate([3.0 + k * STEP, -20.0 + k * STEP, 50.0 + k * STEP, 180.0 - 20 * STEP + k * STEP])
    lat = np.repeat([0.0, -45.0, 60.0, 10.0], 40)
    return points_from_lonlat((lon + 180.0) % 360.0 - 180.0, lat)


def clustered(seed=22):
    """Clusters across the antimeridian, at the pole and elsewhere, a few hundred pairs within 800 m."""
    rng = np.random.default_rng(seed)
    centres = np.array([[179.999, 5.0], [-179.999, 5.0], [10.0, 89.999], [-60.0, -20.0], [3.0, 40.0]])
    xy = np.repeat(centres, 30, axis=0) + rng.normal(0, 0.004, (150, 2))
    xy[:, 0] = (xy[:, 0] + 180) % 360 - 180
    xy[:, 1] = np.clip(xy[:, 1], -90, 90)
    return points_from_lonlat(xy[:, 0], xy[:, 1])


def ulps_of(lon1, lat1, lon2, lat2):
    """The emulated device's error on one pair, -3 to 3 ulps, symmetric in the two points."""
    return int(abs(lon1 + lon2) * 1e6 + abs(lat1 + lat2) * 1e6) % 7 - 3


def nudge(d, ulps):
    for _ in range(abs(ulps)):
        d = math.nextafter(d, math.inf if ulps > 0 else -math.inf)
    return d


def d3_of(pts):
    """The CPU engine's distance of the equator row's 3-step pairs (40 - 3 of them share it bit for bit)."""
    return float(CpuSpatialEngine().within_distance(pts, pts, 400.0, 0, 4, self_join=True)[2][2])


if not SIM:

    def test_the_band_brackets_the_radius_within_the_grid_and_far_beyond_the_devices_error():
        for radius in (0.0, 1e-3, 1.0, 800.0, 6e4, 1e6, 1.9e7):
            lo, hi = device_distance.band(radius)
            assert lo < radius < hi
            # a device's error below 0.99 pi R is under 3e-14 relative (docs/design/spatial.md): 3e4 x room
            assert min(hi - radius, radius - lo) >= 1e-9 * radius
            side, _ = kernels.grid_side(radius, 1 << 20)  # the radius's grid, whose cells must hold hi as well
            assert 2.0 * math.sin(hi / kernels.EARTH_RADIUS_M / 2) < side
        for radius in (device_distance.HOST_DECIDES_FROM_M, 2.0e7, 4e7):
            assert device_distance.band(radius) == (-math.inf, math.inf)

    def test_a_device_whose_functions_are_a_few_ulps_off_stays_well_inside_band_and_tolerance():
        """The bound behind the band and the tolerance: sin, cos and asin each up to 3 ulps off (CUDA documents 2,
        glibc 1) and the sum fused or not move a distance below 0.99 pi R by under 3e-14 of itself."""
        import random

        rng = random.Random(1)
        rad = math.pi / 180

        def haversine(lon1, lat1, lon2, lat2, off):
            f = (lambda v: nudge(v, rng.randint(-3, 3))) if off else (lambda v: v)
            s1, s2 = f(math.sin((lat2 - lat1) * rad * 0.5)), f(math.sin((lon2 - lon1) * rad * 0.5))
            h = s1 * s1 + f(math.cos(lat1 * rad)) * f(math.cos(lat2 * rad)) * (s2 * s2)
            h = min(nudge(h, rng.randint(-1, 1)) if off else h, 1.0)
            return 2 * kernels.EARTH_RADIUS_M * f(math.asin(math.sqrt(h)))

        worst = 0.0
        for share in (1e-6, 1e-3, 0.1, 0.5, 0.9, 0.99):  # of half the circumference
            theta = share * math.pi
            for _ in range(300):
                lon1, lat1, bearing = rng.uniform(-180, 180), rng.uniform(-80, 80), rng.uniform(0, 2 * math.pi)
                p1 = lat1 * rad
                p2 = math.asin(math.sin(p1) * math.cos(theta) + math.cos(p1) * math.sin(theta) * math.cos(bearing))
                l2 = lon1 * rad + math.atan2(math.sin(bearing) * math.sin(theta) * math.cos(p1),
                                             math.cos(theta) - math.sin(p1) * math.sin(p2))
                pair = (lon1, lat1, (l2 / rad + 180) % 360 - 180, p2 / rad)
                d = haversine(*pair, False)
                worst = max(worst, max(abs(haversine(*pair, True) - d) / d for _ in range(3)))
        assert 1e-15 < worst < 3e-14
        assert worst * 3e4 < device_distance.BAND_REL and worst * 30 < device_distance.DISTANCE_RTOL

    @pytest.mark.parametrize("ulps", [-3, -1, 1, 3, "mixed"])
    def test_deciding_the_band_on_the_host_gives_the_cpu_engines_pairs(ulps):
        """A device off by some ulps admits pairs up to the band's top and the host decides the band: exactly
        the CPU engine's pairs at, 1 ulp below and 1 ulp above a radius that many pairs sit on. Deciding on the
        device's own distances instead gets some of those wrong."""
        pts = lattice()
        cpu = CpuSpatialEngine()
        d3 = d3_of(pts)
        naive_wrong = 0
        for radius in (d3, math.nextafter(d3, 0.0), math.nextafter(d3, math.inf)):
            want = cpu.within_distance(pts, pts, radius, self_join=True)
            lo, hi = device_distance.band(radius)
            ci, cj, cd = cpu.within_distance(pts, pts, hi * 1.01 + 1.0, self_join=True)  # all it might admit
            steps = [ulps_of(pts.x[a], pts.y[a], pts.x[b], pts.y[b]) if ulps == "mixed" else ulps
                     for a, b in zip(ci, cj)]
            dev = np.array([nudge(float(d), s) for d, s in zip(cd, steps)])
            admitted = dev <= hi
            i, j, d = ci[admitted], cj[admitted], dev[admitted]
            got = device_distance.decide_band(i, j, d, np.flatnonzero(d > lo), pts, pts, radius)
            for k in range(2):
                np.testing.assert_array_equal(got[k], want[k])
            assert device_distance.agrees(got[2], want[2])
            at = want[2] == d3
            np.testing.assert_array_equal(got[2][at], want[2][at])  # decided on the host: the CPU's distance
            naive = dev <= radius
            naive_wrong += not (np.array_equal(ci[naive], want[0]) and np.array_equal(cj[naive], want[1]))
        assert naive_wrong > 0

    def test_agreement_is_the_stated_tolerance():
        d = np.array([0.0, 1e-3, 1000.0, 1.9e7])
        assert device_distance.agrees(d, d)
        assert device_distance.agrees(d * (1 + 9e-13), d)
        assert not device_distance.agrees(d * (1 + 2e-12) + 1e-9, d)
        assert not device_distance.agrees(d[:3], d)

    def test_numpy_is_capped_below_2_5_while_numba_cuda_calls_row_stack():
        """numba-cuda 0.30.4 registers an overload of np.row_stack, which numpy 2.5 removed: every kernel launch
        then fails. The extras that install numba-cuda must keep numpy below 2.5 for as long as it does."""
        packaging = pytest.importorskip("packaging.requirements")
        spec = importlib.util.find_spec("numba_cuda")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("numba-cuda is not installed")
        source = Path(next(iter(spec.submodule_search_locations))) / "numba" / "cuda" / "np" / "arrayobj.py"
        if "np.row_stack" not in source.read_text():
            pytest.skip("this numba-cuda no longer calls np.row_stack")
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for name, requirements in extras.items():
            parsed = [packaging.Requirement(r) for r in requirements]
            if any(r.name == "numba-cuda" for r in parsed):
                caps = [r.specifier for r in parsed if r.name == "numpy"]
                assert caps and all("2.5.0" not in c and "2.5.2" not in c for c in caps), name

    def square_layers():
        polygons = polygons_from_shapely(np.array([box(0, 0, 2, 2), box(2, 0, 4, 2)], dtype=object))
        points = points_from_lonlat([1.0, 2.0, 3.0, 9.0], [1.0, 1.0, 1.0, 9.0])
        return Layer("pts", "points", np.arange(4), points), Layer("polys", "polygons", np.array([7, 8]), polygons)

    def test_a_kernel_that_cannot_launch_leaves_cuda_spatial_unavailable_and_auto_on_the_cpu(monkeypatch):
        """The registry's own path: the handle's warm-up launches a kernel, the launch raises what numba-cuda
        0.30.4 raises under numpy 2.5, the engine is unavailable with that reason and never attached."""
        from service.engines import CATALOG, EngineRegistry
        from service.process.devices import CudaDevice, CudaProbe
        from spatial import cuda_engine

        class Unlaunchable:
            def __getitem__(self, launch_config):
                return self

            def __call__(self, *args):
                raise AttributeError("module 'numpy' has no attribute 'row_stack'")

        monkeypatch.setattr(cuda_engine, "_build", lambda: SimpleNamespace(
            **{name: Unlaunchable() for name in cuda_engine._KERNELS}))
        spatial = SpatialManager(None, FreeGuard())
        registry = EngineRegistry(CudaProbe(devices=(CudaDevice(0, "Test GPU", 16 << 30),)),
                                  tuple(s for s in CATALOG if s.name in ("cuda-spatial", "cpu-spatial")))
        registry.probe(None, {})
        assert registry.statuses["cuda-spatial"].available  # a device, numba-cuda importable: it is tried

        async def scenario():
            await registry.start(spatial=spatial)
            for layer in square_layers():
                spatial.layers[layer.name] = layer
            try:
                return await spatial.point_in_polygon("pts", "polys", "counts", "auto", None, 100)
            finally:
                await spatial.stop()
                await registry.stop()

        answer = asyncio.run(scenario())
        status = {s.spec.name: s.as_dict() for s in registry.list("spatial")}
        gpu = status["cuda-spatial"]
        assert not gpu["available"] and not gpu["ready"]
        assert gpu["reason"].startswith("failed to start: WarmUpError: AttributeError: module 'numpy' has no "
                                        "attribute 'row_stack' (launching part_bbox_kernel; numba-cuda "), gpu
        assert status["cpu-spatial"]["available"]
        assert set(spatial.engines) == {"cpu"} and set(spatial.executors) == {"cpu"}
        assert answer.engine == "cpu-spatial" and answer.fallback is None and answer.body["counts"] == [2, 2]

    def test_the_manager_prepares_layers_in_the_engines_own_thread(caplog):
        """Loaded at start (before ready), written, rewritten (the old version forgotten first): each prepared in
        the GPU engine's thread; a prepare that fails is logged and the write still stands."""
        calls = []

        class Recorder:
            name, kind, ready = "cuda-spatial", "gpu", True
            broken = None

            def prepare(self, geometry):
                calls.append(("prepare", threading.current_thread().name, geometry))
                if geometry is self.broken:
                    raise MemoryError("out of device memory")

            def forget(self, geometry):
                calls.append(("forget", threading.current_thread().name, geometry))

        pts, polys = square_layers()
        again = Layer("pts", "points", np.arange(2), points_from_lonlat([0.5, 1.5], [0.5, 0.5]))
        engine = Recorder()

        async def scenario():
            spatial = SpatialManager(None, FreeGuard())
            spatial.store = MemoryLayerStore([pts])
            spatial.attach(engine)
            await spatial.start()
            await spatial.loading
            assert spatial.ready and calls == [("prepare", "spatial-gpu_0", pts.geometry)]
            await spatial.create(polys)
            await spatial.create(again)
            broken = Layer("bad", "points", np.arange(1), points_from_lonlat([1.0], [1.0]))
            engine.broken = broken.geometry
            await spatial.create(broken)
            await asyncio.wrap_future(spatial.executors["gpu"].submit(lambda: None))
            assert spatial.layers["bad"] is broken
            await spatial.stop()

        with caplog.at_level(logging.WARNING, logger="switchyard.spatial"):
            asyncio.run(scenario())
        assert [(c[0], c[2]) for c in calls[1:]] == [("prepare", polys.geometry), ("forget", pts.geometry),
                                                     ("prepare", again.geometry), ("prepare", engine.broken)]
        assert {c[1] for c in calls} == {"spatial-gpu_0"}
        assert "could not prepare layer 'bad'" in caplog.text

    def test_in_the_cuda_simulator():
        """The engine-level half of this file, in numba-cuda's simulator (a child pytest)."""
        run_in_cuda_simulator(__file__)

else:
    try:
        from numba import cuda  # noqa: F401  (the simulator; needs numba-cuda[cu12])
    except Exception as exc:  # noqa: BLE001  (any failure to load the simulator means: skip)
        pytest.skip(f"numba.cuda cannot be imported: {exc}", allow_module_level=True)

    from spatial import cuda_engine, cuda_warmup
    from spatial.cuda_engine import CudaSpatialEngine
    from spatial.cuda_warmup import WarmUpError

    @contextlib.contextmanager
    def emulated_device(**cores):
        """The GPU engine compiled with these plain-Python cores in place of kernels.py's."""
        cuda_engine._build.cache_clear()
        cuda_engine.DEVICE_CORE_OVERRIDES.update(cores)
        try:
            yield
        finally:
            cuda_engine.DEVICE_CORE_OVERRIDES.clear()
            cuda_engine._build.cache_clear()

    def haversine_off_by_some_ulps(lon1, lat1, lon2, lat2):
        return nudge(kernels.haversine_m(lon1, lat1, lon2, lat2), ulps_of(lon1, lat1, lon2, lat2))

    def assert_equal_pairs(got, want):
        for k in range(2):
            np.testing.assert_array_equal(got[k], want[k])
        assert device_distance.agrees(got[2], want[2])

    def test_a_device_some_ulps_off_returns_the_cpu_engines_pairs_and_pages():
        cpu = CpuSpatialEngine()
        lat, near = lattice(), clustered()
        d3 = d3_of(lat)
        with emulated_device(haversine_m=haversine_off_by_some_ulps):
            gpu = CudaSpatialEngine()
            for pts, radius in ((lat, d3), (lat, math.nextafter(d3, 0.0)), (near, 800.0)):
                want = cpu.within_distance(pts, pts, radius, self_join=True)
                got = gpu.within_distance(pts, pts, radius, self_join=True)
                assert_equal_pairs(got, want)
                assert not np.array_equal(got[2], want[2])  # the emulated device's own distances, off by ulps
            want = cpu.within_distance(lat, lat, d3, self_join=True)
            pages, start = [], 0
            while start < len(lat):  # pages: whole points, within the budget, adding up to the whole
                i, j, d, after = gpu.within_distance_page(lat, lat, d3, start, len(lat), True, 100)
                assert after > start and len(i) <= 100 and set(i.tolist()) <= set(range(start, after))
                pages.append((i, j, d))
                start = after
            assert len(pages) > 3
            assert_equal_pairs([np.concatenate([p[k] for p in pages]) for k in range(3)], want)
            other = points_from_lonlat(lat.x[::2], lat.y[::2])  # a join of two layers
            assert_equal_pairs(gpu.within_distance(lat, other, d3), cpu.within_distance(lat, other, d3))
            assert gpu.counters["band_pairs"] > 0

    def test_without_the_band_that_device_would_miss_pairs_at_the_radius(monkeypatch):
        """The emulation has teeth: deciding on the device's own distances loses the pairs at the radius."""
        pts = lattice()
        d3 = d3_of(pts)
        monkeypatch.setattr(device_distance, "band", lambda radius: (radius, radius))
        with emulated_device(haversine_m=lambda *p: nudge(kernels.haversine_m(*p), 2)):
            got = CudaSpatialEngine().within_distance(pts, pts, d3, self_join=True)
        want = CpuSpatialEngine().within_distance(pts, pts, d3, self_join=True)
        assert len(got[0]) == len(want[0]) - np.sum(want[2] == d3) and np.sum(want[2] == d3) >= 37

    def test_warm_up_fails_naming_a_kernel_it_never_launched(monkeypatch):
        """The old warm-up's distance join had no pairs, so the write kernel compiled at the first request."""
        def pairless(engine, n_clusters):
            far = points_from_lonlat([0.5, 2.0], [0.5, 2.0])
            engine.within_distance(far, far, 1000.0, self_join=True)
            engine.forget(far)
            return 2

        monkeypatch.setattr(cuda_warmup, "_distance", pairless)
        with pytest.raises(WarmUpError, match="never launched dwithin_write_kernel"):
            CudaSpatialEngine().warm_up()

    def test_warm_up_fails_on_a_wrong_answer():
        with emulated_device(haversine_m=lambda *p: kernels.haversine_m(*p) * (1 + 1e-7)):
            with pytest.raises(WarmUpError, match="distance join wrong"):
                CudaSpatialEngine().warm_up()
        with emulated_device(point_in_part=lambda *args: kernels.OUTSIDE):
            with pytest.raises(WarmUpError, match="point-in-polygon count wrong"):
                CudaSpatialEngine().warm_up()

    def test_every_launch_of_a_request_has_argument_types_the_warm_up_compiled(monkeypatch):
        """numba-cuda compiles a kernel again for every new signature: requests on layers as the service holds
        them (from JSON, from the store's read-only Arrow buffers, partitions) launch only warm-up signatures."""
        import numba
        import pyarrow as pa

        from spatial.geoarrow import Points, Polygons
        from spatial.partitions import partition_of

        seen: dict[str, set] = {}
        launch = CudaSpatialEngine._launch

        def recording(self, name, n, *args):
            seen.setdefault(self.phase, set()).add((name, tuple(numba.typeof(a) for a in args)))
            return launch(self, name, n, *args)

        monkeypatch.setattr(CudaSpatialEngine, "_launch", recording)
        gpu = CudaSpatialEngine()
        gpu.phase = "warm-up"
        gpu.warm_up()
        gpu.phase = "requests"

        def read_only(a):
            return pa.array(np.asarray(a)).to_numpy()

        polys = cuda_warmup.boxes(3)
        stored_polys = Polygons(*(read_only(getattr(polys, f)) for f in ("x", "y", "ring_offsets", "part_offsets",
                                                                         "geometry_offsets")))
        pts = cuda_warmup.box_points(120, 3)[0]
        stored = Points(read_only(pts.x), read_only(pts.y))
        part = partition_of(Layer("p", "points", np.arange(len(pts)), pts), 1, 3).geometry
        for p in (pts, stored, part):
            for g in (polys, stored_polys):
                gpu.pip_counts(p, g)
                gpu.pip_pairs(p, g, 5, 30)
            gpu.within_distance_page(p, p, 30_000.0, 3, len(p), True, 40)
            gpu.within_distance(p, stored, 30_000.0, 0, 10)
        assert seen["requests"] and seen["requests"] <= seen["warm-up"], seen["requests"] - seen["warm-up"]
