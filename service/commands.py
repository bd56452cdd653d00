"""The one-shot `switchyard` subcommands' work, once service/cli.py has parsed their arguments: apply migrations,
write an SSB dataset into the data directory, bulk-load vectors into a running service. Each returns its exit code;
a failure the user must fix exits with its message."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from service.settings import Settings


def migrate(settings: Settings) -> int:
    """Apply pending migrations to the configured database, or to the embedded one, started only for this."""
    from service.database.migrate import apply_migrations
    from service.database.postgres import EmbeddedPostgres, connect

    async def run() -> int:
        embedded = None
        dsn = settings.database.url
        if dsn is None:
            embedded = EmbeddedPostgres(settings.embedded_pgdata)
            dsn = await asyncio.to_thread(embedded.start)
        try:
            conn = await connect(dsn, settings.database.connect_timeout_s)
            try:
                applied = await apply_migrations(conn)
            finally:
                await conn.close()
        finally:
            if embedded is not None:
                await asyncio.to_thread(embedded.stop)
        for m in applied:
            print(f"applied {m.version:04d}_{m.name}")
        if not applied:
            print("database is up to date")
        return 0

    return asyncio.run(run())


def _progress(done: int, total: int | None, message: str) -> None:
    """A one-line progress bar on stderr, redrawn in place."""
    filled = int(30 * done / total) if total else 0
    count = f"{done}/{total}" if total else ""
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {count} {message:<50}", end="", file=sys.stderr, flush=True)


def ssb_generate(data_dir: Path, sf: float, seed: int) -> int:
    """Generate an SSB dataset into the data directory and make it the one the service loads at its next start."""
    from olap.generate import generate
    from olap.schema import dataset_dir

    try:
        target = dataset_dir(data_dir, sf)
        if seed:
            target = target.with_name(f"{target.name}-seed{seed}")
        meta = generate(sf, target, seed, _progress)
    finally:
        print(file=sys.stderr)
    return _activate(data_dir, target, meta)


def ssb_import(data_dir: Path, source: Path, name: str) -> int:
    """Import ssb-dbgen's .tbl files as the dataset `name` and make it the one the service loads at its next start."""
    from olap.importer import SsbImportError, import_tbl

    target = data_dir / "ssb" / name
    try:
        meta = import_tbl(source, target, None, _progress)
    except SsbImportError as exc:
        print(file=sys.stderr)
        sys.exit(f"import failed, nothing was written: {exc}")
    finally:
        print(file=sys.stderr)
    return _activate(data_dir, target, meta)


def _activate(data_dir: Path, target: Path, meta: dict) -> int:
    root = data_dir / "ssb"
    root.mkdir(parents=True, exist_ok=True)
    (root / "active.json").write_text(json.dumps({"dataset": str(target)}))
    print(json.dumps({"dataset": str(target), "rows": meta["rows"]}))
    return 0


def load_vectors(url: str, api_key: str | None, collection: str, vectors_file: str, ids_file: str | None,
                 first_id: int) -> int:
    """Bulk-load a .npy file into a collection of a running service through switchyard_client (one Arrow upsert
    job, followed to its end with a progress bar)."""
    import numpy as np

    from switchyard_client import Client, JobFailed, SwitchyardError, TransportError

    try:
        vectors = np.load(vectors_file).astype(np.float32)
        ids = np.load(ids_file).astype(np.int64) if ids_file else np.arange(first_id, first_id + len(vectors))
    except (OSError, ValueError) as exc:  # a missing file, not a .npy, an object array
        sys.exit(f"cannot read the vectors or ids: {exc}")
    if vectors.ndim != 2 or len(ids) != len(vectors):
        sys.exit(f"need an (n, dim) array of vectors and n ids; got {vectors.shape} and {len(ids)} ids")
    try:
        with Client(url.rstrip("/"), api_key=api_key, transport="http") as client:
            result = client.load(collection, ids, vectors,
                                 progress=lambda done, total, message: _progress(done, total or len(ids), message))
    except JobFailed as exc:
        print(file=sys.stderr)
        print(f"load failed: {exc.job.get('message')}", file=sys.stderr)
        return 1
    except (SwitchyardError, TransportError) as exc:
        sys.exit(str(exc))
    print(file=sys.stderr)
    print(json.dumps(result))
    return 0
