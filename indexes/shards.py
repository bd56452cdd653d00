"""Splitting a collection into shards by id, and merging the shards' answers back into one.

Engine-neutral and free of any distribution library: a scale-out layer (service/cluster) places the shards and
calls these; the single-process service never does.

A shard keeps the rows whose id hashes to it. Every shard replays the whole change log (one read per catch-up) and
keeps its own rows, so its watermark is the collection's seq like any replica's, and a search sent to one replica
of every shard sees the collection as of the lowest of their watermarks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .payloads import parsed
from .resident import Changes, SearchResult

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """The shard of each id: splitmix64's finaliser of the id, modulo the shard count. Stable across processes,
    machines and numpy versions (integer arithmetic only), and spreads consecutive ids evenly."""
    with np.errstate(over="ignore"):
        z = np.asarray(ids, dtype=np.int64).astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(shards)).astype(np.int64)


@dataclass(frozen=True)
class Shard:
    index: int  # 0 .. count - 1
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count} does not exist")

    def owns(self, ids: np.ndarray) -> np.ndarray:
        """A mask over `ids`: those this shard keeps."""
        return shard_of(ids, self.count) == self.index

    def take(self, changes: Changes) -> Changes:
        """The part of a change-log read this shard keeps: its own ids, with the same seq range and commits."""
        if self.count == 1:
            return changes
        mine = self.owns(changes.ids)
        payloads = parsed(changes.payloads, len(changes.ids))
        return replace(changes, deleted=changes.deleted[self.owns(changes.deleted)], ids=changes.ids[mine],
                       vectors=changes.vectors[mine],
                       payloads=None if payloads is None else [p for p, m in zip(payloads, mine) if m])

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def merge_results(parts: list[SearchResult], k: int) -> SearchResult:
    """One answer from every shard's answer to the same queries: the k smallest distances of their union (response
    distances are smaller-is-closer for every metric), ties broken by id so the order does not depend on which
    shard answered first. The watermark is the lowest: every shard is at least that fresh."""
    if not parts:
        raise ValueError("no shard answered")
    if len(parts) == 1:
        return parts[0]
    ids: list[list[int]] = []
    distances: list[list[float]] = []
    for q in range(len(parts[0].ids)):
        pairs = sorted((d, i) for p in parts for i, d in zip(p.ids[q], p.distances[q]))
        ids.append([i for _, i in pairs[:k]])
        distances.append([d for d, _ in pairs[:k]])
    watermarks = [p.watermark for p in parts if p.watermark is not None]
    return SearchResult(ids, distances, min(watermarks) if watermarks else None, merge_plans([p.plan for p in parts]))


def merge_plans(plans: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The plans the shards ran, summed up: matching and total rows add, the selectivity follows from them, and
    each shard's own plan is listed (shards of different sizes may choose differently)."""
    given = [p for p in plans if p]
    if not given:
        return None
    out: dict[str, Any] = {"shards": given}
    kinds = {p.get("plan") for p in given}
    if len(kinds) == 1:
        out["plan"] = kinds.pop()
    if all("matched_rows" in p and "live_rows" in p for p in given):
        matched = sum(p["matched_rows"] for p in given)
        live = sum(p["live_rows"] for p in given)
        out.update(matched_rows=matched, live_rows=live, selectivity=round(matched / live, 6) if live else 0.0)
    return out
