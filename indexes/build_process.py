"""Index builds in a child process, for an engine whose calls must all come from one thread (cuVS).

A large CAGRA build would hold the one GPU worker thread, and every GPU search behind it, for minutes. So a fresh
`python -m indexes.build_process` with its own CUDA context builds it with the same backend class and writes its
serialised bytes (AnnIndex.to_bytes); the service loads them on its GPU thread and swaps them in (resident.py:
plan_build, install). A crash in the build kills the child, not the service. Files go through a pid-named
directory under the data directory (not /tmp, which may be memory), swept of a killed service's leftovers; builds
under `min_values` floats stay on the engine's thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .ann import IndexConfig

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the directory holding indexes/, for the child's path
MIN_VALUES = 4_000_000  # floats (e.g. 31,250 x 128): a CAGRA build below this takes well under a second
ERROR_TAIL_CHARS = 2_000


class BuildFailed(RuntimeError):
    pass


class DetachedBuilder:
    """Builds indexes of one backend class (`factory`, "module:Class", constructed without arguments) in child
    processes, one per build; `stop()` kills the ones still running."""

    def __init__(self, factory: str, min_values: int = MIN_VALUES) -> None:
        self.factory = factory
        self.min_values = min_values
        self.builds = 0  # builds run in a child, for the index report and the tests
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def wants(self, rows: int, dim: int) -> bool:
        """Whether a build of this size goes to a child process."""
        return rows * dim >= self.min_values

    def build(self, config: IndexConfig, vectors: np.ndarray, scratch: Path) -> bytes:
        """The serialised index over `vectors`, built in a child process. Blocks the calling thread (never the
        engine's) until the child is done; raises BuildFailed with the child's error."""
        scratch.mkdir(parents=True, exist_ok=True)
        sweep(scratch)
        with tempfile.TemporaryDirectory(prefix=f"build-{os.getpid()}-", dir=scratch) as tmp:
            src, dst, err = (Path(tmp) / name for name in ("vectors.npy", "index.bin", "error.txt"))
            np.save(src, np.ascontiguousarray(vectors, dtype=np.float32))
            spec = json.dumps({"factory": self.factory, "config": dataclasses.asdict(config), "vectors": str(src),
                               "out": str(dst), "error": str(err), "parent": os.getpid()})
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT),
                                                                             os.environ.get("PYTHONPATH")]))}
            with self._lock:
                if self._stopped:
                    raise BuildFailed("the service is stopping")
                child = subprocess.Popen([sys.executable, "-m", "indexes.build_process", spec], env=env,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                self._children.add(child)
            try:
                _, stderr = child.communicate()
            finally:
                with self._lock:
                    self._children.discard(child)
            if child.returncode != 0 or not dst.exists():
                why = err.read_text()[-ERROR_TAIL_CHARS:] if err.exists() else stderr.decode(errors="replace")[
                    -ERROR_TAIL_CHARS:]
                raise BuildFailed(f"the {config.index_type} build process exited with {child.returncode}: "
                                  f"{why.strip() or 'no error text (killed?)'}")
            self.builds += 1
            return dst.read_bytes()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            children = list(self._children)
        for child in children:
            child.kill()


def sweep(scratch: Path) -> list[str]:
    """Remove the files of builds whose service process is gone (killed mid-build: its temporary directory was
    never cleaned up). Several service processes may share the directory, so only dead ones' are touched."""
    removed = []
    for entry in scratch.glob("build-*-*"):
        pid = entry.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs (a reused pid reads as alive: its files are then kept, never lost)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _resolve(factory: str) -> type:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


def _orphaned_exit(parent: int) -> None:
    """The child's watchdog: a build nobody will load is stopped when its service dies."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build one index (run by DetachedBuilder, not by hand).")
    ap.add_argument("spec", help="JSON: factory, config, vectors, out, error, parent")
    spec = json.loads(ap.parse_args(argv).spec)
    threading.Thread(target=_orphaned_exit, args=(spec["parent"],), daemon=True).start()
    try:
        backend = _resolve(spec["factory"])()
        vectors = np.load(spec["vectors"], mmap_mode="r")
        data = backend.build(IndexConfig(**spec["config"]), vectors).to_bytes()
        part = spec["out"] + ".part"
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, spec["out"])  # whole or absent
    except BaseException:  # noqa: BLE001 - reported to the parent through the error file (its tail: the error)
        import traceback

        Path(spec["error"]).write_text(traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
