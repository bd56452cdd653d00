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
    """Bulk-load a .npy file into a collection of a running service as one Arrow upsert job, with a progress bar."""
    import io
    import time
    import urllib.error
    import urllib.request

    import numpy as np
    import pyarrow as pa

    vectors = np.load(vectors_file).astype(np.float32)
    ids = np.load(ids_file).astype(np.int64) if ids_file else np.arange(first_id, first_id + len(vectors))
    if vectors.ndim != 2 or len(ids) != len(vectors):
        sys.exit(f"need an (n, dim) array of vectors and n ids; got {vectors.shape} and {len(ids)} ids")
    table = pa.table({"id": pa.array(ids), "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)),
                                                                                      vectors.shape[1])})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")

    def call(method: str, path: str, body: bytes | None = None, content_type: str | None = None) -> dict:
        request = urllib.request.Request(base + path, data=body, method=method,
                                         headers={**headers,
                                                  **({"Content-Type": content_type} if content_type else {})})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            problem = json.loads(exc.read() or b"{}")
            sys.exit(f"{method} {path}: {exc.code} {problem.get('detail', exc.reason)}")
        except urllib.error.URLError as exc:
            sys.exit(f"cannot reach {base}: {exc.reason}")

    job = call("PUT", f"/v1/collections/{collection}/points", sink.getvalue(), "application/vnd.apache.arrow.stream")
    while True:
        state = call("GET", job["location"])
        _progress(state["done"], state["total"] or len(ids), state["message"] or state["state"])
        if state["state"] in ("succeeded", "failed"):
            print(file=sys.stderr)
            break
        time.sleep(0.5)
    if state["state"] == "failed":
        print(f"load failed: {state['message']}", file=sys.stderr)
        return 1
    print(json.dumps(state["result"]))
    return 0
