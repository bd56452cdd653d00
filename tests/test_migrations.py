"""Migrations: applied once each, in order, each in a transaction; idempotent; safe from concurrent starters."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from conftest import fresh_database, run
from service.database.migrate import Migration, MigrationError, apply_migrations, load_migrations, pending_migrations


def write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, sql in files.items():
        (directory / name).write_text(sql)
    return directory


async def _apply(dsn: str, migrations: list[Migration] | None = None) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        return [m.version for m in await apply_migrations(conn, migrations)]
    finally:
        await conn.close()


async def _fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


@pytest.fixture
def dsn(server_dsn, request):
    with fresh_database(server_dsn, request.node.name) as url:
        yield url


def test_shipped_migrations_are_ordered_and_start_with_vector():
    migrations = load_migrations()
    assert [m.version for m in migrations] == sorted(m.version for m in migrations)
    assert migrations[0].version == 1 and "CREATE EXTENSION IF NOT EXISTS vector" in migrations[0].sql


def test_apply_is_recorded_and_idempotent(dsn):
    shipped = [m.version for m in load_migrations()]
    assert run(_apply(dsn)) == shipped
    assert run(_apply(dsn)) == []
    rows = run(_fetch(dsn, "SELECT version, checksum FROM schema_migrations ORDER BY version"))
    assert [r["version"] for r in rows] == shipped
    ext = run(_fetch(dsn, "SELECT extversion FROM pg_extension WHERE extname = 'vector'"))
    assert ext and ext[0]["extversion"] >= "0.8"


def test_concurrent_appliers_apply_each_migration_once(dsn, tmp_path):
    migrations = load_migrations(write(tmp_path / "m", {
        "0001_a.sql": "CREATE TABLE a (id int); SELECT pg_sleep(0.3);",
        "0002_b.sql": "INSERT INTO a VALUES (1);",  # would double up if run twice
        "0003_c.sql": "CREATE TABLE c (id int);",  # would fail if run twice
    }))

    async def race() -> list[list[int]]:
        return await asyncio.gather(*(_apply(dsn, migrations) for _ in range(4)))

    results = run(race())
    assert sorted(v for r in results for v in r) == [1, 2, 3]
    assert run(_fetch(dsn, "SELECT count(*) AS n FROM a"))[0]["n"] == 1


def test_two_processes_migrating_at_once_both_succeed(dsn, tmp_path):
    env = {**os.environ, "SWITCHYARD_DATABASE_URL": dsn, "SWITCHYARD_DATA_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-m", "service.cli", "migrate"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("applied 0001_vector_extension" in out for out in outputs) == 1
    assert sum("applied 0002_vector_collections" in out for out in outputs) == 1
    assert sum("up to date" in out for out in outputs) == 1


def test_failed_migration_rolls_back_and_is_not_recorded(dsn, tmp_path):
    migrations = load_migrations(write(tmp_path / "m", {
        "0001_ok.sql": "CREATE TABLE ok (id int);",
        "0002_bad.sql": "CREATE TABLE half (id int); SELECT * FROM no_such_table;",
    }))
    with pytest.raises(asyncpg.UndefinedTableError):
        run(_apply(dsn, migrations))
    assert [r["version"] for r in run(_fetch(dsn, "SELECT version FROM schema_migrations"))] == [1]
    assert run(_fetch(dsn, "SELECT to_regclass('half') AS t"))[0]["t"] is None
    # The lock was released: a corrected migration goes through.
    (tmp_path / "m" / "0002_bad.sql").write_text("CREATE TABLE half (id int);")
    assert run(_apply(dsn, load_migrations(tmp_path / "m"))) == [2]


def test_edited_applied_migration_is_refused(dsn, tmp_path):
    write(tmp_path / "m", {"0001_a.sql": "CREATE TABLE a (id int);"})
    run(_apply(dsn, load_migrations(tmp_path / "m")))
    write(tmp_path / "m", {"0001_a.sql": "CREATE TABLE a (id bigint);"})
    with pytest.raises(MigrationError, match="changed after it was applied"):
        run(_apply(dsn, load_migrations(tmp_path / "m")))


def test_pending_lists_what_is_not_applied(dsn):
    shipped = load_migrations()

    async def pending() -> list[int]:
        conn = await asyncpg.connect(dsn)
        try:
            return [m.version for m in await pending_migrations(conn)]
        finally:
            await conn.close()

    assert run(pending()) == [m.version for m in shipped]
    run(_apply(dsn))
    assert run(pending()) == []


@pytest.mark.parametrize("name", ["1_short.sql", "0001-dash.sql", "0001_UPPER.sql"])
def test_badly_named_files_are_refused(tmp_path, name):
    with pytest.raises(MigrationError, match="NNNN_name.sql"):
        load_migrations(write(tmp_path / "m", {name: "SELECT 1;"}))


def test_duplicate_versions_are_refused(tmp_path):
    with pytest.raises(MigrationError, match="share version 1"):
        load_migrations(write(tmp_path / "m", {"0001_a.sql": "SELECT 1;", "0001_b.sql": "SELECT 2;"}))
