"""How a resident search runs: the plan for a payload filter, and search parameters for a recall target.

Filtered searches (measured with loadtests/bench_filters.py --sweep, FAISS HNSW32 on 200,000 x 128 clustered
vectors, k = 10, one query per call): with the filter as a bitmap, HNSW's cost stays flat as the filter keeps
fewer rows but its recall falls (ef 64: 0.96 at 50% of rows, 0.80 at 5%, 0.50 at 1%). Recall 0.95 needed ef 64 at
50%, 128 at 10%, about 200 at 5%, 350 at 2% and 512 at 1%: ef * selectivity^-0.55 holds it, so that is the effort
rule. Exact search over the matching rows (gathered once, then one matrix product) cost 15 us at 1% and 190 us at
10% against HNSW's 320 us and 1.3 ms at the effort that holds recall: exact wins while the matching rows are
fewer than about 6 * M * ef rows (an HNSW search computes about 2M distances per ef step, each about three times
the cost of a row in a dense product). IVF scans n_probes lists of about n / n_lists rows; kept to the same number
of matching rows its effort is n_probes / selectivity, and exact wins while the matching rows are fewer than the
rows it would scan. The response names the plan, the matching rows and the selectivity. A filter's rows, their
vectors and ids, and the plans made for them are kept (FilterCache) until the collection changes: a filter used by
many searches in a row is evaluated, gathered and planned once.

The exponent is on the safe side where the filter keeps many rows, and kept so: on 100,000 x 128 (HNSW16,
ef_construction 64, random subsets, 300 queries) holding the unfiltered recall at 50% needed ef x 1.3 (x 1.46
gave 0.982 against 0.975 unfiltered, at 246 us against 202), but on 1,000,000 x 128 (HNSW32, ef_construction 40;
loadtests/bench_filters.py) x 1.46 gave 0.955 against 0.956 unfiltered: a weaker graph needs it all. Searching
the index unfiltered for 2k/selectivity rows and filtering them gave the same recall as the bitmap at the same ef
(0.961 at 50%, ef 96) for 5-12% less time; not worth a third plan.

Recall targets: each build leaves a random sample of 500 stored vectors out of the index (they wait in the exact
delta), measures recall@10 of the index over a sweep of its search parameter with them as queries, against exact
search over the indexed rows, then adds them. Stored vectors used as queries while in the index score far too well
(a graph search starts next to its own node): 0.99 calibrated against 0.64 on fresh queries, measured. A targeted
search takes the cheapest swept setting whose calibrated recall reaches the target, scaled for k > 10; none reaching
it means exact search.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from .ann import LIMITS, default_n_lists
from .filters import Node
from .filters import key as filter_key

EFFORT_EXPONENT = 0.55  # ef / n_probes grow as selectivity ** -0.55 (measured, above)
EXACT_MIN_ROWS = 2_000  # always exact below this many matching rows
HNSW_ROWS_PER_EF = 6  # exact wins below 6 * M * ef matching rows (measured, above)
CALIBRATION_K = 10
CALIBRATION_QUERIES = 500  # rows a rebuild holds out of the index as calibration queries ...
MIN_CALIBRATION_ROWS = 5_000  # ... when it has at least this many
RECALIBRATE_GROWTH = 1.25  # an index grown by more than this since its calibration is rebuilt (and calibrated)
SWEEPS: dict[str, tuple[dict[str, Any], ...]] = {
    "hnsw": tuple({"ef": ef} for ef in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)),
    "cagra": tuple({"itopk_size": t} for t in (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)),
    "ivf_flat": tuple({"n_probes": p} for p in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)),
    "ivf_pq": tuple({"n_probes": p, "refine_ratio": r} for p in (4, 8, 16, 32, 64, 128, 256) for r in (1.0, 2.0, 4.0)),
}
FILTER_CACHE_ENTRIES = 16
FILTER_CACHE_VECTOR_BYTES = 64 << 20  # a filter's gathered rows are kept for exact plans up to this size
PLANS_PER_FILTER = 8  # plans remembered per cached filter (distinct k, parameters, recall targets)


@dataclass(frozen=True)
class Plan:
    kind: str  # "ann" (the index), "ann-filtered" (the index with the filter as a bitmap), "exact"
    index_type: str | None
    params: dict[str, Any]
    matched: int | None = None  # rows the filter keeps (None: no filter)
    live: int | None = None  # rows it chose from
    selectivity: float | None = None
    recall_target: float | None = None
    calibrated_recall: float | None = None
    why: str | None = None

    @classmethod
    def unfiltered(cls, index_type: str | None, params: dict[str, Any]) -> "Plan":
        exact = index_type in (None, "brute_force")
        return cls("exact" if exact else "ann", index_type, {} if exact else dict(params))

    def report(self) -> dict[str, Any] | None:
        """What the response says about the plan; None for a plain search."""
        if self.matched is None and self.recall_target is None:
            return None
        out: dict[str, Any] = {"plan": self.kind, "params": self.params}
        if self.matched is not None:
            out.update(matched_rows=self.matched, live_rows=self.live, selectivity=round(self.selectivity or 0.0, 6))
        if self.recall_target is not None:
            out.update(recall_target=self.recall_target, calibrated_recall=self.calibrated_recall)
        if self.why:
            out["why"] = self.why
        return out


def filtered(plan: Plan, matched: int, live: int, k: int, build: dict[str, Any]) -> Plan:
    """Exact over the matching rows, or the index with the filter and its effort raised. `build`: the index's
    build parameters."""
    selectivity = matched / live if live else 0.0
    # Plan(...) rather than dataclasses.replace, which costs microseconds a call: every filtered search plans.
    kind, params, why = "ann-filtered", plan.params, plan.why
    if plan.kind == "exact" or matched == 0:
        kind, params = "exact", {}
    # Below EXACT_MIN_ROWS exact whatever the index would touch: its effort need not be worked out.
    elif matched <= EXACT_MIN_ROWS or matched <= ann_rows(params := raise_effort(plan.params, selectivity, k),
                                                          build, live):
        kind, params, why = "exact", {}, f"{matched} matching rows: fewer than an ANN search would touch"
    return Plan(kind, plan.index_type, params, matched, live, selectivity, plan.recall_target,
                plan.calibrated_recall, why)


def raise_effort(params: dict[str, Any], selectivity: float, k: int) -> dict[str, Any]:
    factor = max(selectivity, 1e-9) ** -EFFORT_EXPONENT
    out = dict(params)
    for name in ("ef", "itopk_size"):
        if name in out:
            out[name] = int(min(LIMITS[name][1], max(k, math.ceil(out[name] * factor))))
    if "n_probes" in out:
        out["n_probes"] = int(min(LIMITS["n_probes"][1], math.ceil(out["n_probes"] / max(selectivity, 1e-9))))
    return out


def ann_rows(params: dict[str, Any], build: dict[str, Any], live: int) -> float:
    """About how many rows' worth of distance work an ANN search with `params` costs, for an index built with
    `build` (HNSW's m, or CAGRA's graph degree as its CPU twin halves it; IVF's list count)."""
    if "ef" in params or "itopk_size" in params:
        m = build.get("m") or build.get("graph_degree", 64) // 2
        return HNSW_ROWS_PER_EF * m * params.get("ef", params.get("itopk_size"))
    if "n_probes" in params:
        n_lists = build.get("n_lists") or default_n_lists(live)
        return min(live, params["n_probes"] * live / n_lists)
    return 0.0


# -- calibration ---------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """recall@k of one index over its parameter sweep, measured on a held-out sample of stored vectors."""

    index_type: str
    rows: int
    k: int
    queries: int
    points: list[dict[str, Any]]  # {"params", "recall", "latency_us"}, in sweep order
    seconds: float = 0.0
    at: float = field(default_factory=time.time)

    def report(self) -> dict[str, Any]:
        return asdict(self)

    def cheapest(self, target: float) -> dict[str, Any] | None:
        """The fastest measured setting whose recall reaches the target."""
        good = [p for p in self.points if p["recall"] >= target]
        return min(good, key=lambda p: p["latency_us"]) if good else None


def targeted(plan: Plan, calibration: Calibration | None, target: float, k: int) -> Plan:
    plan = replace(plan, recall_target=target)
    if plan.kind == "exact":
        return replace(plan, calibrated_recall=1.0)
    if calibration is None or calibration.index_type != plan.index_type:
        return replace(plan, kind="exact", params={}, calibrated_recall=1.0,
                       why="the index is not calibrated yet: exact search")
    point = calibration.cheapest(target)
    if point is None:
        return replace(plan, kind="exact", params={}, calibrated_recall=1.0,
                       why=f"no calibrated setting reaches recall {target}: exact search")
    params = {**plan.params, **point["params"]}
    scale = max(1.0, k / calibration.k)  # a deeper k needs a proportionally deeper graph search
    for name in ("ef", "itopk_size"):
        if name in params:
            params[name] = int(min(LIMITS[name][1], math.ceil(params[name] * scale)))
    return replace(plan, params=params, calibrated_recall=point["recall"])


def calibrate(index_type: str, truth: np.ndarray, search: Callable[[dict[str, Any]], np.ndarray],
              rows: int) -> Calibration | None:
    """recall@k of `search(params)` (row numbers, -1 padded) against `truth` over the sweep for `index_type`,
    each query's hits over its true neighbours; stops once recall passes 0.999 (further settings only cost)."""
    sweep = SWEEPS.get(index_type)
    if sweep is None or len(truth) == 0:
        return None
    started = time.perf_counter()
    k = truth.shape[1]
    possible = int((truth >= 0).sum())
    points = []
    for params in sweep:
        begun = time.perf_counter()
        got = search(params)
        took = (time.perf_counter() - begun) / len(truth)
        hits = sum(len(set(g[g >= 0].tolist()) & set(t[t >= 0].tolist())) for g, t in zip(got, truth))
        recall = round(hits / possible, 4) if possible else 1.0
        points.append({"params": params, "recall": recall, "latency_us": round(took * 1e6, 1)})
        if recall >= 0.999:
            break
    return Calibration(index_type, rows, k, len(truth), points, round(time.perf_counter() - started, 2))


# -- filters -------------------------------------------------------------------------------------------------
@dataclass
class FilterRows:
    mask: np.ndarray  # over rows 0..n_rows-1, dead rows False
    count: int
    _rows: np.ndarray | None = None
    _vectors: np.ndarray | None = None
    _ids: np.ndarray | None = None
    _plans: dict[tuple, tuple[Plan, dict[str, Any] | None]] = field(default_factory=dict)

    def plan(self, key: tuple, make: Callable[[], Plan]) -> tuple[Plan, dict[str, Any] | None]:
        """The plan of a search over these rows and its report, made once per `key`, which must hold everything
        else the plan depends on (k, parameters, recall target, the index and its calibration): the rows are those
        of one state of the collection, so a filter used by many searches in a row is planned once."""
        found = self._plans.get(key)
        if found is None:
            if len(self._plans) >= PLANS_PER_FILTER:
                self._plans.clear()
            plan = make()
            found = self._plans[key] = (plan, plan.report())
        return found

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = np.flatnonzero(self.mask)
        return self._rows

    def vectors(self, all_vectors: np.ndarray) -> np.ndarray:
        """The matching rows' vectors, gathered once (kept while small enough)."""
        if self._vectors is not None:
            return self._vectors
        gathered = all_vectors[self.rows]
        if gathered.nbytes <= FILTER_CACHE_VECTOR_BYTES:
            self._vectors = gathered
        return gathered

    def ids(self, all_ids: np.ndarray) -> np.ndarray:
        """The matching rows' ids, gathered once."""
        if self._ids is None:
            self._ids = all_ids[self.rows]
        return self._ids


class FilterCache:
    """The rows of recently used filters, valid while the collection does not change (the key holds its
    watermark and layout): a filter used by many searches in a row is evaluated once."""

    def __init__(self, entries: int = FILTER_CACHE_ENTRIES) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple, FilterRows] = OrderedDict()
        self._lock = threading.Lock()
        self._last: tuple[Node, tuple, FilterRows] | None = None  # the last filter asked for, its key and rows
        self.hits = self.misses = 0

    def clear(self) -> None:
        """Forget every filter's rows and plans."""
        with self._lock:
            self._items.clear()
            self._last = None

    def rows(self, where: Node, key: tuple, evaluate: Callable[[Node], np.ndarray]) -> FilterRows:
        last = self._last  # the same tree (parsed filters are shared) over the same state: no lock, no lookup
        if last is not None and last[0] is where and last[1] == key:
            self.hits += 1
            return last[2]
        found = self._rows(where, key, evaluate)
        self._last = (where, key, found)
        return found

    def _rows(self, where: Node, key: tuple, evaluate: Callable[[Node], np.ndarray]) -> FilterRows:
        full = (filter_key(where), key)
        with self._lock:
            found = self._items.get(full)
            if found is not None:
                self._items.move_to_end(full)
                self.hits += 1
                return found
        mask = evaluate(where)
        found = FilterRows(mask, int(np.count_nonzero(mask)))
        with self._lock:
            self.misses += 1
            self._items[full] = found
            while len(self._items) > self.entries:
                self._items.popitem(last=False)
        return found
