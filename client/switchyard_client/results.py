"""What the client's calls return: numpy arrays with the answer's metadata beside them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SearchResult:
    """Neighbours of one query (1-D `ids` and `distances`) or of a batch (2-D, a row per query). A row with fewer
    than k neighbours (a filter that keeps few points) is padded with id -1 and distance inf, as FAISS does."""

    ids: np.ndarray  # int64
    distances: np.ndarray  # float32
    engine: str
    took_ms: float
    fallback: str | None
    consistency: str
    watermark: int | None  # the change seq the answering replica had applied (None from pgvector)
    plan: dict[str, Any] | None = None


@dataclass(frozen=True)
class WriteResult:
    """An acknowledged (committed) write; `seq` is its change seq."""

    seq: int | None
    upserted: int | None = None
    deleted: int | None = None


@dataclass(frozen=True)
class Pairs:
    """A spatial join's pairs: `left` and `right` ids (points and polygons for point-in-polygon), and for a
    distance join `distances_m`. `next_cursor`: where the join goes on when `max_pages` stopped it before its
    last page (pass it back as `cursor=`), else None."""

    left: np.ndarray
    right: np.ndarray
    distances_m: np.ndarray | None
    engine: str
    next_cursor: str | None = None


class Counts(tuple[np.ndarray, np.ndarray]):
    """Points per polygon: unpacks as `(polygon_ids, counts)`, int64 arrays; `engine` names the engine that
    answered."""

    engine: str

    def __new__(cls, polygon_ids: np.ndarray, counts: np.ndarray, engine: str) -> "Counts":
        self = super().__new__(cls, (polygon_ids, counts))
        self.engine = engine
        return self

    @property
    def polygon_ids(self) -> np.ndarray:
        return self[0]

    @property
    def counts(self) -> np.ndarray:
        return self[1]


def neighbours(answer: dict[str, Any], batch: bool, k: int) -> SearchResult:
    """A search's JSON answer as arrays of k columns, rows the answer left short padded with -1 and inf."""
    rows = answer["ids"] if batch else [answer["ids"]]
    row_distances = answer["distances"] if batch else [answer["distances"]]
    id_array = np.full((len(rows), k), -1, dtype=np.int64)
    distance_array = np.full((len(rows), k), np.inf, dtype=np.float32)
    for i, (ids, distances) in enumerate(zip(rows, row_distances)):
        id_array[i, :len(ids)] = ids
        distance_array[i, :len(distances)] = distances
    if not batch:
        id_array, distance_array = id_array[0], distance_array[0]
    return SearchResult(id_array, distance_array, answer["engine"], answer["took_ms"], answer.get("fallback"),
                        answer["consistency"], answer.get("watermark"), answer.get("plan"))


def write_result(answer: dict[str, Any]) -> WriteResult:
    return WriteResult(answer.get("seq"), answer.get("upserted"), answer.get("deleted"))
