"""Errors the vector domain raises; service/ maps each to an HTTP status."""

from __future__ import annotations


class VectorError(Exception):
    def __init__(self, detail: str, *, field: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field


class InvalidInput(VectorError):
    """The request cannot be done as asked (wrong dimension, NaN, bad encoding...): nothing was changed."""


class CollectionNotFound(VectorError):
    pass


class CollectionExists(VectorError):
    pass


class CollectionBusy(VectorError):
    """A change to the collection kept meeting others that PostgreSQL could not let it wait for (a drop
    deadlocking with index builds): nothing was changed, try again shortly."""


class CollectionEmpty(VectorError):
    """The request needs stored points and the collection has none yet (recall's sample)."""


class EngineUnavailable(VectorError):
    """The engine asked for cannot serve this collection now (absent, not loaded, or failed)."""


class EngineFailed(VectorError):
    """The engine raised while serving; `auto` falls back to the next engine."""


class NotCaughtUp(VectorError):
    """The resident replica could not reach the consistency level asked for within the time allowed, and the
    request named the engine, so nothing else may answer: try again shortly."""


class ShardUnavailable(VectorError):
    """No replica of one of the collection's shards can answer now (restarting or loading): try again shortly."""
