"""Idle connections against one service (issue 35, item 5): while N TCP connections sit idle, does an honest client
still get answers (200, or a clean 503 problem with Retry-After, never an empty reply or a reset), and once they
close, does the service recover (answers 200, its HTTP processes' file descriptors back near their baseline)?

Holders, each its own process (each raises its RLIMIT_NOFILE to the hard limit, and binds its connections to its own
loopback source address, 127.0.0.2, 127.0.0.3, ..., so that N is not bounded by one address's ephemeral ports),
open N connections between them and send nothing; with --reopen they open again, for the whole run, whatever the
service closes (an attacker keeping the pressure on past the read deadline, which closes a silent connection). An
honest client meanwhile makes a request (GET /v1/collections) on a new connection every --interval seconds.

    python -m loadtests.idle_connections [--connections 25000] [--holders 4] [--duration 30] [--reopen]
                                         [--env SWITCHYARD_X=Y ...] [--url URL --pid PID]

Without --url it starts `switchyard serve` with the service's defaults on a fresh data directory (it inherits this
process's open-file limits, and raises its own soft limit to the hard one). Results: JSON in
results_dir("idle_connections") and a summary on stdout.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import os
import resource
import select
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from loadtests.benchkit import Service, save_json, versions
from loadtests.processes import results_dir

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux: the port is chosen at connect


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# -- holders ---------------------------------------------------------------------------------------------------
def _connect(host: str, port: int, source: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source, 0))
        sock.settimeout(10)
        sock.connect((host, port))
        sock.setblocking(False)
        return sock
    except OSError:
        sock.close()
        return None


def hold(index: int, host: str, port: int, n: int, source: str, reopen: bool, stop: Any, report: Any) -> None:
    """Open `n` idle connections from `source`; keep them (reopening what the service closes, with `reopen`) until
    `stop` is set; send counts to `report` twice a second: open, closed by the service, failed connects."""
    raise_fd_limit()
    open_: dict[int, socket.socket] = {}
    closed = failed = 0
    poller = select.poll()

    def top_up(deadline: float) -> None:
        nonlocal failed
        while len(open_) < n and time.monotonic() < deadline and not stop.is_set():
            sock = _connect(host, port, source)
            if sock is None:
                failed += 1
                continue
            open_[sock.fileno()] = sock
            poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)

    top_up(time.monotonic() + 120)  # the first n
    next_report = 0.0
    while not stop.is_set():
        for fd, _ in poller.poll(100):  # anything readable on an idle connection: a 408 or a close
            sock = open_.get(fd)
            if sock is None:
                continue
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                poller.unregister(sock)
                del open_[fd]
                sock.close()
                closed += 1
        if reopen:
            top_up(time.monotonic() + 0.2)
        if time.monotonic() >= next_report:
            report.put((index, len(open_), closed, failed))
            next_report = time.monotonic() + 0.5
    for sock in open_.values():
        sock.close()
    report.put((index, 0, closed, failed))


class Holders:
    def __init__(self, host: str, port: int, connections: int, holders: int, reopen: bool) -> None:
        ctx = mp.get_context("fork")
        self.stop = ctx.Event()
        self.report: Any = ctx.Queue()
        share = [connections // holders + (i < connections % holders) for i in range(holders)]
        self.procs = [ctx.Process(target=hold, args=(i, host, port, share[i], f"127.0.0.{2 + i}", reopen, self.stop,
                                                     self.report), daemon=True) for i in range(holders)]
        self.state = {i: (0, 0, 0) for i in range(holders)}

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def totals(self) -> dict[str, int]:
        while not self.report.empty():
            i, *counts = self.report.get_nowait()
            self.state[i] = tuple(counts)
        open_, closed, failed = (sum(s[k] for s in self.state.values()) for k in range(3))
        return {"open": open_, "closed_by_service": closed, "failed_connects": failed}

    def finish(self) -> dict[str, int]:
        self.stop.set()
        for p in self.procs:
            p.join(60)
        time.sleep(0.2)
        return self.totals()


# -- the honest client and the service's processes --------------------------------------------------------------
def ask(host: str, port: int, path: str = "/v1/collections") -> tuple[str, float]:
    """One request on a new connection: '200', '503 clean', '503 unclean', another status, or what failed."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        outcome = str(r.status)
        if r.status == 503:
            clean = (r.getheader("content-type") == "application/problem+json" and r.getheader("retry-after")
                     and b"urn:switchyard:problem:" in body)
            outcome = "503 clean" if clean else "503 unclean"
    except http.client.RemoteDisconnected:
        outcome = "empty reply"
    except (ConnectionResetError, BrokenPipeError):
        outcome = "reset"
    except TimeoutError:
        outcome = "timeout"
    except OSError as exc:
        outcome = type(exc).__name__
    finally:
        conn.close()
    return outcome, time.perf_counter() - started


