"""PostgreSQL, the system of record for collections: the catalog, one pgvector table per collection,
deletion records, and the change sequence that resident indexes replay from.

Writes to one collection take a transaction-scoped advisory lock first, so `seq` values within a collection
are handed out in commit order, and "every change after seq w" is a complete, ordered replay. Each write
transaction also records its commit in `vector_commits` (the collection's new head seq, chained to the previous
head) and notifies channel `switchyard_vectors` with "<collection id>:<seq>", delivered at commit to every
process that listens; catalog changes notify "c:<collection id>".
"""

from __future__ import annotations

import asyncio
import builtins
import io
import re
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import numpy as np
import orjson

from . import digest, pgcopy
from .distance import prepare
from .errors import CollectionBusy, CollectionExists, CollectionNotFound, InvalidInput
from .resident import Changes
from .vectors import MAX_PAYLOAD_ROW_BYTES, MAX_PAYLOAD_VALUE_BYTES, Points, check_payload_sizes, payload_keys

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
OPERATORS = {"l2": "<->", "cosine": "<=>", "inner_product": "<#>"}
OPCLASSES = {"l2": "vector_l2_ops", "cosine": "vector_cosine_ops", "inner_product": "vector_ip_ops"}
ADVISORY_NAMESPACE = int.from_bytes(b"SWVC", "big")  # two-key advisory locks: (namespace, collection id)
CHANNEL = "switchyard_vectors"
SMALL_WRITE_ROWS = 1000  # up to this many rows an upsert binds arrays; above, binary COPY into a staged table
FEW_ROWS = 2000  # catch-ups of up to this many rows read in one statement
HEAD = "(SELECT coalesce(max(seq), 0) FROM vector_commits WHERE collection_id = {id})"
# The payloads of the rows read, in seq order, as one JSON array (NULL when none has one): one string for the
# replica to parse off the event loop.
PAYLOADS_JSON = "CASE WHEN bool_or(payload IS NOT NULL) THEN json_agg(payload ORDER BY seq)::text END"
# Index builds on a table ($1), in any process: a drop cancels them (see CollectionStore._drop).
CANCEL_INDEX_BUILDS = ("SELECT pg_cancel_backend(pid) FROM pg_stat_progress_create_index "
                       "WHERE relid = to_regclass($1) AND pid <> pg_backend_pid()")
DROP_TRIES, DROP_BACKOFF_S = 5, 0.05  # a drop that deadlocks: tries in all, and the first wait before the next
MAX_PAYLOAD_KEYS = 1024  # distinct top-level payload keys a collection may hold (SWITCHYARD_MAX_PAYLOAD_KEYS)
# How many of `keys` ($2) the collection ($1) already holds, and how many it holds in all.
KEYS_HELD = ("SELECT (SELECT count(*) FROM vector_payload_keys WHERE collection_id = $1 AND key = ANY($2::text[])) "
             "AS known, (SELECT count(*) FROM vector_payload_keys WHERE collection_id = $1) AS held")


