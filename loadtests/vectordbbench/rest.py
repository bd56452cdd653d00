"""Switchyard's HTTP API as the VectorDBBench client uses it: keep-alive connections through libcurl (pycurl), one
handle per thread (VectorDBBench inserts from several threads sharing one client object), and waiting for jobs.

libcurl, not http.client: the client runs on the same cores as the server in these benchmarks, and per search
http.client cost 121 us of client CPU against pycurl's 61 (loadtests/bench_overhead.py's machine, 1 KB bodies) --
the same reason pgvector is driven through psycopg's C libpq.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlsplit

import orjson
import pycurl


class HttpError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status


class _Handle:
    """A thread's libcurl handle and the options its last request set."""

    def __init__(self, curl: pycurl.Curl) -> None:
        self.curl = curl
        self.chunks: list[bytes] = []
        curl.setopt(pycurl.WRITEFUNCTION, self.chunks.append)
        self.path: str | None = None
        self.headers: list[str] | None = None
        self.method: str | None = None


class Rest:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 3600.0) -> None:
        """`url`: http://host:port, or unix:/path/to.sock for a service listening there (SWITCHYARD_UDS)."""
        self.socket_path = url[len("unix:"):] if url.startswith("unix:") else None
        if self.socket_path is not None:
            self.base = "http://localhost"
        else:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"expected http://host:port or unix:/path, got {url!r}")
            self.base = f"http://{parts.hostname}:{parts.port or 80}"
        self.timeout_s = timeout_s
        # "Expect:" stops libcurl waiting for a 100-continue round trip before bodies over 1 KB.
        common = ["Expect:"] + ([f"Authorization: Bearer {api_key}"] if api_key else [])
        self.headers = ["Content-Type: application/json", *common]
        self.raw_headers = ["Content-Type: application/octet-stream", *common]
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[pycurl.Curl] = []

    def _handle(self) -> "_Handle":
        handle = getattr(self._local, "handle", None)
        if handle is None:
            curl = pycurl.Curl()
            curl.setopt(pycurl.TCP_NODELAY, 1)
            if self.socket_path is not None:
                curl.setopt(pycurl.UNIX_SOCKET_PATH, self.socket_path)
            curl.setopt(pycurl.TIMEOUT_MS, int(self.timeout_s * 1000))
            curl.setopt(pycurl.NOSIGNAL, 1)  # threads: no SIGALRM for timeouts
            handle = self._local.handle = _Handle(curl)
            with self._lock:
                self._all.append(curl)
        return handle

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        return self.send(method, path, data, self.headers)

    def send(self, method: str, path: str, data: bytes | None, headers: list[str]) -> Any:
        """One request with a body already encoded; the JSON answer. libcurl reuses the thread's connection and
        reconnects by itself when the server has closed an idle one."""
        handle = self._handle()
        curl = handle.curl
        # Only what differs from this handle's last request is set again: a search client sends the same URL,
        # headers and method with every vector, and each setopt costs client CPU on the cores the server uses.
        if path != handle.path:
            curl.setopt(pycurl.URL, self.base + path)
            handle.path = path
        if headers is not handle.headers:
            curl.setopt(pycurl.HTTPHEADER, headers)
            handle.headers = headers
        if data is None:
            curl.setopt(pycurl.HTTPGET, 1)
            handle.method = None  # HTTPGET resets the request method
        else:
            curl.setopt(pycurl.POSTFIELDS, data)
        if method != handle.method:
            curl.setopt(pycurl.CUSTOMREQUEST, method)
            handle.method = method
        chunks = handle.chunks
        chunks.clear()
        curl.perform()
        status, payload = curl.getinfo(pycurl.RESPONSE_CODE), b"".join(chunks)
        if status >= 300:
            raise HttpError(method, path, status, payload)
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
            for curl in self._all:
                curl.close()
            self._all.clear()
