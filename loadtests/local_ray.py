"""A Ray cluster of this machine that belongs to whoever started it: for the scale-out tests and benchmark.

Every node is a `ray start --block` child of this process, in a temp directory of its own, on ports picked free
(GCS, Ray Client, dashboard agent), so it runs beside any other Ray of the machine (a `switchyard serve --ray`, a
second test run) without touching it. It is stopped by its handles: each node process gets SIGTERM (it stops the
Ray processes it started), and whatever those had started and is still alive (a worker) is then killed, by pid.
Never `ray stop`, which stops every Ray process of the user on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

from loadtests.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
STARTED_LINE = "Ray runtime started"  # what `ray start` prints once its node is up


@contextmanager
def local_ray_cluster(nodes: int = 2, cpus_per_node: int = 4, tries: int = 2) -> Iterator[str]:
    """A head and nodes - 1 more nodes, loopback only, no auth token (a token left in ~/.ray by another local
    Ray would otherwise split the nodes). Yields the head's address; at exit the driver of this process (if it
    joined) disconnects and the nodes stop. A cluster that does not come up is started again, on new ports, up to
    `tries` times in all; what its head said goes to stderr and into the last error."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this process's driver, and every process started below
    # No drain at SIGTERM: a test cluster has no traffic to hand over (Ray 2.60 waits up to 30 s per node).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    started: list[subprocess.Popen] = []
    temp = ""
    try:
        for attempt in range(1, tries + 1):
            temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
            address = f"127.0.0.1:{free_port()}"
            try:
                for n in range(nodes):
                    started.append(_start_node(ray_cli, [
                        *_role(n, address), "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus_per_node}",
                        "--disable-usage-stats", f"--temp-dir={temp}/n{n}",
                        f"--dashboard-agent-listen-port={free_port()}"], env, Path(temp) / f"node-{n}.log"))
                break
            except RuntimeError as exc:
                failure = f"{exc}\n{_head_report(started, Path(temp))}"
                _stop_nodes(started, temp)
                started = []
                if attempt == tries:
                    raise RuntimeError(failure) from None
                print(f"local Ray cluster, try {attempt} of {tries}, did not start: {failure}", file=sys.stderr)
        yield address
    finally:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        _stop_nodes(started, temp)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _role(n: int, address: str) -> list[str]:
    """`ray start` arguments of node n: the head (n = 0) on the address's port, the others joining it."""
    if n:
        return [f"--address={address}"]
    return ["--head", f"--port={address.rsplit(':', 1)[1]}", "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}"]


def _head_report(started: list[subprocess.Popen], temp: Path) -> str:
    """Whether the head still runs, and the end of its GCS server's logs: why a node could not join it."""
    alive = bool(started) and started[0].poll() is None
    lines = [f"head process alive: {alive}"]
    for log in sorted(temp.glob("n0/session_*/logs/gcs_server.*")):
        lines.append(f"{log.name}: {log.read_text(errors='replace')[-1500:]}")
    return "\n".join(lines)


def _stop_nodes(started: list[subprocess.Popen], temp: str) -> None:
    for proc in reversed(started):  # the head last: the other nodes leave it first
        stop_node(proc)
    if temp:
        shutil.rmtree(temp, ignore_errors=True)


def _start_node(ray_cli: str, args: list[str], env: dict[str, str], log: Path, timeout_s: float = 180
                ) -> subprocess.Popen:
    """`ray start --block ...` as a child of this process, once it says its node is up."""
    out = open(log, "wb")  # noqa: SIM115 - the node writes to it for as long as it runs
    proc = subprocess.Popen([ray_cli, "start", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    out.close()
    deadline = time.monotonic() + timeout_s
    while STARTED_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_node(proc)
            raise RuntimeError(f"ray start {' '.join(args[:2])} failed: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    return proc


def stop_node(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM to one `ray start --block` process (it stops the processes it started), then SIGKILL to any of its
    descendants still alive."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
