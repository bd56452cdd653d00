"""Find CUDA devices through the driver API (libcuda), without importing any RAPIDS library.

Importing cupy/cudf/cuvs costs seconds and gigabytes of mappings; asking the driver costs milliseconds and
works (by failing politely) on machines with no driver at all.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import lru_cache


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    total_memory_bytes: int


@dataclass(frozen=True)
class CudaProbe:
    devices: tuple[CudaDevice, ...] = field(default_factory=tuple)
    reason: str | None = None  # why there is no usable device

    @property
    def present(self) -> bool:
        return bool(self.devices)


@lru_cache(maxsize=2)
def probe_cuda(enabled: bool = True) -> CudaProbe:
    if not enabled:
        return CudaProbe(reason="GPU use disabled by SWITCHYARD_GPU=off")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return CudaProbe(reason=f"CUDA_VISIBLE_DEVICES={visible!r} hides every device")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return CudaProbe(reason="no CUDA device: the NVIDIA driver library libcuda.so.1 is not installed")
    rc = cuda.cuInit(0)
    if rc != 0:
        return CudaProbe(reason=f"no CUDA device: cuInit failed with CUDA error {rc}")
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return CudaProbe(reason="no CUDA device: the driver reports 0 devices")
    devices = []
    for index in range(count.value):
        handle = ctypes.c_int(0)
        if cuda.cuDeviceGet(ctypes.byref(handle), index) != 0:
            continue
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, handle)
        memory = ctypes.c_size_t(0)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(memory), handle)
        devices.append(CudaDevice(index, name.value.decode(errors="replace"), memory.value))
    if not devices:
        return CudaProbe(reason="no CUDA device: none could be opened")
    return CudaProbe(devices=tuple(devices))


def device_pins(probe: CudaProbe, visible: str | None = None) -> list[str]:
    """CUDA_VISIBLE_DEVICES for one engine process per device: each names one device as this process sees it.

    A device's index counts within this process's own visible set, in the order CUDA enumerates it (the same
    CUDA_DEVICE_ORDER reaches the children), so under CUDA_VISIBLE_DEVICES=2,3 device 1 is the token "3": a child
    pinned to it sees exactly the device its parent called 1, whether tokens are indexes, GPU- or MIG- UUIDs."""
    tokens = [t.strip() for t in visible.split(",")] if visible and visible.strip() else None
    return [tokens[d.index] if tokens else str(d.index) for d in probe.devices]


def is_out_of_memory(exc: BaseException) -> bool:
    """An engine ran out of memory: RMM raises MemoryError (std::bad_alloc: out_of_memory), CuPy its
    OutOfMemoryError (a MemoryError), numba-cuda a CudaAPIError naming CUDA_ERROR_OUT_OF_MEMORY."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return "out_of_memory" in text or "out of memory" in text


def configure_device_memory(pool_mb: int, device: CudaDevice) -> str:
    """One allocator for the process, set before any device allocation: an RMM pool as the current device
    resource, with CuPy allocating from it (cuDF and cudf-polars allocate through RMM's current resource, cuVS's
    Python layer through CuPy and RMM). Returns what was set up, for the log. rmm is imported here only."""
    if pool_mb < 0:
        return "no RMM pool (SWITCHYARD_GPU_MEMORY_POOL_MB=-1)"
    try:
        import rmm
    except ImportError:
        return "rmm is not installed: each GPU library allocates on its own"
    initial = pool_mb * 2**20 if pool_mb else device.total_memory_bytes // 2
    maximum = max(initial, int(device.total_memory_bytes * 0.9))
    initial -= initial % 256  # RMM wants pool sizes aligned to 256 bytes
    maximum -= maximum % 256
    # rapidsai/rmm python/rmm/docs/guide.md: PoolMemoryResource(upstream, initial_pool_size=, maximum_pool_size=),
    # rmm.mr.set_current_device_resource(pool) before any allocation; CuPy through rmm_cupy_allocator.
    pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=initial, maximum_pool_size=maximum)
    rmm.mr.set_current_device_resource(pool)
    try:
        import cupy
        from rmm.allocators.cupy import rmm_cupy_allocator

        cupy.cuda.set_allocator(rmm_cupy_allocator)
    except ImportError:
        pass
    return f"RMM pool of {initial / 2**30:.1f} GiB (up to {maximum / 2**30:.1f} GiB) on {device.name}"
