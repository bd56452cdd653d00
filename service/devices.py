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
