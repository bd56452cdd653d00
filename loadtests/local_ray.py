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
def local_ray_cluster(nodes: int = 2, cpus_per_node: int = 4) -> Iterator[str]:
    """A head and nodes - 1 more nodes, loopback only, no auth token (a token left in ~/.ray by another local
    Ray would otherwise split the nodes). Yields the head's address; at exit the driver of this process (if it
    joined) disconnects and the nodes stop."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this process's driver, and every process started below
    # No drain at SIGTERM: a test cluster has no traffic to hand over (Ray 2.60 waits up to 30 s per node).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    port = free_port()
    address = f"127.0.0.1:{port}"
    started: list[subprocess.Popen] = []
    try:
        for n in range(nodes):
            role = ["--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}"
                    ] if n == 0 else [f"--address={address}"]
            started.append(_start_node(ray_cli, [
                *role, "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus_per_node}",
                "--disable-usage-stats", f"--temp-dir={temp}/n{n}", f"--dashboard-agent-listen-port={free_port()}",
            ], env, Path(temp) / f"node-{n}.log"))
        yield address
    finally:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        for proc in reversed(started):  # the head last: the other nodes leave it first
            stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


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
