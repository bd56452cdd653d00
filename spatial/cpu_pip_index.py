"""The CPU engine's point-in-polygon index: a uniform grid over the polygons whose cells are decided once (inside
or outside a part) where no edge reaches them, with each part's edges bucketed by grid row for the cells an edge
does reach. Built once per polygon layer (CpuSpatialEngine caches it); the layout: docs/design/spatial.md.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import kernels
from .geoarrow import Polygons

K = kernels.compile_core(njit(cache=True))  # the scalar cores, compiled once for the CPU modules
_point_in_edges = K.point_in_edges

OUTSIDE = kernels.OUTSIDE
INSIDE = kernels.INSIDE
BOUNDARY = kernels.BOUNDARY
PAD = 1e-6  # cells: the edge-to-cell marking margin (the cell arithmetic errs by < 1e-11 cells)


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
