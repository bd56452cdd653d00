"""indexes/hugepages.py: a FAISS index's vectors and graph are found, advised onto huge pages where the system has
them, and the index answers the same either way."""

from __future__ import annotations

import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from indexes import hugepages
from indexes.ann import IndexConfig
from indexes.faiss_index import FaissIndex

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    if sys.platform != "linux" or not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def test_the_regions_of_an_hnsw_index_are_its_vectors_and_graph():
    index = faiss.IndexHNSWFlat(64, 16)
    index.add(np.random.default_rng(0).standard_normal((20_000, 64)).astype(np.float32))
    sizes = sorted(hugepages.span(v)[1] for v in hugepages.regions(index))
    assert sizes[-1] == 20_000 * 64 * 4  # the vectors
    assert 20_000 * 16 * 4 <= sizes[-2]  # the graph: at least 2m neighbours per node on level 0
    flat = faiss.IndexFlatL2(64)
    flat.add(np.zeros((100, 64), np.float32))
    assert [hugepages.span(v)[1] for v in hugepages.regions(flat)] == [100 * 64 * 4]


def test_advise_covers_only_whole_huge_pages():
    page = hugepages.HUGE_PAGE
    assert hugepages.advise(0, 10 * page, True) == 0  # no address: nothing
    assert hugepages.advise(page + 1, page, False) == 0  # no whole huge page inside


def vm_flags(address: int) -> list[str]:
    """The kernel's flags for the mapping holding `address` (/proc/self/smaps): "hg" is MADV_HUGEPAGE."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are {thp_mode()!r} here")
def test_a_built_index_is_advised_onto_huge_pages_and_searches_the_same():
    data = np.random.default_rng(1).standard_normal((30_000, 128)).astype(np.float32)
    config = IndexConfig("hnsw", "l2", 128, {"m": 16, "ef_construction": 40})
    plain = FaissIndex.build(config, data, threads=1, huge_pages=False)
    huge = FaissIndex.build(config, data, threads=1, huge_pages=True)
    address, size = hugepages.span(faiss.downcast_index(huge.index.storage).codes)
    assert size == data.nbytes
    first_whole = (address + hugepages.HUGE_PAGE - 1) & ~(hugepages.HUGE_PAGE - 1)
    assert "hg" in vm_flags(first_whole)
    queries = data[:100] + 0.01
    assert np.array_equal(plain.search(queries, 10, {"ef": 64}, None)[1], huge.search(queries, 10, {"ef": 64}, None)[1])
