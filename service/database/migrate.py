"""Apply the SQL files in migrations/ in order, each once, each in its own transaction.

Two processes starting together are serialised by a session advisory lock; the second finds the work done.
A migration that was applied and then edited is refused (its checksum changed), never silently re-run.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import asyncpg

log = logging.getLogger("switchyard.migrate")

# Any constant works as long as every Switchyard process uses the same one: 'SWYD' as an integer.
MIGRATION_LOCK_KEY = int.from_bytes(b"SWYD", "big")
FILENAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


class MigrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """Migrations from `directory`, or the ones shipped in the `migrations` package."""
    files = directory.iterdir() if directory is not None else resources.files("migrations").iterdir()
    found: dict[int, Migration] = {}
    for entry in files:
        if not entry.name.endswith(".sql"):
            continue
        match = FILENAME.match(entry.name)
        if match is None:
            raise MigrationError(f"migration file {entry.name!r} is not named NNNN_name.sql")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations share version {version}: {found[version].name}, {match.group(2)}")
        found[version] = Migration(version, match.group(2), entry.read_text(encoding="utf-8"))
    return [found[v] for v in sorted(found)]


async def apply_migrations(conn: asyncpg.Connection, migrations: list[Migration] | None = None) -> list[Migration]:
    """Apply what is not yet applied; return the migrations applied by this call."""
    migrations = load_migrations() if migrations is None else migrations
    applied_now: list[Migration] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    try:
        await conn.execute(CREATE_TABLE)
        rows = await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
        recorded = {r["version"]: r for r in rows}
        for m in migrations:
            row = recorded.get(m.version)
            if row is not None:
                if row["checksum"] != m.checksum:
                    raise MigrationError(
                        f"migration {m.version:04d}_{m.name} was changed after it was applied; "
                        "add a new migration instead of editing an applied one"
                    )
                continue
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version, m.name, m.checksum,
                )
            log.info("applied migration %04d_%s", m.version, m.name)
            applied_now.append(m)
        unknown = sorted(set(recorded) - {m.version for m in migrations})
        if unknown:
            log.warning("database has migrations this build does not know: %s (a newer Switchyard ran here)", unknown)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    return applied_now


async def pending_migrations(conn: asyncpg.Connection, migrations: list[Migration] | None = None) -> list[Migration]:
    migrations = load_migrations() if migrations is None else migrations
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")} if exists else set()
    return [m for m in migrations if m.version not in done]
