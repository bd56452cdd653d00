"""A collection resident in memory: its vectors, the id <-> row mapping, deletes, and an ANN index.

Engine-neutral (FAISS and cuVS: anything with the AnnIndex protocol). Rows 0..index.size-1 are in the ANN index,
later rows (the delta) are searched exactly and merged; deletes and replaced ids are tombstones searches never
return, compacted away by a rebuild. Changes come only from PostgreSQL's change log (`apply`), in one step, so a
replica is always PostgreSQL's state at some seq; `digest` follows every change. Within one `generation` rows are
only appended, so a reader may take the arrays and the row count under the lock and copy rows below it after.
Searches are in resident_search.py (ResidentSearch, a base of ResidentCollection).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from . import digest, planner
from .ann import AnnIndex, IndexConfig, min_train_rows, resolve_type
from .distance import exact_search, prepare
from .payloads import PayloadIndex, parsed
from .resident_search import ResidentSearch
from .resident_search import SearchResult as SearchResult  # re-exported: its users import it from here
from .rwlock import ReadWriteLock

# A write of up to this many rows goes straight into an index that can add (HNSW): cheap, and under the write
# lock. Larger ones wait in the delta (searched exactly) for a background rebuild: HNSW adds of 5,000 768-d rows
# took a second each, in the acknowledgement path and blocking searches (a 100k x 768 load of 5,000-row upserts
# spent 76% of its time there).
DIRECT_ADD_ROWS = 64
# A rebuild that adds to a copy of the index (_extend) adds, outside the lock, the rows written while it added, in
# at most EXTEND_PASSES passes, until fewer than EXTEND_MORE_ROWS came: what is left joins under the write lock at the
# swap. Before, a 100,000 x 768 load's rows written during one pass (65,000) joined there, holding writes and
# searches for seconds, and left the calibration made at 35,000 rows stale, so another full rebuild followed.
EXTEND_PASSES = 8
EXTEND_MORE_ROWS = 256


@dataclass
class PendingBuild:
    """A rebuild between its halves (ResidentCollection.plan_build, install): the rows it covers, in the order the
    index numbers them, and the bytes of an index built over the first `n_indexed` elsewhere, if it was."""

    generation: int
    snapshot_rows: int  # rows of the layout then; rows after it were written during the build
    rows: np.ndarray  # row numbers of that layout
    n_indexed: int  # 0: too few rows for an index of this type
    config: IndexConfig
    ids: np.ndarray
    vectors: np.ndarray
    hashes: np.ndarray
    data: bytes | None = None


class IndexBackend(Protocol):
    """Builds and restores one engine's indexes (FAISS on CPU, cuVS on GPU)."""

    name: str
    kind: str

    def build(self, config: IndexConfig, vectors: np.ndarray) -> AnnIndex: ...

    def load(self, config: IndexConfig, data: bytes) -> AnnIndex: ...


@dataclass
class Changes:
    """A collection's changes after seq `since` up to `head`, as one consistent read of the change log:
    the ids deleted, and the current rows of the ids written, in that range."""

    since: int
    head: int
    deleted: np.ndarray
    ids: np.ndarray
    vectors: np.ndarray
    commits: list[tuple[int, float]] = field(default_factory=list)  # (seq, commit time as epoch seconds)
    # Per written id, in order: a list (JSON text, a dict or None each) or one JSON array; None: none has one.
    payloads: list[Any] | str | None = None

    @property
    def rows(self) -> int:
        return len(self.deleted) + len(self.ids)


@dataclass(frozen=True)
class RebuildPolicy:
    """When a background rebuild is worth its cost."""

    dead_fraction: float = 0.2  # dead rows over live rows
    delta_rows: int = 10_000  # rows outside the ANN index (searched exactly), at least ...
    delta_fraction: float = 0.1  # ... and at least this share of the live rows


class RebuildConflict(RuntimeError):
    """The layout changed while a rebuild ran (another compaction or a restore): its result is dropped."""