def http_pids(root: int) -> list[int]:
    """The service's processes that serve HTTP: `root` and its descendants but PostgreSQL's."""
    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    out = []
    for p in procs:
        try:
            if "postgres" not in p.name() and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def fds(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
    return total


def honest_phase(host: str, port: int, seconds: float, interval: float, holders: Holders | None = None,
                 pids: list[int] | None = None) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        outcome, seconds_taken = ask(host, port)
        outcomes[outcome] += 1
        latencies.append(seconds_taken)
        if holders is not None:
            samples.append({"t": round(time.monotonic() - end + seconds, 2), **holders.totals(),
                            "service_fds": fds(pids or []), "outcome": outcome})
        time.sleep(interval)
    latencies.sort()
    return {"outcomes": dict(outcomes), "requests": len(latencies),
            "p50_ms": round(1000 * latencies[len(latencies) // 2], 1) if latencies else None,
            "max_ms": round(1000 * latencies[-1], 1) if latencies else None, "samples": samples}


def run(args: argparse.Namespace, host: str, port: int, root_pid: int) -> dict[str, Any]:
    pids = http_pids(root_pid)
    result: dict[str, Any] = {"connections": args.connections, "holders": args.holders, "reopen": args.reopen,
                              "service_fd_limit": psutil.Process(pids[0]).rlimit(psutil.RLIMIT_NOFILE),
                              "service_pids": pids}
    result["baseline"] = honest_phase(host, port, 3, args.interval)
    result["baseline_fds"] = fds(pids)
    holders = Holders(host, port, args.connections, args.holders, args.reopen)
    holders.start()
    ramp_end = time.monotonic() + 120
    while holders.totals()["open"] + holders.totals()["closed_by_service"] < args.connections:
        if time.monotonic() > ramp_end:
            break
        time.sleep(0.2)
    result["ramp"] = {"seconds": round(time.monotonic() - ramp_end + 120, 1), **holders.totals(),
                      "service_fds": fds(pids)}
    result["under_attack"] = honest_phase(host, port, args.duration, args.interval, holders, pids)
    result["peak_service_fds"] = max((s["service_fds"] for s in result["under_attack"]["samples"]), default=None)
    result["holders_end"] = holders.finish()
    # Recovery: answers 200 again, and the descriptors return to near their baseline.
    started = time.monotonic()
    while fds(pids) > result["baseline_fds"] + 50 and time.monotonic() - started < 60:
        time.sleep(0.5)
    result["recovery"] = {"seconds_to_fds_near_baseline": round(time.monotonic() - started, 1),
                          "fds": fds(pids), **honest_phase(host, port, 3, args.interval)}
    return result


def summary(result: dict[str, Any]) -> str:
    attack = result["under_attack"]
    lines = [
        f"service fd limit {result['service_fd_limit']}, baseline fds {result['baseline_fds']}",
        f"ramp: {result['ramp']}",
        f"under attack ({attack['requests']} honest requests): {attack['outcomes']}, p50 {attack['p50_ms']} ms, "
        f"max {attack['max_ms']} ms; peak service fds {result['peak_service_fds']}",
        f"holders at the end: {result['holders_end']}",
        f"recovery: fds {result['recovery']['fds']} after {result['recovery']['seconds_to_fds_near_baseline']} s, "
        f"answers {result['recovery']['outcomes']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=25_000)
    parser.add_argument("--holders", type=int, default=4, help="processes holding the connections")
    parser.add_argument("--duration", type=float, default=30, help="seconds of honest requests under attack")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between honest requests")
    parser.add_argument("--reopen", action="store_true", help="reopen what the service closes, for the whole run")
    parser.add_argument("--env", action="append", default=[], help="SWITCHYARD_X=Y for the service started")
    parser.add_argument("--url", help="a running service (with --pid, its serving process)")
    parser.add_argument("--pid", type=int)
    parser.add_argument("--out", type=Path, default=results_dir("idle_connections"))
    args = parser.parse_args(argv)
    raise_fd_limit()
    service = None
    if args.url:
        if args.pid is None:
            parser.error("--url needs --pid (for the service's file descriptors)")
        host, port, root = args.url.split("//")[1].split(":")[0], int(args.url.rsplit(":", 1)[1]), args.pid
    else:
        folder = Path(tempfile.mkdtemp(prefix="switchyard-idle-"))
        service = Service(folder / "data", env=dict(e.split("=", 1) for e in args.env), benchmark_env=False)
        service.start()
        assert service.proc is not None
        host, port, root = "127.0.0.1", service.port, service.proc.pid
    try:
        result = run(args, host, port, root)
    finally:
        if service is not None:
            service.stop()
    result["env"] = args.env
    result["versions"] = versions("uvicorn", "uvloop")
    path = args.out / f"idle-{args.connections}-{int(time.time())}.json"
    save_json(path, result)
    print(summary(result))
    print(f"results: {path}", file=sys.stderr)
    answers = result["under_attack"]["outcomes"]
    failures = sum(n for outcome, n in answers.items() if outcome not in ("200", "503 clean"))
    recovered = set(result["recovery"]["outcomes"]) == {"200"}
    return 0 if failures == 0 and recovered else 1


if __name__ == "__main__":
    sys.exit(main())
