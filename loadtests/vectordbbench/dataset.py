"""Data sets for VectorDBBench's custom-dataset cases: a seeded clustered mixture, .npy files, exact ground truth,
and the Parquet layout VectorDBBench reads from a folder (no VectorDBBench import here).

The layout (vectordb_bench/backend/dataset.py, CustomDataset): `train.parquet` (id int64 = row number, emb),
`test.parquet` (id, emb), `neighbors.parquet` (id of the query, neighbors_id: train ids, closest first, at least
k of them); for label filters `scalar_labels.parquet` (id, labels: one label per train row, in id order) and per
label percentage p a `neighbors_labels_label_{p}.parquet` over the rows labelled with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

METRICS = ("l2", "cosine", "ip")  # VectorDBBench's custom-dataset metric names (L2, COSINE, IP)
REST_LABEL = "label_rest"  # the label of rows outside every requested percentage


def label_value(percentage: float) -> str:
    """VectorDBBench's LabelFilter.label_value for a label percentage (0.02 -> 'label_2p', 0.001 -> 'label_0.1p')."""
    p = percentage * 100
    return f"label_{int(p)}p" if p >= 1 else f"label_{p:.1f}p"


def label_gt_file(percentage: float) -> str:
    return f"neighbors_labels_{label_value(percentage)}.parquet"  # LabelFilter.groundtruth_file, label_field 'labels'


@dataclass
class CustomDataset:
    """What VectorDBBench's custom case needs to know about a folder in the layout above."""

    dir: str
    size: int
    dim: int
    metric: str
    queries: int
    label_percentages: list[float] = field(default_factory=list)
    train_files: list[str] = field(default_factory=lambda: ["train"])

    def to_dict(self) -> dict:
        return asdict(self)