@dataclass(frozen=True)
class Commit:
    """A committed write: the collection's head before it and after it."""

    prev: int
    seq: int


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
    def __init__(self, pool: asyncpg.Pool, max_payload_keys: int = MAX_PAYLOAD_KEYS,
                 max_payload_value_bytes: int = MAX_PAYLOAD_VALUE_BYTES,
                 max_payload_row_bytes: int = MAX_PAYLOAD_ROW_BYTES) -> None:
        self.pool = pool
        self.max_payload_keys = max_payload_keys
        self.max_payload_value_bytes, self.max_payload_row_bytes = max_payload_value_bytes, max_payload_row_bytes
        # Per collection id, keys this process has seen committed in vector_payload_keys (ids are never reused,
        # keys never leave it but with their collection): writes within them need no look-up.
        self.known_keys: dict[int, set[str]] = {}

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
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, f"c:{c.id}")
        return c

    async def drop(self, name: str) -> Collection:
        """Drop the collection, its table and its records, in one transaction: retried (with backoff) when
        PostgreSQL breaks a deadlock by failing it, CollectionBusy (nothing dropped) when that keeps happening."""
        tries = 0
        while True:
            try:
                return await self._drop(name)
            except asyncpg.DeadlockDetectedError as exc:
                tries += 1
                if tries == DROP_TRIES:
                    raise CollectionBusy(f"collection {name!r} was not deleted: its drop kept deadlocking with index "
                                         "builds on its table; try again", field="collection") from exc
                await asyncio.sleep(DROP_BACKOFF_S * 2 ** (tries - 1))

    async def _drop(self, name: str) -> Collection:
        """One try of drop(). A CREATE INDEX CONCURRENTLY on the table (the pgvector index's background build, in
        any process) waits for every transaction older than its snapshot, this one too while it waits for the
        table's lock, which the build holds: a deadlock. So the builds are cancelled first (their index goes with
        the table), after the catalog row is locked, which tells a cancelled build to wait for this drop before it
        asks whether its collection is gone (dropped()). A build starting in between can still deadlock: drop()
        tries again."""
        async with self.pool.acquire() as conn, conn.transaction():
            c = await self._get(conn, name, lock=True)
            await conn.execute(CANCEL_INDEX_BUILDS, c.table)
            await conn.execute(f"DROP TABLE IF EXISTS {c.table}")
            await conn.execute("DELETE FROM vector_collections WHERE id = $1", c.id)
            await conn.execute("DELETE FROM vector_replica_reports WHERE collection_id = $1", c.id)
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, f"c:{c.id}")
        self.known_keys.pop(c.id, None)
        return c

    async def list(self) -> list[Collection]:
        rows = await self.pool.fetch("SELECT * FROM vector_collections ORDER BY name")
        return [Collection.from_row(r) for r in rows]

    async def get(self, name: str) -> Collection:
        async with self.pool.acquire() as conn:
            return await self._get(conn, name)

    async def dropped(self, c: Collection) -> bool:
        """Whether the collection is gone from PostgreSQL, once a drop of it under way has ended (FOR SHARE waits
        for the drop's lock on its row): what a build that failed asks, which that drop may have cancelled."""
        return await self.pool.fetchval("SELECT 1 FROM vector_collections WHERE id = $1 FOR SHARE", c.id) is None

    @staticmethod
    async def _get(conn: asyncpg.Connection, name: str, lock: bool = False) -> Collection:
        """The collection named `name`; `lock`: its row locked until the transaction ends (a drop's, which other
        drops of it wait for, then find it gone). NO KEY UPDATE, so writes' foreign-key checks do not wait."""
        row = await conn.fetchrow("SELECT * FROM vector_collections WHERE name = $1" +
                                  (" FOR NO KEY UPDATE" if lock else ""), name)
        if row is None:
            raise CollectionNotFound(f"no collection named {name!r}", field="collection")
        return Collection.from_row(row)

    async def count(self, c: Collection) -> int:
        return await self.pool.fetchval(f"SELECT count(*) FROM {c.table}")

    async def upsert(self, c: Collection, points: Points) -> Commit:
        """Insert or replace the points in one transaction; its commit covers (prev, seq]. Small writes bind arrays
        (unnest); large ones COPY into a temporary table first, which costs PostgreSQL ~1 ms of CPU for the table
        alone (5x a one-row upsert by arrays, measured)."""
        self.check_payload_sizes(points.payloads)
        keys = payload_keys(points.payloads)
        new_keys = keys - self.known_keys.get(c.id, set())
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", ADVISORY_NAMESPACE, c.id)
            if new_keys:
                await self._add_keys(conn, c, new_keys)
            if len(points.ids) <= SMALL_WRITE_ROWS:
                source, args = self._bind_rows(c, points)
            else:
                source, args = await self._stage_rows(conn, c, points), ()
            row = await conn.fetchrow(
                f"WITH w AS (INSERT INTO {c.table} (id, embedding, payload, seq) "
                f"SELECT id, embedding, payload, nextval('vector_change_seq') FROM {source} ORDER BY id "
                f"ON CONFLICT (id) DO UPDATE SET embedding = EXCLUDED.embedding, payload = EXCLUDED.payload, "
                f"seq = EXCLUDED.seq RETURNING seq), "
                f"m AS (SELECT max(seq) AS seq, count(*) AS n FROM w), "
                f"h AS (SELECT {HEAD.format(id='$1')} AS prev), "
                f"x AS (INSERT INTO vector_commits (collection_id, seq, prev_seq, upserts) "
                f"SELECT $1, m.seq, h.prev, m.n FROM m, h RETURNING seq, prev_seq) "
                f"SELECT seq, prev_seq, pg_notify($2, $1::text || ':' || seq) FROM x", c.id, CHANNEL, *args,
            )
            commit = Commit(row["prev_seq"], row["seq"])
        self.known_keys.setdefault(c.id, set()).update(new_keys)  # committed now
        return commit

    def check_payload_sizes(self, payloads: builtins.list[bytes | None] | None, first: int = 0) -> None:
        """Refuse (InvalidInput naming the payload) a payload or payload value over its size limit: every write's
        check before anything is written, and a bulk load's for each chunk before its first is."""
        check_payload_sizes(payloads, self.max_payload_value_bytes, self.max_payload_row_bytes, first)

    async def check_keys(self, c: Collection, keys: set[str]) -> None:
        """Refuse (InvalidInput, field payloads) keys that would take the collection past its limit: a bulk
        load's check before its first chunk is written (each chunk's upsert checks again, under the lock)."""
        new_keys = keys - self.known_keys.get(c.id, set())
        if new_keys:
            async with self.pool.acquire() as conn:
                await self._count_keys(conn, c, new_keys)

    async def _count_keys(self, conn: Any, c: Collection, keys: set[str]) -> None:
        row = await conn.fetchrow(KEYS_HELD, c.id, list(keys))
        total = row["held"] + len(keys) - row["known"]
        if total > self.max_payload_keys:
            raise InvalidInput(f"would give collection {c.name!r} {total:,} distinct top-level payload keys "
                               f"({len(keys) - row['known']:,} new); a collection holds at most "
                               f"{self.max_payload_keys:,} (SWITCHYARD_MAX_PAYLOAD_KEYS)", field="payloads")

    async def _add_keys(self, conn: Any, c: Collection, keys: set[str]) -> None:
        """Register a write's new payload keys under the collection's write lock, before its rows: past the limit,
        nothing is written."""
        await self._count_keys(conn, c, keys)
        await conn.execute("INSERT INTO vector_payload_keys (collection_id, key) SELECT $1, unnest($2::text[]) "
                           "ON CONFLICT DO NOTHING", c.id, list(keys))

    @staticmethod
    def _bind_rows(c: Collection, points: Points) -> tuple[str, tuple]:
        from pgvector import Vector

        payloads = ([None if p is None else p.decode() for p in points.payloads] if points.payloads is not None
                    else [None] * len(points.ids))
        source = f"unnest($3::bigint[], $4::vector({c.dim})[], $5::jsonb[]) AS s(id, embedding, payload)"
        return source, (points.ids.tolist(), [Vector(v) for v in points.vectors], payloads)

    @staticmethod
    async def _stage_rows(conn: Any, c: Collection, points: Points) -> str:
        columns = ["id", "embedding"] + (["payload"] if points.payloads is not None else [])
        await conn.execute(f"CREATE TEMP TABLE stage (id bigint, embedding vector({c.dim}), payload jsonb) "
                           "ON COMMIT DROP")
        await conn.copy_to_table("stage",
                                 source=io.BytesIO(pgcopy.encode_rows(points.ids, points.vectors, points.payloads)),
                                 columns=columns, format="binary")
        return "stage"

    async def delete(self, c: Collection, ids: np.ndarray) -> tuple[np.ndarray, Commit]:
        """Delete by id; returns the ids that existed and the commit recording their deletion. Deleting nothing
        commits nothing: the commit is then empty (prev = seq = the head it found)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", ADVISORY_NAMESPACE, c.id)
            deleted = await conn.fetch(f"DELETE FROM {c.table} WHERE id = ANY($1::bigint[]) RETURNING id", ids.tolist())
            if not deleted:
                head = await conn.fetchval(f"SELECT {HEAD.format(id='$1')}", c.id)
                return np.empty(0, dtype=np.int64), Commit(head, head)
            gone = np.array([r["id"] for r in deleted], dtype=np.int64)
            row = await conn.fetchrow(
                f"WITH s AS (SELECT nextval('vector_change_seq') AS seq), "
                f"h AS (SELECT {HEAD.format(id='$1')} AS prev), "
                f"t AS (INSERT INTO vector_tombstones (collection_id, id, seq) "
                f"SELECT $1, unnest($2::bigint[]), seq FROM s), "
                f"x AS (INSERT INTO vector_commits (collection_id, seq, prev_seq, deletes) "
                f"SELECT $1, s.seq, h.prev, $3 FROM s, h RETURNING seq, prev_seq) "
                f"SELECT seq, prev_seq, pg_notify($4, $1::text || ':' || seq) FROM x",
                c.id, gone.tolist(), len(gone), CHANNEL,
            )
            return gone, Commit(row["prev_seq"], row["seq"])

    # -- the change log ----------------------------------------------------------------------------------
    async def heads(self) -> dict[int, tuple[str, int]]:
        """Every collection's id -> (name, head seq), in one round trip (the followers' poll)."""
        rows = await self.pool.fetch(f"SELECT c.id, c.name, {HEAD.format(id='c.id')} AS head FROM vector_collections c")
        return {r["id"]: (r["name"], r["head"]) for r in rows}

    async def head(self, c: Collection) -> int:
        """The collection's latest committed seq; CollectionNotFound if it was dropped."""
        head = await self.pool.fetchval(f"SELECT {HEAD.format(id='vc.id')} FROM vector_collections vc WHERE vc.id = $1",
                                        c.id)
        if head is None:
            raise CollectionNotFound(f"no collection named {c.name!r}", field="collection")
        return head

    async def read_changes(self, c: Collection, since: int) -> Changes:
        """Everything committed after `since`, as of one snapshot: ids deleted, current rows of the ids written,
        and the commits with their times. `head` < `since` means PostgreSQL is behind the caller (a database
        restored from a backup). A small catch-up is one statement (one snapshot, one round trip); a large one,
        or a whole collection, is a REPEATABLE READ transaction reading the rows with binary COPY."""
        if since > 0:
            changes = await self._read_few_changes(c, since)
            if changes is not None:
                return changes
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            head = await conn.fetchval(f"SELECT {HEAD.format(id='vc.id')} FROM vector_collections vc WHERE vc.id = $1",
                                       c.id)
            if head is None:
                raise CollectionNotFound(f"no collection named {c.name!r}", field="collection")
            if head <= since:
                return Changes(since, head, *_no_changes(c.dim))
            commits = await conn.fetch(
                "SELECT seq, extract(epoch FROM committed_at)::float8 AS at FROM vector_commits "
                "WHERE collection_id = $1 AND seq > $2 ORDER BY seq", c.id, since)
            # An empty replica (since 0) has nothing to delete.
            deleted = [] if since == 0 else await conn.fetch(
                "SELECT DISTINCT id FROM vector_tombstones WHERE collection_id = $1 AND seq > $2", c.id, since)
            ids, _, vectors = await self._copy_rows(conn, c, since)
            payloads = await conn.fetchval(f"SELECT {PAYLOADS_JSON} FROM {c.table} WHERE seq > $1", since)
        gone = np.fromiter((r["id"] for r in deleted), dtype=np.int64, count=len(deleted))
        return Changes(since, head, gone, ids, vectors, [(r["seq"], r["at"]) for r in commits], payloads)

    async def _read_few_changes(self, c: Collection, since: int) -> Changes | None:
        """The changes after `since` in one statement, or None when more than FEW_ROWS rows changed."""
        row = await self.pool.fetchrow(
            f"SELECT {HEAD.format(id='vc.id')} AS head, "
            f"(SELECT count(*) FROM {c.table} WHERE seq > $2) AS n_rows, "
            f"(SELECT array_agg(seq ORDER BY seq) FROM vector_commits WHERE collection_id = $1 AND seq > $2) AS seqs, "
            f"(SELECT array_agg(extract(epoch FROM committed_at)::float8 ORDER BY seq) FROM vector_commits "
            f"WHERE collection_id = $1 AND seq > $2) AS ats, "
            f"(SELECT array_agg(DISTINCT id) FROM vector_tombstones WHERE collection_id = $1 AND seq > $2) AS deleted, "
            f"w.rows, w.payloads FROM vector_collections vc, LATERAL ("  # one scan gives rows and payloads
            f"SELECT string_agg(int8send(id) || vector_send(embedding), ''::bytea ORDER BY seq) AS rows, "
            f"{PAYLOADS_JSON} AS payloads "
            f"FROM (SELECT id, seq, embedding, payload FROM {c.table} WHERE seq > $2 ORDER BY seq LIMIT $3) r) w "
            f"WHERE vc.id = $1", c.id, since, FEW_ROWS)
        if row is None:
            raise CollectionNotFound(f"no collection named {c.name!r}", field="collection")
        if row["head"] <= since:
            return Changes(since, row["head"], *_no_changes(c.dim))
        if row["n_rows"] > FEW_ROWS:
            return None
        ids, vectors = pgcopy.decode_sent_rows(row["rows"] or b"", c.dim)
        gone = np.array(row["deleted"] or [], dtype=np.int64)
        return Changes(since, row["head"], gone, ids, vectors, list(zip(row["seqs"] or [], row["ats"] or [])),
                       row["payloads"])

    @staticmethod
    async def _copy_rows(conn: asyncpg.Connection, c: Collection,
                         since: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, seqs, vectors) of every row written after `since`, in seq order, read with binary COPY."""
        buffer = io.BytesIO()
        await conn.copy_from_query(f"SELECT id, seq, embedding FROM {c.table} WHERE seq > {int(since)} ORDER BY seq",
                                   output=buffer, format="binary")
        return pgcopy.decode_rows(buffer.getvalue(), c.dim)

    async def rows(self, c: Collection) -> tuple[np.ndarray, np.ndarray]:
        """Every stored (id, vector)."""
        async with self.pool.acquire() as conn:
            ids, _, vectors = await self._copy_rows(conn, c, 0)
        return ids, vectors

    async def content(self, c: Collection) -> dict[str, Any]:
        """PostgreSQL's side of the comparison with a replica: rows, head seq and content digest, one snapshot."""
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            head = await conn.fetchval(f"SELECT {HEAD.format(id='$1')}", c.id)
            ids, _, vectors = await self._copy_rows(conn, c, 0)
        value = digest.total(digest.row_hashes(ids, prepare(np, vectors, c.metric)))
        return {"rows": len(ids), "seq": head, "digest": digest.show(value)}

    async def lag(self, c: Collection, watermark: int) -> dict[str, Any]:
        """How far a replica at `watermark` is behind: rows changed after it, and the age of the oldest commit it
        has not applied."""
        row = await self.pool.fetchrow(
            f"SELECT (SELECT count(*) FROM {c.table} WHERE seq > $2) + "
            f"(SELECT count(*) FROM vector_tombstones WHERE collection_id = $1 AND seq > $2) AS rows, "
            f"(SELECT extract(epoch FROM clock_timestamp() - min(committed_at))::float8 FROM vector_commits "
            f"WHERE collection_id = $1 AND seq > $2) AS behind_s, {HEAD.format(id='$1')} AS head", c.id, watermark)
        return {"head": row["head"], "lag_rows": row["rows"], "lag_ms": round(1000 * (row["behind_s"] or 0.0), 3)}

    async def commit_token(self, c: Collection, seq: int) -> str | None:
        token = await self.pool.fetchval("SELECT token::text FROM vector_commits WHERE collection_id = $1 AND seq = $2",
                                         c.id, seq)
        return token

    # -- replica reports -----------------------------------------------------------------------------------
    async def ask_for_reports(self, c: Collection, request: str) -> None:
        await self.pool.execute("SELECT pg_notify($1, $2)", CHANNEL, f"r:{c.id}:{request}")

    async def save_report(self, process: str, collection_id: int, request: str, report: dict[str, Any]) -> None:
        await self.pool.execute(
            "INSERT INTO vector_replica_reports (process, collection_id, request, report) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (process, collection_id) DO UPDATE SET request = EXCLUDED.request, report = EXCLUDED.report, "
            "reported_at = clock_timestamp()", process, collection_id, request, orjson.dumps(report).decode())

    async def reports(self, c: Collection, request: str) -> builtins.list[dict[str, Any]]:  # list: the method above
        rows = await self.pool.fetch("SELECT report FROM vector_replica_reports "
                                     "WHERE collection_id = $1 AND request = $2", c.id, request)
        return [orjson.loads(r["report"]) for r in rows]

    async def live_followers(self, prefix: str) -> int:
        """Processes following the change log now: their listening connections (application_name `prefix`...)."""
        return await self.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE $1",
            prefix + "%")


def _no_changes(dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(deleted ids, written ids, vectors), all empty."""
    return np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, dim), np.float32)
