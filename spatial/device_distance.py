"""The GPU distance join's contract with the CPU engine: the same pairs in the same order, distances within a
stated tolerance, pairs at the radius itself included.

A device's sin, cos, asin and sqrt are not glibc's, so its haversine may differ from the CPU engine's in the last
bits. The device kernels therefore admit every pair up to a slightly widened radius (`band`), and the pairs whose
device distance lies in the band around the radius are decided again on the host with the CPU engine's own
compiled core (`decide_band`): membership is the CPU engine's, bit for bit. Bounds and measurements:
docs/design/spatial.md.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from .cpu_engine import K  # the CPU engine's compiled cores: its haversine, bit for bit
from .geoarrow import Points
from .kernels import EARTH_RADIUS_M

BAND_REL = 1e-9  # the band's half-width relative to the radius: > 3 x 10^4 x a device's error (< 3e-14)
BAND_ABS_M = 1e-6  # and absolute, for radii near zero
# Beyond 99% of half the circumference asin is ill-conditioned (the error grows towards the antipode):
# for such radii the host decides every pair the device admits.
HOST_DECIDES_FROM_M = 0.99 * math.pi * EARTH_RADIUS_M
# What every GPU distance agrees with the CPU engine's to: |d_gpu - d_cpu| <= RTOL * d_cpu + ATOL_M.
DISTANCE_RTOL = 1e-12
DISTANCE_ATOL_M = 1e-9


def band(radius_m: float) -> tuple[float, float]:
    """(lo, hi): the device admits pairs with its distance <= hi; those with a device distance > lo are decided
    on the host."""
    if radius_m >= HOST_DECIDES_FROM_M:
        return -math.inf, math.inf
    half = radius_m * BAND_REL + BAND_ABS_M
    return radius_m - half, radius_m + half


_haversine = K.haversine_m


@njit(cache=True)
def _haversine_many(lon1, lat1, lon2, lat2):
    out = np.empty(lon1.shape[0], np.float64)
    for k in range(lon1.shape[0]):
        out[k] = _haversine(lon1[k], lat1[k], lon2[k], lat2[k])
    return out


def host_haversine(lon1: np.ndarray, lat1: np.ndarray, lon2: np.ndarray, lat2: np.ndarray) -> np.ndarray:
    """The CPU engine's haversine of each (point 1, point 2), in metres."""
    f64 = functools.partial(np.array, dtype=np.float64, order="C", copy=True)  # one argument type, always
    return _haversine_many(f64(lon1), f64(lat1), f64(lon2), f64(lat2))


def agrees(d_gpu: np.ndarray, d_cpu: np.ndarray) -> bool:
    """Whether GPU distances agree with the CPU engine's within the contract's tolerance."""
    d_gpu, d_cpu = np.asarray(d_gpu, np.float64), np.asarray(d_cpu, np.float64)
    return d_gpu.shape == d_cpu.shape and bool(np.all(np.abs(d_gpu - d_cpu) <= DISTANCE_RTOL * d_cpu + DISTANCE_ATOL_M))


def decide_band(i: np.ndarray, j: np.ndarray, d: np.ndarray, in_band: np.ndarray, a: Points, b: Points,
                radius_m: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The device's pairs (i into a, j into b, its distances d, sorted) with those at positions `in_band` decided
    again as the CPU engine decides them: kept when the host distance is <= radius_m, with that distance."""
    if len(in_band) == 0:
        return i, j, d
    ib, jb = i[in_band], j[in_band]
    exact = host_haversine(np.asarray(a.x)[ib], np.asarray(a.y)[ib], np.asarray(b.x)[jb], np.asarray(b.y)[jb])
    keep = np.ones(len(i), bool)
    keep[in_band] = exact <= radius_m
    d = np.array(d, dtype=np.float64)
    d[in_band] = exact
    return i[keep], j[keep], d[keep]
