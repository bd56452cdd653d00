"""The spatial engines as the service's registry sees them: each attaches itself to the SpatialManager."""

from __future__ import annotations

from typing import Any

from .manager import SpatialManager


class _Handle:
    def __init__(self, spatial: SpatialManager, **context: Any) -> None:
        self.spatial = spatial
        self.context = context

    def make(self) -> Any:
        raise TypeError("subclasses make their engine")

    async def start(self) -> None:
        self.spatial.attach(self.make())

    async def stop(self) -> None:
        """The manager shuts the engines' executors down."""

    @property
    def ready(self) -> bool:
        return self.spatial.ready  # layers are resident once loaded from PostgreSQL


class CpuSpatialHandle(_Handle):
    def make(self) -> Any:
        from .cpu_engine import CpuSpatialEngine

        return CpuSpatialEngine()


class PostgisHandle(_Handle):
    async def start(self) -> None:
        from .postgis_engine import PostgisEngine

        engine = PostgisEngine(self.context["pool"])
        await engine.start()
        self.spatial.attach(engine)


class CudaSpatialHandle(_Handle):
    def make(self) -> Any:
        from .cuda_engine import CudaSpatialEngine

        return CudaSpatialEngine()

    async def start(self) -> None:
        """Compile and launch every kernel at engine start, on the engine's own thread, not on the first request;
        a warm-up that fails (a kernel that cannot launch, a wrong answer) fails the start with its reason."""
        await self.spatial.attach_warmed(self.make())
