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
from .errors import TimedOut, TransportError

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
            except TimeoutError as exc:  # socket.timeout
                conn.close()
                raise TimedOut(f"{method} {path}: no answer within {timeout:g} s") from exc
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
        curl.setopt(pycurl.MAXCONNECTS, 1)  # one kept-alive connection per handle (a fresh one replaces it)
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
        self.fresh = False  # FRESH_CONNECT set: the last call was unsafe to send twice

    def headers(self) -> dict[str, str]:
        out = {}
        for line in self.header_lines:
            name, sep, value = line.decode("latin-1").partition(":")
            if sep:
                out[name.strip().lower()] = value.strip()
        return out


class CurlPool:
    """libcurl (pycurl) handles, each keeping its connection alive and reconnecting by itself: one per call in
    flight, and at most `max_idle` kept between calls, newest first (a handle per thread that ever called kept a
    socket open for each until close())."""

    name = "pycurl"

    def __init__(self, endpoint: Endpoint, max_idle: int = 32) -> None:
        import pycurl

        self.pycurl = pycurl
        self.endpoint = endpoint
        self.base = f"http://{endpoint.host}:{endpoint.port}"
        self.max_idle = max_idle
        self._idle: list[_Handle] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> _Handle:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Handle(self.pycurl, self.endpoint)

    def _give_back(self, handle: _Handle) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(handle)
                return
        handle.curl.close()

    def send(self, method: str, path: str, body: bytes | BinaryIO | None, headers: dict[str, str], timeout: float,
             idempotent: bool) -> Response:
        handle = self._take()
        try:
            return self._perform(handle, method, path, body, headers, timeout, idempotent)
        finally:
            self._give_back(handle)

    def _perform(self, h: _Handle, method: str, path: str, body: bytes | BinaryIO | None, headers: dict[str, str],
                 timeout: float, idempotent: bool) -> Response:
        pycurl = self.pycurl
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
        if h.fresh != (not idempotent):
            # libcurl sends a request again, unasked, when a reused connection closes before any answer: a call
            # that is unsafe to send twice goes on a new connection, which it never resends on.
            curl.setopt(pycurl.FRESH_CONNECT, 0 if idempotent else 1)
            h.fresh = not idempotent
        h.chunks.clear()
        h.header_lines.clear()
        try:
            curl.perform()
        except pycurl.error as exc:
            if exc.args and exc.args[0] == pycurl.E_OPERATION_TIMEDOUT:
                raise TimedOut(f"{method} {path}: no answer within {timeout:g} s: {exc}") from exc
            raise TransportError(f"{method} {path}: {exc}") from exc
        status = curl.getinfo(pycurl.RESPONSE_CODE)
        return Response(status, h.headers() if status >= 400 else {}, b"".join(h.chunks))

    def close(self) -> None:
        with self._lock:
            handles, self._idle, self._closed = self._idle, [], True
        for handle in handles:
            handle.curl.close()


def transport_for(url: str, kind: str, max_idle: int) -> Transport:
    """`kind`: "http" (http.client), "pycurl", or "auto" (pycurl when it is installed)."""
    endpoint = Endpoint(url)
    if kind == "pycurl" or kind == "auto":
        try:
            return CurlPool(endpoint, max_idle)
        except ImportError:
            if kind == "pycurl":
                raise ImportError("transport='pycurl' needs pycurl (pip install pycurl)") from None
    elif kind != "http":
        raise ValueError(f"transport must be auto, http or pycurl, not {kind!r}")
    return HttpPool(endpoint, max_idle)
