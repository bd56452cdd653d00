"""A stand-in for the cuVS backend in the build-process tests: FAISS indexes, the GPU's kind (so the manager gives
it one engine thread and a DetachedBuilder), and builds that wait for a gate file (SWITCHYARD_TEST_BUILD_GATE)
so that a test can act while a build is running in its child process."""

from __future__ import annotations

import os
import time
from pathlib import Path

from indexes.build_process import DetachedBuilder
from indexes.faiss_index import FaissBackend

GATE = "SWITCHYARD_TEST_BUILD_GATE"


class GatedBackend(FaissBackend):
    name, kind = "gated", "gpu"

    def __init__(self, detached: bool = False) -> None:
        super().__init__(threads=1)
        self.builder = DetachedBuilder(f"{__name__}:GatedBackend", min_values=0) if detached else None

    def build(self, config, vectors):
        gate = os.environ.get(GATE)
        while gate and not Path(gate).exists():
            time.sleep(0.02)
        return super().build(config, vectors)


class FailingBackend(FaissBackend):
    def build(self, config, vectors):
        raise ValueError("no index for these vectors")


class DyingBackend(FaissBackend):
    def build(self, config, vectors):
        os._exit(9)  # as a segfault or the OOM killer would end it
