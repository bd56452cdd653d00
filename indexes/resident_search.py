"""Searches of a resident collection: plain ones, and those with a payload filter or a recall target, which
planner.py plans; each over the ANN index and the exact delta, merged.

ResidentSearch is the search half of ResidentCollection (resident.py): it reads the collection's rows under its
lock and changes none of them (its filter cache and remembered plans aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import planner
from .ann import AnnIndex
from .distance import exact_search, from_engine, merge_topk, prepare
from .filters import Node
from .payloads import PayloadIndex
from .rwlock import ReadWriteLock

MAX_OVERFETCH = 4096


@dataclass
class SearchResult:
    ids: list[list[int]]
    distances: list[list[float]]
    watermark: int | None = None  # the change seq the answer reflects (None: read from PostgreSQL itself)
    plan: dict[str, Any] | None = None  # filtered or recall-targeted searches: the plan that ran (planner.py)


class ResidentSearch:
    """Searches over the state below, which ResidentCollection sets and changes (see resident.py's note on
    rows and generations)."""

    metric: str
    lock: ReadWriteLock
    index: AnnIndex | None
    calibration: planner.Calibration | None
    filters: planner.FilterCache
    payloads: PayloadIndex
    plan_epoch: int
    watermark: int
    generation: int
    n_rows: int
    n_dead: int
    _ids: np.ndarray
    _vectors: np.ndarray
    _alive: np.ndarray

    if TYPE_CHECKING:  # ResidentCollection's own, declared for the type checker
        @property
        def count(self) -> int: ...

        @property
        def indexed_rows(self) -> int: ...

        def _dead_row_marker(self) -> Callable[[np.ndarray], None] | None: ...

    def keep_mask(self) -> np.ndarray | None:
        """Rows a search may return, or None when every row may be returned."""
        return self._alive[: self.n_rows].copy() if self.n_dead else None

    def search(self, queries: np.ndarray, k: int, params: dict[str, Any], where: Node | None = None,
               recall_target: float | None = None) -> SearchResult:
        """Top-k live rows. `where` restricts them to a payload filter (planner.py picks exact search over the
        matching rows or the ANN index with them as a filter); `recall_target` picks calibrated parameters."""
        q = prepare(np, queries, self.metric)
        if where is None and recall_target is None:
            return self._search_plain(q, k, params)
        with self.lock.read():
            watermark, matched = self.watermark, None
            if where is not None:
                matched = self.filters.rows(where, self._filter_key(), self._evaluate)
                plan, report = matched.plan((k, tuple(params.items()), recall_target, self.plan_epoch),
                                            lambda: self._plan(k, params, recall_target, matched.count))
            else:
                plan = self._plan(k, params, recall_target, None)
                report = plan.report()
            if self.count == 0 or plan.matched == 0:
                empty: list[list[Any]] = [[] for _ in range(len(q))]
                return SearchResult(empty, [list(e) for e in empty], watermark, report)
            # An index that is exact whatever its parameters (exact_index.py, on the device) runs every plan itself.
            on_host = plan.kind == "exact" and not getattr(self.index, "exact", False)
            if on_host and matched is not None:  # over the matching rows, gathered once per filter
                scores, local = exact_search(np, matched.vectors(self._vectors), q, k, self.metric)
                ids = _ids_of(matched.ids(self._ids), local)
            else:
                if on_host and plan.index_type not in (None, "brute_force"):  # no setting reaches a target
                    scores, rows = exact_search(np, self._vectors[: self.n_rows], q, k, self.metric, self.keep_mask())
                else:
                    keep = matched.mask if matched is not None else self.keep_mask()
                    scores, rows = self._search_rows(q, k, plan.params, keep, matched is not None)
                ids = _ids_of(self._ids, rows)
        return _shape(ids, from_engine(np, scores, self.metric), watermark, report)

    def _plan(self, k: int, params: dict[str, Any], recall_target: float | None, matched: int | None) -> planner.Plan:
        """How a search runs (planner.py): for a recall target, and for a filter keeping `matched` rows."""
        index_type = self.index.config.index_type if self.index is not None else None
        plan = planner.Plan.unfiltered(index_type, params)
        if recall_target is not None:
            plan = planner.targeted(plan, self.calibration, recall_target, k)
        if matched is not None:
            build = self.index.config.params if self.index is not None else {}
            plan = planner.filtered(plan, matched, self.count, k, build)
        return plan

    def _search_plain(self, q: np.ndarray, k: int, params: dict[str, Any]) -> SearchResult:
        """search() without a filter or a recall target, which needs no planner: most searches, so kept short."""
        with self.lock.read():
            watermark = self.watermark
            if self.count == 0:
                return SearchResult([[] for _ in range(len(q))], [[] for _ in range(len(q))], watermark)
            index = self.index
            if index is not None and not self.n_dead and self.n_rows == index.size:  # every row in the index, alive
                scores, rows = index.search(q, k, {} if index.config.index_type == "brute_force" else params, None)
            else:
                exact = index is None or index.config.index_type == "brute_force"
                scores, rows = self._search_rows(q, k, {} if exact else params, self.keep_mask())
            ids = _ids_of(self._ids, rows)
        return _shape(ids, from_engine(np, scores, self.metric), watermark)

    def _filter_key(self) -> tuple[int, int]:
        """What a filter's rows depend on: every change moves the watermark, every new layout the generation."""
        return (self.generation, self.watermark)

    def _evaluate(self, where: Node) -> np.ndarray:
        n = self.n_rows
        return self.payloads.evaluate(where, n) & self._alive[:n]

    def _search_rows(self, q: np.ndarray, k: int, params: dict[str, Any], keep: np.ndarray | None,
                     filtered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        parts = []
        size = self.indexed_rows
        if size:
            parts.append(self._search_index(q, k, params, keep, filtered))
        if self.n_rows > size:
            delta_keep = keep[size:] if keep is not None else None
            s, r = exact_search(np, self._vectors[size:self.n_rows], q, k, self.metric, delta_keep)
            parts.append((s, np.where(r >= 0, r + size, -1)))
        if not parts:
            return exact_search(np, self._vectors[:0], q, k, self.metric)
        return merge_topk(np, self.metric, k, *parts) if len(parts) > 1 or parts[0][1].shape[1] != k else parts[0]

    def planner_report(self) -> dict[str, Any]:
        """The payload fields the filter index holds (live rows per kind of value), the calibration of the index,
        and the filter cache's use."""
        with self.lock.read():
            fields = self.payloads.describe(self._alive[: self.n_rows])
            calibration = self.calibration.report() if self.calibration is not None else None
        return {"payload_fields": fields, "calibration": calibration,
                "filter_cache": {"hits": self.filters.hits, "misses": self.filters.misses}}

    def _search_index(self, q: np.ndarray, k: int, params: dict[str, Any], keep: np.ndarray | None,
                      filtered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The ANN index's top-k of its own rows, none outside `keep`."""
        assert self.index is not None  # there are indexed rows
        size = self.indexed_rows
        index_keep = keep[:size] if keep is not None else None
        if not filtered and self._dead_row_marker() is not None:
            index_keep = None  # the index drops its dead rows itself, from its resident bitset
        if index_keep is None or self.index.supports_filter:
            return self.index.search(q, k, params, index_keep)
        # No filter in this index: over-fetch past the rows that will be dropped.
        excluded = size - int(index_keep.sum())
        fetch = min(size, k + min(excluded, MAX_OVERFETCH))
        s, r = self.index.search(q, fetch, params, None)
        bad = (r < 0) | ~index_keep[np.maximum(r, 0)]
        return s, np.where(bad, -1, r)


def _ids_of(all_ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The ids of row numbers, -1 (no result) kept; most searches have none, and skip marking them (np.where cost
    a microsecond a search)."""
    ids = all_ids.take(rows, mode="clip")  # rows >= 0 are all below len(all_ids)
    if rows.size and rows.min() < 0:
        ids[rows < 0] = -1
    return ids


SHAPE_ROWS = 512


def _shape(ids: np.ndarray, distances: np.ndarray, watermark: int | None = None,
           plan: dict[str, Any] | None = None) -> SearchResult:
    """Per query, the valid results in order (fewer than k when fewer rows qualify). Converted SHAPE_ROWS queries
    at a time: one tolist() of a large batch holds the GIL, which the event loop then waits for, for milliseconds."""
    out_ids: list[list[int]] = []
    out_d: list[list[float]] = []
    for q0 in range(0, len(ids), SHAPE_ROWS):
        out_ids += ids[q0:q0 + SHAPE_ROWS].tolist()
        out_d += distances[q0:q0 + SHAPE_ROWS].tolist()
    if ids.size and ids.min() < 0:  # the engines mark a missing result -1, and only at the end of a row
        for i in np.flatnonzero(ids[:, -1] < 0).tolist():
            n = out_ids[i].index(-1)
            out_ids[i], out_d[i] = out_ids[i][:n], out_d[i][:n]
    return SearchResult(out_ids, out_d, watermark, plan)