class ResidentCollection(ResidentSearch):
    def __init__(self, name: str, dim: int, metric: str, index_type: str, build_params: dict[str, Any],
                 backend: IndexBackend, policy: RebuildPolicy | None = None) -> None:
        self.name, self.dim, self.metric = name, dim, metric
        self.index_type = index_type  # as configured: may be "auto"
        self.build_params = build_params
        self.backend = backend
        self.policy = policy or RebuildPolicy()
        self.lock = ReadWriteLock()  # searches share it; changes and swaps take it alone
        self._ids = np.empty(0, dtype=np.int64)
        self._vectors = np.empty((0, dim), dtype=np.float32)
        self._alive = np.empty(0, dtype=bool)
        self._hashes = np.empty(0, dtype=np.uint64)
        self.n_rows = 0
        self.n_dead = 0
        self.row_of: dict[int, int] = {}
        self.payloads = PayloadIndex()  # row for row with the vectors
        self.filters = planner.FilterCache()
        self.calibration: planner.Calibration | None = None  # of the current index (None: not calibrated yet)
        self.held_out: tuple[int, int] | None = None  # rows the last rebuild left out of the index, to calibrate
        self.index: AnnIndex | None = None
        self.plan_epoch = 0  # moves with the index and its calibration, which remembered plans depend on
        self.watermark = 0
        self.digest = 0
        self.generation = 0
        self.rebuilds = 0  # completed rebuilds ...
        self.carried_over = 0  # ... and the rows written or deleted while they ran, carried over at their swaps
        self.adopted = 0  # snapshots of another process's rebuild taken instead of a rebuild here (adopt)

    # -- state -----------------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return self.n_rows - self.n_dead

    @property
    def indexed_rows(self) -> int:
        return self.index.size if self.index is not None else 0

    @property
    def delta_rows(self) -> int:
        return self.n_rows - self.indexed_rows

    def _grow(self, extra: int) -> None:
        need = self.n_rows + extra
        if need <= len(self._ids):
            return
        capacity = max(need, int(len(self._ids) * 1.5), 1024)
        for attr, shape in (("_ids", (capacity,)), ("_vectors", (capacity, self.dim)), ("_alive", (capacity,)),
                            ("_hashes", (capacity,))):
            old = getattr(self, attr)
            new = np.zeros(shape, dtype=old.dtype)
            new[: self.n_rows] = old[: self.n_rows]
            setattr(self, attr, new)

    def _kill(self, ids: np.ndarray) -> None:
        killed = []
        for i in ids.tolist():
            row = self.row_of.pop(i, None)
            if row is not None:
                self._alive[row] = False
                self.n_dead += 1
                self.digest = digest.sub(self.digest, int(self._hashes[row]))
                killed.append(row)
        mark_dead = self._dead_row_marker()
        if killed and mark_dead is not None:
            mark_dead(np.asarray(killed, dtype=np.int64))

    def _dead_row_marker(self) -> Callable[[np.ndarray], None] | None:
        """The index's mark_dead when it keeps its own record of dead rows (a resident device bitset), so searches
        need not pass one; else None."""
        return getattr(self.index, "mark_dead", None)

    def _swap_index(self, index: AnnIndex | None) -> None:
        """Install a built or restored index over the current rows, telling it which of its rows are dead."""
        self.index = index
        self.plan_epoch += 1
        mark_dead = self._dead_row_marker()
        if index is not None and mark_dead is not None:
            dead = np.flatnonzero(~self._alive[: index.size])
            if len(dead):
                mark_dead(dead)

    def _append(self, ids: np.ndarray, prepared: np.ndarray, hashes: np.ndarray, payloads: list[Any] | None) -> None:
        """New rows for ids (the old row of a replaced id becomes dead). Allocates before it changes anything."""
        self._grow(len(ids))
        self.payloads.append(payloads, len(ids))  # rows n_rows.. of the payload index: no search sees them yet
        self._kill(ids)
        start, end = self.n_rows, self.n_rows + len(ids)
        self._ids[start:end] = ids
        self._vectors[start:end] = prepared
        self._alive[start:end] = True
        self._hashes[start:end] = hashes
        self.row_of.update(zip(ids.tolist(), range(start, end)))
        self.n_rows = end
        self.digest = digest.add(self.digest, digest.total(hashes))
        self._add_delta(len(ids))

    def _add_delta(self, written: int) -> None:
        """Small writes join an index that can add. An index whose add is costly per call (CAGRA's extend copies
        the whole device dataset) sets `add_batch_rows`: small writes then gather in the delta, searched exactly,
        and join in one add once that many are there. Rows after a large write wait for a rebuild."""
        index = self.index
        if index is None or not index.supports_add or written > DIRECT_ADD_ROWS:
            return
        batch = getattr(index, "add_batch_rows", 1)
        if batch <= self.delta_rows <= batch - 1 + DIRECT_ADD_ROWS:
            index.add(self._vectors[index.size: self.n_rows])  # the index stays a full prefix of the rows

    # -- changes ---------------------------------------------------------------------------------------
    def apply(self, changes: Changes) -> bool:
        """Bring the replica from seq `changes.since` (or later) to `changes.head`: deleted ids die, written
        ids get their current vector. Returns False when the replica is already at or past `head` (applying an
        older read would bring back what a newer one removed). Applying a read that starts at or before the
        watermark is idempotent: every id it names ends in its state at `head`, and the others did not change."""
        written = self._written(changes)  # outside the lock
        with self.lock.write():
            if changes.head <= self.watermark:
                return False
            if changes.since > self.watermark:
                raise ValueError(f"changes after seq {changes.since} cannot apply to a replica at {self.watermark}")
            self._apply_locked(changes, *written)
            return True

    def _written(self, changes: Changes) -> tuple[np.ndarray, np.ndarray, list[Any] | None]:
        """The written rows' prepared vectors, hashes and payloads: the part of an apply that needs no lock."""
        prepared = prepare(np, changes.vectors, self.metric)
        return prepared, digest.row_hashes(changes.ids, prepared), parsed(changes.payloads, len(changes.ids))

    def _apply_locked(self, changes: Changes, prepared: np.ndarray, hashes: np.ndarray,
                      payloads: list[Any] | None) -> None:
        self._kill(changes.deleted)
        if len(changes.ids):
            self._append(changes.ids, prepared, hashes, payloads)
        self.watermark = changes.head

    def upsert(self, ids: np.ndarray, vectors: np.ndarray, seq: int, payloads: list[Any] | None = None) -> None:
        """Insert or replace, as the change at `seq` (tests and tools; the service applies change-log reads)."""
        self.apply(Changes(self.watermark, max(seq, self.watermark + 1), np.empty(0, np.int64), ids, vectors,
                           payloads=payloads))

    def delete(self, ids: np.ndarray, seq: int) -> None:
        self.apply(Changes(self.watermark, max(seq, self.watermark + 1), ids, np.empty(0, np.int64),
                           np.empty((0, self.dim), np.float32)))

    def content(self) -> dict[str, Any]:
        """What a replica holds, for comparing with PostgreSQL: rows, watermark, digest."""
        with self.lock.read():
            return {"rows": self.count, "watermark": self.watermark, "digest": digest.show(self.digest),
                    "rebuilds": self.rebuilds, "rebuild_carried_rows": self.carried_over, "adopted": self.adopted}

    # -- build -----------------------------------------------------------------------------------------
    def _min_rows(self, config: IndexConfig) -> int:
        """Rows an index of this config needs; a backend that trains nothing (exact_index.py) needs one."""
        return 1 if getattr(self.backend, "trains", True) is False else min_train_rows(config.index_type,
                                                                                          config.params)

    def config_for(self, n_rows: int) -> IndexConfig:
        return IndexConfig(resolve_type(self.index_type, n_rows), self.metric, self.dim, self.build_params)

    @property
    def compact(self) -> bool:
        """A rebuild would change nothing: no dead rows, and every row in an index of the type `auto` picks."""
        return (self.n_dead == 0 and self.delta_rows == 0 and self.index is not None
                and self.index.config.index_type == self.config_for(self.count).index_type
                and not self.calibration_stale)

    @property
    def calibration_stale(self) -> bool:
        """The index can be calibrated and has no calibration, or has grown by more than a quarter since (its
        recall at a given setting falls as it grows): a rebuild measures it again."""
        if self.index is None or self.index.config.index_type not in planner.SWEEPS:
            return False
        c = self.calibration
        if c is None or c.index_type != self.index.config.index_type:
            return self.count >= planner.MIN_CALIBRATION_ROWS
        return self.indexed_rows > planner.RECALIBRATE_GROWTH * (c.rows + c.queries)

    def needs_rebuild(self) -> bool:
        """Worth rebuilding: many dead rows, a large exact delta, or `auto` would now pick another type. Called on
        the event loop, so it takes no lock (it must never wait for a search): a heuristic over a few counters."""
        p = self.policy
        live = max(self.count, 1)
        config = self.config_for(self.count)
        if self.count < self._min_rows(config):
            return self.index is not None and self.n_dead > max(0.5, p.dead_fraction) * live
        if self.index is None or self.index.config.index_type != config.index_type:
            return True
        return (self.n_dead > p.dead_fraction * live or self.delta_rows > max(p.delta_rows, p.delta_fraction * live)
                or self.calibration_stale)

    def rebuild(self, progress: Callable[[str], None] | None = None, hold_out: int = 0) -> None:
        """Compact dead rows and build a fresh index over the live ones. Searches and changes go on meanwhile:
        the build runs outside the lock, and what changed during it is carried over at the swap. The caller
        runs one rebuild at a time; a layout change meanwhile (a restore) makes this one raise RebuildConflict.
        `hold_out` live rows (chosen at random) are left out of the build, in the exact delta, as calibration
        queries the index has never seen (`calibrate`); `absorb` then adds them.

        Where nothing is dead and the index is of the type a build would make, and adding rows to it gives the
        index a build would (AnnIndex.copy_for_growth: HNSW's build is a sequence of adds), the delta is added
        to a copy of the index instead: O(delta), not O(rows), so a collection filled by a stream of large
        writes is built about once in all rather than once per rebuild (a 100,000 x 768 load rebuilt 4 times)."""
        if self._extend(progress, hold_out):
            return
        self.install(self.plan_build(hold_out), progress)

    def plan_build(self, hold_out: int = 0) -> PendingBuild:
        """rebuild()'s first half: the live rows a build covers (the layout read under the lock), with `hold_out`
        of them last (left out of the index). It calls nothing of the engine's, so it may run on any thread, and so may
        building the index over `pending.vectors[:pending.n_indexed]` elsewhere (indexes/build_process.py)."""
        generation, snapshot_rows, alive, (ids_now, vectors_now, hashes_now) = self._layout()
        rows = np.flatnonzero(alive)
        config = self.config_for(len(rows))
        n_indexed = len(rows)
        if hold_out and config.index_type in planner.SWEEPS and len(rows) >= planner.MIN_CALIBRATION_ROWS:
            held = np.zeros(len(rows), dtype=bool)
            held[np.random.default_rng(len(rows)).choice(len(rows), size=hold_out, replace=False)] = True
            rows, n_indexed = np.concatenate([rows[~held], rows[held]]), len(rows) - hold_out
        builds = n_indexed >= self._min_rows(config) and n_indexed > 0
        return PendingBuild(generation, snapshot_rows, rows, n_indexed if builds else 0, config, ids_now[rows],
                            vectors_now[rows], hashes_now[rows])

    def install(self, pending: PendingBuild, progress: Callable[[str], None] | None = None) -> None:
        """rebuild()'s second half, on the engine's thread: the index built (or loaded from the bytes a build
        process made), then swapped in with what changed meanwhile carried over. A layout change since
        plan_build (a restore) raises RebuildConflict."""
        index = None
        if pending.data is not None:
            if progress:
                progress(f"loading the {pending.config.index_type} index built over {pending.n_indexed} vectors")
            index = self.backend.load(pending.config, pending.data)
            pending.data = None  # the bytes may be large: not kept while the swap waits for the lock
        elif pending.n_indexed:
            if progress:
                progress(f"building {pending.config.index_type} over {pending.n_indexed} vectors")
            index = self.backend.build(pending.config, pending.vectors[:pending.n_indexed])
        rows, snapshot_rows = pending.rows, pending.snapshot_rows
        with self.lock.write():
            # Rows are only appended within a generation, so `rows` still names the same rows: check it by id.
            if self.generation != pending.generation or not np.array_equal(self._ids[rows], pending.ids):
                raise RebuildConflict(f"collection {self.name}: the layout changed during the rebuild")
            still_alive = self._alive[rows]  # deleted or replaced during the build: dead now
            tail = slice(snapshot_rows, self.n_rows)  # written during the build
            self.rebuilds += 1
            self.carried_over += int((~still_alive).sum()) + (self.n_rows - snapshot_rows)
            ids = np.concatenate([pending.ids, self._ids[tail]])
            vectors = np.concatenate([pending.vectors, self._vectors[tail]])
            alive = np.concatenate([still_alive, self._alive[tail]])
            hashes = np.concatenate([pending.hashes, self._hashes[tail]])
            payloads = self.payloads.take(np.concatenate([rows, np.arange(snapshot_rows, self.n_rows)]))
            self._set_rows(ids, vectors, alive, hashes, payloads)
            self._swap_index(index)
            partial = index is not None and pending.n_indexed < len(rows)
            self.held_out = (pending.n_indexed, len(rows)) if partial else None
            if self.held_out is None:
                self._absorb()

    def _extend(self, progress: Callable[[str], None] | None, hold_out: int) -> bool:
        """rebuild() by adding the delta to a copy of the index, where that is the same (see rebuild); False
        where a build is due. The copy is made under the lock (writers may add to the index), the adding after
        it, again for rows written meanwhile (EXTEND_PASSES); the last `hold_out` rows of the delta stay out of the
        copy, for calibration."""
        with self.lock.read():
            index = self.index
            if (index is None or self.n_dead or self.n_rows == index.size
                    or index.config.index_type != self.config_for(self.count).index_type):
                return False
            copy = index.copy_for_growth() if hasattr(index, "copy_for_growth") else None
            if copy is None:
                return False
            generation, start = self.generation, index.size
        added = covered = start  # rows added to the copy; and those plus the ones held out of it
        for done in range(EXTEND_PASSES):
            with self.lock.read():
                if self.generation != generation:
                    raise RebuildConflict(f"collection {self.name}: the layout changed during the rebuild")
                end, vectors = self.n_rows, self._vectors  # rows below `end` stay as they are in this generation
            upto = end
            if (hold_out and copy.config.index_type in planner.SWEEPS and end - start > hold_out
                    and end - hold_out >= planner.MIN_CALIBRATION_ROWS):
                upto = end - hold_out
            if upto - added < (1 if done == 0 else EXTEND_MORE_ROWS):
                break
            if progress:
                progress(f"adding {upto - added} vectors to the {copy.config.index_type} index of {added}")
            copy.add(vectors[added:upto])
            added, covered = upto, end
        with self.lock.write():
            if self.generation != generation:
                raise RebuildConflict(f"collection {self.name}: the layout changed during the rebuild")
            self.rebuilds += 1
            self.carried_over += self.n_rows - covered
            self._swap_index(copy)
            self.held_out = (added, covered) if added < covered else None
            if self.held_out is None:
                self._absorb()
        return True

    def absorb(self) -> None:
        """Add the rows after the index (held-out calibration queries, writes since) to an index that can add."""
        with self.lock.write():
            self.held_out = None
            self._absorb()

    def _absorb(self) -> None:
        if self.index is not None and self.index.supports_add and self.n_rows > self.index.size:
            self.index.add(self._vectors[self.index.size: self.n_rows])

    def _set_rows(self, ids: np.ndarray, vectors: np.ndarray, alive: np.ndarray, hashes: np.ndarray,
                  payloads: PayloadIndex) -> None:
        """A new layout (compaction or restore): a new generation."""
        self._ids, self._vectors, self._alive, self._hashes = ids, vectors, alive, hashes
        self.payloads = payloads
        self.n_rows = len(ids)
        self.n_dead = int((~alive).sum())
        self.row_of = dict(zip(ids[alive].tolist(), np.flatnonzero(alive).tolist()))
        self.digest = digest.total(hashes[alive])
        self.generation += 1

    # -- calibration -----------------------------------------------------------------------------------
    def calibrate(self) -> planner.Calibration | None:
        """Measure the index's recall@10 over its parameter sweep (planner.calibrate), with the rows the last
        rebuild held out as queries and exact search over the indexed rows as truth; keep it with the index.
        Runs outside the lock but for each search; a swap meanwhile discards the result."""
        with self.lock.read():
            index, held = self.index, self.held_out
            if index is None or held is None or index.config.index_type not in planner.SWEEPS:
                return None
            queries = self._vectors[held[0]:held[1]].copy()
            size = index.size
            data, keep = self._vectors[:size], self._alive[:size].copy()
        k = planner.CALIBRATION_K
        truth = exact_search(np, data, queries, k, self.metric, keep)[1]  # in bounded blocks

        def search(params: dict[str, Any]) -> np.ndarray:
            with self.lock.read():
                if self.index is not index:
                    raise RebuildConflict("the index changed during calibration")
                keep_now = self.keep_mask()
                _, rows = self._search_index(queries, k, params, None if keep_now is None else keep_now[:size])
            return rows

        try:
            found = planner.calibrate(index.config.index_type, truth, search, size)
        except RebuildConflict:
            return None
        with self.lock.write():
            if self.index is index and found is not None:
                self.calibration = found
                self.plan_epoch += 1
        return found

    # -- reads of the rows -----------------------------------------------------------------------------
    def vectors_of(self, ids: np.ndarray) -> np.ndarray:
        """Prepared vectors of live ids (for recall sampling)."""
        with self.lock.read():
            return self._vectors[[self.row_of[i] for i in ids.tolist()]].copy()

    def _layout(self) -> tuple[int, int, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(generation, rows, a copy of the alive mask, the row arrays): only the mask is copied under the lock;
        rows below the count stay as they are (see the module's note), so callers copy them without it."""
        with self.lock.read():
            n = self.n_rows
            return self.generation, n, self._alive[:n].copy(), (self._ids, self._vectors, self._hashes)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, prepared vectors) of every live row."""
        _, _, alive, (ids, vectors, _) = self._layout()
        rows = np.flatnonzero(alive)
        return ids[rows], vectors[rows]

    # -- snapshots -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything a snapshot needs. The index is serialised under the lock (changes would alter it); the rows
        are copied after it."""
        with self.lock.read():
            n = self.n_rows
            alive, arrays = self._alive[:n].copy(), (self._ids, self._vectors)
            out = {"watermark": self.watermark, "digest": digest.show(self.digest),
                   "index_type": self.index.config.index_type if self.index is not None else None,
                   "index_bytes": self.index.to_bytes() if self.index is not None else None,
                   "calibration": self.calibration.report() if self.calibration is not None else None}
            payload_meta, payload_arrays = self.payloads.state()  # columns are replaced, never shrunk: copy now
            payload_arrays = {name: a.copy() for name, a in payload_arrays.items()}
        return {"ids": arrays[0][:n].copy(), "vectors": arrays[1][:n].copy(), "alive": alive,
                "payload_meta": payload_meta, "payload_arrays": payload_arrays, **out}

    def restore(self, state: dict[str, Any]) -> None:
        """Take a snapshot's state. Its content must hash to the digest it recorded, or ValueError."""
        loaded = self._checked(state)
        with self.lock.write():
            self._take(state, *loaded)

    def adopt(self, state: dict[str, Any], changes: Changes) -> bool:
        """Take a snapshot another process sharing the data directory wrote after its rebuild, brought up to date
        by `changes` (the log after the snapshot's seq): its index instead of building one here. In one step under
        the lock, so no search sees the replica go back to the snapshot's seq. False, with nothing changed, when
        the changes do not start at the snapshot or end before this replica's watermark (it moved on: read again).
        ValueError as restore() for a snapshot that does not hash to its digest."""
        if changes.since != int(state["watermark"]):
            return False
        loaded, written = self._checked(state), self._written(changes)
        with self.lock.write():
            if changes.head < self.watermark:
                return False
            self._take(state, *loaded)
            self._apply_locked(changes, *written)
            self.adopted += 1
            return True

    def _checked(self, state: dict[str, Any]) -> tuple[np.ndarray, PayloadIndex, AnnIndex | None]:
        """A snapshot's row hashes, payload index and loaded index, once its rows hash to its digest."""
        ids, vectors, alive = state["ids"], state["vectors"], state["alive"]
        hashes = digest.row_hashes(ids, vectors)
        found = digest.show(digest.total(hashes[alive]))
        if found != state["digest"]:
            raise ValueError(f"snapshot content digest {found} differs from the recorded {state['digest']}")
        payloads = PayloadIndex.restore(state["payload_meta"], state["payload_arrays"])
        if payloads.rows != len(ids):
            raise ValueError(f"snapshot payload index has {payloads.rows} rows for {len(ids)} vectors")
        index = None
        if state["index_type"] is not None:
            config = IndexConfig(state["index_type"], self.metric, self.dim, self.build_params)
            index = self.backend.load(config, state["index_bytes"])
        return hashes, payloads, index

    def _take(self, state: dict[str, Any], hashes: np.ndarray, payloads: PayloadIndex,
              index: AnnIndex | None) -> None:
        """A checked snapshot's rows, index and calibration, as the replica at its seq (under the write lock)."""
        calibration = state.get("calibration")
        self._set_rows(state["ids"], state["vectors"], state["alive"], hashes, payloads)
        self._swap_index(index)
        self.held_out = None
        self.calibration = planner.Calibration(**calibration) if calibration else None
        self.plan_epoch += 1
        self.watermark = int(state["watermark"])

