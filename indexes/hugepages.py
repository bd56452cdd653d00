"""Transparent huge pages for a resident FAISS index's vectors and graph (SWITCHYARD_HUGE_PAGES).

A graph search reads about a thousand vectors at scattered places, and with 4 KiB pages nearly each read is a TLB
miss. Ranges are advised MADV_HUGEPAGE and, after bulk work (builds, loads, large adds: background threads),
collapsed at once with MADV_COLLAPSE (Linux 6.1+); a small add under the replica's lock only advises. Where THP is
off, on other systems, or for memory FAISS does not expose, nothing happens. Measurements:
docs/design/vectors.md#huge-pages.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
COLLAPSE_ROWS = 10_000  # an add of at least this many rows is bulk work (a build, an extension): collapse after it
ITEM_BYTES = {"Int32Vector": 4, "IntVector": 4, "UInt64Vector": 8, "Int64Vector": 8, "Float32Vector": 4,
              "UInt8Vector": 1}

_madvise: Any = None
if sys.platform == "linux":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no libc symbols to reach: leave pages as they are
        _madvise = None


def advise(address: int, size: int, collapse: bool) -> int:
    """Huge pages for the whole 2 MiB pages inside [address, address + size); the bytes advised (0: none)."""
    start = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (address + size) & ~(HUGE_PAGE - 1)
    if _madvise is None or not address or end <= start:
        return 0
    if _madvise(start, end - start, MADV_HUGEPAGE) != 0:
        return 0  # THP "never", or an old kernel
    if collapse:
        _madvise(start, end - start, MADV_COLLAPSE)  # best effort: a failure leaves the advice for khugepaged
    return end - start


def span(vector: Any) -> tuple[int, int]:
    """(address, bytes) of a FAISS vector (its MaybeOwnedVector or std::vector wrappers); (0, 0) when unknown."""
    try:
        address = int(vector.data())
        if hasattr(vector, "byte_size"):
            return address, int(vector.byte_size())
        return address, int(vector.size()) * ITEM_BYTES[type(vector).__name__]
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0, 0


def regions(index: Any) -> list[Any]:
    """The large arrays a search of `index` reads at random: flat codes (an HNSW index's vectors, a refine
    index's exact vectors) and the HNSW graph. IVF lists are many small arrays: left alone."""
    import faiss

    index = faiss.downcast_index(index)
    out = []
    if isinstance(index, faiss.IndexHNSW):
        out += [index.hnsw.neighbors, index.hnsw.offsets, index.hnsw.levels]  # type: ignore[attr-defined]  # not in faiss's stubs
        index = faiss.downcast_index(index.storage)
    elif isinstance(index, faiss.IndexRefine):
        index = faiss.downcast_index(index.refine_index)
    if isinstance(index, faiss.IndexFlatCodes):
        out.append(index.codes)
    return out


def back_index(index: Any, collapse: bool) -> int:
    """Advise (and with `collapse`, move now) the index's large arrays onto huge pages; the bytes advised."""
    total = 0
    for vector in regions(index):
        address, size = span(vector)
        total += advise(address, size, collapse)
    return total
