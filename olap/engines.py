"""The OLAP engines as the service's registry sees them: each one attaches itself to the OlapManager when it
starts, and is ready once it holds the active dataset (or when there is none to hold yet)."""

from __future__ import annotations

from typing import Any

from .manager import OlapManager


class _Handle:
    def __init__(self, olap: OlapManager, **context: Any) -> None:
        self.olap = olap
        self.context = context
        self.engine: Any = None

    def make(self) -> Any:
        raise TypeError("subclasses make their engine")

    async def start(self) -> None:
        self.engine = self.make()
        self.olap.attach(self.engine)

    async def stop(self) -> None:
        """The manager closes the engines."""

    @property
    def ready(self) -> bool:
        # Before a dataset exists there is nothing to load; once the active one is loading, wait for it.
        return self.olap.ready and (self.olap.active is None or self.engine.ready
                                    or self.engine.kind in self.olap.load_errors)


class CudfEngineHandle(_Handle):
    def make(self) -> Any:
        from .cudf_engine import CudfEngine

        return CudfEngine()


class DuckDBEngineHandle(_Handle):
    def make(self) -> Any:
        from .duckdb_engine import DuckDBEngine

        return DuckDBEngine(threads=self.context.get("cpu_threads"),
                            memory_limit=self.context.get("duckdb_memory_limit"))


class PostgresEngineHandle(_Handle):
    def make(self) -> Any:
        from .postgres_engine import PostgresEngine

        return PostgresEngine(self.context["pool"], self.context.get("sql_pool") or self.context["pool"])
