"""Full replicas (`serve --workers N`) that share the clients: each worker listens on a TCP socket of its own on the
port (SO_REUSEPORT), and the kernel spreads new connections over them.

With Uvicorn's one socket shared by every worker, whichever worker woke first accepted every connection waiting:
16 connections opened together all went to one of two workers, and VectorDBBench's 4 clients got one worker's QPS
while the other sat idle (docs/design/serving.md). Linux only; elsewhere the workers share one socket as before.
"""

from __future__ import annotations

import logging
import socket
import sys

from uvicorn import Config
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess, Process

log = logging.getLogger("uvicorn.error")


def spreads_connections() -> bool:
    """Whether the kernel balances connections over sockets bound with SO_REUSEPORT (Linux); elsewhere the option
    only lets sockets share a port, and the first one takes every connection."""
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to one port, for one worker each. The port is first bound alone, so that a port in use
    is refused here (OSError) rather than shared with whatever holds it; port 0 picks a free one for all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    listeners = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.set_inheritable(True)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def run_workers(config: Config, shared: list[socket.socket]) -> None:
    """Serve as `config.workers` full replicas, each on a listener of its own and on the `shared` sockets, until
    stopped. A port that cannot be bound exits with uvicorn's start-up failure code, as its own bind does."""
    try:
        listeners = bind_listeners(config.host, config.port, config.workers)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
        sys.exit(STARTUP_FAILURE)
    log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit), %d workers with a socket each", config.host,
             listeners[0].getsockname()[1], config.workers)
    Workers(config, listeners, shared).run()


class Workers(Multiprocess):
    """Uvicorn's supervisor, with worker i serving the i-th listener (and the shared sockets, a unix socket). A worker
    that dies is replaced on its own listener; meanwhile the connections the kernel gives that listener wait in its
    queue, which this process's copy of the socket keeps open. The number of workers is fixed (no SIGTTIN/TTOU)."""

    def __init__(self, config: Config, listeners: list[socket.socket], shared: list[socket.socket]) -> None:
        super().__init__(config, sockets=shared)  # config.workers processes, one per listener
        self.listeners, self.shared = listeners, shared

    def _start(self, index: int) -> Process:
        process = Process(self.config, [self.listeners[index], *self.shared])
        process.start()
        return process

    def init_processes(self) -> None:
        self.processes = [self._start(index) for index in range(self.processes_num)]

    def keep_subprocess_alive(self) -> None:
        for index, process in enumerate(self.processes):
            if self.should_exit.is_set() or process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()  # hung, or gone
            process.join()
            if process.exitcode == STARTUP_FAILURE:  # every restart would fail the same way
                log.error("Child process [%s] failed to start, stopping the parent process.", process.pid)
                self.should_exit.set()
                return
            log.info("Child process [%s] died", process.pid)
            self.processes[index] = self._start(index)

    def restart_all(self) -> None:
        """SIGHUP: each worker replaced in turn, its replacement serving before it goes."""
        for index, old in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new = self._start(index)
            if not new.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                new.kill()
                new.join()
                log.error("New child process [%s] was not ready in time; keeping worker [%s].", new.pid, old.pid)
                return
            old.terminate()
            old.join()
            self.processes[index] = new

    def handle_ttin(self) -> None:
        log.info("Received SIGTTIN: the number of workers is fixed (SWITCHYARD_WORKERS); nothing changes.")

    def handle_ttou(self) -> None:
        log.info("Received SIGTTOU: the number of workers is fixed (SWITCHYARD_WORKERS); nothing changes.")
