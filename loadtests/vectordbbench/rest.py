"""Switchyard's HTTP API as the VectorDBBench client uses it: JSON over keep-alive connections, one per thread
(VectorDBBench inserts from several threads sharing one client object), and waiting for jobs."""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import orjson


class HttpError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status


class Rest:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 3600.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected http://host:port, got {url!r}")
        self.host, self.port, self.timeout_s = parts.hostname, parts.port or 80, timeout_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[http.client.HTTPConnection] = []

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        return self.send(method, path, data, self.headers)

    def send(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> Any:
        """One request with a body already encoded; the JSON answer."""
        try:
            conn = self._connection()
            conn.request(method, path, data, headers)
            response = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # The server closed an idle keep-alive connection: once more on a new one.
            conn = self._connection(fresh=True)
            conn.request(method, path, data, headers)
            response = conn.getresponse()
        payload = response.read()
        if response.status >= 300:
            raise HttpError(method, path, response.status, payload)
        return orjson.loads(payload) if payload else None

    def wait_job(self, job_id: str, poll_s: float = 0.5) -> dict:
        """The job's final state; a failed job raises."""
        while True:
            job = self.call("GET", f"/v1/jobs/{job_id}")
            if job["state"] == "succeeded":
                return job
            if job["state"] == "failed":
                raise RuntimeError(f"job {job_id} failed: {job.get('message')}")
            time.sleep(poll_s)

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
