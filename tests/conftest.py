"""Test fixtures: one real PostgreSQL (with pgvector) per test run, a fresh database per test module.

SWITCHYARD_TEST_DATABASE_URL points the suite at an existing server instead of the embedded one; the
server must let the user create and drop databases.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from fastapi.testclient import TestClient

from service.database.postgres import EmbeddedPostgres
from service.http.app import create_app
from service.settings import Settings


def run(coro: Any) -> Any:
    """Run a coroutine from a synchronous test (each call gets its own event loop)."""
    return asyncio.run(coro)


def with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


async def _execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def server_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("SWITCHYARD_TEST_DATABASE_URL")
    if external:
        yield external
        return
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pg") / "pgdata")
    dsn = server.start()
    yield dsn
    server.stop()


@contextmanager
def fresh_database(server_dsn: str, label: str) -> Iterator[str]:
    name = f"t_{re.sub(r'[^a-z0-9]+', '_', label.lower())[-40:]}_{uuid.uuid4().hex[:8]}"
    run(_execute(server_dsn, f'CREATE DATABASE "{name}"'))
    try:
        yield with_database(server_dsn, name)
    finally:
        run(_execute(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="module")
def database_url(server_dsn: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of this test module's own."""
    with fresh_database(server_dsn, request.module.__name__) as dsn:
        yield dsn


@pytest.fixture
def make_settings(database_url: str, tmp_path: Path):
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"database_url": database_url, "data_dir": tmp_path / "data"}
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def make_client(make_settings):
    """Start an app (lifespan included) with the given settings; stop it when the test ends."""
    clients: list[TestClient] = []

    def make(*, raise_server_exceptions: bool = True, **overrides: Any) -> TestClient:
        app = create_app(make_settings(**overrides))
        client = TestClient(app, raise_server_exceptions=raise_server_exceptions)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in reversed(clients):
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()
