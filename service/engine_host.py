"""The engine process's end of the front/engine split: the hot operations a front process sends it."""

from __future__ import annotations

import time
from pathlib import Path

from .engine_link import EngineServer
from .fastlane import observe_hot
from .routes.vectors import answer_search, answer_upsert
from .vector_requests import ParsedSearch, ParsedUpsert
from .runtime import Runtime


def engine_server(runtime: Runtime, path: Path) -> EngineServer:
    async def search(name: str, parsed: ParsedSearch, front_s: float) -> bytes:
        start = time.perf_counter()
        answer = await answer_search(runtime, name, parsed)
        observe_hot(runtime.metrics, True, front_s + time.perf_counter() - start)
        return answer

    async def upsert(name: str, parsed: ParsedUpsert, front_s: float) -> bytes:
        start = time.perf_counter()
        answer = await answer_upsert(runtime, name, parsed)
        observe_hot(runtime.metrics, False, front_s + time.perf_counter() - start)
        return answer

    return EngineServer(path, {"search": search, "upsert": upsert})
