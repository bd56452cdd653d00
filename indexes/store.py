"""PostgreSQL, the system of record for collections: the catalog, one pgvector table per collection,
deletion records, and the change sequence that resident indexes replay from.

Writes to one collection take a transaction-scoped advisory lock first, so `seq` values within a collection
are handed out in commit order, and "every change after seq w" is a complete, ordered replay.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import numpy as np
import orjson

from . import pgcopy
from .errors import CollectionExists, CollectionNotFound, InvalidInput
from .vectors import Points

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
OPERATORS = {"l2": "<->", "cosine": "<=>", "inner_product": "<#>"}
OPCLASSES = {"l2": "vector_l2_ops", "cosine": "vector_cosine_ops", "inner_product": "vector_ip_ops"}
ADVISORY_NAMESPACE = int.from_bytes(b"SWVC", "big")  # two-key advisory locks: (namespace, collection id)


@dataclass(frozen=True)
class Collection:
    id: int
    name: str
    dim: int
    metric: str
    index_type: str
    index_params: dict[str, Any] = field(default_factory=dict)
    pgvector_index: dict[str, Any] = field(default_factory=dict)

    @property
    def table(self) -> str:
        return f"vectors_{self.id}"

    @property
    def operator(self) -> str:
        return OPERATORS[self.metric]

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> "Collection":
        return cls(row["id"], row["name"], row["dim"], row["metric"], row["index_type"],
                   orjson.loads(row["index_params"]), orjson.loads(row["pgvector_index"]))


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise InvalidInput("collection names are 1-63 letters, digits, '_' or '-', starting with a letter or digit",
                           field="name")
    return name


class CollectionStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def create(self, name: str, dim: int, metric: str, index_type: str, index_params: dict[str, Any],
                     pgvector_index: dict[str, Any]) -> Collection:
        check_name(name)
        async with self.pool.acquire() as conn, conn.transaction():
            try:
                row = await conn.fetchrow(
                    "INSERT INTO vector_collections (name, dim, metric, index_type, index_params, pgvector_index) "
                    "VALUES ($1, $2, $3, $4, $5, $6) RETURNING *",
                    name, dim, metric, index_type, orjson.dumps(index_params).decode(),
                    orjson.dumps(pgvector_index).decode(),
                )
            except asyncpg.UniqueViolationError:
                raise CollectionExists(f"collection {name!r} already exists", field="name") from None
            c = Collection.from_row(row)
            await conn.execute(
                f"CREATE TABLE {c.table} (id bigint PRIMARY KEY, embedding vector({dim}) NOT NULL, payload jsonb, "
                f"seq bigint NOT NULL)"
            )
            await conn.execute(f"CREATE INDEX ON {c.table} (seq)")
            await conn.execute(f"CREATE INDEX ON {c.table} USING gin (payload jsonb_path_ops)")
        return c

    async def drop(self, name: str) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            c = await self._get(conn, name)
            await conn.execute(f"DROP TABLE IF EXISTS {c.table}")
            await conn.execute("DELETE FROM vector_collections WHERE id = $1", c.id)

    async def list(self) -> list[Collection]:
        rows = await self.pool.fetch("SELECT * FROM vector_collections ORDER BY name")
        return [Collection.from_row(r) for r in rows]

    async def get(self, name: str) -> Collection:
        async with self.pool.acquire() as conn:
            return await self._get(conn, name)

    @staticmethod
    async def _get(conn: asyncpg.Connection, name: str) -> Collection:
        row = await conn.fetchrow("SELECT * FROM vector_collections WHERE name = $1", name)
        if row is None:
            raise CollectionNotFound(f"no collection named {name!r}", field="collection")
        return Collection.from_row(row)

    async def count(self, c: Collection) -> int:
        return await self.pool.fetchval(f"SELECT count(*) FROM {c.table}")

    async def upsert(self, c: Collection, points: Points) -> int:
        """Insert or replace the points in one transaction; returns the highest seq it wrote."""
        payload_col = ", payload" if points.payloads is not None else ""
        data = pgcopy.encode_rows(points.ids, points.vectors, points.payloads)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", ADVISORY_NAMESPACE, c.id)
            await conn.execute(
                f"CREATE TEMP TABLE stage (id bigint, embedding vector({c.dim}), payload jsonb) ON COMMIT DROP"
            )
            await conn.copy_to_table("stage", source=io.BytesIO(data), columns=["id", "embedding"] + (["payload"] if payload_col else []),
                                     format="binary")
            return await conn.fetchval(
                f"WITH w AS (INSERT INTO {c.table} (id, embedding, payload, seq) "
                f"SELECT id, embedding, payload, nextval('vector_change_seq') FROM stage ORDER BY id "
                f"ON CONFLICT (id) DO UPDATE SET embedding = EXCLUDED.embedding, payload = EXCLUDED.payload, "
                f"seq = EXCLUDED.seq RETURNING seq) SELECT max(seq) FROM w"
            )

    async def delete(self, c: Collection, ids: np.ndarray) -> tuple[np.ndarray, int | None]:
        """Delete by id; returns the ids that existed and the seq recorded for the deletion."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", ADVISORY_NAMESPACE, c.id)
            deleted = await conn.fetch(f"DELETE FROM {c.table} WHERE id = ANY($1::bigint[]) RETURNING id", ids.tolist())
            if not deleted:
                return np.empty(0, dtype=np.int64), None
            gone = np.array([r["id"] for r in deleted], dtype=np.int64)
            seq = await conn.fetchval(
                "WITH s AS (SELECT nextval('vector_change_seq') AS seq) "
                "INSERT INTO vector_tombstones (collection_id, id, seq) SELECT $1, unnest($2::bigint[]), seq FROM s "
                "RETURNING seq", c.id, gone.tolist(),
            )
            return gone, seq

    async def rows_since(self, c: Collection, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, seqs, vectors) of every row written after `seq`, in seq order, read with binary COPY."""
        buffer = io.BytesIO()
        async with self.pool.acquire() as conn:
            await conn.copy_from_query(
                f"SELECT id, seq, embedding FROM {c.table} WHERE seq > {int(seq)} ORDER BY seq",
                output=buffer, format="binary",
            )
        return pgcopy.decode_rows(buffer.getvalue(), c.dim)

    async def deleted_since(self, c: Collection, seq: int) -> tuple[np.ndarray, int]:
        rows = await self.pool.fetch(
            "SELECT id, seq FROM vector_tombstones WHERE collection_id = $1 AND seq > $2", c.id, seq
        )
        ids = np.array([r["id"] for r in rows], dtype=np.int64)
        return ids, max((r["seq"] for r in rows), default=seq)

    async def latest_seq(self, c: Collection) -> int:
        return await self.pool.fetchval(
            f"SELECT greatest((SELECT coalesce(max(seq), 0) FROM {c.table}), "
            f"(SELECT coalesce(max(seq), 0) FROM vector_tombstones WHERE collection_id = $1))", c.id,
        )

    async def ids_matching(self, c: Collection, payload_filter: dict[str, Any]) -> np.ndarray:
        """Ids whose payload contains every key/value of the filter (jsonb @>, served by the GIN index)."""
        rows = await self.pool.fetch(f"SELECT id FROM {c.table} WHERE payload @> $1::jsonb",
                                     orjson.dumps(payload_filter).decode())
        return np.fromiter((r["id"] for r in rows), dtype=np.int64, count=len(rows))

