"""Blocking HTTP/1.1 with keep-alive for Client: libcurl through pycurl (the default: about 60% of http.client's
client CPU per call), or a pool of the standard library's http.client connections; TCP or a unix socket."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

from ._wire import Response
from .errors import TransportError

BLOCK_BYTES = 1 << 20  # a file body is sent this much at a time
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class Endpoint:
    """Where the service listens: `http://host:port`, or `unix:/path/to.sock` (SWITCHYARD_UDS)."""

    def __init__(self, url: str) -> None:
        self.socket_path: str | None = None
        if url.startswith("unix:"):
            self.socket_path, self.host, self.port = url[len("unix:"):], "localhost", 80
            return
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected http://host:port or unix:/path/to.sock, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80


class Transport(Protocol):
    name: str  # "pycurl" or "http"

    def send(self, method: str, path: str, body: bytes | BinaryIO | None, headers: dict[str, str], timeout: float,
             idempotent: bool) -> Response: ...

    def close(self) -> None: ...


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout, blocksize=BLOCK_BYTES)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class HttpPool:
    """Idle keep-alive connections, newest first, at most `max_idle` of them; any number in use at once (one per
    calling thread). One the service may have closed for idleness is not reused for a call that is unsafe to
    send twice; an idempotent call on a stale one is sent once more on a fresh connection."""

    name = "http"

    def __init__(self, endpoint: Endpoint, max_idle: int = 32, idle_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.max_idle = max_idle
        self.idle_s = idle_s  # under the service's shortest keep-alive (SWITCHYARD_KEEP_ALIVE_S, 1 s at least)
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def _new(self, timeout: float) -> http.client.HTTPConnection:
        if self.endpoint.socket_path is not None:
            return _UnixConnection(self.endpoint.socket_path, timeout)
        return http.client.HTTPConnection(self.endpoint.host, self.endpoint.port, timeout=timeout,
                                          blocksize=BLOCK_BYTES)

    def _take(self, timeout: float, fresh_only: bool) -> tuple[http.client.HTTPConnection, bool]:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if fresh_only and now - since > self.idle_s:
                    conn.close()
                    continue
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.timeout = timeout
                return conn, True
        return self._new(timeout), False

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def send(self, method: str, path: str, body: bytes | BinaryIO | None, headers: dict[str, str], timeout: float,
             idempotent: bool) -> Response:
        for attempt in range(2):
            if body is not None and not isinstance(body, bytes):
                body.seek(0)
            conn, reused = self._take(timeout, fresh_only=not idempotent)
            try:
                conn.request(method, path, body, headers)
                answer = conn.getresponse()
                data = answer.read()
            except STALE as exc:
                conn.close()
                if reused and idempotent and attempt == 0:
                    continue
                raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
            if answer.will_close:
                conn.close()
            else:
                self._give_back(conn)
            return Response(answer.status, {k.lower(): v for k, v in answer.getheaders()}, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


class _Handle:
    """A thread's libcurl handle and what its last request set: only what differs is set again (a search client
    sends the same URL, headers and method with every vector, and each setopt costs client CPU)."""

    def __init__(self, pycurl: Any, endpoint: Endpoint) -> None:
        self.curl = curl = pycurl.Curl()
        curl.setopt(pycurl.TCP_NODELAY, 1)
        curl.setopt(pycurl.NOSIGNAL, 1)  # threads: no SIGALRM for timeouts
        if endpoint.socket_path is not None:
            curl.setopt(pycurl.UNIX_SOCKET_PATH, endpoint.socket_path)
        self.chunks: list[bytes] = []
        self.header_lines: list[bytes] = []  # parsed only for an error answer (its Retry-After)
        curl.setopt(pycurl.WRITEFUNCTION, self.chunks.append)
        curl.setopt(pycurl.HEADERFUNCTION, self.header_lines.append)
        self.url: str | None = None
        self.sent_headers: tuple[tuple[str, str], ...] | None = None
        self.method: str | None = None
        self.timeout: float | None = None
        self.uploading = False

    def headers(self) -> dict[str, str]:
        out = {}
        for line in self.header_lines:
            name, sep, value = line.decode("latin-1").partition(":")
            if sep:
                out[name.strip().lower()] = value.strip()
        return out


class CurlPool:
    """libcurl (pycurl), one handle per calling thread: it keeps its connection alive and reconnects by itself."""

    name = "pycurl"

    def __init__(self, endpoint: Endpoint) -> None:
        import pycurl

        self.pycurl = pycurl
        self.endpoint = endpoint
        self.base = f"http://{endpoint.host}:{endpoint.port}"
        self._local = threading.local()
        self._all: list[_Handle] = []
        self._lock = threading.Lock()

    def _handle(self) -> _Handle:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self._local.handle = _Handle(self.pycurl, self.endpoint)
            with self._lock:
                self._all.append(handle)
        return handle

    def send(self, method: str, path: str, body: bytes | BinaryIO | None, headers: dict[str, str], timeout: float,
             idempotent: bool) -> Response:
        pycurl, h = self.pycurl, self._handle()
        curl = h.curl
        url = self.base + path
        if url != h.url:
            curl.setopt(pycurl.URL, url)
            h.url = url
        sent = tuple(headers.items())
        if sent != h.sent_headers:
            curl.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in sent] + ["Expect:"])  # no 100-continue wait
            h.sent_headers = sent
        if timeout != h.timeout:
            curl.setopt(pycurl.TIMEOUT_MS, int(timeout * 1000))
            h.timeout = timeout
        if h.uploading:  # the last request sent a file: back to in-memory bodies
            curl.setopt(pycurl.UPLOAD, 0)
            h.uploading = False
        if body is not None and not isinstance(body, bytes):
            body.seek(0)
            curl.setopt(pycurl.UPLOAD, 1)
            curl.setopt(pycurl.READDATA, body)
            curl.setopt(pycurl.INFILESIZE_LARGE, int(headers["Content-Length"]))
            h.uploading = True
        elif body is None and method in ("GET", "DELETE"):
            curl.setopt(pycurl.HTTPGET, 1)
            h.method = None  # HTTPGET resets the request method
        else:
            curl.setopt(pycurl.POSTFIELDS, body or b"")
        if method != h.method:
            curl.setopt(pycurl.CUSTOMREQUEST, method)
            h.method = method
        h.chunks.clear()
        h.header_lines.clear()
        try:
            curl.perform()
        except pycurl.error as exc:
            raise TransportError(f"{method} {path}: {exc}") from exc
        status = curl.getinfo(pycurl.RESPONSE_CODE)
        return Response(status, h.headers() if status >= 400 else {}, b"".join(h.chunks))

    def close(self) -> None:
        with self._lock:
            handles, self._all = self._all, []
        for handle in handles:
            handle.curl.close()


def transport_for(url: str, kind: str, max_idle: int) -> Transport:
    """`kind`: "http" (http.client), "pycurl", or "auto" (pycurl when it is installed)."""
    endpoint = Endpoint(url)
    if kind == "pycurl" or kind == "auto":
        try:
            return CurlPool(endpoint)
        except ImportError:
            if kind == "pycurl":
                raise ImportError("transport='pycurl' needs pycurl (pip install pycurl)") from None
    elif kind != "http":
        raise ValueError(f"transport must be auto, http or pycurl, not {kind!r}")
    return HttpPool(endpoint, max_idle)
