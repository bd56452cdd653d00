"""The vector domain's facade: collections in Postgres, their resident replicas, routing between engines.

Write path: validate -> Postgres transaction (serialised per collection; it takes the change seqs and records
the commit) -> this process's replica applies the commit (indexes/replica.py) -> ack with the seq.
Every process follows the change log (indexes/follower.py: LISTEN/NOTIFY plus a poll), so each resident replica
is PostgreSQL's state at its watermark, whichever process took the write.
Read path: the consistency level asked for is reached (or `auto` falls back to pgvector) -> pick an engine
(gpu -> cpu -> pgvector for `auto`) -> search -> the response says which engine served, at which watermark,
and why it fell back, if it did.
Start-up: each collection's snapshot is validated (content digest, its commit still in PostgreSQL's log) and
caught up from the log; without a usable snapshot the replica is read whole from Postgres.

CollectionManager is composed of one class per job, each over the state they share (manager_state.py):
manager_catalog.py (create, drop, describe, replicas, start-up loads), manager_writes.py, manager_builds.py
(rebuilds), manager_search.py (engine routing, consistency waits) and manager_recall.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .batching import MicroBatcher
from .manager_catalog import Catalog
from .manager_recall import Recall
from .manager_search import SearchAnswer
from .manager_state import ENGINE_KIND, Consistency
from .manager_writes import Writes
from .resident import IndexBackend

__all__ = ["ENGINE_KIND", "CollectionManager", "Consistency", "SearchAnswer"]


class CollectionManager(Catalog, Writes, Recall):
    """The vector domain's facade (see the module's note): its parts, and the engines attached to them."""

    def attach(self, kind: str, backend: IndexBackend) -> None:
        """Make a backend hold resident indexes. cuVS calls must come from one thread (NVIDIA/cuvs #2041), so on
        the GPU rebuilds share that thread, except what a backend's build process (build_process.py) does; on the
        CPU they have their own, and searches keep two."""
        self.backends[kind] = backend
        self.executors[kind] = ThreadPoolExecutor(max_workers=1 if kind == "gpu" else 2,
                                                  thread_name_prefix=f"vectors-{kind}")
        # A build process (build_process.py) frees the GPU thread during builds; without one they share it.
        # A build thread of its own starts with thread_init (lower CPU priority): a build may then use every core
        # (FaissIndex.build), taking only what searches leave.
        shares = kind == "gpu" and getattr(backend, "builder", None) is None
        self.build_executors[kind] = self.executors[kind] if shares else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"vectors-{kind}-build", initializer=self.thread_init)
        # Lone cheap searches may run on the event loop (see batching.py), on the CPU only: cuVS calls must stay
        # on their one thread.
        self.batchers[kind] = MicroBatcher(self._run_batch, self.executors[kind], max_batch=self.max_batch,
                                           window_s=self.batch_window_s,
                                           inline_below_s=self.inline_search_s if kind == "cpu" else 0.0,
                                           can_inline=self._uncontended, turn_budget_s=self.inline_turn_s)
