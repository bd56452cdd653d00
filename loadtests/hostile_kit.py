"""What the hostile-client suite (loadtests/hostile.py) watches while an attack runs, and the context an attack
records its answers in: the service's memory (its own processes and its PostgreSQL's), its in-flight slots from
/metrics, an honest client's latency and answers, and every status the attack itself got back."""

from __future__ import annotations

import http.client
import multiprocessing
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import orjson
import psutil

PROBLEM_JSON = "application/problem+json"
HONEST_COLLECTION, HONEST_DIM, HONEST_ROWS = "honest", 16, 2000


@dataclass
class Target:
    """A running service under attack: where it listens, its key, its processes and its PostgreSQL's data."""

    url: str
    key: str | None
    root_pid: int
    data_dir: Path
    pgdata: Path | None = None  # the embedded PostgreSQL's data directory (its processes work in it)
    profile: str = "main"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def headers(self, key: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if key and self.key else {}

    def service_processes(self) -> list[psutil.Process]:
        """The service's own processes (the engine or serving process, fronts, their helpers), not PostgreSQL."""
        try:
            root = psutil.Process(self.root_pid)
            return [root, *(c for c in root.children(recursive=True) if c.name() != "postgres")]
        except psutil.Error:
            return []

    def alive(self) -> bool:
        try:
            return psutil.Process(self.root_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def postgres_processes(self) -> list[psutil.Process]:
        if self.pgdata is None:
            return []
        target, found = str(self.pgdata.resolve()), []
        for process in psutil.process_iter(["name"]):
            try:
                if process.info["name"] == "postgres" and process.cwd() == target:
                    found.append(process)
            except psutil.Error:
                continue
        return found


def _rss(processes: list[psutil.Process]) -> list[int]:
    out = []
    for p in processes:
        try:
            out.append(p.memory_info().rss)
        except psutil.Error:
            pass
    return out


def metrics_gauges(url: str, headers: dict[str, str], timeout_s: float = 2) -> dict[str, float]:
    """The unlabelled gauges of one /metrics scrape, with `switchyard_inflight` summed over the work classes and
    `switchyard_inflight_limit` that of light work (searches)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=timeout_s).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("switchyard_"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        if not labels:
            out[name] = number
        elif name == "switchyard_inflight":
            out[name] = out.get(name, 0.0) + number
        elif name == "switchyard_inflight_limit" and 'work="light"' in labels:
            out[name] = number
    return out


class Watch:
    """Samples the service while an attack runs: RSS of its processes (summed) and of its largest PostgreSQL
    process, and the in-flight gauges of /metrics."""

    def __init__(self, target: Target, interval_s: float = 0.1, scrape_s: float = 1.0) -> None:
        self.target, self.interval_s, self.scrape_s = target, interval_s, scrape_s
        self.stop_event = threading.Event()
        self.rss: list[int] = []
        self.pg_rss: list[int] = []
        self.inflight: list[float] = []
        self.limits: list[float] = []
        self.metrics_errors = 0
        self._pg: list[psutil.Process] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="hostile-watch")

    def sample_memory(self) -> tuple[int, int]:
        own = sum(_rss(self.target.service_processes()))
        pg = max(_rss(self._pg), default=0)
        return own, pg

    def start(self) -> dict[str, float]:
        self._pg = self.target.postgres_processes()
        own, pg = self.sample_memory()
        self._thread.start()
        return {"rss": own, "pg_rss": pg}

    def rebase(self, peaks: bool = False) -> dict[str, float]:
        """A new baseline once the attack's setup is done (its collections hold memory of their own): the memory
        sampled before is forgotten, and with `peaks` the in-flight gauges too (the attack starts)."""
        self._pg = self.target.postgres_processes()
        own, pg = self.sample_memory()
        self.rss, self.pg_rss = [], []
        if peaks:
            self.inflight, self.limits = [], []
        return {"rss": own, "pg_rss": pg}

    def _run(self) -> None:
        next_scrape, n = 0.0, 0
        while not self.stop_event.is_set():
            n += 1
            if n % 20 == 0:  # PostgreSQL's backends come and go
                self._pg = self.target.postgres_processes()
            own, pg = self.sample_memory()
            self.rss.append(own)
            self.pg_rss.append(pg)
            if time.monotonic() >= next_scrape:
                next_scrape = time.monotonic() + self.scrape_s
                try:
                    gauges = metrics_gauges(self.target.url, self.target.headers())
                    self.inflight.append(gauges.get("switchyard_inflight", 0.0))
                    if "switchyard_inflight_limit" in gauges:
                        self.limits.append(gauges["switchyard_inflight_limit"])
                except (httpx.HTTPError, OSError):
                    self.metrics_errors += 1
            self.stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self.stop_event.set()
        self._thread.join(5)


class HonestClient:
    """One well-behaved client over TCP: single-vector JSON searches with the key on one keep-alive connection,
    paced, recording each latency and status (a transport failure as its exception's name). It runs in a process
    of its own: in the attacker's, the attack's own work (building megabyte bodies under the GIL) would show up as
    the service's latency."""

    def __init__(self, target: Target, pace_s: float = 0.01, timeout_s: float = 10) -> None:
        self.target, self.pace_s, self.timeout_s = target, pace_s, timeout_s
        import numpy as np

        rng = np.random.default_rng(11)
        self.bodies = [orjson.dumps({"vector": rng.standard_normal(HONEST_DIM).tolist(), "k": 10}) for _ in range(64)]
        spawn = multiprocessing.get_context("spawn")
        self._stop = spawn.Event()
        self._results, self._sender = spawn.Pipe(duplex=False)
        self._process = spawn.Process(target=_honest_loop, daemon=True, name="hostile-honest", args=(
            self.target.port, self.target.headers(), self.bodies, pace_s, timeout_s, self._stop, self._sender))

    def start(self) -> None:
        self._process.start()

    def stop(self, since: float = 0.0) -> dict[str, Any]:
        """Stop it; the summary of the calls it started at or after `since` (time.monotonic)."""
        self._stop.set()
        calls: list[tuple[float, float, str]] = []
        if self._results.poll(self.timeout_s + 10):
            calls = self._results.recv()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
        window = [(latency, status) for started, latency, status in calls if started >= since]
        return summary([latency for latency, _ in window], Counter(status for _, status in window))

    def measure(self, seconds: float) -> dict[str, Any]:
        """Alone for `seconds`: the unloaded reference."""
        self.start()
        time.sleep(seconds)
        return self.stop()


def _honest_loop(port: int, key_headers: dict[str, str], bodies: list[bytes], pace_s: float, timeout_s: float,
                 stop: Any, results: Any) -> None:
    """HonestClient's process: search until `stop` is set, then send back the latencies and statuses."""
    headers = {"Content-Type": "application/json", **key_headers}
    calls: list[tuple[float, float, str]] = []  # (started, seconds, status); time.monotonic is one clock for all
    conn: http.client.HTTPConnection | None = None
    i = 0
    while not stop.is_set():
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        began, started = time.monotonic(), time.perf_counter()
        try:
            conn.request("POST", f"/v1/collections/{HONEST_COLLECTION}/search", bodies[i % len(bodies)], headers)
            response = conn.getresponse()
            response.read()
            status = str(response.status)
            if response.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as exc:
            status = type(exc).__name__
            conn.close()
            conn = None
        calls.append((began, time.perf_counter() - started, status))
        i += 1
        stop.wait(pace_s)
    if conn is not None:
        conn.close()
    results.send(calls)


def summary(latencies: list[float], statuses: Counter[str]) -> dict[str, Any]:
    lat = sorted(latencies)
    pct = lambda q: round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 2) if lat else None  # noqa: E731
    return {"calls": len(lat), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "mean_ms": round(1000 * statistics.fmean(lat), 2) if lat else None,
            "statuses": dict(statuses), "refused": sum(n for s, n in statuses.items() if s != "200")}


class Ctx:
    """One attack's record: every status it got back, its checks of the service's answers, its notes; its
    parameters and its deadline (attacks stop sending when it passes)."""

    def __init__(self, target: Target, params: dict[str, Any], budget_s: float) -> None:
        self.target, self.params = target, params
        self.deadline = time.monotonic() + budget_s
        self.statuses: Counter[str] = Counter()
        self.checks: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.skipped: str | None = None
        self.began = time.monotonic()  # the attack proper's start: its setup (begin) comes before
        self.on_begin: Callable[[], None] = lambda: None

    def begin(self) -> None:
        """The attack's setup is done (collections seeded): the runner waits for the service to settle, then the
        attack's window starts here, for the honest client's latencies and the memory baseline."""
        self.on_begin()
        self.began = time.monotonic()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def client(self, key: bool = True, timeout_s: float = 60, headers: dict[str, str] | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.target.url, headers={**self.target.headers(key), **(headers or {})},
                            timeout=min(timeout_s, max(1.0, self.left())))

    def send(self, http: httpx.Client, method: str, path: str, retry: bool = False,
             **kwargs: Any) -> httpx.Response | None:
        """One request of the attack; its status counted (a transport failure counted by its name, None back).
        retry: once more after a transport failure (a connection the service dropped after its last answer)."""
        try:
            response = http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.statuses[type(exc).__name__] += 1
            if retry and not isinstance(exc, httpx.TimeoutException):
                return self.send(http, method, path, **kwargs)
            return None
        self.statuses[str(response.status_code)] += 1
        return response

    def note(self, text: str) -> None:
        self.notes.append(text)

    def expect(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail[:300]})
        return bool(ok)

    def expect_answer(self, name: str, response: httpx.Response | None, allowed: str = "4xx") -> bool:
        """`allowed`: "4xx" (a client error, as problem+json), or "2xx|4xx" (served, or refused as one)."""
        if response is None:
            return self.expect(name, False, "no answer (transport error or timeout)")
        status = response.status_code
        kinds = allowed.split("|")
        ok = f"{status // 100}xx" in kinds
        detail = f"{status}"
        if status >= 400:
            ctype = response.headers.get("content-type", "")
            problem = ctype.startswith(PROBLEM_JSON)
            ok = ok and problem
            try:
                body = response.json() if problem else {}
            except ValueError:
                body = {}
            detail += f" {str(body.get('type', ctype)).rsplit(':', 1)[-1]}"
            if body.get("field"):
                detail += f" field={body['field']}"
        return self.expect(name, ok, f"{detail} (wanted {allowed})")


def wait_job(http: httpx.Client, accepted: dict[str, Any], timeout_s: float) -> str:
    """A job's final state, or 'timeout'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = http.get(accepted["location"]).json()["state"]
        if state not in ("queued", "running"):
            return state
        time.sleep(0.3)
    return "timeout"


def keepalive_probe(port: int, method: str, path: str, body: bytes, headers: dict[str, str],
                    timeout_s: float = 30) -> tuple[int | str, bytes, str, bool]:
    """One request on a fresh keep-alive connection, then GET /healthz on the same one: (status, body,
    content type, whether the connection survived the answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        payload, status, ctype = response.read(), response.status, response.getheader("content-type", "")
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        return type(exc).__name__, b"", "", False
    try:
        conn.request("GET", "/healthz")
        survived = conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        survived = False
    conn.close()
    return status, payload, ctype, survived


def bounded(fn: Callable[[], None], seconds: float) -> bool:
    """Run fn in a daemon thread for at most `seconds`; whether it finished."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()
