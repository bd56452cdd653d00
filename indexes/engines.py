"""The vector engines as the service's registry sees them: each one plugs its backend into the
CollectionManager when it starts, and is ready when the collections it holds are loaded."""

from __future__ import annotations

import asyncio
from typing import Any

from .manager import CollectionManager


class _ResidentEngine:
    kind = ""

    def __init__(self, vectors: CollectionManager, **_: Any) -> None:
        self.vectors = vectors

    def backend(self) -> Any:
        raise TypeError("subclasses name their backend")

    async def start(self) -> None:
        self.vectors.attach(self.kind, self.backend())

    async def stop(self) -> None:
        """The manager stops (and snapshots) the collections; nothing of the engine's own to release."""

    @property
    def ready(self) -> bool:
        # Only the engine that holds the resident indexes has anything to load.
        return self.vectors.resident_kind != self.kind or self.vectors.ready


class FaissEngine(_ResidentEngine):
    kind = "cpu"

    def __init__(self, vectors: CollectionManager, cpu_threads: int | None = None, huge_pages: bool = True,
                 **_: Any) -> None:
        super().__init__(vectors)
        self.threads = cpu_threads
        self.huge_pages = huge_pages

    def backend(self) -> Any:
        from .faiss_index import FaissBackend

        return FaissBackend(self.threads, self.huge_pages)


class CuvsEngine(_ResidentEngine):
    kind = "gpu"

    def __init__(self, vectors: CollectionManager, gpu_build_process: bool = True, **_: Any) -> None:
        super().__init__(vectors)
        self.build_process = gpu_build_process

    def backend(self) -> Any:
        from .cuvs_index import CuvsBackend

        return CuvsBackend(self.build_process)


class CupyExactEngine(_ResidentEngine):
    """Exact search with CuPy on device-resident vectors (exact_index.py): the GPU vector engine where cuVS is not
    installed. Its CuPy kernels compile at start (a warm-up search of each path), not on the first request."""

    kind = "gpu"

    def backend(self) -> Any:
        from .exact_index import ExactArrayBackend

        return ExactArrayBackend()

    async def start(self) -> None:
        """Warm up before attaching (a failure leaves the engine unavailable, nothing attached), then once more on
        the engine's own thread, which gets its own cuBLAS handle."""
        backend = self.backend()
        await asyncio.to_thread(backend.warm_up)
        self.vectors.attach(self.kind, backend)
        await asyncio.get_running_loop().run_in_executor(self.vectors.executors[self.kind], backend.warm_up)


class PgvectorEngine:
    """Searches inside PostgreSQL: nothing to load, ready as soon as the database is."""

    ready = True

    def __init__(self, vectors: CollectionManager, **_: Any) -> None:
        self.vectors = vectors

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
