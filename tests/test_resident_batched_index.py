"""resident.py with an index like cuVS's: adds that are costly per call (batched), and deletes the index keeps
itself (a resident bitset). A NumPy stand-in with those two traits, answers checked against exact search."""

from __future__ import annotations

import numpy as np

from indexes.ann import IndexConfig
from indexes.distance import exact_search
from indexes.resident import DIRECT_ADD_ROWS, ResidentCollection

DIM = 8


class BatchedIndex:
    """Exact search over its rows; add costs a whole copy (as CAGRA's extend), so it asks for batches; it keeps
    its own dead rows (as CuvsIndex's resident bitset)."""

    supports_add = True
    supports_filter = True
    add_batch_rows = 10

    def __init__(self, config: IndexConfig, vectors: np.ndarray) -> None:
        self.config, self.vectors = config, np.array(vectors)
        self.alive = np.ones(len(vectors), dtype=bool)
        self.adds: list[int] = []
        self.keeps_given: list[bool] = []

    @property
    def size(self) -> int:
        return len(self.vectors)

    def add(self, vectors: np.ndarray) -> None:
        self.adds.append(len(vectors))
        self.vectors = np.concatenate([self.vectors, vectors])
        self.alive = np.concatenate([self.alive, np.ones(len(vectors), dtype=bool)])

    def mark_dead(self, rows: np.ndarray) -> None:
        self.alive[rows[rows < self.size]] = False

    def search(self, q, k, params, keep):
        self.keeps_given.append(keep is not None)
        mask = self.alive if keep is None else keep & self.alive
        return exact_search(np, self.vectors, q, k, "l2", mask)

    def to_bytes(self) -> bytes:
        return self.vectors.astype(np.float32).tobytes()


class Backend:
    name, kind = "batched", "gpu"

    def build(self, config, vectors):
        return BatchedIndex(config, vectors)

    def load(self, config, data):
        return BatchedIndex(config, np.frombuffer(data, np.float32).reshape(-1, DIM))


def check_exact(r: ResidentCollection, oracle: dict[int, np.ndarray], queries: np.ndarray) -> None:
    ids = np.array(sorted(oracle))
    data = np.stack([oracle[i] for i in ids.tolist()])
    _, rows = exact_search(np, data, queries, 5, "l2")
    got = r.search(queries, 5, {})
    assert got.ids == ids[rows].tolist()


def test_small_writes_join_in_batches_and_deletes_stay_with_the_index():
    rng = np.random.default_rng(3)
    r = ResidentCollection("c", DIM, "l2", "brute_force", {}, Backend())
    oracle = {i: rng.normal(size=DIM).astype(np.float32) for i in range(100)}
    r.upsert(np.arange(100), np.stack(list(oracle.values())), 1)
    r.rebuild()
    index = r.index
    queries = rng.normal(size=(6, DIM)).astype(np.float32)
    seq = 2
    for i in range(100, 125):  # one row at a time: joins the index ten at a time
        oracle[i] = rng.normal(size=DIM).astype(np.float32)
        r.upsert(np.array([i]), oracle[i][None], seq)
        seq += 1
        check_exact(r, oracle, queries)
    assert index.adds == [10, 10] and (r.indexed_rows, r.delta_rows) == (120, 5)

    big = {i: rng.normal(size=DIM).astype(np.float32) for i in range(200, 200 + DIRECT_ADD_ROWS + 1)}
    r.upsert(np.array(list(big)), np.stack(list(big.values())), seq)  # too large for the ack path: waits
    oracle.update(big)
    assert index.adds == [10, 10] and r.delta_rows == 5 + len(big)

    dead = [3, 50, 110, 121, 200]  # in the index, in the delta
    r.delete(np.array(dead), seq + 1)
    for i in dead:
        del oracle[i]
    index.keeps_given.clear()
    check_exact(r, oracle, queries)
    assert index.keeps_given == [False]  # the index applied its own record of the dead rows
    assert not index.alive[[3, 50, 110]].any() and index.alive[[4, 111]].all()

    state = r.state()  # a restored index learns the dead rows it holds
    restored = ResidentCollection("c", DIM, "l2", "brute_force", {}, Backend())
    restored.restore(state)
    assert not restored.index.alive[[3, 50, 110]].any()
    check_exact(restored, oracle, queries)
