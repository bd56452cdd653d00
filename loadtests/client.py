"""How the load-test runner talks to Switchyard while it prepares data: plain HTTP (never the service
in-process), jobs followed with a progress bar."""

from __future__ import annotations

import io
import sys
import time
from typing import Any

import httpx
import numpy as np

from loadtests.processes import ServiceError

ARROW_STREAM = "application/vnd.apache.arrow.stream"


def progress(label: str, done: int, total: int | None) -> None:
    """A one-line progress bar on stderr, redrawn in place."""
    filled = int(30 * done / total) if total else 0
    print(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {done}/{total or '?'} {label[:60]:<60}", end="",
          file=sys.stderr, flush=True)


class Api:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def call(self, method: str, path: str, ok: tuple[int, ...] = (200, 201, 202, 204), **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServiceError(f"cannot reach {self.url}: {exc}") from None
        if response.status_code not in ok:
            try:
                problem = response.json()
                detail = f"{problem.get('title', '')}: {problem.get('detail', '')}"
            except ValueError:
                detail = response.text[:300]
            raise ServiceError(f"{method} {path}: {response.status_code} {detail}")
        return response.json() if response.content else None

    def wait_job(self, accepted: dict[str, Any], label: str) -> dict[str, Any]:
        message = None
        while True:
            job = self.call("GET", accepted["location"])
            if job["message"] != message or job["state"] in ("succeeded", "failed"):
                message = job["message"]
                progress(f"{label}: {message or job['state']}", job["done"], job["total"])
            if job["state"] in ("succeeded", "failed"):
                print(file=sys.stderr)
                if job["state"] == "failed":
                    raise ServiceError(f"{label} failed: {job['message']}")
                return job
            time.sleep(0.5)

    def collection(self, name: str) -> dict[str, Any] | None:
        try:
            return self.call("GET", f"/v1/collections/{name}")
        except ServiceError as exc:
            if " 404 " in str(exc):
                return None
            raise

    def bulk_load(self, name: str, base: np.ndarray, first_id: int = 0, chunk_rows: int = 200_000) -> float:
        """Arrow IPC bulk loads (jobs), in chunks so a large file never sits in memory twice. Returns seconds."""
        import pyarrow as pa

        started = time.perf_counter()
        for start in range(0, len(base), chunk_rows):
            part = np.ascontiguousarray(base[start:start + chunk_rows], dtype=np.float32)
            ids = pa.array(np.arange(first_id + start, first_id + start + len(part), dtype=np.int64))
            table = pa.table({"id": ids, "vector": pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)),
                                                                                     part.shape[1])})
            sink = io.BytesIO()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            accepted = self.call("PUT", f"/v1/collections/{name}/points", content=sink.getvalue(),
                                 headers={"Content-Type": ARROW_STREAM})
            self.wait_job(accepted, f"load rows {start:,}-{start + len(part):,} of {len(base):,}")
        return time.perf_counter() - started

    def build(self, name: str) -> float:
        started = time.perf_counter()
        self.wait_job(self.call("POST", f"/v1/collections/{name}/build"), f"build {name}")
        return time.perf_counter() - started
