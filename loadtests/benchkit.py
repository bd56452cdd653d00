"""Shared pieces of the benchmark drivers: the service under test, machine-load sampling, timing,
thread-per-client load loops, results on disk.

Method (docs/design/verification.md): Switchyard and its peers run on the same data in the same run; each
measurement is warmed up, repeated, and stored with how busy the rest of the machine was.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from loadtests.local_ray import local_ray_cluster as local_ray_cluster  # re-exported for tests and benchmarks
from loadtests.processes import BENCHMARK_ENV
from loadtests.processes import results_dir as results_dir  # re-exported for the bench_*.py scripts
from switchyard_client import Client, RetryPolicy
from switchyard_client import __version__ as client_version


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """A `switchyard serve` subprocess on a fresh data directory (embedded PostgreSQL) or a given URL."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    benchmark_env: bool = True  # loadtests/processes.BENCHMARK_ENV first (False: the service's own defaults)
    cpus: set[int] | None = None  # the cores it starts on (its PostgreSQL too), as `taskset` would: it sizes to them

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pg_dsn(self) -> str:
        return f"postgresql://postgres:@/postgres?host={self.data_dir / 'postgres'}"

    def start(self, timeout_s: float = 120) -> None:
        import httpx

        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
        env.update({"SWITCHYARD_LOG_LEVEL": "warning", **(BENCHMARK_ENV if self.benchmark_env else {}), **self.env})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.data_dir.parent / "service.log", "ab"),
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}; "
                                   f"see {self.data_dir.parent / 'service.log'}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("service not ready in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def pids(self) -> set[int]:
        """The service and its PostgreSQL server processes: CPU they use is the system under test's."""
        out = set()
        if self.proc is not None:
            out.add(self.proc.pid)
        for p in psutil.process_iter(["name", "cmdline"]):
            if p.info["name"] == "postgres" or "postgres" in " ".join(p.info["cmdline"] or [])[:200]:
                out.add(p.pid)
        return out


class JsonClient:
    """One keep-alive HTTP connection to the service under test, JSON in and out; reconnects once when the
    server has closed an idle connection (while a peer was being measured)."""

    def __init__(self, port: int, timeout_s: float = 3600) -> None:
        self.port, self.timeout_s = port, timeout_s
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        import orjson

        data = (body if isinstance(body, bytes) or body is None
                else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))
        try:
            self.conn.request(method, path, data, {"Content-Type": content_type})
            response = self.conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
            self.conn.request(method, path, data, {"Content-Type": content_type})
            response = self.conn.getresponse()
        payload = response.read()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {response.status}: {payload[:300]!r}")
        return orjson.loads(payload) if payload else {}


def switchyard(url: str, transport: str = "auto") -> Client:
    """Switchyard through the client its users install, as a benchmark drives it: its fastest transport ("auto":
    libcurl when pycurl is installed), retries off (a refusal is counted, not hidden; typed exceptions carry
    .status) and no deadline sent (the socket waits up to the client's 300 s)."""
    return Client(url, retry=RetryPolicy(max_retries=0), transport=transport)


def client_label(client: Client) -> str:
    """What the results say drove Switchyard: `switchyard_client <version>, <transport>, <TCP or unix socket>`."""
    where = "unix socket" if client.url.startswith("unix:") else "TCP"
    return f"switchyard_client {client_version}, {client.transport}, {where}"


class MachineLoad:
    """CPU used by processes other than ours during a section, in cores (sampled from /proc and psutil)."""

    def __init__(self, pids: Callable[[], set[int]]) -> None:
        self.pids = pids

    @staticmethod
    def _busy_seconds() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)

    def _ours(self) -> float:
        total = 0.0
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        for pid in self.pids():
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:  # a PostgreSQL backend or worker that ended meanwhile
                pass
        seen = set()
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                c = p.cpu_times()
                # Children it has reaped count too: PostgreSQL's parallel workers live only for one query.
                total += c.user + c.system + c.children_user + c.children_system
            except psutil.Error:
                pass
        return total

    @contextmanager
    def measure(self, out: dict[str, Any]) -> Iterator[None]:
        busy0, ours0, t0 = self._busy_seconds(), self._ours(), time.monotonic()
        try:
            yield
        finally:
            elapsed = max(time.monotonic() - t0, 1e-9)
            other = max(0.0, (self._busy_seconds() - busy0) - (self._ours() - ours0)) / elapsed
            out["other_cores"] = round(other, 3)
            out["busy_flag"] = other > 0.2


def wait_for_quiet(max_wait_s: float = 30, threshold_cores: float = 0.2,
                   processes: Callable[[], list[psutil.Process]] | None = None) -> float:
    """Wait until the machine is quiet (other processes use < threshold cores), or give up; with `processes`,
    until those processes are (a service and its PostgreSQL, while other clients run beside them). The load seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        if processes is None:
            load = psutil.cpu_percent(interval=1.0) / 100 * psutil.cpu_count()
        else:
            load = _process_cores(processes(), 1.0)
        if load < threshold_cores or time.monotonic() > deadline:
            return load


def _process_cores(processes: list[psutil.Process], interval_s: float) -> float:
    """Cores these processes used over the next `interval_s` (those that end meanwhile count as idle)."""
    for p in processes:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(interval_s)
    used = 0.0
    for p in processes:
        try:
            used += p.cpu_percent(None) / 100
        except psutil.Error:
            pass
    return used


def run_clients(n_clients: int, duration_s: float,
                make_client: Callable[[int], Callable[[int], int]]) -> dict[str, Any]:
    """Closed-loop load: n threads, each calling its client(i) back to back for duration_s.
    client(i) returns how many queries that call answered; a client with a close() is closed afterwards.
    Returns QPS and latency percentiles."""
    stop = threading.Event()
    counts = [0] * n_clients
    latencies: list[list[float]] = [[] for _ in range(n_clients)]
    errors: list[BaseException] = []
    clients = [make_client(c) for c in range(n_clients)]
    barrier = threading.Barrier(n_clients + 1)

    def worker(c: int) -> None:
        call = clients[c]
        i = c
        barrier.wait()
        try:
            while not stop.is_set():
                t = time.perf_counter()
                counts[c] += call(i)
                latencies[c].append(time.perf_counter() - t)
                i += n_clients
        except BaseException as exc:  # noqa: BLE001 - reported after the run
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(n_clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    time.sleep(duration_s)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for call in clients:
        close = getattr(call, "close", None)
        if close is not None:
            close()
    if errors:
        raise RuntimeError(f"client failed: {errors[0]!r}") from errors[0]
    lat = sorted(x for per in latencies for x in per)
    pct = lambda q: round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None  # noqa: E731
    return {"qps": round(sum(counts) / elapsed, 1), "calls": len(lat), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "clients": n_clients, "seconds": round(elapsed, 2)}


def repeat(runs: int, fn: Callable[[], dict[str, Any]], key: str = "qps") -> dict[str, Any]:
    """One warm-up, then `runs` runs; the median run's figures plus min and max of `key`."""
    fn()
    results = [fn() for _ in range(runs)]
    values = [r[key] for r in results]
    median = sorted(results, key=lambda r: r[key])[len(results) // 2]
    return {**median, f"{key}_min": min(values), f"{key}_max": max(values), "runs": runs,
            f"{key}_median": statistics.median(values)}


def versions(*distributions: str) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version(), "machine": platform.machine(),
                                  "cores": str(os.cpu_count())}
    for d in distributions:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out


def save_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