# -- making vectors ------------------------------------------------------------------------------------------
def synthetic(n: int, dim: int, queries: int, seed: int = 0,
              clusters: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A Gaussian mixture (one cluster per 1,000 points by default): train rows and fresh queries from the same
    mixture. Clusters overlap enough that HNSW at a modest ef misses some true neighbours."""
    rng = np.random.default_rng(seed)
    clusters = clusters or max(8, n // 1000)
    centres = rng.normal(0.0, 1.0, (clusters, dim)).astype(np.float32)
    spread = rng.uniform(0.35, 0.7, clusters).astype(np.float32)

    def draw(count: int) -> np.ndarray:
        which = rng.integers(0, clusters, count)
        return centres[which] + rng.normal(0.0, 1.0, (count, dim)).astype(np.float32) * spread[which, None]

    return draw(n), draw(queries)


def load_npy(paths: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """train.npy, test.npy and optionally neighbors.npy (train row numbers, closest first)."""
    if len(paths) not in (2, 3):
        raise ValueError("give train.npy,test.npy[,neighbors.npy]")
    train = np.load(paths[0]).astype(np.float32, copy=False)
    test = np.load(paths[1]).astype(np.float32, copy=False)
    if train.ndim != 2 or test.ndim != 2 or train.shape[1] != test.shape[1]:
        raise ValueError(f"train {train.shape} and test {test.shape} must be 2-D with the same dimension")
    neighbors = np.load(paths[2]).astype(np.int64, copy=False) if len(paths) == 3 else None
    if neighbors is not None and (neighbors.shape[0] != len(test) or neighbors.min() < 0
                                  or neighbors.max() >= len(train)):
        raise ValueError(f"neighbors {neighbors.shape} must have a row per query of train row numbers")
    return train, test, neighbors


# -- ground truth --------------------------------------------------------------------------------------------
def ground_truth(train: np.ndarray, test: np.ndarray, k: int, metric: str, rows: np.ndarray | None = None,
                 chunk: int = 256) -> np.ndarray:
    """Exact k nearest train ids per query (brute force, float64), closest first, ties by id; only among `rows`
    when given."""
    ids = np.arange(len(train)) if rows is None else np.sort(rows)
    if len(ids) < k:
        raise ValueError(f"only {len(ids)} candidate rows for k={k}")
    base = train[ids].astype(np.float64)
    queries = test.astype(np.float64)
    if metric == "cosine":
        base = base / np.maximum(np.linalg.norm(base, axis=1, keepdims=True), 1e-30)
        queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-30)
    sq = (base ** 2).sum(axis=1) if metric == "l2" else None
    out = np.empty((len(queries), k), np.int64)
    for start in range(0, len(queries), chunk):
        dots = queries[start:start + chunk] @ base.T
        scores = sq[None, :] - 2 * dots if metric == "l2" else -dots  # smaller is closer; |q|^2 is constant per row
        top = np.argpartition(scores, k - 1, axis=1)[:, :k]
        for i, cand in enumerate(top):
            order = np.lexsort((cand, scores[i, cand]))
            out[start + i] = ids[cand[order]]
    return out


# -- labels --------------------------------------------------------------------------------------------------
def make_labels(n: int, percentages: list[float], seed: int = 0) -> np.ndarray:
    """One label per row: for each percentage p a disjoint random share p of the rows gets label_value(p), the
    rest REST_LABEL (VectorDBBench's label filter then selects about p of the data)."""
    if sum(percentages) > 1:
        raise ValueError(f"label percentages {percentages} add up to more than 1")
    labels = np.full(n, REST_LABEL, dtype=object)
    order = np.random.default_rng(seed + 1).permutation(n)
    start = 0
    for p in percentages:
        count = round(p * n)
        labels[order[start:start + count]] = label_value(p)
        start += count
    return labels


# -- the Parquet layout --------------------------------------------------------------------------------------
def _vectors(matrix: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(matrix.astype(np.float32).ravel()), matrix.shape[1]).cast(
        pa.list_(pa.float32()))


def _neighbors_table(ids: np.ndarray) -> pa.Table:
    return pa.table({"id": pa.array(np.arange(len(ids)), pa.int64()),
                     "neighbors_id": pa.array(list(ids), pa.list_(pa.int64()))})


def write_custom_dataset(out: Path, train: np.ndarray, test: np.ndarray, metric: str, k: int,
                         neighbors: np.ndarray | None = None, label_percentages: list[float] | None = None,
                         seed: int = 0) -> CustomDataset:
    """Writes the folder VectorDBBench's custom case reads; ground truth is computed here when not given."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}")
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array(np.arange(len(train)), pa.int64()), "emb": _vectors(train)}),
                   out / "train.parquet", row_group_size=10_000)
    pq.write_table(pa.table({"id": pa.array(np.arange(len(test)), pa.int64()), "emb": _vectors(test)}),
                   out / "test.parquet")
    if neighbors is None:
        neighbors = ground_truth(train, test, k, metric)
    elif neighbors.shape[1] < k:
        raise ValueError(f"neighbors.npy has {neighbors.shape[1]} neighbours per query, k is {k}")
    pq.write_table(_neighbors_table(neighbors), out / "neighbors.parquet")
    percentages = list(label_percentages or [])
    if percentages:
        labels = make_labels(len(train), percentages, seed)
        pq.write_table(pa.table({"id": pa.array(np.arange(len(train)), pa.int64()),
                                 "labels": pa.array(labels.tolist(), pa.string())}), out / "scalar_labels.parquet")
        for p in percentages:
            rows = np.flatnonzero(labels == label_value(p))
            pq.write_table(_neighbors_table(ground_truth(train, test, k, metric, rows)), out / label_gt_file(p))
    return CustomDataset(dir=str(out.resolve()), size=len(train), dim=train.shape[1], metric=metric,
                         queries=len(test), label_percentages=percentages)


def describe_parquet_dir(folder: Path, metric: str, label_percentages: list[float] | None = None) -> CustomDataset:
    """A folder already in the layout: its size and dimension from the files, and a check that the files the
    requested cases read are there."""
    folder = folder.resolve()
    train_files = sorted(p.stem for p in folder.glob("train*.parquet")) or sorted(
        p.stem for p in folder.glob("shuffle_train*.parquet"))
    needed = ["test.parquet", "neighbors.parquet"]
    percentages = list(label_percentages or [])
    if percentages:
        needed += ["scalar_labels.parquet", *(label_gt_file(p) for p in percentages)]
    missing = [name for name in needed if not (folder / name).exists()]
    if not train_files or missing:
        raise ValueError(f"{folder} is not a custom-dataset folder: missing {missing or ['train.parquet']}")
    size = sum(pq.ParquetFile(folder / f"{name}.parquet").metadata.num_rows for name in train_files)
    first = pq.ParquetFile(folder / f"{train_files[0]}.parquet").read_row_group(0, columns=["emb"])
    dim = len(first.column("emb")[0])
    queries = pq.ParquetFile(folder / "test.parquet").metadata.num_rows
    return CustomDataset(dir=str(folder), size=size, dim=dim, metric=metric, queries=queries,
                         label_percentages=percentages, train_files=train_files)
